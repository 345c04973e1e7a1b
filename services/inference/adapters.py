"""LoRA adapters on the embedded engine's resident base: loaded by name, chosen per request, per batch row.

``LoraAdapters`` holds named adapters read from PEFT directories (``read_adapter``: ``adapter_config.json``
and ``adapter_model.safetensors``, checked against the live model: every tensor a ``lora_A``/``lora_B`` of a
``torch.nn.Linear`` it has, shapes that fit). The base weights are never touched: a forward hook on each
targeted Linear adds ``scale * B(A(x))`` to the rows whose request names that adapter, so one batch may mix
adapters and rows on the bare base. ``rows(names)`` sets the row -> adapter map for one forward pass; with
no adapter named the hooks add nothing. ``merge`` folds an adapter into the weights for good (an engine
built on an adapter directory: the coordinator's in-process players).

Loading a name never disturbs running requests (they name other adapters); ``unload`` refuses new requests
for the name at once and removes it once no queued or running request names it (the engine says when).
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from services.common.adapter_dir import ADAPTER_WEIGHTS, adapter_config
from services.inference.request import EngineError

_PREFIX = "base_model.model."
UNLOAD_POLL_S = 0.01


@dataclass(frozen=True)
class Adapter:
    """One adapter: per targeted module (its name in the model), its (A, B) and the LoRA scale."""

    name: str
    path: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float


def _scale(cfg: dict, where: Path) -> float:
    for key in ("use_dora", "fan_in_fan_out"):
        if cfg.get(key):
            raise EngineError(f"{where}: {key} adapters are not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise EngineError(f"{where}: per-module rank_pattern/alpha_pattern are not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, int | float):
        raise EngineError(f"{where}: r and lora_alpha must be numbers (r >= 1)")
    return float(alpha) / (math.sqrt(r) if cfg.get("use_rslora") else r)


def read_adapter(model: torch.nn.Module, name: str, path: str) -> Adapter:
    """Read and check the adapter at ``path`` against ``model``; EngineError with the reason otherwise."""
    root = Path(path)
    try:
        cfg = adapter_config(root)
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    scale = _scale(cfg, root / "adapter_config.json")
    try:
        state = load_file(str(root / ADAPTER_WEIGHTS))
    except Exception as exc:
        raise EngineError(f"cannot read {root / ADAPTER_WEIGHTS}: {exc}") from exc
    modules = dict(model.named_modules())
    param = next(model.parameters())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in state.items():
        stem, _, kind = key.removeprefix(_PREFIX).removesuffix(".weight").rpartition(".")
        if not key.startswith(_PREFIX) or kind not in ("lora_A", "lora_B"):
            raise EngineError(f"{root.name}: tensor {key!r} is not a LoRA A/B weight")
        pairs.setdefault(stem, {})[kind] = t
    weights = {}
    for stem, ab in pairs.items():
        mod = modules.get(stem)
        if not isinstance(mod, torch.nn.Linear):
            raise EngineError(f"{root.name}: {stem!r} is not a Linear module of this model")
        a, b = ab.get("lora_A"), ab.get("lora_B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] \
                or a.shape[1] != mod.in_features or b.shape[0] != mod.out_features:
            raise EngineError(f"{root.name}: the LoRA weights of {stem!r} do not fit it")
        weights[stem] = (a.to(param.device, param.dtype), b.to(param.device, param.dtype))
    if not weights:
        raise EngineError(f"{root.name}: the adapter holds no LoRA weights")
    return Adapter(name=name, path=str(path), weights=weights, scale=scale)


@torch.no_grad()
def merge(model: torch.nn.Module, adapter: Adapter) -> None:
    """Fold the adapter into the model's weights (W += scale * B @ A)."""
    modules = dict(model.named_modules())
    for stem, (a, b) in adapter.weights.items():
        modules[stem].weight.add_(adapter.scale * (b @ a))


class LoraAdapters:
    """Named adapters on one live model, applied by forward hooks to the rows that name them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.loaded: dict[str, Adapter] = {}
        self.unloading: set[str] = set()
        self._hooked: set[str] = set()
        self._groups: list[tuple[Adapter, torch.Tensor | None]] = []  # this forward's (adapter, rows or all)
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        return sorted(self.loaded)

    def check(self, name: str | None) -> None:
        """EngineError unless ``name`` (when given) is loaded and not being unloaded."""
        if name is not None and (name not in self.loaded or name in self.unloading):
            raise EngineError(f"lora_path {name!r} is not a loaded adapter (loaded: {self.names()})")

    async def load(self, name: str, path: str) -> None:
        """Read the adapter off the event loop, then make it servable under ``name``."""
        if name in self.loaded:
            raise EngineError(f"an adapter named {name!r} is already loaded (unload it first)")
        adapter = await asyncio.to_thread(read_adapter, self.model, name, path)
        with self._lock:
            if name in self.loaded:
                raise EngineError(f"an adapter named {name!r} is already loaded (unload it first)")
            for stem in adapter.weights.keys() - self._hooked:
                self.model.get_submodule(stem).register_forward_hook(self._hook(stem))
                self._hooked.add(stem)
            self.loaded[name] = adapter

    async def unload(self, name: str, in_use: Callable[[str], bool]) -> None:
        """Refuse new requests for ``name`` now; remove it once ``in_use(name)`` is false."""
        if name not in self.loaded or name in self.unloading:
            raise EngineError(f"no loaded adapter named {name!r} (loaded: {self.names()})")
        self.unloading.add(name)
        try:
            # requests finish on the engine's thread: its queue and rows are polled
            while in_use(name):  # noqa: ASYNC110
                await asyncio.sleep(UNLOAD_POLL_S)
            with self._lock:
                del self.loaded[name]
        finally:
            self.unloading.discard(name)

    @contextmanager
    def rows(self, names: list[str | None], device: torch.device) -> Iterator[None]:
        """For one forward pass over rows named ``names`` (None: the bare base), apply their adapters."""
        named = {n for n in names if n is not None}
        if not named:
            yield
            return
        groups: list[tuple[Adapter, torch.Tensor | None]] = []
        for n in sorted(named):
            idx = [i for i, x in enumerate(names) if x == n]
            rows = None if len(idx) == len(names) else torch.tensor(idx, device=device)
            groups.append((self.loaded[n], rows))
        self._groups = groups
        try:
            yield
        finally:
            self._groups = []

    def _hook(self, stem: str) -> Callable[..., torch.Tensor | None]:
        def add_lora(_: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor | None:
            if not self._groups:
                return None
            x = args[0]
            for adapter, rows in self._groups:
                ab = adapter.weights.get(stem)
                if ab is None:
                    continue
                a, b = ab
                if rows is None:
                    out = out + adapter.scale * ((x @ a.T) @ b.T)
                else:
                    out = out.index_add(0, rows, adapter.scale * ((x.index_select(0, rows) @ a.T) @ b.T))
            return out

        return add_lora
