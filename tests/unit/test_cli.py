"""The ``tandem`` command line: help on every argument, ``--version``, ``up``/``validate`` ``--set``, and
refusals that say what they are, ``--checkpoint`` directories (a model, or a LoRA run's adapter)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.contracts.config import ConfigError, load_config
from services.launcher.cli import build_parser
from services.launcher.overrides import load_with_overrides, write_effective
from services.launcher.preflight import preflight
from services.play.offline_eval import assign_checkpoints

REPO = Path(__file__).resolve().parents[2]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_argument_of_every_command_has_help() -> None:
    parser = build_parser()
    commands = _subparsers(parser)
    assert {"up", "validate", "init-demo", "envs", "eval", "serve", "runs", "compare", "sweep"} <= set(commands)
    missing = [f"{name} {a.dest}" for name, p in commands.items() for a in p._actions
               if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not missing, missing
    assert "``" not in (commands["eval"].description or "") and "Score weights" in commands["eval"].description


@pytest.mark.integration  # a child process: the installed command
def test_version_and_eval_help_from_the_command() -> None:
    out = subprocess.run([sys.executable, "-m", "services.launcher.cli", "--version"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("tandem ")
    helped = subprocess.run([sys.executable, "-m", "services.launcher.cli", "eval", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--checkpoint [AGENT=]DIR" in helped.stdout and "``" not in helped.stdout


def _config(tmp_path: Path, model: Path, name: str = "cli") -> Path:
    data = {"run": {"name": name, "output_dir": str(tmp_path / "runs"), "checkpoint_root": str(tmp_path / "ck"),
                    "total_steps": 4},
            "environment": {"name": "tictactoe", "roles": {"X": "A", "O": "B"}},
            "agents": {"A": {"model_path": str(model)}, "B": {"model_path": str(model)}}, "api": {"port": 0}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_set_overrides_with_the_sweep_grammar(tmp_path: Path) -> None:
    path = _config(tmp_path, tmp_path / "m")
    cfg, data = load_with_overrides(str(path), ["run.total_steps=6", "agents.A.algorithm.lr=5e-4",
                                                "environment.roles={X: B, O: A}"])
    assert cfg.run.total_steps == 6 and cfg.agents["A"].algorithm.lr == 5e-4 and cfg.agents["B"].algorithm.lr == 1e-3
    assert {role: p.agent for role, p in cfg.environment.roles.items()} == {"X": "B", "O": "A"}
    written = Path(write_effective(cfg, data, f"{path} --set run.total_steps=6"))
    assert written == tmp_path / "runs" / "configs" / "cli.yaml"
    assert yaml.safe_load(written.read_text())["run"]["total_steps"] == 6
    assert load_with_overrides(str(path), []) [1] is None  # no pairs: the services read the file itself
    for bad, named in (("run.total_steps=x", "--set run.total_steps='x'"), ("run.nope=1", "--set run.nope=1"),
                       ("total_steps", "expected KEY=VALUE")):
        with pytest.raises(ConfigError, match=named.replace("[", r"\[")):
            load_with_overrides(str(path), [bad])


def test_refusals_name_what_they_are(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = _config(tmp_path, tiny_model_dir, "kept")
    (tmp_path / "ck" / "kept").mkdir(parents=True)
    (tmp_path / "ck" / "kept" / "v00001").write_text("weights")
    cfg, _ = load_with_overrides(str(path), ["run.total_steps=6"])
    with pytest.raises(ConfigError) as refused:
        preflight(cfg, f"{path} --set run.total_steps=6", "new")
    text = str(refused.value)
    assert text.startswith(f"{path} --set run.total_steps=6: refused, to keep an earlier run's data")
    assert "invalid config" not in text and f"tandem up {path} --set run.total_steps=6 --resume" in text
    cfg, _ = load_with_overrides(str(path), [f"agents.A.model_path={tmp_path / 'absent'}"])
    with pytest.raises(ConfigError, match=r": cannot start:\n  agents.A.model_path: .* is not a model directory"):
        preflight(cfg, str(path), "fresh")
    with pytest.raises(ConfigError, match=": not ready to run:"):
        preflight(cfg, str(path), "validate")


def test_a_missing_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.common import extras

    assert extras.missing("wandb", "logging.wandb") is None  # the suite installs every extra
    monkeypatch.setitem(extras.EXTRAS, "wandb", "no_such_package_for_tandem.sub")
    message = extras.missing("wandb", "logging.wandb")
    assert message is not None and "pip install 'tandem[wandb]'" in message and message.startswith("logging.wandb")
    with pytest.raises(extras.MissingExtra, match=r"tandem\[wandb\]"):
        extras.require("wandb", "logging.wandb")


def test_checkpoints_are_model_or_adapter_directories(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = load_config(_config(tmp_path, model))

    def adapter(name: str, config: dict) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(config))
        return tmp_path / name

    ok = adapter("v00012", {"base_model_name_or_path": str(model)})
    assert assign_checkpoints(cfg, [f"B={ok}"]) == {"A": str(model), "B": str(ok)}
    refusals = {str(tmp_path / "empty"): "is neither a model directory .* nor a LoRA adapter directory",
                str(adapter("orphan", {"base_model_name_or_path": str(tmp_path / "gone")})):
                    "the adapter's base model .*gone is not a model directory",
                str(adapter("baseless", {"r": 8})): "names no base_model_name_or_path"}
    for path, why in refusals.items():
        with pytest.raises(ConfigError, match=f"--checkpoint B={path}: .*{why}"):
            assign_checkpoints(cfg, [f"B={path}"])
