"""``tandem info``: the installation's version, devices, backends, algorithms, environments and tools."""

from __future__ import annotations

import json
import subprocess
import sys

from services.contracts.config import BUILTIN_ALGORITHMS
from services.envs.registry import BUILTINS
from services.envs.tools.base import BUILTIN_TOOLS
from tests.helpers import REPO


def test_info_lists_what_is_installed() -> None:
    out = subprocess.run([sys.executable, "-m", "services.launcher.cli", "info", "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["version"].startswith("tandem ") and info["devices"][-1].startswith("cpu: ")
    assert info["algorithms"] == list(BUILTIN_ALGORITHMS) and info["environments"] == list(BUILTINS)
    assert info["tools"] == list(BUILTIN_TOOLS) == ["calculator", "python", "files", "search"]
    assert info["backends"]["torch"] is True and info["engines"]["embedded"] is True
    text = subprocess.run([sys.executable, "-m", "services.launcher.cli", "info"], cwd=REPO, capture_output=True,
                          text=True, timeout=120).stdout
    assert text.startswith(info["version"]) and "tool_relay" in text and "calculator" in text
