"""``tandem sft`` (supervised training from a chat-format JSONL file) and ``tandem pipeline`` (collect → SFT → RL).

``tandem sft CONFIG`` trains every agent with ``agents.X.sft`` (``algorithm: sft``) on its file, instead of live
samples, and writes ``<checkpoint_root>/<run.name>/<agent>/v#####`` (the last version) and ``sft_report.json``
(the file's NLL before and after); an RL config then starts from it as its ``model_path``.

``tandem pipeline CONFIG`` runs the MRLM hybrid pipeline of a config with a ``pipeline`` section, each stage's
checkpoint feeding the next:

1. collect: ``pipeline.episodes`` episodes played by the agents' ``model_path`` (``tandem collect``; the
   ``pipeline.demonstrate`` roles by the environment's demonstrations), kept above ``pipeline.min_reward``, to
   ``<output_dir>/<run>-pipeline/trajectories.jsonl``;
2. SFT: every training agent on its own trajectories with ``algorithm: sft`` (``pipeline.sft``: epochs,
   max_samples, batch_size, lr; no KL term), to ``<checkpoint_root>/<run>-sft/<agent>/v#####``: a full HF
   directory (under the agent's ``lora``, the adapters it trained merged into the base);
3. RL: ``tandem up`` of the config with each training agent's ``model_path`` set to its SFT checkpoint (the
   effective config under ``<output_dir>/configs/<run>.yaml``); an agent with ``lora`` trains new adapters on
   that merged model.

``<output_dir>/<run>-pipeline/pipeline.json`` records each stage: the file and the weight versions that played
it, each SFT checkpoint with its start model and NLL, the RL run's start models and last checkpoints.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import multiprocessing
import os
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from services.contracts.config import (
    AgentConfig,
    AlgorithmConfig,
    ConfigError,
    PipelineConfig,
    SftDataConfig,
    TandemConfig,
    apply_env_overrides,
    parse_config,
)
from services.contracts.players import AgentPlayer
from services.envs.registry import check_environment_config
from services.launcher import run_lock
from services.launcher.overrides import add_set_argument, load_with_overrides, write_effective
from services.launcher.preflight import preflight
from services.launcher.sweep import load_yaml
from services.play.demonstrate import check_demonstrated


def add_pipeline_commands(sub: Any) -> None:
    p_sft = sub.add_parser("sft", help="train agents with algorithm sft on their chat-format JSONL file "
                           "(agents.X.sft.dataset) and write the checkpoint an RL run starts from")
    p_sft.add_argument("config", help="a config whose agents have algorithm: sft and an sft section")
    p_sft.add_argument("--agent", action="append", default=[], help="train only this agent (repeatable)")
    p_sft.add_argument("--fresh", action="store_true", help="delete the agents' earlier SFT checkpoints first")
    add_set_argument(p_sft)
    p_pipe = sub.add_parser("pipeline", help="collect, then SFT, then RL (tandem up), each stage's checkpoint "
                            "feeding the next (the config's pipeline section)")
    p_pipe.add_argument("config", help="a run config with a pipeline section")
    p_pipe.add_argument("--fresh", action="store_true", help="delete the stages' earlier outputs and the RL "
                        "run's state first")
    add_set_argument(p_pipe)


def _torch_env() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def clear_or_refuse(path: Path, fresh: bool, what: str) -> None:
    """A stage's output directory: deleted with ``--fresh``, else it must be empty or absent."""
    if fresh:
        shutil.rmtree(path, ignore_errors=True)
    elif path.is_dir() and any(path.iterdir()):
        raise ConfigError(f"{what}: {path} already holds an earlier run's output; --fresh deletes it")


def sft_agents(cfg: TandemConfig, agents: list[str], fresh: bool, root: Path) -> list[dict[str, Any]]:
    """Train the named agents (all with an sft section when none are named); their SftResult as JSON."""
    from services.training.sft_file import train_from_file  # torch: only now

    names = agents or [n for n, a in cfg.agents.items() if a.sft is not None]
    if not names:
        raise ConfigError("agents: no agent has an sft section (agents.X.sft.dataset, with algorithm.name sft)")
    for name in names:
        if name not in cfg.agents or cfg.agents[name].sft is None:
            raise ConfigError(f"agents.{name}.sft: not set (a dataset, with algorithm.name sft)")
        clear_or_refuse(root / name, fresh, f"agents.{name}.sft")
    _torch_env()
    results = []
    for name in names:
        try:
            results.append(train_from_file(cfg.agents[name], name, root / name).to_json())
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return results


def sft_command(args: argparse.Namespace) -> int:
    try:
        cfg, _ = load_with_overrides(args.config, args.set)
        results = sft_agents(cfg, args.agent, args.fresh, Path(cfg.run.checkpoint_root) / cfg.run.name)
    except ConfigError as exc:
        print(f"tandem sft: {exc}", file=sys.stderr)
        return 2
    for r in results:
        print(f"{r['agent']}: {r['samples']} samples, {r['steps']} steps, NLL {r['nll_before']:.4f} -> "
              f"{r['nll_after']:.4f}; checkpoint {r['checkpoint']}")
    return 0


def stage_problems(cfg: TandemConfig) -> list[str]:
    """What keeps a training agent out of the SFT stage (checked before the first stage plays)."""
    problems = []
    for name, acfg in cfg.agents.items():
        if acfg.train and acfg.backend != "torch":
            problems.append(f"agents.{name}.backend: the pipeline's SFT stage trains on backend torch")
    if cfg.pipeline is not None and cfg.pipeline.demonstrate:
        agent_roles = {r for r, p in cfg.environment.roles.items() if isinstance(p, AgentPlayer)}
        try:
            check_demonstrated(check_environment_config(cfg.environment), agent_roles, cfg.pipeline.demonstrate)
        except ValueError as exc:
            problems.append(f"pipeline.demonstrate: {str(exc).removeprefix('--demonstrate ')}")
    return problems


def sft_stage_config(acfg: AgentConfig, pipeline: PipelineConfig, dataset: Path) -> AgentConfig:
    """The agent as the pipeline's SFT stage trains it: algorithm sft at pipeline.sft.lr, on ``dataset``."""
    spec = pipeline.sft
    try:
        data = SftDataConfig(dataset=str(dataset), epochs=spec.epochs, max_samples=spec.max_samples,
                             batch_size=spec.batch_size)
    except ValueError as exc:
        raise ConfigError(f"pipeline: the collect stage's file for the SFT stage: {exc}") from None
    algorithm = AlgorithmConfig(name="sft", lr=spec.lr or acfg.algorithm.lr)
    return acfg.model_copy(update={"algorithm": algorithm, "sft": data})


def latest_version(agent_dir: Path) -> str | None:
    versions = sorted(p for p in agent_dir.glob("v[0-9][0-9][0-9][0-9][0-9]") if p.is_dir())
    return str(versions[-1].resolve()) if versions else None


def pipeline_command(args: argparse.Namespace) -> int:
    from services.launcher.up import up

    try:
        cfg, data = load_with_overrides(args.config, args.set)
        data = data if data is not None else load_yaml(args.config)
        if cfg.pipeline is None:
            raise ConfigError(f"{args.config}: pipeline: not set (episodes, min_reward, sft: the stages' settings)")
        if problems := stage_problems(cfg):
            raise ConfigError(f"{args.config}: cannot start:\n  " + "\n  ".join(problems))
        run_lock.check_live(cfg)
        preflight(cfg, args.config, "fresh" if args.fresh else "new")  # the RL run's, before any stage
        stage_dir = Path(cfg.run.output_dir) / f"{cfg.run.name}-pipeline"
        sft_root = Path(cfg.run.checkpoint_root) / f"{cfg.run.name}-sft"
        clear_or_refuse(stage_dir, args.fresh, "pipeline")
        clear_or_refuse(sft_root, args.fresh, "pipeline")
        manifest, data = run_stages_apart(cfg, data, stage_dir, sft_root)
        rl_cfg = parse_config(apply_env_overrides(copy.deepcopy(data)), f"{args.config} (pipeline RL stage)")
        rl_path = write_effective(rl_cfg, data, f"{args.config}, RL stage of tandem pipeline")
    except ConfigError as exc:
        print(f"tandem pipeline: {exc}", file=sys.stderr)
        return 2
    except run_lock.RunIsLive as exc:
        print(str(exc), file=sys.stderr)
        return run_lock.RUN_IS_LIVE
    print(f"pipeline: RL from the SFT checkpoints ({rl_path})")
    (stage_dir / "pipeline.json").write_text(json.dumps(manifest, indent=1) + "\n")  # collect and SFT so far
    code = up(rl_cfg, rl_path, fresh=args.fresh)
    manifest["rl"] = {"run": cfg.run.name, "config": rl_path, "exit_code": code, "agents": {
        name: {"model_path": rl_cfg.agents[name].model_path,
               "last_checkpoint": latest_version(Path(cfg.run.checkpoint_root) / cfg.run.name / name)}
        for name in manifest["sft"]}}
    (stage_dir / "pipeline.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"pipeline: stages recorded in {stage_dir / 'pipeline.json'}")
    return code


def run_stages_apart(cfg: TandemConfig, data: dict[str, Any], stage_dir: Path,
                     sft_root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """``run_stages`` in a child process: the models, optimizer states and allocator heap of the collect and SFT
    stages go back to the OS before the RL stage's services start (held, they were gigabytes of its memory)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(run_stages, cfg, data, stage_dir, sft_root).result()


def run_stages(cfg: TandemConfig, data: dict[str, Any], stage_dir: Path,
               sft_root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Collect, then SFT: the manifest, and ``data`` (the config's YAML) with each trained agent's SFT checkpoint
    as its model_path."""
    from services.play.collect import collect
    from services.training.sft_file import train_from_file

    assert cfg.pipeline is not None
    _torch_env()
    trajectories = stage_dir / "trajectories.jsonl"
    print(f"pipeline: collect, {cfg.pipeline.episodes} episodes -> {trajectories}")
    try:
        counts = asyncio.run(collect(cfg, {}, cfg.pipeline.episodes, trajectories, cfg.pipeline.min_reward,
                                     cfg.pipeline.demonstrate))
    except ValueError as exc:
        raise ConfigError(f"pipeline: the collect stage: {exc}") from None
    versions = sorted({json.loads(line)["weight_version"] for line in trajectories.read_text().splitlines()})
    manifest: dict[str, Any] = {"collect": {"file": str(trajectories.resolve()), **counts, "weight_versions": versions,
                                            "model_paths": {n: a.model_path for n, a in cfg.agents.items()}},
                                "sft": {}}
    if not counts["kept"]:
        raise ConfigError(f"pipeline.min_reward: the collect stage kept no trajectory of {cfg.pipeline.episodes} "
                          "episodes (lower it, or play more)")
    for name, acfg in cfg.agents.items():
        if not acfg.train:
            continue
        print(f"pipeline: SFT of {name} on its trajectories")
        try:
            result = train_from_file(sft_stage_config(acfg, cfg.pipeline, trajectories), name, sft_root / name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        manifest["sft"][name] = result.to_json()
        data["agents"][name]["model_path"] = result.checkpoint
        print(f"pipeline: {name}: NLL {result.nll_before:.4f} -> {result.nll_after:.4f} on {result.samples} samples, "
              f"checkpoint {result.checkpoint}")
    return manifest, data
