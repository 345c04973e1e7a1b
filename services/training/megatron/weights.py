"""HF <-> Megatron weights for dense Qwen2, Qwen3 and Llama.

Layouts: megatron fuses q, k and v into ``linear_qkv`` grouped per KV head (for each
query group: its query heads, then its key head, then its value head), and gate and up
into ``linear_fc1`` (gate first; megatron applies the activation to the first half).
With tensor parallelism each rank holds a contiguous slice of the fused QKV (whole
groups) and, of fc1, its slice of gate followed by its slice of up. With pipeline
parallelism each stage numbers its layers from 0; ``layer_offset`` maps them.

``hf_to_mcore``/``mcore_to_hf`` convert whole (unsharded) state dicts and are exact
inverses (split and concatenate only), so HF -> Megatron -> HF is bit-exact.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from services.training.megatron.model import Arch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = "model.layers.{i}."
_SIMPLE = {  # megatron layer suffix -> HF layer suffix (one tensor each)
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}


def load_hf_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory (one model.safetensors or an index of shards)."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            out.update(load_file(d / shard))
        return out
    if not (d / "model.safetensors").is_file():
        raise FileNotFoundError(f"{d} holds neither model.safetensors nor model.safetensors.index.json")
    return load_file(d / "model.safetensors")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: Arch) -> torch.Tensor:
    g, d = a.num_kv_heads, a.head_dim
    rest = q.shape[1:]
    parts = (q.reshape(g, a.num_heads // g * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, a: Arch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d = a.num_kv_heads, a.head_dim
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (a.num_heads // g + 2) * d, *rest).split([a.num_heads // g * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_mcore(hf: dict[str, torch.Tensor], a: Arch) -> dict[str, torch.Tensor]:
    """Whole HF state dict -> whole megatron state dict (global layer numbers)."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not a.tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(a.num_layers):
        h, m = _HF_LAYER.format(i=i), f"decoder.layers.{i}."
        for mc, hs in _SIMPLE.items():
            if h + hs in hf:
                out[m + mc] = hf[h + hs]
        for kind in ("weight", "bias"):
            names = [f"{h}self_attn.{p}_proj.{kind}" for p in "qkv"]
            if names[0] in hf:
                out[f"{m}self_attention.linear_qkv.{kind}"] = fuse_qkv(*(hf[n] for n in names), a)
            gate, up = f"{h}mlp.gate_proj.{kind}", f"{h}mlp.up_proj.{kind}"
            if gate in hf:
                out[f"{m}mlp.linear_fc1.{kind}"] = torch.cat([hf[gate], hf[up]], dim=0)
    return out


def mcore_to_hf(mc: dict[str, torch.Tensor], a: Arch) -> dict[str, torch.Tensor]:
    """Whole megatron state dict -> whole HF state dict (no lm_head when tied)."""
    out = {"model.embed_tokens.weight": mc["embedding.word_embeddings.weight"],
           "model.norm.weight": mc["decoder.final_layernorm.weight"]}
    if not a.tied:
        out["lm_head.weight"] = mc["output_layer.weight"]
    for name, t in mc.items():
        match = _LAYER.match(name)
        if not match:
            continue
        h, rest = _HF_LAYER.format(i=int(match.group(1))), match.group(2)
        if rest in _SIMPLE:
            out[h + _SIMPLE[rest]] = t
        elif rest.startswith("self_attention.linear_qkv."):
            kind = rest.rsplit(".", 1)[1]
            for p, part in zip("qkv", split_qkv(t, a), strict=True):
                out[f"{h}self_attn.{p}_proj.{kind}"] = part
        elif rest.startswith("mlp.linear_fc1."):
            kind = rest.rsplit(".", 1)[1]
            gate, up = t.chunk(2, dim=0)
            out[f"{h}mlp.gate_proj.{kind}"], out[f"{h}mlp.up_proj.{kind}"] = gate, up
        else:
            raise KeyError(f"megatron tensor {name} has no HF counterpart")
    return {k: v.contiguous() for k, v in out.items()}


def global_name(local: str, layer_offset: int) -> str:
    match = _LAYER.match(local)
    return f"decoder.layers.{int(match.group(1)) + layer_offset}.{match.group(2)}" if match else local


def shard(full: torch.Tensor, name: str, param: torch.nn.Parameter, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's slice of a whole megatron tensor."""
    if tp == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if ".linear_fc1." in name:  # [gate; up] -> [gate_rank; up_rank]
        return torch.cat([half.chunk(tp, dim=dim)[rank] for half in full.chunk(2, dim=dim)], dim=dim)
    return full.chunk(tp, dim=dim)[rank]


def unshard(pieces: list[torch.Tensor], name: str, param: torch.nn.Parameter) -> torch.Tensor:
    """Inverse of ``shard`` given every TP rank's slice, in rank order."""
    if len(pieces) == 1 or not getattr(param, "tensor_model_parallel", False):
        return pieces[0]
    dim = param.partition_dim
    if ".linear_fc1." in name:
        halves = [p.chunk(2, dim=dim) for p in pieces]
        return torch.cat([torch.cat([h[0] for h in halves], dim=dim), torch.cat([h[1] for h in halves], dim=dim)],
                         dim=dim)
    return torch.cat(pieces, dim=dim)
