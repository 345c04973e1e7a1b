"""``--set KEY=VALUE`` on ``tandem up`` and ``tandem validate``: the grammar of ``tandem sweep``'s ``--set``.

A key is a dotted path into the YAML, the value a YAML scalar (``1e-3``, ``false``, ``{X: A, O: B}``);
every pair is checked against the schema, and a bad one fails naming its key. The services read one
file, so ``up`` writes the config with the pairs applied to ``run.output_dir/configs/<run.name>.yaml``
and runs from that file (the ``TANDEM__…`` environment overrides still apply on top, as for any file).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import yaml

from services.contracts.config import TandemConfig, apply_env_overrides, load_config, parse_config
from services.launcher.sweep import check_keys, load_yaml, parse_assignment, set_key

SET_HELP = ("override one config field (repeatable): a dotted key into the YAML and a YAML value, "
            "e.g. --set run.total_steps=6 --set agents.A.algorithm.lr=1e-3")


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)


def effective_path(cfg: TandemConfig) -> Path:
    return Path(cfg.run.output_dir) / "configs" / f"{cfg.run.name}.yaml"


def load_with_overrides(path: str, sets: list[str]) -> tuple[TandemConfig, dict[str, Any] | None]:
    """The config with the ``--set`` pairs applied (and the environment's overrides, as for any file), and
    the YAML data to write for the services (None when there are no pairs: they read ``path`` itself)."""
    if not sets:
        return load_config(path), None
    pairs = [parse_assignment(s) for s in sets]
    data = load_yaml(path)
    check_keys(data, pairs, path)
    for key, value in pairs:
        set_key(data, key, value)
    return parse_config(apply_env_overrides(copy.deepcopy(data), None), f"{path} with --set"), data


def write_effective(cfg: TandemConfig, data: dict[str, Any], source: str) -> str:
    """Write the config with the pairs applied to ``run.output_dir/configs/<run.name>.yaml``; its path."""
    out = effective_path(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# {source} (written by tandem up)\n" + yaml.safe_dump(data, sort_keys=False))
    return str(out)
