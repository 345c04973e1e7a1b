"""A megatron-core GPTModel built from an HF config (dense Qwen2, Qwen3, Llama).

``transformer_config`` maps the HF fields onto megatron's TransformerConfig (GQA,
head_dim, RMSNorm eps, gated SiLU MLP, qkv bias for Qwen2, QK-norm for Qwen3, tied
embeddings) and ``build_model`` builds the model with the local (non-Transformer-Engine)
layer spec and sets RoPE's inverse frequencies from transformers' own rope functions, so
default, linear and llama3 scaling match exactly. ``init_parallel`` starts
torch.distributed (gloo on CPU, nccl on GPU) and megatron's parallel state.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig
from transformers import PretrainedConfig

from services.common.embedded_redis import free_port

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModel(ValueError):
    """An HF config this backend cannot represent faithfully."""


@dataclass(frozen=True)
class Arch:
    """What the weight converters need to know about one HF architecture."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    linear_bias: bool
    qk_norm: bool


def arch_of(hf: PretrainedConfig) -> Arch:
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(f"model_type {hf.model_type!r} is not supported by the megatron backend; "
                               f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if getattr(hf, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"hidden_act {hf.hidden_act!r}: only the gated SiLU MLP is supported")
    if getattr(hf, "use_sliding_window", False):
        raise UnsupportedModel("use_sliding_window: sliding-window attention is not supported")
    attn_bias = bool(getattr(hf, "attention_bias", False))
    mlp_bias = bool(getattr(hf, "mlp_bias", False))
    if hf.model_type == "llama" and attn_bias != mlp_bias:
        raise UnsupportedModel("llama with attention_bias != mlp_bias: megatron has one add_bias_linear switch")
    heads = hf.num_attention_heads
    return Arch(
        model_type=hf.model_type, num_layers=hf.num_hidden_layers, num_heads=heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        hidden=hf.hidden_size, ffn=hf.intermediate_size, vocab=hf.vocab_size,
        tied=bool(getattr(hf, "tie_word_embeddings", False)),
        qkv_bias=hf.model_type == "qwen2" or attn_bias,
        linear_bias=hf.model_type == "llama" and attn_bias,
        qk_norm=hf.model_type == "qwen3",
    )


def rope_inv_freq(hf: PretrainedConfig) -> torch.Tensor:
    """RoPE inverse frequencies exactly as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    if rope_type == "default":
        dim = arch_of(hf).head_dim
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf)
    if scaling != 1.0:
        raise UnsupportedModel(f"rope_type {rope_type!r} scales attention by {scaling}; not supported")
    return inv_freq.float()


def transformer_config(hf: PretrainedConfig, tp: int = 1, pp: int = 1, on_gpu: bool = False) -> TransformerConfig:
    a = arch_of(hf)
    return TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden, ffn_hidden_size=a.ffn,
        num_attention_heads=a.num_heads, num_query_groups=a.num_kv_heads, kv_channels=a.head_dim,
        normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False,
        add_bias_linear=a.linear_bias, add_qkv_bias=a.qkv_bias, qk_layernorm=a.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        use_cpu_initialization=not on_gpu, init_method_std=getattr(hf, "initializer_range", 0.02),
    )


def build_model(hf: PretrainedConfig, on_gpu: bool = False) -> GPTModel:
    """The GPTModel for this rank's pipeline stage (parallel state must be initialised)."""
    a = arch_of(hf)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    cfg = transformer_config(hf, tp, pp, on_gpu)
    spec = get_gpt_layer_local_spec(qk_layernorm=a.qk_norm, normalization="RMSNorm")
    model = GPTModel(
        cfg, spec, vocab_size=a.vocab, max_sequence_length=hf.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=a.tied, position_embedding_type="rope", parallel_output=True,
    )
    model.rotary_pos_emb.inv_freq = rope_inv_freq(hf).to(torch.cuda.current_device() if on_gpu else "cpu")
    return model.cuda() if on_gpu else model


def init_parallel(tp: int = 1, pp: int = 1, seed: int = 0, on_gpu: bool | None = None) -> bool:
    """Start torch.distributed (torchrun's env, else a world of one) and megatron's groups, on the GPUs
    (nccl) when ``on_gpu`` (default: whenever torch sees one), else on the CPU over gloo.

    Returns ``on_gpu``. On CPU the compat layer is enabled here and nowhere else.
    """
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    if not torch.distributed.is_initialized():
        if on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if "WORLD_SIZE" in os.environ:
            torch.distributed.init_process_group("nccl" if on_gpu else "gloo")
        else:
            torch.distributed.init_process_group("nccl" if on_gpu else "gloo", rank=0, world_size=1,
                                                 init_method=f"tcp://127.0.0.1:{free_port()}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if on_gpu:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    else:
        from services.training.megatron import cpu_compat

        cpu_compat.enable()
        cpu_compat.seed_rng_tracker(seed, parallel_state.get_tensor_model_parallel_rank())
    torch.manual_seed(seed)
    return on_gpu
