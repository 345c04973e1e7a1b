"""The megatron backend as a trainer: the same step as the torch backend, export, resume, layout checks, DP=2.

Run as a script under torchrun (``torchrun --nproc_per_node 2 tests/unit/test_megatron_policy.py OUT MODEL``) it
is the data-parallel worker of ``test_two_data_parallel_processes_train_like_one``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from services.contracts.config import AgentConfig, AlgorithmConfig, ConfigError, MegatronLayout  # noqa: E402
from services.contracts.messages import Sample  # noqa: E402
from services.training.backends import make_policy  # noqa: E402
from tests.helpers import completion_sample  # noqa: E402

PROMPT = [5, 6, 7, 8]


def sample(out: list[int], reward: float, group: str, version: int = 0) -> Sample:
    return completion_sample(PROMPT, out, reward, group, version)


SAMPLES = [sample([40, 41, 42], 1.0, "g"), sample([50, 51], 0.0, "g"), sample([60, 61, 62, 63], 1.0, "h"),
           sample([70], 0.0, "h")]
EQUAL = [sample([40, 41], 1.0, "g"), sample([50, 51], 0.0, "g"), sample([60, 61], 1.0, "h"),
         sample([70, 71], 0.0, "h")]


def agent(model_dir: Path, backend: str = "megatron", **algo: object) -> AgentConfig:
    return AgentConfig(model_path=str(model_dir), backend=backend,
                       algorithm=AlgorithmConfig(**{"lr": 1e-2, **algo}))


def seq_logp(policy: object, s: Sample) -> float:
    from services.training.torch_backend import pad_batch

    b = pad_batch([s], policy.pad_id)
    return float((policy.logprobs(b) * b["mask"]).sum())


def test_megatron_step_equals_torch_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Same model, same batch, same algorithm: the same loss, grad norm and (up to float noise) new weights."""
    metrics, weights = {}, {}
    for backend in ("torch", "megatron"):
        policy = make_policy(agent(tiny_model_dir, backend, minibatches=2), 1.0)
        metrics[backend] = policy.train_step(SAMPLES)
        path, checksum = policy.save(tmp_path / backend)
        weights[backend] = load_file(path / "model.safetensors")
        assert len(checksum) == 64 and policy.weight_version == 1
    t, m = metrics["torch"], metrics["megatron"]
    for key in ("pg_loss", "loss", "clip_frac", "grad_norm", "grad_norm_mean", "entropy", "ratio_mean"):
        assert m[key] == pytest.approx(t[key], rel=1e-4, abs=1e-5), key
    assert {k for k in t if k != "backend"} <= set(m)
    assert sorted(weights["torch"]) == sorted(weights["megatron"])
    for k, v in weights["torch"].items():
        assert torch.allclose(weights["megatron"][k], v, atol=1e-3, rtol=0), k


def turns(group: str, turn_rewards: list[float], sid: str) -> Sample:
    """Three generated turns (runs of 1s in the mask) that earned ``turn_rewards``."""
    mask = [0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1]
    return Sample(agent="A", role="X", episode_id=sid, group_id=group, group_samples=2,
                  tokens=[5 + i for i in range(11)], loss_mask=mask,
                  rollout_logprobs=[-2.0 if m else 0.0 for m in mask], reward=sum(turn_rewards),
                  weight_versions=[0, 0, 0], turn_rewards=turn_rewards)


def test_megatron_step_equals_torch_step_under_turn_credit(tiny_model_dir: Path) -> None:
    """Per-turn credit's per-token advantages reach the Megatron loss as they reach torch's."""
    batch = [turns("g", [1.0, -0.5, 0.0], "a"), turns("g", [-0.5, 1.0, 0.0], "b"),
             turns("h", [0.2, 0.2, 0.2], "c"), turns("h", [0.0, 0.0, 1.0], "d")]
    metrics = {b: make_policy(agent(tiny_model_dir, b, credit="turn"), 1.0).train_step(batch)
               for b in ("torch", "megatron")}
    for key in ("pg_loss", "loss", "grad_norm"):
        assert metrics["megatron"][key] == pytest.approx(metrics["torch"][key], rel=1e-4, abs=1e-5), key
    assert metrics["torch"]["grad_norm"] > 0  # equal totals in group g: only the turns' credit moves anything


@pytest.mark.parametrize("algo", [{"name": "grpo"}, {"name": "cispo"}, {"name": "dpo"},
                                  {"name": "grpo", "kl_coef": 0.1, "entropy_coef": 0.01}])
def test_one_step_raises_the_better_answer(tiny_model_dir: Path, algo: dict) -> None:
    policy = make_policy(agent(tiny_model_dir, **algo), 1.0)
    good, bad = sample([40, 41, 42], 1.0, "g"), sample([50, 51, 52], 0.0, "g")
    before = seq_logp(policy, good) - seq_logp(policy, bad)
    metrics = policy.train_step([good, bad])
    assert seq_logp(policy, good) - seq_logp(policy, bad) > before + 1e-3, metrics
    assert metrics["grad_norm"] > 0 and metrics["tokens_per_s"] > 0
    if "kl_coef" in algo:
        assert "kl" in metrics and "entropy_loss" in metrics


def test_exported_directory_loads_in_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = make_policy(agent(tiny_model_dir), 1.0)
    policy.train_step(SAMPLES)
    path, _ = policy.save(tmp_path / "v00001")
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in path.iterdir()}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    from services.training.torch_backend import pad_batch

    b = pad_batch(SAMPLES, policy.pad_id)
    from services.training.grpo import token_logprobs

    with torch.no_grad():
        want = token_logprobs(hf(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1],
                              b["targets"], 1.0)
    got = policy.logprobs(b)
    real = b["attention_mask"][:, 1:].bool()
    assert torch.allclose(got[real], want[real], atol=1e-4)


def test_save_state_and_load_state_resume_exactly(tiny_model_dir: Path, tmp_path: Path) -> None:
    first = make_policy(agent(tiny_model_dir, lr_scheduler="linear", decay_steps=10), 1.0)
    first.train_step(SAMPLES)
    first.save_state(tmp_path / "state" / "v00001", 1)
    assert not list((tmp_path / "state").glob("*.tmp*"))
    again = make_policy(agent(tiny_model_dir, lr_scheduler="linear", decay_steps=10), 1.0)
    assert again.load_state(tmp_path / "state" / "v00001") == 1 and again.weight_version == 1
    a, b = first.train_step(SAMPLES), again.train_step(SAMPLES)
    assert a["lr"] == b["lr"] and a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for (n, p), (_, q) in zip(first.model.named_parameters(), again.model.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_inconsistent_layouts_fail_naming_the_field(tiny_model_dir: Path) -> None:
    from transformers import AutoConfig

    from services.training.megatron.layout import check_layout
    from services.training.megatron.model import arch_of

    arch = arch_of(AutoConfig.from_pretrained(tiny_model_dir))  # 4 heads, 2 kv heads, 2 layers
    cases = [
        (MegatronLayout(tensor_parallel=2), 2, False, "megatron.tensor_parallel: tensor/pipeline parallelism needs"),
        (MegatronLayout(pipeline_parallel=2), 2, False, "megatron.pipeline_parallel"),
        (MegatronLayout(tensor_parallel=4), 4, True, "megatron.tensor_parallel: 4 must divide"),
        (MegatronLayout(pipeline_parallel=4), 4, True, "megatron.pipeline_parallel: 4 must divide the number of lay"),
        (MegatronLayout(data_parallel=2), 1, False, "tensor_parallel x pipeline_parallel x data_parallel"),
    ]
    for lay, world, gpus, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            check_layout(lay, arch, world, gpus)
    check_layout(MegatronLayout(tensor_parallel=2, pipeline_parallel=2, data_parallel=2), arch, 8, True)
    with pytest.raises(ConfigError, match="megatron.data_parallel"):
        make_policy(AgentConfig(model_path=str(tiny_model_dir), backend="megatron",
                                megatron=MegatronLayout(data_parallel=3)), 1.0)


def test_config_accepts_megatron_and_checks_the_layout_fields() -> None:
    from services.contracts.config import parse_config

    base = {"run": {"name": "r"}, "environment": {"name": "tictactoe", "roles": {"X": "A"}}}
    cfg = parse_config({**base, "agents": {"A": {"model_path": "m", "backend": "megatron",
                                                 "megatron": {"data_parallel": 2}}}})
    assert cfg.agents["A"].backend == "megatron" and cfg.agents["A"].megatron.data_parallel == 2
    with pytest.raises(ConfigError, match="agents.A.megatron.tensor_parallel"):
        parse_config({**base, "agents": {"A": {"model_path": "m", "megatron": {"tensor_parallel": 0}}}})
    with pytest.raises(ConfigError, match="agents.A.megatron.expert_parallel"):
        parse_config({**base, "agents": {"A": {"model_path": "m", "megatron": {"expert_parallel": 2}}}})


def test_launcher_starts_a_multi_rank_megatron_trainer_under_torchrun() -> None:
    from services.launcher.up import trainer_command

    base = ["--config", "c.yaml", "--agent", "A"]
    one = trainer_command(AgentConfig(model_path="m", backend="megatron"), base)
    assert one[1:] == ["-m", "services.trainer", *base]
    two = trainer_command(AgentConfig(model_path="m", backend="megatron", megatron=MegatronLayout(data_parallel=2)),
                          base)
    assert Path(two[0]).name == "torchrun" and two[1:] == ["--standalone", "--nproc_per_node", "2", "-m",
                                                           "services.trainer", *base]
    assert trainer_command(AgentConfig(model_path="m", megatron=MegatronLayout(data_parallel=2)), base)[1] == "-m"


@pytest.mark.slow
def test_two_data_parallel_processes_train_like_one(tiny_model_dir: Path, tmp_path: Path) -> None:
    """torchrun, 2 processes over gloo, data_parallel 2: rank 0 drives rank 1; the weights equal one process's."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", "2", __file__, str(tmp_path),
                           str(tiny_model_dir)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    single = make_policy(agent(tiny_model_dir), 1.0)
    want = single.train_step(EQUAL)
    single.save(tmp_path / "single")
    got = torch.load(tmp_path / "dp2_metrics.pt")
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    a, b = load_file(tmp_path / "dp2" / "model.safetensors"), load_file(tmp_path / "single" / "model.safetensors")
    # AdamW's first step moves an element by lr * g / (|g| + eps): where a gradient is at eps's scale, the two
    # ranks' other reduction order can move it anywhere in [-lr, lr]. So: nearly every element equal, none off by
    # more than one step (measured: at most 0.04 % of a tensor's elements past 1e-6, none past 4e-4 at lr 1e-2).
    for k in a:
        diff = (a[k] - b[k]).abs()
        assert float((diff > 1e-6).float().mean()) <= 1e-3 and float(diff.max()) <= 1e-2, k
    assert (tmp_path / "dp2_state" / "megatron_rank0_0.pt").is_file()


def _dp_worker(out: Path, model_dir: Path) -> None:
    acfg = AgentConfig(model_path=str(model_dir), backend="megatron", algorithm=AlgorithmConfig(lr=1e-2),
                       megatron=MegatronLayout(data_parallel=2))
    policy = make_policy(acfg, 1.0)
    if policy.follower:
        policy.follow()
        return
    metrics = policy.train_step(EQUAL)
    policy.save(out / "dp2")
    policy.save_state(out / "dp2_state", 1)
    assert policy.load_state(out / "dp2_state") == 1
    policy.close()
    torch.save(metrics, out / "dp2_metrics.pt")


if __name__ == "__main__":
    _dp_worker(Path(sys.argv[1]), Path(sys.argv[2]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is what a machine without a GPU shows")
def test_megatron_follows_trainer_device(tiny_model_dir: Path) -> None:
    """``trainer.device: cuda`` without a GPU stops the megatron backend at start, naming the field (it used to
    pick the device from torch alone)."""
    acfg = AgentConfig(model_path=str(tiny_model_dir), backend="megatron", trainer={"device": "cuda"})
    with pytest.raises(ConfigError, match=r"trainer\.device: 'cuda' was asked for, but torch sees no GPU"):
        make_policy(acfg, 1.0)
