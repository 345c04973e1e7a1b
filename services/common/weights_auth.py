"""Authenticated weights: what the trainer signs when it publishes a version, what the rollout checks before
its engines load one.

* ``weights_checksum``: SHA-256 over every file of the version's directory (relative name and content,
  in name order), so a swapped ``config.json`` or shard changes it as much as a changed tensor.
* ``sign``: HMAC-SHA256 with the run's secret over (agent, version, path, checksum).
* ``run_secret``: the run's secret, from the environment only (``TANDEM_WEIGHTS_SECRET``, or the file
  ``TANDEM_WEIGHTS_SECRET_FILE`` names: a mounted secret), never from Redis: whoever holds the Redis password
  must not be able to sign weights. Only the trainers (which sign) and the rollouts (which verify) get it;
  one without it refuses to start naming the variable (``secret_problem``). ``tandem up`` makes it once per
  run into ``runs/<run>/weights.secret`` (mode 0600, ``run_dir_secret``), kept for ``--resume`` and wiped
  by ``--fresh``, and hands it to its children by environment, as it does the admin token
  (``services/common/admin_token.py``); docker compose and Kubernetes give it by environment or file.
* ``refusal``: why an update must not be loaded, or None: the signature (constant-time compare), the
  trainer's commit of that very version (its train log: same path and checksum, and not beyond the
  published version), and the checksum recomputed from the files on disk.
* ``load_refusal``: the engine's own check before it loads a directory (whatever admin token its caller
  holds): the rollout sends the update's checksum and signature with the load (``WeightsProof``, two HTTP
  headers beside SGLang's unchanged body); the engine recomputes the signature for its own agent, the
  version and the path, and the checksum from the files on disk. Any route that loads weights calls it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.contracts.messages import WeightsUpdate
from services.contracts.records import TrainLogRecord
from services.contracts.streams import Streams

SECRET_ENV = "TANDEM_WEIGHTS_SECRET"
SECRET_FILE_ENV = "TANDEM_WEIGHTS_SECRET_FILE"
SECRET_FILE = "weights.secret"


class MissingWeightsSecret(RuntimeError):
    """This process was given no weights-signing secret."""


def weights_checksum(directory: Path | str) -> str:
    """SHA-256 over the directory's files: for each (in relative-name order) its name, size and content."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"no weights directory {root}")
    h = hashlib.sha256()
    for p in sorted(x for x in root.rglob("*") if x.is_file()):
        h.update(f"{p.relative_to(root).as_posix()}\0{p.stat().st_size}\0".encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def sign(secret: bytes, agent: str, version: int, path: str, checksum: str) -> str:
    payload = json.dumps([agent, version, path, checksum], separators=(",", ":")).encode()
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


def secret_problem() -> str | None:
    """Why this process has no usable weights secret (naming the variable), or None."""
    if os.environ.get(SECRET_ENV):
        return None
    path = os.environ.get(SECRET_FILE_ENV)
    if not path:
        return (f"{SECRET_ENV} is not set: the trainers sign and the rollouts verify weights with the run's "
                f"secret, which `tandem up` hands them (runs/<run>/{SECRET_FILE}); elsewhere set {SECRET_ENV} "
                f"(or {SECRET_FILE_ENV}, a file holding it) to the same value for every trainer and rollout")
    try:
        if not Path(path).read_text().strip():
            return f"{SECRET_FILE_ENV}: {path} is empty"
    except OSError as exc:
        return f"{SECRET_FILE_ENV}: cannot read {path}: {exc.strerror}"
    return None


def run_secret() -> bytes:
    """The run's signing secret (``$TANDEM_WEIGHTS_SECRET``, else the file ``$TANDEM_WEIGHTS_SECRET_FILE``
    names); raises ``MissingWeightsSecret`` naming the variable."""
    if (problem := secret_problem()) is not None:
        raise MissingWeightsSecret(problem)
    env = os.environ.get(SECRET_ENV)
    return env.encode() if env else Path(os.environ[SECRET_FILE_ENV]).read_text().strip().encode()


def run_dir_secret(run_dir: Path | str) -> str:
    """``tandem up``'s secret for its children: ``$TANDEM_WEIGHTS_SECRET`` when set, else the run directory's
    ``weights.secret`` (mode 0600), made once and read back on ``--resume``."""
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    path = Path(run_dir) / SECRET_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
        secret = path.read_text().strip()
        if not secret:
            raise MissingWeightsSecret(f"{path} is empty: restore it to resume the run, or start it --fresh") from None
        return secret
    secret = secrets.token_hex(32)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
        f.flush()
        os.fsync(f.fileno())
    return secret


async def committed(redis: Any, streams: Streams, agent: str, version: int) -> TrainLogRecord | None:
    """The trainer's train-log record of ``version`` (one record per version, appended in order), if committed."""
    published = await redis.get(streams.published_weight_version(agent))
    if published is None or version > int(published):
        return None
    first = await redis.lindex(streams.train_log(agent), 0)  # older records may be archived (common/history.py)
    offset = TrainLogRecord.parse(first).weight_version if first is not None else 1
    raw = await redis.lindex(streams.train_log(agent), version - offset) if version >= offset else None
    rec = TrainLogRecord.parse(raw) if raw is not None else None
    if rec is not None and rec.weight_version == version:
        return rec
    for raw in await redis.lrange(streams.train_log(agent), 0, -1):  # a log not in version order: look it up
        rec = TrainLogRecord.parse(raw)
        if rec.weight_version == version:
            return rec
    return None


async def refusal(redis: Any, streams: Streams, secret: bytes, w: WeightsUpdate) -> str | None:
    """Why the update must not be loaded (forged, uncommitted, corrupt), or None when it is authentic."""
    if not w.signature:
        return "not signed"
    if not hmac.compare_digest(w.signature, sign(secret, w.agent, w.weight_version, w.path, w.checksum)):
        return "bad signature (not signed with this run's secret)"
    rec = await committed(redis, streams, w.agent, w.weight_version)
    if rec is None:
        return f"version {w.weight_version} is not one the trainer of {w.agent!r} committed"
    if rec.path != w.path or rec.checksum != w.checksum:
        return f"version {w.weight_version} differs from the trainer's commit (path or checksum)"
    try:
        on_disk = await asyncio.to_thread(weights_checksum, w.path)
    except OSError as exc:
        return f"cannot read {w.path}: {exc}"
    if not hmac.compare_digest(on_disk, w.checksum):
        return f"the files under {w.path} do not match the checksum (corrupt or replaced)"
    return None


CHECKSUM_HEADER = "X-Tandem-Weights-Checksum"
SIGNATURE_HEADER = "X-Tandem-Weights-Signature"


@dataclass(frozen=True)
class WeightsProof:
    """A committed version's checksum and the trainer's signature, sent with a load to the engine."""

    checksum: str
    signature: str

    @classmethod
    def of(cls, w: WeightsUpdate) -> WeightsProof:
        return cls(checksum=w.checksum, signature=w.signature)

    @classmethod
    def from_headers(cls, headers: Any) -> WeightsProof | None:
        checksum, signature = headers.get(CHECKSUM_HEADER), headers.get(SIGNATURE_HEADER)
        return cls(checksum, signature) if checksum and signature else None

    def headers(self) -> dict[str, str]:
        return {CHECKSUM_HEADER: self.checksum, SIGNATURE_HEADER: self.signature}


def load_refusal(secret: bytes, agent: str, version: int | None, path: str, proof: WeightsProof | None) -> str | None:
    """Why an engine of ``agent`` must not load ``path`` as ``version``, or None (blocking: it reads the files).

    Only a version the agent's trainer signed passes: the signature over (agent, version, path, checksum) with
    the run's secret, and the checksum of the files on disk now."""
    if version is None:
        return "no weight_version: only a version the trainer committed is loaded"
    if proof is None:
        return (f"no weights signature ({CHECKSUM_HEADER}, {SIGNATURE_HEADER}): only a version the trainer of "
                f"{agent!r} committed is loaded, whatever token the caller holds")
    if not hmac.compare_digest(proof.signature, sign(secret, agent, version, path, proof.checksum)):
        return f"bad signature: {path} is not version {version} as the trainer of {agent!r} committed it"
    try:
        on_disk = weights_checksum(path)
    except OSError as exc:
        return f"cannot read {path}: {exc}"
    if not hmac.compare_digest(on_disk, proof.checksum):
        return f"the files under {path} do not match the signed checksum (corrupt or replaced)"
    return None
