"""``tandem pipeline``: configs/pipeline_demo.yaml's collect → SFT → RL on the demo model (smaller), each stage's
checkpoint feeding the next; and with LoRA in both stages (the SFT adapters merged into the RL stage's model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.adapter_dir import base_of, is_adapter_dir
from services.training.algorithms import masked_mean
from services.training.grpo import token_logprobs
from services.training.sft_file import file_samples
from services.training.step import pad_batch
from tests.helpers import REPO

pytestmark = pytest.mark.slow
RL_STEPS = 2
EPISODES = 24


def pipeline(config: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launcher.cli", "pipeline", str(config), *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=900)


@torch.no_grad()
def file_nll(model_dir: str, dataset: str) -> float:
    """The file's mean NLL on its assistant tokens under the weights in ``model_dir``, computed here."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    samples, _ = file_samples(tok, dataset, "A")
    batch = pad_batch(samples, tok.pad_token_id or 0)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    return float(masked_mean(-token_logprobs(logits, batch["targets"], 1.0), batch["mask"]))


def distance(a: str, b: str) -> float:
    wa, wb = load_file(Path(a) / "model.safetensors"), load_file(Path(b) / "model.safetensors")
    return sum(float((wa[k] - wb[k]).pow(2).sum()) for k in wa) ** 0.5


def pipe_config(tmp_path: Path, model: Path, episodes: int = EPISODES, sft_lr: float = 1e-3, **agent: Any) -> Path:
    """configs/pipeline_demo.yaml made small, written to ``tmp_path``; ``agent``: more of agents.A's fields."""
    cfg = yaml.safe_load((REPO / "configs" / "pipeline_demo.yaml").read_text())
    cfg["run"].update(name="pipe", total_steps=RL_STEPS, concurrent_episodes=16,
                      checkpoint_root=str(tmp_path / "ckpt"), output_dir=str(tmp_path / "runs"))
    cfg["api"] = {"port": 0}
    # self-play, both sides kept unless they lost (the test's small model makes illegal moves: few outright wins)
    cfg["pipeline"] = {"episodes": episodes, "min_reward": 0.0, "sft": {"epochs": 8, "batch_size": 8, "lr": sft_lr}}
    cfg["environment"].update(group_size=4, eval={"episodes": 4})
    cfg["agents"]["A"].update(model_path=str(model), groups_per_batch=2, **agent)
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_collect_then_sft_then_rl_each_stage_feeding_the_next(tmp_path: Path, warm_model_dir: Path):
    path = pipe_config(tmp_path, warm_model_dir)
    proc = pipeline(path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "runs" / "pipe-pipeline" / "pipeline.json").read_text())

    # collect: the start model played; every kept trajectory is A's, at weight version 0, with reward >= 0
    collected = manifest["collect"]
    rows = [json.loads(line) for line in Path(collected["file"]).read_text().splitlines()]
    # two model roles an episode: each kept, dropped below min_reward, or silent (its game ended before its turn)
    assert len(rows) == collected["kept"] > 0
    assert collected["kept"] + collected["dropped"] + collected["silent"] == 2 * EPISODES, collected
    assert {r["agent"] for r in rows} == {"A"} and {r["weight_version"] for r in rows} == {0}
    assert min(r["reward"] for r in rows) >= 0.0 and collected["model_paths"]["A"] == str(warm_model_dir)

    # SFT: from the model that collected, on its file, one version per step; the file's NLL went down
    sft = manifest["sft"]["A"]
    assert sft["start_model"] == str(warm_model_dir) and sft["dataset"] == collected["file"]
    steps = 8 * -(-len(rows) // 8)
    assert sft["steps"] == sft["weight_version"] == steps and sft["samples"] == len(rows)
    assert sft["checkpoint"] == str((tmp_path / "ckpt" / "pipe-sft" / "A" / f"v{steps:05d}").resolve())
    before, after = file_nll(str(warm_model_dir), collected["file"]), file_nll(sft["checkpoint"], collected["file"])
    assert after < before - 0.05, (before, after)
    assert before == pytest.approx(sft["nll_before"], rel=1e-3) and after == pytest.approx(sft["nll_after"], rel=1e-3)

    # RL: tandem up from the SFT checkpoint, RL_STEPS versions of its own
    rl = manifest["rl"]
    assert rl["exit_code"] == 0 and rl["agents"]["A"]["model_path"] == sft["checkpoint"]
    effective = yaml.safe_load(Path(rl["config"]).read_text())
    assert effective["agents"]["A"]["model_path"] == sft["checkpoint"]
    first = tmp_path / "ckpt" / "pipe" / "A" / "v00001"
    assert rl["agents"]["A"]["last_checkpoint"] == str((first.parent / f"v{RL_STEPS:05d}").resolve())
    summary = json.loads((tmp_path / "runs" / "pipe" / "summary.json").read_text())
    assert summary["phase"] == "done" and summary["agents"]["A"]["last_weight_version"] == RL_STEPS
    # the RL trainer started from the SFT weights: its first version is one step from them, many from the start
    assert distance(str(first), sft["checkpoint"]) < 0.5 * distance(str(first), str(warm_model_dir))

    again = pipeline(path)  # every stage's output is kept: a second run is refused before any stage
    assert again.returncode == 2 and "already has state" in again.stderr and "--fresh" in again.stderr


def test_the_pipeline_with_lora_merges_the_sft_adapters_and_rl_trains_new_ones_on_that(tmp_path: Path,
                                                                                       warm_model_dir: Path):
    lora = {"r": 8, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]}
    proc = pipeline(pipe_config(tmp_path, warm_model_dir, episodes=16, sft_lr=3e-3, lora=lora))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "runs" / "pipe-pipeline" / "pipeline.json").read_text())
    sft, file = manifest["sft"]["A"], manifest["collect"]["file"]
    assert sft["lora"]["r"] == 8 and not is_adapter_dir(sft["checkpoint"])  # a full model: the adapters merged in
    before, after = file_nll(str(warm_model_dir), file), file_nll(sft["checkpoint"], file)
    assert after < before - 0.05, (before, after)
    assert after == pytest.approx(sft["nll_after"], rel=1e-3)
    rl = manifest["rl"]
    assert rl["exit_code"] == 0 and rl["agents"]["A"]["model_path"] == sft["checkpoint"]
    last = Path(rl["agents"]["A"]["last_checkpoint"])
    assert last.name == f"v{RL_STEPS:05d}" and is_adapter_dir(last)  # RL's own adapters, on the merged model
    assert base_of(last) == sft["checkpoint"]
