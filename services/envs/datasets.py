"""Tasks from a local dataset: ``environment.dataset`` (or ``environment.params.dataset``) of the math, code and
tool-math environments.

A ``DatasetSpec`` (the config's ``DatasetConfig``, whose files it reads) names a local file or directory
(nothing is fetched): JSON Lines (``.jsonl``), a JSON list (``.json``), Parquet (``.parquet``, through
``pyarrow``: the ``datasets`` extra), or a directory written by Hugging Face ``datasets``' ``save_to_disk`` (the
``hf-datasets`` extra). ``{split}`` in the path is replaced by the split's name (``data/gsm8k.{split}.jsonl``); a
directory of ``datasets`` holds its splits itself; a single file without ``{split}`` may carry a
``split_column``. ``fields`` maps the task's fields (``question`` and ``answer`` for math, ``prompt`` and
``tests`` for code) to the dataset's columns. ``split`` feeds training and ``eval_split`` (when set) the
held-out evaluation (``Environment.evaluation_params``). A missing file, split or column fails when the
parameters are checked, at start, naming the parameter.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, field_validator, model_validator

from services.common.extras import missing
from services.contracts.config import DatasetConfig
from services.envs.params import EnvParams

FORMATS = (".jsonl", ".json", ".parquet")


class DatasetSpec(DatasetConfig, EnvParams):
    """Where an environment's tasks come from (instead of its generator), checked against its files."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @field_validator("path")
    @classmethod
    def _exists(cls, path: str) -> str:
        candidates = [path.replace("{split}", s) for s in ("train", "test")] if "{split}" in path else [path]
        if not any(Path(p).exists() for p in candidates):
            raise ValueError(f"no such file or directory: {path}")
        if "{split}" not in path and Path(path).is_file() and Path(path).suffix not in FORMATS:
            raise ValueError(f"{path}: not one of {', '.join(FORMATS)} (or a datasets directory)")
        return path

    @model_validator(mode="after")
    def _splits_and_columns_exist(self) -> DatasetSpec:
        for split in filter(None, {self.split, self.eval_split}):
            rows = self.rows(split)
            if not rows:
                raise ValueError(f"split {split!r}: no rows in {self.path}")
            for name, column in self.fields.items():
                if column not in rows[0]:
                    raise ValueError(f"fields.{name}: no column {column!r} in {self.path} "
                                     f"(columns: {', '.join(rows[0])})")
        return self

    def draw(self, rng: random.Random) -> dict[str, Any]:
        """One row of ``split``, drawn with ``rng`` (the group's seed: a group's copies share it)."""
        rows = self.rows()
        return rows[rng.randrange(len(rows))]

    def column(self, name: str) -> str:
        return self.fields.get(name, name)

    def rows(self, split: str | None = None) -> list[dict[str, Any]]:
        """The rows of ``split`` (default: ``self.split``)."""
        return list(load_rows(self.path, split or self.split, self.split_column))

    def require(self, *names: str) -> None:
        """Raise ValueError naming the first task field whose column the rows lack."""
        first = self.rows()[0]
        for name in names:
            if self.column(name) not in first:
                raise ValueError(f"fields.{name}: no column {self.column(name)!r} in {self.path} (columns: "
                                 f"{', '.join(first)}); map it with dataset.fields.{name}")


def _need(extra: str, what: str) -> None:
    """A ValueError (a parameter error, at start) naming the extra when its package is missing."""
    if (message := missing(extra, what)) is not None:
        raise ValueError(message)


@functools.lru_cache(maxsize=32)
def load_rows(path: str, split: str, split_column: str | None) -> tuple[dict[str, Any], ...]:
    """The rows of one split, read once per process."""
    where = Path(path.replace("{split}", split))
    if "{split}" in path and not where.exists():
        raise ValueError(f"split {split!r}: no file {where}")
    if where.is_dir():
        _need("hf-datasets", "a Hugging Face datasets directory")
        import datasets

        data = datasets.load_from_disk(str(where))
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(f"split {split!r}: not in {where} (splits: {', '.join(data)})")
            data = data[split]
        rows = tuple(dict(r) for r in data)
    elif where.suffix == ".parquet":
        _need("datasets", "a Parquet dataset")
        import pyarrow.parquet as pq

        rows = tuple(pq.read_table(where).to_pylist())
    elif where.suffix == ".json":
        rows = tuple(json.loads(where.read_text()))
    else:
        rows = tuple(json.loads(line) for line in where.read_text().splitlines() if line.strip())
    if split_column is not None:
        rows = tuple(r for r in rows if r.get(split_column) == split)
    return rows
