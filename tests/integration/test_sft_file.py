"""Supervised training from a chat-format JSONL file: the view and mask of a file sample, the SFT loss's
gradient only on assistant tokens, ``agents.X.sft`` validation naming the field, short training runs (every
weight; LoRA, whose checkpoint is the base with the adapter merged in), and ``tandem sft`` with the refusals of
``tandem up`` and ``tandem pipeline``."""

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

from services.common.adapter_dir import is_adapter_dir
from services.common.embedded_redis import free_port
from services.contracts.config import ConfigError, SftRecord, parse_config
from services.launcher.preflight import preflight
from services.training.algorithms import make_algorithm, make_inputs
from services.training.grpo import token_logprobs
from services.training.sft_file import file_sample, file_samples, mean_nll, train_from_file
from services.training.step import pad_batch
from services.training.torch_backend import TorchPolicy
from tests.helpers import REPO

RECORD = {"messages": [{"role": "system", "content": "You play tic-tac-toe."},
                       {"role": "user", "content": "Board: ... Your move?"},
                       {"role": "assistant", "content": "5"},
                       {"role": "tool", "content": "cell 5 taken"},
                       {"role": "assistant", "content": "1"}],
          "reward": 1.0, "measures": {"won": 1.0}, "weight_version": 3, "agent": "A", "role": "X",
          "environment": "tictactoe", "episode_id": "collect-0"}


def config(model: Path, sft: dict[str, Any] | None, algorithm: str = "sft") -> dict[str, Any]:
    agent: dict[str, Any] = {"model_path": str(model), "algorithm": {"name": algorithm}}
    if sft is not None:
        agent["sft"] = sft
    return {"run": {"name": "sft"}, "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "scripted:random"}},
            "agents": {"A": agent}}


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_a_file_sample_is_the_chat_template_with_the_mask_on_assistant_tokens_only(tiny_model_dir: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    s = file_sample(tok, SftRecord.model_validate(RECORD), "A", "f:1")
    rendered = tok.apply_chat_template(RECORD["messages"], tokenize=False)
    assert s.tokens == tok.encode(rendered, add_special_tokens=False)  # token-exact: the template's own view
    learned = [t for t, m in zip(s.tokens, s.loss_mask, strict=True) if m]
    eos = tok.eos_token_id
    assert learned == [*tok.encode("5", add_special_tokens=False), eos, *tok.encode("1", add_special_tokens=False),
                       eos]
    context = tok.decode([t for t, m in zip(s.tokens, s.loss_mask, strict=True) if not m])
    assert "You play tic-tac-toe." in context and "cell 5 taken" in context and "5" not in context.split("taken")[1]
    assert s.reward == 1.0 and s.weight_versions == [3, 3] and s.agent == "A"


def test_the_sft_loss_has_gradient_only_on_assistant_tokens_of_a_file_sample(tiny_model_dir: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    s = file_sample(tok, SftRecord.model_validate(RECORD), "A", "f:1")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = pad_batch([s], tok.pad_token_id or 0)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logits.retain_grad()
    logp = token_logprobs(logits, batch["targets"], 1.0)
    cfg = parse_config(config(tiny_model_dir, None)).agents["A"].algorithm
    x = make_inputs(cfg, logp, batch["old_logp"], batch["mask"], torch.zeros(1), torch.zeros(1, dtype=torch.bool))
    loss, stats = make_algorithm(cfg).loss(x)
    loss.backward()
    assert logits.grad is not None
    per_position = logits.grad[0].abs().sum(-1)  # position t predicts token t+1
    assistant = torch.tensor(s.loss_mask[1:], dtype=torch.bool)
    assert bool((per_position[~assistant] == 0).all()), "a prompt, system or tool token got gradient"
    assert bool((per_position[assistant] > 0).all())
    nll = -logp[0][assistant].detach().mean()
    assert stats["nll"] == pytest.approx(float(nll), rel=1e-5)  # the mean over assistant tokens, nothing else


def test_sft_config_names_the_field_for_a_missing_file_a_bad_line_and_the_wrong_algorithm(tiny_model_dir: Path,
                                                                                          tmp_path: Path):
    with pytest.raises(ConfigError, match=r"agents\.A\.sft\.dataset\n?.*no such file"):
        parse_config(config(tiny_model_dir, {"dataset": str(tmp_path / "nope.jsonl")}))
    bad = write_jsonl(tmp_path / "bad.jsonl", [RECORD, "{not json", RECORD])
    with pytest.raises(ConfigError, match=r"agents\.A\.sft\.dataset.*line 2"):
        parse_config(config(tiny_model_dir, {"dataset": str(bad)}))
    no_reply = write_jsonl(tmp_path / "no_reply.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError, match=r"agents\.A\.sft\.dataset.*line 1.*no assistant message"):
        parse_config(config(tiny_model_dir, {"dataset": str(no_reply)}))
    role = write_jsonl(tmp_path / "role.jsonl", [{"messages": [{"role": "robot", "content": "hi"}]}])
    with pytest.raises(ConfigError, match=r"line 1: messages\.0\.role"):
        parse_config(config(tiny_model_dir, {"dataset": str(role)}))
    good = write_jsonl(tmp_path / "good.jsonl", [RECORD])
    with pytest.raises(ConfigError, match=r"agents\.A: .*sft: a dataset trains with algorithm sft.*'grpo'"):
        parse_config(config(tiny_model_dir, {"dataset": str(good)}, algorithm="grpo"))
    with pytest.raises(ConfigError, match=r"agents\.A\.sft\.epochs"):
        parse_config(config(tiny_model_dir, {"dataset": str(good), "epochs": 0}))
    cfg = parse_config(config(tiny_model_dir, {"dataset": str(good), "epochs": 2, "max_samples": 4}))
    assert cfg.agents["A"].sft is not None and cfg.agents["A"].sft.epochs == 2


def test_records_of_other_agents_and_past_the_context_are_left_out(tiny_model_dir: Path, tmp_path: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [RECORD, {**RECORD, "agent": "B"}, {"messages": RECORD["messages"]}]  # no agent: every agent's
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    samples, counts = file_samples(tok, str(path), "A")
    assert len(samples) == 2 and counts == {"records": 3, "other_agents": 1, "too_long": 0}
    samples, counts = file_samples(tok, str(path), "A", context=len(samples[0].tokens) - 1)
    assert not samples and counts["too_long"] == 2


def test_train_from_file_lowers_the_files_nll_and_writes_the_last_version(tiny_model_dir: Path, tmp_path: Path):
    rows = [{"messages": [{"role": "user", "content": f"Board {i}. Your move?"},
                          {"role": "assistant", "content": str(1 + i % 9)}], "reward": float(i % 2)}
            for i in range(12)]
    path = write_jsonl(tmp_path / "moves.jsonl", rows)
    cfg = config(tiny_model_dir, {"dataset": str(path), "epochs": 3, "batch_size": 4})
    cfg["agents"]["A"]["algorithm"].update(lr=3e-3, sft_min_reward=1.0)  # only the 6 rewarded records
    acfg = parse_config(cfg).agents["A"]
    result = train_from_file(acfg, "A", tmp_path / "out")
    assert result.samples == 6 and result.counts["below_min_reward"] == 6
    assert result.steps == 6 and result.weight_version == 6  # 3 epochs x 2 steps of 4 + 2
    assert Path(result.checkpoint) == (tmp_path / "out" / "v00006").resolve()
    assert (Path(result.checkpoint) / "config.json").is_file()
    assert result.nll_after < result.nll_before - 0.1, result
    report = json.loads((tmp_path / "out" / "sft_report.json").read_text())
    assert report["checkpoint"] == result.checkpoint and report["start_model"] == str(tiny_model_dir)


def test_sft_with_lora_writes_the_base_with_the_adapter_merged_in_as_a_model_path(tiny_model_dir: Path,
                                                                                   tmp_path: Path):
    rows = [{"messages": [{"role": "user", "content": f"Board {i}. Your move?"},
                          {"role": "assistant", "content": str(1 + i % 9)}]} for i in range(8)]
    path = write_jsonl(tmp_path / "moves.jsonl", rows)
    cfg = config(tiny_model_dir, {"dataset": str(path), "epochs": 3, "batch_size": 4})
    cfg["agents"]["A"]["algorithm"]["lr"] = 1e-2
    cfg["agents"]["A"]["lora"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    result = train_from_file(parse_config(cfg).agents["A"], "A", tmp_path / "out")
    assert result.steps == 6 and result.lora is not None and result.lora["r"] == 4
    assert result.nll_after < result.nll_before - 0.1, result
    ckpt = Path(result.checkpoint)
    assert not is_adapter_dir(ckpt) and (ckpt / "config.json").is_file() and (ckpt / "tokenizer.json").is_file()
    start, merged = load_file(tiny_model_dir / "model.safetensors"), load_file(ckpt / "model.safetensors")
    assert not any("lora_" in k or "base_layer" in k for k in merged) and set(start) <= set(merged)
    changed = {k for k in start if not torch.equal(start[k], merged[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")) for k in changed)
    # the next stage starts from it as its model_path, here with LoRA of its own (new adapters: B = 0)
    cfg["agents"]["A"]["model_path"] = str(ckpt)
    after = TorchPolicy(parse_config(cfg).agents["A"], temperature=1.0)
    samples, _ = file_samples(after.tokenizer, str(path), "A")
    assert mean_nll(after, samples, 4) == pytest.approx(result.nll_after, rel=1e-4)


def tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.launcher.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_tandem_sft_writes_the_checkpoint_and_up_and_pipeline_refuse_what_is_not_theirs(tiny_model_dir: Path,
                                                                                        tmp_path: Path):
    data = write_jsonl(tmp_path / "d.jsonl", [RECORD] * 4)
    cfg = config(tiny_model_dir, {"dataset": str(data), "batch_size": 2})
    cfg["run"].update(checkpoint_root=str(tmp_path / "ckpt"), output_dir=str(tmp_path / "runs"))
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tandem("sft", str(path))
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = tmp_path / "ckpt" / "sft" / "A" / "v00002"
    assert "A: 4 samples, 2 steps" in out.stdout and str(ckpt.resolve()) in out.stdout
    assert (ckpt / "model.safetensors").is_file()
    again = tandem("sft", str(path))  # the checkpoints are kept unless --fresh
    assert again.returncode == 2 and "agents.A.sft" in again.stderr and "--fresh" in again.stderr
    assert tandem("sft", str(path), "--fresh", "--set", "agents.A.sft.epochs=2").returncode == 0
    assert (tmp_path / "ckpt" / "sft" / "A" / "v00004").is_dir() and not ckpt.exists()
    with pytest.raises(ConfigError, match=r"agents\.A\.sft: tandem up trains on live samples.*tandem sft"):
        preflight(parse_config(cfg), str(path), "new")
    nopipe = tandem("pipeline", str(path))
    assert nopipe.returncode == 2 and "pipeline: not set" in nopipe.stderr
    rl = {**config(tiny_model_dir, None, "grpo"), "pipeline": {"episodes": 1, "demonstrate": ["X"]}}
    path.write_text(yaml.safe_dump(rl))
    nodemo = tandem("pipeline", str(path))  # tic-tac-toe has no demonstrations: refused before any stage
    assert nodemo.returncode == 2, nodemo.stderr[-3000:]
    assert "pipeline.demonstrate: X: environment tictactoe cannot demonstrate it" in nodemo.stderr
    # no tic-tac-toe episode earns 5: the collect stage (run in a child process) keeps nothing, and its error
    # comes back as the pipeline's own
    rl["pipeline"] = {"episodes": 2, "min_reward": 5.0}
    rl["run"].update(name="empty", checkpoint_root=str(tmp_path / "ckpt"), output_dir=str(tmp_path / "runs"))
    rl["api"] = {"port": free_port()}
    path.write_text(yaml.safe_dump(rl))
    empty = tandem("pipeline", str(path))
    assert empty.returncode == 2, empty.stderr[-3000:]
    assert "pipeline.min_reward: the collect stage kept no trajectory of 2 episodes" in empty.stderr
