"""LoRA for the torch backend (peft): adapters on a frozen base; each version goes to the engines as the adapter.

Each agent's trainer wraps its own copy of the base model; only the adapter
parameters are trainable (and optimised, and saved in the trainer state). A
version is published as a PEFT adapter directory (``save_adapter``: the adapter
config naming the base's absolute path, and the adapter's safetensors), which the
engines serve on their resident base (``/load_lora_adapter``). ``save_merged`` writes the base with the adapter
folded in as a full HF directory (SFT from a file: a checkpoint the next stage starts from as its ``model_path``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, get_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase

from services.common.adapter_dir import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from services.contracts.config import LoraConfig


def add_adapters(model: torch.nn.Module, cfg: LoraConfig) -> PeftModel:
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [m for m in cfg.target_modules if m not in names]
    if missing:
        raise ValueError(f"lora.target_modules: {missing} are not modules of this model")
    pcfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, pcfg)


def save_adapter(model: PeftModel, out_dir: Path, base_path: str) -> None:
    """Write the adapter as PEFT does (``adapter_config.json`` + ``adapter_model.safetensors``), naming
    ``base_path`` (made absolute) as its base; nothing else, so the directory is the adapter's bytes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(model).items()}
    save_file(state, str(out_dir / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    cfg = model.peft_config["default"].to_dict()
    cfg["base_model_name_or_path"] = str(Path(base_path).resolve())
    cfg = {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.items()}
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str))


def merged_state(model: PeftModel) -> dict[str, torch.Tensor]:
    """The base's weights under their plain names, each adapted layer's with its adapter folded in
    (W + scale * B @ A); the model itself is left as it is (adapters on, base frozen)."""
    base = model.get_base_model()
    deltas = {f"{name}.weight": mod.get_delta_weight("default") for name, mod in base.named_modules()
              if isinstance(mod, LoraLayer) and "default" in mod.lora_A}
    state = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        key = key.replace(".base_layer.", ".")
        state[key] = value + deltas[key].to(value.dtype) if key in deltas else value
    return state


def save_merged(model: PeftModel, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> None:
    """Write the base with the adapter folded in as a full HF directory (config, safetensors, tokenizer)."""
    base = model.get_base_model()
    if getattr(base.config, "tie_word_embeddings", False) and {"lm_head", "embed_tokens"} & set(
            model.peft_config["default"].target_modules):
        raise ValueError("lora.target_modules: an adapter on a tied embedding cannot be merged into one weight; "
                         "leave lm_head and embed_tokens out")
    with torch.no_grad():
        base.save_pretrained(out_dir, state_dict=merged_state(model), safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def adapter_state(model: PeftModel) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def load_adapter_state(model: PeftModel, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    unknown = [n for n in state if n not in params]
    if unknown:
        raise ValueError(f"trainer state holds adapter weights this model lacks: {unknown[:3]}")
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t)
