"""``tandem up CONFIG``: embedded Redis and every service as child processes.

Order: Redis (embedded unless the config names one) → per agent the rollout
(which starts the agent's real SGLang router and engines itself), buffer and
trainer → the coordinator. It shows progress from the coordinator's ``/v1/status``, and
stops everything on Ctrl-C, when the run ends, or when any child dies (the
dead child is named and the exit code is non-zero).
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import redis as redis_lib
from rich.console import Console
from rich.live import Live
from rich.table import Table

from services.common.embedded_redis import EmbeddedRedis, free_port
from services.contracts.config import AgentConfig, TandemConfig
from services.launcher.processes import ProcessGroup, child_env, python_module
from services.launcher.progress import Progress, fmt_duration


def status_table(status: dict | None, progress: Progress | None = None) -> Table:
    progress = progress or Progress()
    eta = fmt_duration(progress.run_eta_s(status)) if status else "-"
    table = Table(title=f"Tandem run {status.get('run') if status else ''} — "
                        f"{status.get('phase') if status else 'starting'} — ETA {eta}")
    for col in ("agent", "step", "steps/min", "ETA", "weight version", "mean reward", "eval start", "eval end",
                "episodes/s"):
        table.add_column(col)
    if status:
        for name, a in status["agents"].items():
            fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
            rate = progress.steps_per_min(name)
            table.add_row(name, f"{a['step']}/{status['total_steps']}", "-" if rate is None else f"{rate:.2f}",
                          fmt_duration(progress.eta_s(name, a["step"], status["total_steps"])),
                          str(a["weight_version"]), fmt(a["recent_group_reward"]), fmt(a["eval_start"]),
                          fmt(a["eval_end"]), f"{status['episodes_per_s']:.2f}")
    return table


def summary_table(summary: dict) -> Table:
    table = Table(title=f"Tandem run {summary['run']} — {summary['phase']} in {summary['wall_s']}s")
    cols = ("weight_versions", "steps", "reward_first_quarter", "reward_last_quarter", "eval_start", "eval_end")
    table.add_column("agent")
    for c in cols:
        table.add_column(c)
    for name, a in summary["agents"].items():
        table.add_row(name, *("-" if a[c] is None else (f"{a[c]:.3f}" if isinstance(a[c], float) else str(a[c]))
                              for c in cols))
    return table


def trainer_command(acfg: AgentConfig, base: list[str]) -> list[str]:
    """The megatron backend with more than one rank runs under torchrun (rank 0 is the trainer service)."""
    lay = acfg.megatron
    ranks = lay.tensor_parallel * lay.pipeline_parallel * lay.data_parallel
    if acfg.backend == "megatron" and ranks > 1:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        return [torchrun, "--standalone", "--nproc_per_node", str(ranks), "-m", "services.trainer", *base]
    return python_module("services.trainer", *base)


def start_services(cfg: TandemConfig, config_path: str, group: ProcessGroup, api_port: int) -> str:
    """Start every service; return the control API URL. Each rollout starts its agent's SGLang router
    and engines itself (embedded on CPU, ``sglang.launch_server`` with ``engine: sglang``)."""
    for agent, acfg in cfg.agents.items():
        base = ["--config", config_path, "--agent", agent]
        group.start(f"rollout.{agent}", python_module("services.rollout", *base))
        if acfg.train:  # a frozen agent has its rollout (router and engines) only
            group.start(f"buffer.{agent}", python_module("services.buffer", *base))
            group.start(f"trainer.{agent}", trainer_command(acfg, base))
    coord = group.start("coordinator", python_module("services.coordinator", "--config", config_path,
                                                     "--port", str(api_port)))
    api = f"http://{cfg.api.host}:{api_port}"
    group.wait_http(f"{api}/health", coord, timeout=180)
    return api


def clear_run_keys(redis_url: str, run: str) -> int:
    """A fresh run on an external Redis starts without the keys of an earlier run of that name."""
    client = redis_lib.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"tandem:{run}:*", count=1000))
        return int(client.delete(*keys)) if keys else 0
    finally:
        client.close()


def up(cfg: TandemConfig, config_path: str, console: Console | None = None) -> int:
    """Run the experiment from scratch: the run's directory, checkpoints and Redis keys are reset."""
    console = console or Console()
    run_dir = cfg.run_dir()
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(Path(cfg.run.checkpoint_root) / cfg.run.name, ignore_errors=True)
    if cfg.redis_url:
        clear_run_keys(cfg.redis_url, cfg.run.name)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def echo(name: str, line: str) -> None:
        if " INFO " in line and "uvicorn" in line:
            return
        with lock:
            console.print(f"[dim]{name:>13}[/dim] │ {line}", markup=True, highlight=False, soft_wrap=True)

    redis = None
    env: dict[str, str] = {}
    if not cfg.redis_url:
        redis = EmbeddedRedis(data_dir=run_dir / "redis").start()
        env["TANDEM_REDIS_URL"] = redis.url
        console.print(f"embedded Redis at {redis.url} (data in {run_dir / 'redis'})")
    api_port = cfg.api.port or free_port()
    if threading.current_thread() is threading.main_thread():  # SIGTERM stops the run like Ctrl-C
        signal.signal(signal.SIGTERM, _interrupt)
    group = ProcessGroup(run_dir / "logs", child_env(env), echo)
    code = 0
    started = time.time()
    try:
        api = start_services(cfg, config_path, group, api_port)
        console.print(f"control API at {api} (docs at {api}/docs) — all services up in {time.time() - started:.0f}s")
        code = watch(group, api, console)
    except KeyboardInterrupt:
        console.print("interrupted (Ctrl-C or SIGTERM): stopping every service")
        code = 130
    except RuntimeError as exc:
        console.print(f"[red]{exc}[/red]")
        code = 1
    finally:
        group.stop_all()
        if redis is not None:
            redis.stop()
    summary_path = run_dir / "summary.json"
    if code == 0 and summary_path.exists():
        console.print(summary_table(json.loads(summary_path.read_text())))
        console.print(f"summary: {summary_path}   plot: {run_dir / 'rewards.png'}")
    return code


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def watch(group: ProcessGroup, api: str, console: Console) -> int:
    """Refresh progress until the coordinator exits; fail if any other child dies first."""
    waiter = threading.Event()
    status = None
    progress = Progress()
    last_print = 0.0
    with Live(status_table(None), console=console, auto_refresh=False,
              transient=False) if console.is_terminal else _NoLive() as live:
        while True:
            dead = group.dead()
            if dead is not None:
                console.print(f"[red]{dead.name} died (exit code {dead.proc.returncode}); stopping the run[/red]")
                return 1
            if group.exited("coordinator") == 0:
                return 0
            try:
                status = httpx.get(f"{api}/v1/status", timeout=2.0).json()
                progress.update(status)
            except (httpx.HTTPError, ValueError):
                pass
            if console.is_terminal:
                live.update(status_table(status, progress), refresh=True)
            elif status and time.time() - last_print > 15:
                console.print(status_table(status, progress))
                last_print = time.time()
            waiter.wait(1.0)


class _NoLive:
    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
