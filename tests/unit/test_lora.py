"""LoRA on the torch backend: only adapters train, the engines get the adapter alone, state round-trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.contracts.config import AgentConfig, AlgorithmConfig, LoraConfig
from services.contracts.messages import Sample
from services.inference.adapters import merge, read_adapter
from services.training.backends import make_policy
from services.training.torch_backend import TorchPolicy, pad_batch
from tests.helpers import completion_sample

LORA = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def batch() -> list[Sample]:
    return [completion_sample([5, 6, 7], out, r, "g", logp=-5.5)
            for out, r in (([40, 41, 42], 1.0), ([50, 51, 52], 0.0))]


def policy(model_dir: Path, seed: int = 0, **algo) -> TorchPolicy:
    return make_policy(AgentConfig(model_path=str(model_dir), lora=LORA, seed=seed,
                                   algorithm=AlgorithmConfig(lr=0.05, **algo)), 1.0)


def test_only_adapters_train_and_the_adapter_export_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    p = policy(tiny_model_dir)
    before = {n: t.detach().clone() for n, t in p.model.named_parameters()}
    trainable = [n for n, t in p.model.named_parameters() if t.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(len(g["params"]) for g in p.optimizer.param_groups) == len(trainable)
    p.train_step(batch())
    changed = {n for n, t in p.model.named_parameters() if not torch.equal(t, before[n])}
    assert changed and all("lora_" in n for n in changed)
    assert any("lora_B" in n for n in changed)  # B starts at zero; a step made the adapter non-trivial

    out, checksum = p.save(tmp_path / "v00001")
    assert len(checksum) == 64
    assert sorted(f.name for f in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    merge(merged, read_adapter(merged, "v1", str(out)))  # what an engine built on the directory serves
    b = pad_batch(batch(), p.pad_id)
    with torch.no_grad():
        m_logits = merged(input_ids=b["input_ids"]).logits
        p.model.eval()
        adapted = p.model(input_ids=b["input_ids"]).logits
        base_logits = base(input_ids=b["input_ids"]).logits
    torch.testing.assert_close(m_logits, adapted, atol=1e-4, rtol=1e-4)
    assert (m_logits - base_logits).abs().max() > 1e-3
    # the trained model still carries its adapters (export did not merge them in place)
    assert any("lora_" in n for n, _ in p.model.named_parameters())


def test_two_agents_get_their_own_adapters_on_one_frozen_base(tiny_model_dir: Path) -> None:
    base_bytes = (tiny_model_dir / "model.safetensors").read_bytes()
    a, b = policy(tiny_model_dir, seed=1), policy(tiny_model_dir, seed=2)
    a.train_step(batch())
    b.train_step(list(reversed([s.model_copy(update={"reward": 1.0 - s.reward}) for s in batch()])))
    la = {n: t for n, t in a.model.named_parameters() if t.requires_grad}
    lb = {n: t for n, t in b.model.named_parameters() if t.requires_grad}
    assert la.keys() == lb.keys() and any(not torch.equal(la[n], lb[n]) for n in la)
    assert (tiny_model_dir / "model.safetensors").read_bytes() == base_bytes


def test_lora_reference_is_the_base_and_state_round_trips(tiny_model_dir: Path, tmp_path: Path) -> None:
    p = policy(tiny_model_dir, kl_coef=0.1)
    first = p.train_step(batch())
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # adapters start as the identity
    assert p.train_step(batch())["kl"] > 0
    p.save_state(tmp_path / "s", p.weight_version)
    q = policy(tiny_model_dir, kl_coef=0.1)
    assert q.load_state(tmp_path / "s") == 2
    for (n, x), (_, y) in zip(p.model.named_parameters(), q.model.named_parameters(), strict=True):
        torch.testing.assert_close(x, y, msg=n)
    plain = make_policy(AgentConfig(model_path=str(tiny_model_dir)), 1.0)
    with pytest.raises(ValueError, match="lora=on"):
        plain.load_state(tmp_path / "s")


def test_bad_lora_target_fails_naming_the_field(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"lora.target_modules: \['nope'\]"):
        make_policy(AgentConfig(model_path=str(tiny_model_dir), lora=LoraConfig(target_modules=["nope"])), 1.0)
