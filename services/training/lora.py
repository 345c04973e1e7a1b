"""LoRA for the torch backend (peft): adapters on a frozen base; each version goes to the engines as the adapter.

Each agent's trainer wraps its own copy of the base model; only the adapter
parameters are trainable (and optimised, and saved in the trainer state). A
version is published as a PEFT adapter directory (``save_adapter``: the adapter
config naming the base's absolute path, and the adapter's safetensors), which the
engines serve on their resident base (``/load_lora_adapter``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file

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
