"""The checkpoints on disk as the REST API shows them: listing, metadata, PEFT export, signed file URLs.

A checkpoint is a directory ``data_dir/runs/{model_id}/{kind}/{name}`` (``kind`` is ``weights``
(``save_state``), ``sampler_weights`` (an HF directory) or ``external_weights`` (a PEFT adapter:
``adapter_model.safetensors`` + ``adapter_config.json``, each file age-encrypted to ``.age`` when
the save named recipients)); its ``tinker://{model_id}/{kind}/{name}`` path is what clients see.
A training state converts to a PEFT adapter without loading any model: its tensors are peft's own
parameters under the adapter name ``adapter``. File URLs carry an HMAC-SHA256 signature and an
expiry, so a plain HTTP GET (the cookbook's ``urllib``) fetches them without an API key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch
from peft import LoraConfig as PeftLoraConfig
from safetensors.torch import save_file

from services.tinker_api.lora_host import LORA_ALPHA
from services.tinker_api.losses import UserError

KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
URL_TTL_S = 3600


def parse_path(path: str) -> tuple[str, str, str]:
    """``tinker://model_id/kind/name`` to (model_id, kind, name); a UserError naming the path otherwise."""
    if not path.startswith("tinker://"):
        raise UserError(f"path: {path!r} is not a tinker:// path")
    parts = path[len("tinker://"):].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0] or not parts[2]:
        raise UserError(f"path: {path!r} is not tinker://<model_id>/<{'|'.join(KINDS)}>/<name>")
    return parts[0], parts[1], parts[2]


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def describe(model_id: str, kind: str, d: Path, expires_at: float | None, public: bool = False) -> dict[str, Any]:
    """One checkpoint as the SDK's ``types.Checkpoint``."""
    return {"checkpoint_id": f"{kind}/{d.name}", "checkpoint_type": KINDS[kind],
            "time": datetime.fromtimestamp(d.stat().st_mtime, UTC).isoformat(),
            "tinker_path": f"tinker://{model_id}/{kind}/{d.name}", "size_bytes": dir_size(d), "public": public,
            "expires_at": None if expires_at is None else datetime.fromtimestamp(expires_at, UTC).isoformat()}


def checkpoint_dirs(runs: Path, model_id: str) -> list[tuple[str, Path]]:
    """(kind, directory) of every finished checkpoint of a model, oldest first (temp dirs left out)."""
    found = [(kind, d) for kind in KINDS for d in (runs / model_id / kind).glob("*")
             if d.is_dir() and ".tmp" not in d.name]
    return sorted(found, key=lambda kd: kd[1].stat().st_mtime)


# -- PEFT adapters --------------------------------------------------------------------------
def adapter_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A training state's LoRA tensors under PEFT's saved names (``...q_proj.lora_A.weight``)."""
    return {k.replace(".adapter.", "."): v.contiguous() for k, v in state["weights"].items()}


def write_adapter(state: dict[str, Any], base_model: str, out_dir: Path, recipients: list[str] | None = None
                  ) -> Path:
    """A PEFT adapter directory from a training state (atomically); each file age-encrypted with recipients."""
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(adapter_tensors(state), str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    PeftLoraConfig(r=int(state["rank"]), lora_alpha=LORA_ALPHA, lora_dropout=0.0, bias="none",
                   target_modules=list(state["targets"]), task_type="CAUSAL_LM",
                   base_model_name_or_path=base_model).save_pretrained(str(tmp))
    if recipients:
        encrypt_files(tmp, recipients)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def parse_recipients(recipients: list[str]) -> list[Any]:
    """age recipients (``age1...`` keys or SSH public keys); a UserError naming the bad one."""
    import pyrage

    if len(recipients) > 10:
        raise UserError("age_encryption_recipients: at most 10")
    out = []
    for i, r in enumerate(recipients):
        kind = pyrage.ssh.Recipient if r.startswith("ssh-") else pyrage.x25519.Recipient
        try:
            out.append(kind.from_str(r))
        except Exception as exc:  # noqa: BLE001 - pyrage raises its own RecipientError
            raise UserError(f"age_encryption_recipients[{i}]: not an age or SSH public key: {exc}") from None
    return out


def encrypt_files(root: Path, recipients: list[str]) -> None:
    import pyrage

    keys = parse_recipients(recipients)
    for f in [p for p in root.rglob("*") if p.is_file()]:
        f.with_name(f.name + ".age").write_bytes(pyrage.encrypt(f.read_bytes(), keys))
        f.unlink()


# -- signed file URLs -----------------------------------------------------------------------
class UrlSigner:
    """HMAC-SHA256 over (file path, expiry) with a key kept in ``data_dir/url.key`` (0600, made once)."""

    def __init__(self, data_dir: Path) -> None:
        key_file = Path(data_dir) / "url.key"
        if not key_file.is_file():
            key_file.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        self.key = key_file.read_text().strip().encode()

    def _sig(self, rel: str, expires: int) -> str:
        return hmac.new(self.key, f"{rel}\n{expires}".encode(), hashlib.sha256).hexdigest()

    def url(self, base_url: str, rel: str, ttl_s: int = URL_TTL_S) -> tuple[str, int]:
        expires = int(time.time()) + ttl_s
        return f"{base_url.rstrip('/')}/api/v1/files/{quote(rel)}?expires={expires}&sig={self._sig(rel, expires)}", \
            expires

    def check(self, rel: str, expires: int, sig: str) -> None:
        if expires < time.time():
            raise UserError("the signed URL has expired: ask for new ones")
        if not hmac.compare_digest(self._sig(rel, expires), sig):
            raise UserError("the URL's signature does not match")


# -- operators: a checkpoint out of the data directory --------------------------------------
def export(data_dir: Path, tinker_path: str, out_dir: Path) -> Path:
    """Copy a checkpoint out of ``data_dir`` (no server needed): a training state becomes a PEFT adapter,
    a sampler snapshot is its HF directory, an external-weights checkpoint its files."""
    model_id, kind, name = parse_path(tinker_path)
    src = Path(data_dir) / "runs" / model_id / kind / name
    if "/" in model_id or model_id in (".", "..") or "/" in name or not src.is_dir():
        raise UserError(f"path: no checkpoint at {tinker_path} under {data_dir}")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"{out_dir}: not empty")
    if kind == "weights":
        import json

        state = torch.load(src / "tinker_state.pt", map_location="cpu", weights_only=False)
        base = json.loads((src / "meta.json").read_text())["base_model"]
        return write_adapter(state, base, out_dir)
    shutil.copytree(src, out_dir, dirs_exist_ok=True)
    return out_dir
