"""Weight loading for the embedded engine: a checkpoint directory's safetensors into a live model.

``load_weights`` reads every ``*.safetensors`` file of a directory, checks that the tensors fit the
model exactly (names and shapes; a tied ``lm_head`` may be left out) and only then loads them, so a
bad checkpoint raises ``EngineError`` and leaves the live model as it was.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from services.inference.request import EngineError


def load_weights(model: torch.nn.Module, model_path: str) -> None:
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise EngineError(f"no .safetensors files in {model_path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:
            raise EngineError(f"cannot read {f}: {exc}") from exc
    expected = model.state_dict()
    tied = getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" in expected
    if tied and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise EngineError(f"weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    shapes = [k for k, v in expected.items() if tuple(v.shape) != tuple(state[k].shape)]
    if shapes:
        raise EngineError(f"shape mismatch for {shapes[:5]}")
    model.load_state_dict(state, strict=True)
