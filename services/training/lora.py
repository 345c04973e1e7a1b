"""LoRA for the torch backend (peft): adapters on a frozen base, merged weights for the engines.

Each agent's trainer wraps its own copy of the base model; only the adapter
parameters are trainable (and optimised, and saved in the trainer state). The
engines load plain HF directories, so every version is exported merged.
"""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model

from services.contracts.config import LoraConfig


def add_adapters(model: torch.nn.Module, cfg: LoraConfig) -> PeftModel:
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [m for m in cfg.target_modules if m not in names]
    if missing:
        raise ValueError(f"lora.target_modules: {missing} are not modules of this model")
    pcfg = PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                          target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, pcfg)


def merged_copy(model: PeftModel) -> torch.nn.Module:
    """A plain transformers model with the adapters folded in; the trained model is left as it is."""
    return copy.deepcopy(model).merge_and_unload()


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
