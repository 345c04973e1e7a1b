"""``tandem info``: what this installation has: version, devices, training backends, inference engines,
algorithms, environments and tools."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

from services.common.extras import installed


def version() -> str:
    """``tandem X.Y.Z``: the installed package's version."""
    try:
        return f"tandem {metadata.version('tandem')}"
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "tandem (not installed)"


def devices() -> list[str]:
    """The accelerators torch sees (name and memory), then the CPU."""
    import torch

    out = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out.append(f"cuda:{i} {props.name} ({props.total_memory / 2**30:.0f} GiB)")
    out.append(f"cpu: {os.cpu_count()} cores ({platform.machine()})")
    return out


def gather() -> dict[str, Any]:
    """Everything ``tandem info`` prints, as a JSON-able dict."""
    import torch

    from services.contracts.config import BUILTIN_ALGORITHMS
    from services.envs.registry import BUILTINS
    from services.envs.tools.base import BUILTIN_TOOLS

    return {
        "version": version(), "python": platform.python_version(), "torch": torch.__version__,
        "devices": devices(),
        "backends": {"torch": True, "megatron": installed("megatron.core")},
        "engines": {"embedded": True, "sglang": installed("sglang")},
        "algorithms": list(BUILTIN_ALGORITHMS), "environments": list(BUILTINS), "tools": list(BUILTIN_TOOLS),
    }


def render(info: dict[str, Any]) -> str:
    def avail(d: dict[str, bool]) -> str:
        return ", ".join(f"{k}{'' if ok else ' (not installed)'}" for k, ok in d.items())

    return "\n".join([
        f"{info['version']} (Python {info['python']}, torch {info['torch']})",
        "devices:      " + "; ".join(info["devices"]),
        "backends:     " + avail(info["backends"]),
        "engines:      " + avail(info["engines"]),
        "algorithms:   " + ", ".join(info["algorithms"]),
        "environments: " + ", ".join(info["environments"]) + "  (plug-ins: package.module:Class)",
        "tools:        " + ", ".join(info["tools"]) + "  (plug-ins: package.module:Name)",
    ])
