"""HF <-> Megatron parity per architecture (Qwen2, Qwen3, Llama), on tiny random configs.

* the megatron-core GPTModel's logits equal transformers' on the same input within 1e-4 (float32);
* HF -> Megatron -> HF is bit-exact: the same tensor names, every tensor torch.equal;
* the exported directory loads in transformers and gives the same logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config  # noqa: E402

from services.demo.tiny_model import build_tokenizer  # noqa: E402
from services.training.megatron.model import UnsupportedModel, arch_of, build_model, init_parallel  # noqa: E402
from services.training.megatron.weights import (  # noqa: E402
    fuse_qkv,
    hf_to_mcore,
    load_hf_state,
    mcore_to_hf,
    split_qkv,
)

COMMON = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)
CONFIGS = {
    # Qwen3: QK-norm, head_dim != hidden/heads, tied embeddings
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=True, rope_theta=1e6),
    # Qwen2: qkv bias, separate lm_head
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False, rope_theta=1e6),
    # Llama: llama3 RoPE scaling, no biases, MHA (kv heads = heads)
    "llama": lambda: LlamaConfig(**{**COMMON, "num_key_value_heads": 4}, tie_word_embeddings=False, rope_theta=5e5,
                                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # Llama with attention and MLP biases, linear RoPE scaling, GQA
    "llama_bias": lambda: LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                      rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


@pytest.fixture(scope="module", autouse=True)
def parallel() -> None:
    init_parallel(1, 1, seed=0)


def random_hf_dir(name: str, path: Path) -> Path:
    """A transformers model of the named config with random weights (norms and biases too), saved with a tokenizer."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in pname else p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def causal_mask(b: int, t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).triu(1)[None, None].expand(b, 1, t, t)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name: str, tmp_path: Path) -> None:
    d = random_hf_dir(name, tmp_path / name)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    a = arch_of(hf.config)
    model = build_model(hf.config).eval()
    result = model.load_state_dict(hf_to_mcore(load_hf_state(d), a), strict=False)
    assert not result.unexpected_keys and all(k.endswith("_extra_state") for k in result.missing_keys)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = model(ids, torch.arange(17)[None].expand(2, 17), causal_mask(2, 17))
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hf_megatron_hf_round_trip_is_bit_exact(name: str, tmp_path: Path) -> None:
    d = random_hf_dir(name, tmp_path / name)
    original = load_hf_state(d)
    a = arch_of(AutoModelForCausalLM.from_pretrained(d).config)
    model = build_model(AutoModelForCausalLM.from_pretrained(d).config)
    model.load_state_dict(hf_to_mcore(original, a), strict=False)
    mc = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    back = mcore_to_hf(mc, a)
    assert sorted(back) == sorted(original)
    for k, v in original.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_qkv_layout_is_grouped_per_kv_head() -> None:
    cfg = Qwen3Config(**COMMON, head_dim=2)
    a = arch_of(cfg)
    d, hpg = 2, 2  # head_dim, query heads per group
    q = torch.arange(4 * d).float().unsqueeze(1)        # heads 0..3
    k = 100 + torch.arange(2 * d).float().unsqueeze(1)  # kv heads 0..1
    v = 200 + torch.arange(2 * d).float().unsqueeze(1)
    fused = fuse_qkv(q, k, v, a).squeeze(1).tolist()
    # group 0: q heads 0,1 then k0 then v0; group 1: q heads 2,3 then k1 then v1
    assert fused == [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert all(torch.equal(x, y) for x, y in zip(split_qkv(fuse_qkv(q, k, v, a), a), (q, k, v), strict=True))
    assert hpg * a.num_kv_heads == a.num_heads


def test_unsupported_configs_fail_clearly() -> None:
    from transformers import GPT2Config

    with pytest.raises(UnsupportedModel, match="model_type 'gpt2'"):
        arch_of(GPT2Config())
    with pytest.raises(UnsupportedModel, match="rope_type 'yarn'"):
        from services.training.megatron.model import rope_inv_freq

        rope_inv_freq(Qwen3Config(**COMMON, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                          "original_max_position_embeddings": 64}))
