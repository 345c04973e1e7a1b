"""Dataset-backed tasks (``environment.dataset`` or ``environment.params.dataset``): formats, splits, field
mappings, the held-out split for evaluation, and errors at start that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.extras import installed
from services.contracts.config import ConfigError, EnvironmentConfig, parse_config
from services.envs.datasets import DatasetSpec
from services.envs.registry import check_environment_config, load_environment
from tests.helpers import REPO

WORDS = str(REPO / "data" / "samples" / "word_problems.jsonl")
CODE = str(REPO / "data" / "samples" / "code_tasks.jsonl")


def env_config(name: str, dataset: dict, roles: dict | None = None) -> EnvironmentConfig:
    return EnvironmentConfig(name=name, params={"dataset": dataset}, roles=roles or {"solver": "A"})


def test_the_sample_math_dataset_with_a_held_out_split() -> None:
    spec = {"path": WORDS, "split_column": "split", "eval_split": "test"}
    math = load_environment("math")
    train = {r["question"] for r in DatasetSpec(**spec).rows()}
    test = {r["question"] for r in DatasetSpec(**spec).rows("test")}
    assert train and test and not train & test
    drawn = {math({"dataset": spec}, seed).task.prompt for seed in range(40)}
    assert drawn <= train and len(drawn) > 5
    held_out = math.evaluation_params({"dataset": spec})
    assert {math(held_out, seed).task.prompt for seed in range(20)} <= test
    env = math({"dataset": spec}, 0)
    row = next(r for r in DatasetSpec(**spec).rows() if r["question"] == env.task.prompt)
    assert env.task.reference == row["answer"].split("#### ")[-1]  # GSM8K-style answers


async def test_the_sample_code_dataset_with_mapped_fields() -> None:
    spec = {"path": CODE, "split_column": "split", "fields": {"prompt": "task", "reference": "solution"}}
    code = load_environment("code")
    env = code({"dataset": spec}, 3)
    assert env.task.prompt in {r["task"] for r in DatasetSpec(**spec).rows()}
    assert await env.grade(env.task.reference) == 1.0 and await env.grade(env.task.wrong) == 0.0


def test_split_files_and_parquet(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in Path(WORDS).read_text().splitlines()]
    for split in ("train", "test"):
        with open(tmp_path / f"wp.{split}.jsonl", "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows if r["split"] == split)
    spec = DatasetSpec(path=str(tmp_path / "wp.{split}.jsonl"), eval_split="test")
    assert len(spec.rows()) == 18 and len(spec.rows("test")) == 6
    if installed("pyarrow"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "wp.parquet")
        parquet = DatasetSpec(path=str(tmp_path / "wp.parquet"), split_column="split", split="test")
        assert parquet.rows() == [r for r in rows if r["split"] == "test"]


def test_bad_datasets_fail_at_start_naming_the_parameter(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^environment\.params\.dataset\.path: .*no such file"):
        check_environment_config(env_config("math", {"path": str(tmp_path / "missing.jsonl")}))
    with pytest.raises(ValueError, match=r"^environment\.params\.dataset: .*fields\.question: no column 'q'"):
        check_environment_config(env_config("math", {"path": WORDS, "fields": {"question": "q"}}))
    with pytest.raises(ValueError, match=r"^environment\.params\.dataset: .*fields\.prompt: no column 'prompt'"):
        check_environment_config(env_config("code", {"path": CODE}))
    with pytest.raises(ValueError, match=r"^environment\.params\.dataset: .*split 'dev': no rows"):
        check_environment_config(env_config("math", {"path": WORDS, "split_column": "split", "split": "dev"}))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"dataset\.path: .*not one of"):
        check_environment_config(env_config("math", {"path": str(tmp_path / "x.csv")}))


def test_a_datasets_directory_without_the_library_names_the_extra(tmp_path: Path) -> None:
    if installed("datasets"):
        pytest.skip("Hugging Face datasets is installed")
    (tmp_path / "hf").mkdir()
    with pytest.raises(ValueError, match=r"hf-datasets"):
        check_environment_config(env_config("math", {"path": str(tmp_path / "hf")}))


def test_a_top_level_dataset_feeds_the_environment_and_its_held_out_split(tmp_path: Path) -> None:
    spec = {"path": WORDS, "split_column": "split", "eval_split": "test"}
    train = {r["question"] for r in DatasetSpec(**spec).rows()}
    test = {r["question"] for r in DatasetSpec(**spec).rows("test")}
    for name in ("math", "tool_math"):
        cfg = EnvironmentConfig(name=name, dataset=spec, roles={"solver": "A"}, eval={"opponent": "oracle"})
        env_cls = check_environment_config(cfg)
        assert {env_cls(cfg.env_params(), seed).task.prompt for seed in range(30)} <= train
        held_out = env_cls.evaluation_params(cfg.env_params())
        assert {env_cls(held_out, seed).task.prompt for seed in range(20)} <= test
    data = {"run": {"name": "d"}, "agents": {"A": {"model_path": str(tmp_path)}},
            "environment": {"name": "math", "roles": {"solver": "A"}, "dataset": {"split": "train"}}}
    with pytest.raises(ConfigError, match=r"environment\.dataset\.path: Field required"):
        parse_config(data)
    data["environment"].update(dataset=spec, params={"dataset": spec})
    with pytest.raises(ConfigError, match=r"environment: .*dataset: also given as params\.dataset"):
        parse_config(data)


def test_a_bad_top_level_dataset_fails_at_start_naming_environment_dataset(tmp_path: Path) -> None:
    def top(name: str, dataset: dict, roles: dict | None = None) -> EnvironmentConfig:
        return EnvironmentConfig(name=name, dataset=dataset, roles=roles or {"solver": "A"})

    with pytest.raises(ValueError, match=r"^environment\.dataset\.path: .*no such file"):
        check_environment_config(top("math", {"path": str(tmp_path / "missing.jsonl")}))
    with pytest.raises(ValueError, match=r"^environment\.dataset: .*fields\.question: no column 'q'"):
        check_environment_config(top("tool_math", {"path": WORDS, "fields": {"question": "q"}}))
    with pytest.raises(ValueError, match=r"^environment\.dataset: .*fields\.prompt: no column 'prompt'"):
        check_environment_config(top("code", {"path": CODE}))
    with pytest.raises(ValueError, match=r"^environment\.dataset: tictactoe takes no dataset .*math, math_critic"):
        check_environment_config(top("tictactoe", {"path": WORDS}, {"X": "A", "O": "scripted:random"}))
    with pytest.raises(ValueError, match=r"^environment\.params\.max_operand: "):  # params keep their own name
        check_environment_config(EnvironmentConfig(name="math", dataset={"path": WORDS}, params={"max_operand": 0},
                                                   roles={"solver": "A"}))
