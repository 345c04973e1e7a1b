"""The training side of the service: every model's LoRA client, and the files its saves write.

All methods are blocking (torch, disk) and run on the service's single training thread, one
operation at a time, in each model's ``seq_id`` order. Files live under ``data_dir/runs``:

* ``{model_id}/weights/{name}/`` — ``save_state``: ``tinker_state.pt`` (adapter weights and,
  for a full save, the AdamW state) plus ``meta.json`` (base model, LoRA layout, seed);
* ``{model_id}/sampler_weights/{name}/`` — ``save_weights_for_sampler``: the merged weights as
  an HF directory the engine loads; written once, never changed;
* ``{model_id}/external_weights/{name}/`` — ``save_weights_external``: the adapter as PEFT saves
  it (``checkpoints.write_adapter``), its files age-encrypted when the save named recipients.

Their ``tinker://{model_id}/weights/{name}`` paths are what clients see.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.tinker_api import wire
from services.tinker_api.checkpoints import parse_path, write_adapter
from services.tinker_api.custom_loss import CustomLoss
from services.tinker_api.lora_host import STATE_FILE, BaseHost, LoraClient
from services.tinker_api.losses import BuiltinLoss, UserError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_name(name: str | None, field: str = "path") -> str:
    if not name or not _NAME.match(name):
        raise UserError(f"{field}: {name!r} is not a checkpoint name (letters, digits, '.', '_', '-'; "
                        "at most 128 characters)")
    return name


class Workshop:
    def __init__(self, data_dir: Path, device: str = "cpu", local_dir: Callable[[str], str] = os.path.abspath
                 ) -> None:
        self.device = device
        self.local_dir_of = local_dir  # a base model's name -> its local directory
        self.runs = Path(data_dir) / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self.hosts: dict[str, BaseHost] = {}
        self.clients: dict[str, LoraClient] = {}
        self.losses: dict[str, CustomLoss] = {}  # loss_id -> the checked graph (built once)

    # -- paths ----------------------------------------------------------------------------
    def tinker_path(self, model_id: str, kind: str, name: str) -> str:
        return f"tinker://{model_id}/{kind}/{name}"

    def local_dir(self, model_id: str, kind: str, name: str) -> Path:
        if "/" in model_id or model_id in ("", ".", ".."):
            raise UserError(f"path: bad model id {model_id!r}")
        return self.runs / model_id / kind / check_name(name)

    def resolve(self, path: str, kind: str) -> Path:
        """A ``tinker://model_id/{kind}/name`` path to its directory; a UserError if it is not one that exists."""
        model_id, held, name = parse_path(path)
        if kind not in (held, "any"):
            raise UserError(f"path: {path!r} holds {held}, this call needs {kind}")
        out = self.local_dir(model_id, held, name)
        if not out.is_dir():
            raise UserError(f"path: no checkpoint at {path}")
        return out

    # -- models ---------------------------------------------------------------------------
    def host(self, base_model: str) -> BaseHost:
        key = self.local_dir_of(base_model)
        if key not in self.hosts:
            self.hosts[key] = BaseHost(key, self.device)
        return self.hosts[key]

    def client(self, model_id: str) -> LoraClient:
        if model_id not in self.clients:
            raise UserError(f"model_id: {model_id!r} is not a live model")
        return self.clients[model_id]

    def create(self, model_id: str, spec: dict[str, Any]) -> None:
        if model_id in self.clients:
            return
        host = self.host(spec["base_model"])
        self.clients[model_id] = LoraClient(host, _adapter_name(model_id), int(spec["rank"]), int(spec["seed"]),
                                            bool(spec["train_mlp"]), bool(spec["train_attn"]),
                                            bool(spec["train_unembed"]))

    def info(self, model_id: str) -> dict[str, Any]:
        c = self.client(model_id)
        n = sum(p.numel() for p in c.params)
        return {"adapter_params": n, "adapter_bytes": n * 4, "optimizer_bytes": 2 * n * 4}

    # -- training -------------------------------------------------------------------------
    def forward_backward(self, model_id: str, body: bytes, custom: dict[str, Any] | None = None
                         ) -> tuple[bytes, float]:
        """One forward(_backward); ``custom`` is the stored record of the custom loss the request names."""
        _, _, loss_fn, config, data, forward_only = wire.decode_forward_backward(body)
        loss: BuiltinLoss | CustomLoss = BuiltinLoss(loss_fn, config) if custom is None else self.custom_loss(custom)
        logps, total, metrics = self.client(model_id).forward_backward(data, loss, backward=not forward_only)
        return wire.encode_forward_backward(logps, {"loss:sum": total, **metrics}), total

    def custom_loss(self, record: dict[str, Any]) -> CustomLoss:
        if record["loss_id"] not in self.losses:
            self.losses[record["loss_id"]] = CustomLoss(record["name"], record["inputs"], record["graph"])
        return self.losses[record["loss_id"]]

    def optim_step(self, model_id: str, req: wire.OptimStep) -> dict[str, Any]:
        if req.optimizer_params is not None and req.optimizer_params.get("type", "adamw") != "adamw":
            raise UserError(f"optim_params: only AdamW is served here, got {req.optimizer_params.get('type')!r}")
        params = (req.adam_params or wire.AdamSpec()).model_dump()
        return {"metrics": self.client(model_id).optim_step(params), "type": "optim_step"}

    # -- saves and loads ------------------------------------------------------------------
    def save_state(self, model_id: str, name: str, spec: dict[str, Any]) -> str:
        out = self.local_dir(model_id, "weights", name)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save(self.client(model_id).state(optimizer=True), tmp / STATE_FILE)
        meta = {k: spec[k] for k in ("base_model", "rank", "seed", "train_mlp", "train_attn", "train_unembed")}
        (tmp / "meta.json").write_text(json.dumps({**meta, "model_id": model_id}, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
        return self.tinker_path(model_id, "weights", name)

    def save_sampler(self, model_id: str, name: str) -> tuple[str, Path]:
        out = self.local_dir(model_id, "sampler_weights", name)
        c = self.client(model_id)
        c.host.export(c.name, out)
        return self.tinker_path(model_id, "sampler_weights", name), out

    def save_external(self, model_id: str, name: str, base_model: str, recipients: list[str] | None
                      ) -> tuple[str, int]:
        """The adapter as a PEFT directory (tinker path, bytes written)."""
        out = self.local_dir(model_id, "external_weights", name)
        write_adapter(self.client(model_id).state(optimizer=False), base_model, out, recipients)
        return self.tinker_path(model_id, "external_weights", name), sum(f.stat().st_size for f in out.iterdir())

    def checkpoint_meta(self, path: str) -> dict[str, Any]:
        return json.loads((self.resolve(path, "weights") / "meta.json").read_text())

    def load(self, model_id: str, path: str, optimizer: bool) -> None:
        state = torch.load(self.resolve(path, "weights") / STATE_FILE, map_location="cpu", weights_only=False)
        self.client(model_id).load(state, optimizer)

    def drop(self, model_id: str) -> list[str]:
        """The model leaves memory and its ephemeral sampler snapshots leave the disk; returns their dirs."""
        client = self.clients.pop(model_id, None)
        if client is not None:
            client.close()
        gone = sorted((self.runs / model_id / "sampler_weights").glob("ephemeral-*"))
        for d in gone:
            shutil.rmtree(d, ignore_errors=True)
        return [str(d) for d in gone]


def _adapter_name(model_id: str) -> str:
    return "a" + re.sub(r"[^A-Za-z0-9_]", "_", model_id)
