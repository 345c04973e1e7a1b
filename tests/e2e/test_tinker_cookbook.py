"""tinker-cookbook recipes train against a live ``tandem serve`` (docs/architecture.md §12), unchanged.

The recipe is the cookbook's multiplayer RL tic-tac-toe (``recipes/multiplayer_rl/text_arena``):
self-play on one LoRA client, evaluation against the untrained base model sampled at the same
time. It is a client of the server, so it runs in its own virtualenv (``make cookbook-venv``:
``tinker-cookbook==0.5.8`` pins a transformers older than the project's), on the tiny demo
model as a local directory with the ``role_colon`` renderer, shortened to two steps of four
players. The first run stops after step 1; the second, pointed at the same log directory,
resumes from the checkpoint the first one saved (weights and optimizer) and finishes step 2.

``sl_basic`` runs under its own hub model name (``Qwen/Qwen3.5-9B-Base``), which the server maps to a local
directory (``models``), on a local conversations file given on its command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker

from services.common.embedded_redis import EmbeddedRedis
from tests.helpers import tinker_server
from tests.tinker_server import ROOT, TinkerServer

VENV = Path(os.environ.get("TANDEM_COOKBOOK_VENV", ROOT / "build" / "cookbook-venv"))
RECIPE = "tinker_cookbook.recipes.multiplayer_rl.text_arena.train"


@pytest.fixture(scope="module")
def cookbook_python() -> Path:
    """The cookbook's virtualenv: made by ``make cookbook-venv`` (a no-op when its stamp is there)."""
    if "TANDEM_COOKBOOK_VENV" not in os.environ:
        subprocess.run(["make", "-s", "cookbook-venv", f"PYTHON={sys.executable}"], cwd=ROOT, check=True)
    python = VENV / "bin" / "python"
    assert python.is_file(), f"no cookbook virtualenv at {VENV}"
    return python


@pytest.fixture(scope="module")
def server(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerServer]:
    url = redis_server.url.rsplit("/", 1)[0] + "/7"
    with tinker_server(url, tmp_path_factory.mktemp("tinker-cookbook")) as srv:
        yield srv


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo model with room for a whole game: its byte-level tokens make the board ~2k long."""
    from services.demo.tiny_model import create_tiny_model

    path = create_tiny_model(tmp_path_factory.mktemp("cookbook") / "models" / "tiny", seed=0)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}, indent=2))
    assert str(path).count("/") >= 3  # the SDK's tokenizer lookup mangles a path with exactly two '/'
    return path


def run_recipe(python: Path, server: TinkerServer, model: Path, log_path: Path, max_steps: int) -> str:
    args = [f"model_name={model}", "renderer_name=role_colon", "batch_size=4", "num_train_datapoints=8",
            "num_test_datapoints=2", "max_tokens=16", "eval_every=1", "save_every=1", f"max_steps={max_steps}",
            f"log_path={log_path}", "behavior_if_log_dir_exists=resume"]
    return run_module(python, server, RECIPE, args, log_path.parent)


def run_module(python: Path, server: TinkerServer, module: str, args: list[str], cwd: Path) -> str:
    """Run a cookbook module from its own virtualenv against ``server``; its output, after checking it succeeded."""
    env = {**os.environ, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": "tml-cookbook", "HF_HUB_OFFLINE": "1",
           "TINKER_COOKBOOK_RUNS_DIR": str(cwd), "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("PYTHONPATH", None)  # the recipe sees only its own virtualenv
    proc = subprocess.run([str(python), "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Training completed successfully" in out, out[-4000:]
    return out


def checkpoints(log_path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_cookbook_text_arena_runs_and_resumes(cookbook_python: Path, server: TinkerServer, long_model_dir: Path,
                                             tmp_path: Path):
    log_path = tmp_path / "run"
    run_recipe(cookbook_python, server, long_model_dir, log_path, max_steps=1)
    first = checkpoints(log_path)
    assert [c["batch"] for c in first] == [1, 1] and first[-1]["name"] == "final", first
    state = str(first[-1]["state_path"])
    assert state.startswith("tinker://") and "/weights/final" in state

    out = run_recipe(cookbook_python, server, long_model_dir, log_path, max_steps=2)
    assert f"Resumed training from {state}" in out, out[-4000:]
    # the renderer the first run recorded in its training run's metadata is read back on resume
    assert "Renderer metadata matches" in out, out[-4000:]
    both = checkpoints(log_path)
    assert [c["batch"] for c in both] == [1, 1, 2, 2], both
    assert str(both[-1]["state_path"]).split(":train:")[0] != state.split(":train:")[0]  # a new session
    steps = [json.loads(line)["step"] for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1], steps  # step 0 from the first run, step 1 from the resumed one


HUB_NAME = "Qwen/Qwen3.5-9B-Base"  # sl_basic's default model; the cookbook's registry gives it ``role_colon``


@pytest.fixture(scope="module")
def hub_server(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory,
               tiny_model_dir: Path) -> Iterator[TinkerServer]:
    url = redis_server.url.rsplit("/", 1)[0] + "/15"
    models = json.dumps({HUB_NAME: str(tiny_model_dir)})
    srv = TinkerServer(url, tmp_path_factory.mktemp("tinker-hub"), settings={"models": models}).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.slow
def test_cookbook_sl_basic_runs_under_its_hub_name(cookbook_python: Path, hub_server: TinkerServer,
                                                   tiny_model_dir: Path, tmp_path: Path):
    conversations = [{"messages": [{"role": "user", "content": f"What is {a} plus {b}?"},
                                   {"role": "assistant", "content": f"{a + b}."}]}
                     for a in range(4) for b in range(3)]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations))
    # the recipe's dataset loads its tokenizer by the hub name: here, a directory of that name in its cwd
    (tmp_path / HUB_NAME).parent.mkdir(parents=True)
    (tmp_path / HUB_NAME).symlink_to(tiny_model_dir)
    common = "dataset_builder.common_config."
    args = ["dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
            f"dataset_builder.file_path={data}", f"{common}model_name_for_tokenizer={HUB_NAME}",
            f"{common}renderer_name=role_colon", f"{common}batch_size=4", f"{common}max_length=256",
            f"log_path={tmp_path / 'run'}", "eval_every=0"]  # no model_name: the recipe's own default
    run_module(cookbook_python, hub_server, "tinker_cookbook.recipes.sl_basic", args, tmp_path)

    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2], metrics  # 12 conversations, 4 a batch, one epoch
    assert all(m["num_sequences"] == 4 and 0 < m["train_mean_nll"] < 20 for m in metrics), metrics
    final = checkpoints(tmp_path / "run")[-1]
    assert final["name"] == "final" and str(final["sampler_path"]).startswith("tinker://"), final
    # the run on the server is under the hub name
    rest = tinker.RestClient(base_url=hub_server.url, api_key="tml-cookbook")
    run = rest.get_training_run_by_tinker_path(str(final["state_path"])).result()
    assert run.base_model == HUB_NAME, run
