"""``tandem serve`` under hub names: ``models: {NAME: DIR}`` (or ``--model NAME=DIR``) serves local directories as
the names recipes look up, two models at once (the unmodified SDK, tinker 0.38, on a live server)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from services.common.embedded_redis import EmbeddedRedis
from tests.helpers import tinker_service
from tests.tinker_server import ROOT, TinkerServer

KEY = "tml-names"
IDS = [60 + (7 * i) % 50 for i in range(24)]
POLICY, ANSWERER = "Qwen/Qwen3-8B", "Qwen/Qwen3.5-9B"


@pytest.fixture(scope="module")
def second_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.demo.tiny_model import create_tiny_model

    return create_tiny_model(tmp_path_factory.mktemp("second") / "model", seed=1)


@pytest.fixture(scope="module")
def server(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
           second_model: Path) -> Iterator[TinkerServer]:
    url = redis_server.url.rsplit("/", 1)[0] + "/11"
    models = json.dumps({POLICY: str(tiny_model_dir), ANSWERER: str(second_model)})
    srv = TinkerServer(url, tmp_path_factory.mktemp("tinker-names"), settings={"models": models}).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_hub_names_serve_local_directories_two_models_at_once(server: TinkerServer, tiny_model_dir: Path):
    with tinker_service(server.url, KEY) as service:
        caps = tinker.RestClient(base_url=server.url, api_key=KEY).get_server_capabilities().result()
        names = {m.model_name for m in caps.supported_models}
        assert {POLICY, ANSWERER} <= names
        tc = service.create_lora_training_client(base_model=POLICY, rank=4, seed=0).result()
        assert tc.get_info().model_data.model_name == POLICY
        assert tc.get_tokenizer().encode("abc") == tc.get_tokenizer().encode("abc")  # loads from the local dir
        direct = service.create_sampling_client(base_model=str(tiny_model_dir)).result()
        policy = service.create_sampling_client(base_model=POLICY).result()
        answerer = service.create_sampling_client(base_model=ANSWERER).result()
        prompt = types.ModelInput.from_ints(IDS)
        by_dir, by_name, other = (np.array(s.compute_logprobs(prompt).result()[1:], dtype=np.float32)
                                  for s in (direct, policy, answerer))
        np.testing.assert_array_equal(by_name, by_dir)  # the name is the directory
        assert not np.allclose(other, by_dir, atol=1e-3)  # the second served model is another model
        with pytest.raises(Exception, match="served names"):
            service.create_lora_training_client(base_model="nobody/Unknown-1B", rank=4).result()


def test_bad_model_mappings_fail_at_start(tmp_path: Path):
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "services.tinker_api", *args, "--port", "0"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT),
                                                                                "PATH": "/usr/bin:/bin"})

    bad = serve("--model", "no-equals-sign")
    assert bad.returncode == 2 and "NAME=DIR" in bad.stderr
    missing = serve("--model", f"Qwen/Qwen3-8B={tmp_path / 'nowhere'}")
    assert missing.returncode == 2 and "Qwen/Qwen3-8B" in missing.stderr and "config.json" in missing.stderr
    config = tmp_path / "serve.yaml"
    config.write_text(f"tinker_api:\n  models:\n    Qwen/Qwen3-8B: {tmp_path / 'nowhere'}\n")
    in_file = serve(str(config))
    assert in_file.returncode == 2 and "tinker_api.models" in in_file.stderr, in_file.stderr
