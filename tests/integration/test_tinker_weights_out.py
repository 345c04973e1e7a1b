"""Weights out of ``tandem serve``: external (PEFT) saves, the REST listings, signed downloads, the operator's export.

The unmodified SDK (tinker 0.38) drives a live server. An exported adapter, fetched through
its signed URLs with plain ``urllib`` and put on the base model by ``peft``, gives the training
client's own logprobs. tinker-cookbook's ``weights.download`` (in its own virtualenv) fetches a
training state and an external checkpoint; ``tandem serve export`` writes the same adapter from
the data directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from peft import PeftModel
from safetensors.torch import load_file
from tinker import types
from transformers import AutoModelForCausalLM

from services.common.embedded_redis import EmbeddedRedis
from tests.helpers import tinker_server, tinker_service
from tests.tinker_server import ROOT, TinkerServer

KEY = "tml-weights-out"
IDS = [60 + (7 * i) % 50 for i in range(24)]
VENV = Path(os.environ.get("TANDEM_COOKBOOK_VENV", ROOT / "build" / "cookbook-venv"))


@pytest.fixture(scope="module")
def server(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    url = redis_server.url.rsplit("/", 1)[0] + "/9"
    with tinker_server(url, tmp_path_factory.mktemp("tinker-out")) as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server: TinkerServer) -> Iterator[tinker.ServiceClient]:
    with tinker_service(server.url, KEY) as client:
        yield client


@pytest.fixture(scope="module")
def trained(service: tinker.ServiceClient, tiny_model_dir: Path) -> tinker.TrainingClient:
    tc = service.create_lora_training_client(base_model=str(tiny_model_dir), rank=4, seed=3).result()
    for _ in range(2):
        fb = tc.forward_backward([sft_datum(IDS)], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        fb.result(), opt.result()
    return tc


def sft_datum(ids: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


def client_logprobs(tc: tinker.TrainingClient) -> np.ndarray:
    return tc.forward([sft_datum(IDS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def adapter_logprobs(base_dir: Path, adapter_dir: Path) -> np.ndarray:
    """The adapter as peft applies it to the base model (nothing of Tandem's in the way)."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([IDS[:-1]])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(IDS[1:])[:, None]).squeeze(-1).numpy()


def test_external_save_listings_and_signed_download(service: tinker.ServiceClient, server: TinkerServer,
                                                    trained: tinker.TrainingClient, tiny_model_dir: Path,
                                                    tmp_path: Path):
    path = trained.save_weights_external("final").result().path
    assert path == f"tinker://{trained.model_id}/external_weights/final"
    state = trained.save_state("state").result().path
    trained.save_weights_for_sampler("snap").result()
    rest = tinker.RestClient(base_url=server.url, api_key=KEY)
    listed = rest.list_checkpoints(trained.model_id).result().checkpoints
    assert {(c.checkpoint_type, c.checkpoint_id) for c in listed} == {
        ("external", "external_weights/final"), ("training", "weights/state"), ("sampler", "sampler_weights/snap")}
    assert all(c.size_bytes and c.size_bytes > 0 for c in listed)
    runs = rest.list_training_runs(limit=100).result()
    mine = [r for r in runs.training_runs if r.training_run_id == trained.model_id]
    assert mine and mine[0].lora_rank == 4 and mine[0].last_checkpoint.tinker_path == state
    assert runs.cursor.total_count >= 1
    info = rest.get_weights_info_by_tinker_path(state).result()
    assert info.base_model == str(tiny_model_dir) and info.lora_rank == 4 and info.is_lora
    everyone = rest.list_user_checkpoints(limit=1000).result().checkpoints
    assert {c.tinker_path for c in listed} <= {c.tinker_path for c in everyone}

    urls = rest.get_external_weights_urls(path).result().urls
    assert set(urls) == {"adapter_config.json", "adapter_model.safetensors"}
    out = tmp_path / "adapter"
    out.mkdir()
    for name, url in urls.items():  # no API key: the signature is the credential
        urllib.request.urlretrieve(url, out / name)
    np.testing.assert_allclose(adapter_logprobs(tiny_model_dir, out), client_logprobs(trained), atol=1e-4)
    forged = urls["adapter_config.json"].replace("sig=", "sig=0")
    assert httpx.get(forged).status_code == 400

    cli = tmp_path / "exported"  # tandem serve export: the training state as the same PEFT adapter
    proc = subprocess.run([sys.executable, "-m", "services.launcher.cli", "serve", "export", state, str(cli),
                           "--data-dir", str(server.data_dir)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got, want = load_file(cli / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
    (ext,) = [c for c in rest.list_checkpoints(trained.model_id).result().checkpoints if c.tinker_path == path]
    assert ext.expires_at is not None
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in {c.tinker_path for c in rest.list_checkpoints(trained.model_id).result().checkpoints}


def test_the_cookbooks_weights_download(server: TinkerServer, trained: tinker.TrainingClient, tiny_model_dir: Path,
                                        tmp_path: Path):
    """A training state (the cookbook loads it, exports it age-encrypted, fetches, decrypts, deletes the export)
    and an external checkpoint, through ``tinker_cookbook.weights.download`` in the cookbook's virtualenv."""
    if "TANDEM_COOKBOOK_VENV" not in os.environ:
        subprocess.run(["make", "-s", "cookbook-venv", f"PYTHON={sys.executable}"], cwd=ROOT, check=True)
    python = VENV / "bin" / "python"
    assert python.is_file(), f"no cookbook virtualenv at {VENV}"
    state = trained.save_state("for-download").result().path
    external = trained.save_weights_external("for-download").result().path
    script = ("import sys; from tinker_cookbook import weights\n"
              "for path, out in zip(sys.argv[1::2], sys.argv[2::2]):\n"
              "    print(weights.download(tinker_path=path, output_dir=out))\n")
    env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": KEY, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([str(python), "-c", script, state, str(tmp_path / "state"), external,
                           str(tmp_path / "external")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    want = client_logprobs(trained)
    for out in ("state", "external"):
        assert sorted(p.name for p in (tmp_path / out).iterdir()) == ["adapter_config.json",
                                                                      "adapter_model.safetensors"]
        np.testing.assert_allclose(adapter_logprobs(tiny_model_dir, tmp_path / out), want, atol=1e-4)
    left = [c.checkpoint_id for c in tinker.RestClient(base_url=server.url, api_key=KEY)
            .list_user_checkpoints(limit=1000).result().checkpoints if c.checkpoint_id == "external_weights/download"]
    assert not left  # the cookbook deleted its temporary export
