"""An optional part the config asks for and this install lacks fails at start, naming its pip extra.

LoRA (``agents.X.lora``) needs peft, which the `lora` extra installs (the demo's install has no peft):
``tandem up`` and ``tandem validate`` name the extra before anything starts, and the trainer does too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common import extras
from services.contracts.config import parse_config
from services.launcher.preflight import extras_problems


def _cfg(tmp_path: Path, lora: bool) -> dict:
    agent = {"model_path": "m", "sampling": {"max_new_tokens": 4}, **({"lora": {"r": 4}} if lora else {})}
    return {"run": {"name": "x", "output_dir": str(tmp_path / "runs"), "checkpoint_root": str(tmp_path / "ck")},
            "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}},
            "agents": {"A": agent, "B": {"model_path": "m", "sampling": {"max_new_tokens": 4}}}}


def test_lora_without_peft_names_the_lora_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config(_cfg(tmp_path, lora=True))
    assert extras_problems(cfg) == []  # the suite installs every extra
    monkeypatch.setitem(extras.EXTRAS, "lora", "no_such_package_for_tandem")
    (problem,) = extras_problems(cfg)
    assert problem.startswith("agents.A.lora needs the optional package 'no_such_package_for_tandem'")
    assert "pip install 'tandem[lora]'" in problem
    assert extras_problems(parse_config(_cfg(tmp_path, lora=False))) == []


def test_trainer_lora_helpers_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.training import torch_backend

    assert torch_backend.lora().__name__ == "services.training.lora"
    monkeypatch.setitem(extras.EXTRAS, "lora", "no_such_package_for_tandem")
    with pytest.raises(extras.MissingExtra, match=r"tandem\[lora\]"):
        torch_backend.lora()


def test_every_extra_is_a_pyproject_extra() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    assert set(extras.EXTRAS) <= set(optional)
    core = {d.split("=")[0].split(">")[0].strip().lower() for d in project["dependencies"]}
    assert "peft" not in core  # the demo's install stays small (README)
    assert any(d.startswith("peft") for d in optional["lora"]) and any(d.startswith("peft") for d in optional["tinker"])
    assert "lora" in optional["dev"][0]
