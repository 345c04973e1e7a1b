"""``tandem up CONFIG``: embedded Redis and every service as child processes.

Order: Redis (embedded unless the config names one; its AOF under ``runs/<run>/redis``) → per
agent the rollout (which starts the agent's real SGLang router and engines itself; one that shares another
agent's engines drives that agent's router instead: ``shared_fleet_env`` fixes its port) → the
coordinator → per trained agent the buffer and trainer (a new run's once its first turn is played:
services/launcher/deferred.py). It prints the dashboard's address first, then shows the live view
(services/launcher/live_view.py) from the coordinator's ``/v1/status`` (validated as a ``RunStatus``,
services/contracts/status.py) and supervises every child and the embedded Redis: one that dies is
restarted in place within the restart budget (``run.max_restarts`` in ``run.restart_window_s``), the
count goes to the live view, the Redis hash ``state:restarts`` and ``summary.json``; past the budget
the run stops naming the service and saying that ``--resume`` continues it. Ctrl-C (SIGINT, handled
explicitly) and SIGTERM stop everything; ``tandem up CONFIG --resume`` then continues the run.
"""

from __future__ import annotations

import json
import logging
import queue
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis as redis_lib
from rich.console import Console
from rich.live import Live

from services.common.admin_token import ADMIN_TOKEN_ENV, bearer, new_token, token_from_env
from services.common.embedded_redis import EmbeddedRedis, free_port
from services.common.weights_auth import SECRET_ENV, run_dir_secret
from services.contracts.config import AgentConfig, TandemConfig
from services.contracts.status import RunStatus
from services.contracts.streams import Streams
from services.launcher import run_lock
from services.launcher.deferred import AfterFirstTurn
from services.launcher.disk import DiskWatch
from services.launcher.live_view import LogEcho, eval_table, new_evals, status_table, summary_table
from services.launcher.processes import (
    LOST_EPISODES,
    ProcessGroup,
    RestartBudget,
    ServiceFailed,
    Supervised,
    child_env,
    python_module,
)
from services.launcher.progress import Progress
from services.launcher.restarts import EngineRestarts, RestartLedger

log = logging.getLogger("tandem.launcher")
DISK_CHECK_S = 5.0  # how often the launcher looks for a full disk


def trainer_command(acfg: AgentConfig, base: list[str]) -> list[str]:
    """The megatron backend with more than one rank runs under torchrun (rank 0 is the trainer service)."""
    lay = acfg.megatron
    ranks = lay.tensor_parallel * lay.pipeline_parallel * lay.data_parallel
    if acfg.backend == "megatron" and ranks > 1:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        return [torchrun, "--standalone", "--nproc_per_node", str(ranks), "-m", "services.trainer", *base]
    return python_module("services.trainer", *base)


def start_services(cfg: TandemConfig, config_path: str, group: ProcessGroup, api_port: int,
                   later: AfterFirstTurn | None = None) -> str:
    """Start every service; return the control API URL. Each rollout starts its agent's SGLang router
    and engines itself (embedded on CPU, ``sglang.launch_server`` with ``engine: sglang``). The order is
    the first turn's critical path: the rollouts (their engines are the slowest start), the coordinator,
    then the buffers and trainers (needed only once the first groups are played): held in ``later`` when
    given, which starts them after the first turn (services/launcher/deferred.py), else all at once."""
    base = {agent: ["--config", config_path, "--agent", agent] for agent in cfg.agents}
    for agent in cfg.agents:
        group.start(f"rollout.{agent}", python_module("services.rollout", *base[agent]))
    group.start("coordinator", python_module("services.coordinator", "--config", config_path, "--port", str(api_port)))
    trained = [agent for agent, acfg in cfg.agents.items() if acfg.train]  # a frozen agent: its rollout only
    start = later.add if later is not None else group.start
    for agent in trained:
        start(f"buffer.{agent}", python_module("services.buffer", *base[agent]))
    for agent in trained:
        start(f"trainer.{agent}", trainer_command(cfg.agents[agent], base[agent]))
    return f"http://{cfg.api.host}:{api_port}"


def shared_fleet_env(cfg: TandemConfig) -> dict[str, str]:
    """For agents that share another agent's engines (``share_engines_with``): the owner's router on a fixed
    port (a free one unless configured; every service reads it through the override) for the sharing rollouts
    to drive, and one admin token for that fleet and every rollout that drives it."""
    owners = sorted({a.share_engines_with for a in cfg.agents.values() if a.share_engines_with})
    if not owners:
        return {}
    env = {ADMIN_TOKEN_ENV: token_from_env() or new_token()}
    for owner in owners:
        if not cfg.agents[owner].router_port:
            env[f"TANDEM__agents__{owner}__router_port"] = str(free_port())
    return env


def clear_run_keys(redis_url: str, run: str) -> int:
    """``--fresh`` on an external Redis: delete the keys of the earlier run of that name."""
    client = redis_lib.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"tandem:{run}:*", count=1000))
        return int(client.delete(*keys)) if keys else 0
    finally:
        client.close()


def wipe_run(cfg: TandemConfig) -> None:
    """``--fresh``: the run's directory (reports, logs, embedded Redis data), checkpoints and Redis keys."""
    shutil.rmtree(cfg.run_dir(), ignore_errors=True)
    shutil.rmtree(Path(cfg.run.checkpoint_root) / cfg.run.name, ignore_errors=True)
    if cfg.redis_url:
        clear_run_keys(cfg.redis_url, cfg.run.name)


def _set(event: threading.Event) -> threading.Event:
    event.set()
    return event


@dataclass
class RedisProcess(Supervised):
    """The embedded Valkey under supervision: restarted on the same port, password and AOF, by a thread of its
    own that lives as long as the launcher (replaying a large AOF takes a while; the launcher's loop goes on
    supervising the services meanwhile). One long-lived thread, because the parent-death signal that ends
    Valkey with the launcher fires when the *thread* that started it exits."""

    server: EmbeddedRedis | None = None
    idle: threading.Event = field(default_factory=lambda: _set(threading.Event()))  # cleared while restarting
    requests: queue.Queue[None] = field(default_factory=queue.Queue)
    worker: threading.Thread | None = None

    def failed(self) -> bool:
        if not self.idle.is_set():
            return False  # a restart under way: it ends answering, or dead (then this is failed again)
        return self.server is not None and not self.server.alive()

    def exit_code(self) -> int | None:
        return self.server.proc.poll() if self.server and self.server.proc else None

    def respawn(self) -> None:
        if self.worker is None or not self.worker.is_alive():
            self.worker = threading.Thread(target=self._serve, name="valkey-restarts", daemon=True)
            self.worker.start()
        self.idle.clear()
        self.requests.put(None)

    def _serve(self) -> None:
        assert self.server is not None
        while True:
            self.requests.get()
            try:
                self.server.restart()
            except Exception as exc:  # it did not come up: the next supervision counts another death
                log.warning("the embedded Redis did not come back: %s", exc)
            finally:
                self.idle.set()

    def join(self, timeout: float = 60.0) -> None:
        """Wait for a restart under way to end."""
        self.idle.wait(timeout)


def browser_url(host: str, port: int) -> str:
    """The address a browser on this machine opens (a wildcard bind answers on loopback)."""
    return f"http://{'127.0.0.1' if host in ('', '0.0.0.0', '::') else host}:{port}"


def up(cfg: TandemConfig, config_path: str, console: Console | None = None, resume: bool = False,
       fresh: bool = False, verbose: bool = False) -> int:
    """Run the experiment: new (no earlier state; preflight checked), ``fresh`` (the earlier state is wiped
    first) or ``resume`` (the run's Redis AOF, checkpoints and directory are kept and the services go on).
    The services' logs go to ``runs/<run>/logs/``; ``verbose`` streams them to the console too (else only
    their warnings and errors show there, beside the live view)."""
    console = console or Console()
    run_dir = cfg.run_dir()
    run_lock.acquire(cfg, config_path)  # one run, one stack: RunIsLive names a live launcher (run_lock.py)
    if threading.current_thread() is threading.main_thread():  # SIGTERM and SIGINT stop the run like Ctrl-C,
        signal.signal(signal.SIGTERM, _interrupt)  # SIGINT too where it was inherited ignored (a script's
        signal.signal(signal.SIGINT, _interrupt)  # background job), where Python installs no handler of its own
    if fresh:
        wipe_run(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    api_port = cfg.api.port or free_port()
    console.print(f"dashboard: {browser_url(cfg.api.host, api_port)}/ (answers once the services are up)",
                  soft_wrap=True)
    console.print(f"logs: {run_dir / 'logs'}/<service>.log; "
                  + ("streamed here (--verbose)" if verbose else "warnings and errors shown here (--verbose: all)"),
                  soft_wrap=True, highlight=False)
    echo = LogEcho(console, verbose)
    redis = None
    env: dict[str, str] = {SECRET_ENV: run_dir_secret(run_dir), **shared_fleet_env(cfg)}  # by environment
    redis_url = cfg.redis_url
    if not cfg.redis_url:
        redis = EmbeddedRedis(data_dir=run_dir / "redis", appendfsync=cfg.run.redis_appendfsync,
                              maxmemory_mb=cfg.run.redis_maxmemory_mb).start(timeout=120)
        env["TANDEM_REDIS_URL"] = redis_url = redis.url
        console.print(f"embedded Redis on 127.0.0.1:{redis.port} (password-protected; data in {run_dir / 'redis'})"
                      + (", resumed from its AOF" if resume else ""))
    ledger = RestartLedger(redis_url, cfg.run.name)
    engines = EngineRestarts(ledger)
    group = ProcessGroup(run_dir / "logs", child_env(env), echo,
                         RestartBudget(cfg.run.max_restarts, cfg.run.restart_window_s), ledger.record)
    if redis is not None:
        group.others.append(RedisProcess("redis", server=redis))
    code = 0
    try:
        # a new run starts its buffers and trainers after the first turn; a resumed one at once
        later = None if resume else AfterFirstTurn(redis_url, [Streams(cfg.run.name).turns(a) for a in cfg.agents])
        api = start_services(cfg, config_path, group, api_port, later)
        disk = DiskWatch([run_dir / "redis" if redis is not None else run_dir, run_dir, Path(cfg.run.checkpoint_root)],
                         lambda: ledger.client.info("persistence"),
                         lambda line: console.print(f"[red]{line}[/red]", soft_wrap=True))
        code = watch(group, api, console, cfg.api.token, engines, later.watch() if later else None, disk)
    except KeyboardInterrupt:
        console.print("interrupted (Ctrl-C or SIGTERM): stopping every service"
                      f" (continue with `tandem up {config_path} --resume`)")
        code = 130
    except RuntimeError as exc:  # ServiceFailed included
        console.print(f"[red]{exc}[/red]", soft_wrap=True)
        if isinstance(exc, ServiceFailed):
            console.print(f"nothing acknowledged is lost: once the cause is fixed, `tandem up {config_path} --resume` "
                          "continues the run where it stopped", soft_wrap=True)
        code = 1
    finally:
        group.stop_all()
        for other in group.others:
            if isinstance(other, RedisProcess):
                other.join()  # a restart under way ends before the counts are read and the server stopped
        restarts = ledger.counts({**group.restart_counts(), **engines.total})
        ledger.client.close()
        if redis is not None:
            redis.stop()
    return report(run_dir, code, restarts, console)


def failed_episodes(summary: dict) -> dict[str, int]:
    """Episodes the run lost (an environment bug, a lost turn), per purpose: ``episodes_failed``'s totals."""
    return {purpose: int(per.get("total", 0)) for purpose, per in (summary.get("episodes_failed") or {}).items()
            if int(per.get("total", 0))}


def report(run_dir: Path, code: int, restarts: dict[str, int], console: Console) -> int:
    """Add the restarts per service to ``summary.json`` and print the summary of a finished run. A run that
    finished but lost episodes exits ``LOST_EPISODES`` (4), naming them, so scripts and sweeps see it."""
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        summary["restarts"] = {name: restarts.get(name, 0) for name in sorted(restarts)}
        summary_path.write_text(json.dumps(summary, indent=2))
        if code == 0:
            console.print(summary_table(summary))
            console.print(f"summary: {summary_path}   plot: {run_dir / 'rewards.png'}")
            if lost := failed_episodes(summary):
                console.print(f"[yellow]the run finished but lost episodes: {lost} (summary.json episodes_failed, "
                              f"the coordinator's log says why); exit {LOST_EPISODES}[/yellow]", soft_wrap=True)
                code = LOST_EPISODES
        if code and summary.get("error"):  # the run failed for good: say why (the coordinator's message)
            console.print(f"[red]the run failed: {summary['error']}[/red]", soft_wrap=True)
    if any(restarts.values()):
        console.print("restarts: " + ", ".join(f"{k} {v}" for k, v in sorted(restarts.items()) if v))
    return code


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def watch(group: ProcessGroup, api: str, console: Console, token: str = "", engines: EngineRestarts | None = None,
          later: AfterFirstTurn | None = None, disk: DiskWatch | None = None) -> int:
    """Supervise the children (restart a dead one within the budget) and refresh progress until the
    coordinator exits 0; ``ServiceFailed`` when a service is past its restart budget. Once the status says
    the run is over (``done`` or ``stopped``) only the coordinator is still restarted: it writes the report
    and stops the others, and a service that dies then is not started again."""
    waiter = threading.Event()
    status = None
    progress = Progress()
    last_print = 0.0
    started = time.time()
    announced, disk_checked = False, 0.0
    evals_shown: set[tuple[str, float]] = set()
    with Live(status_table(None), console=console, auto_refresh=False,
              transient=False) if console.is_terminal else _NoLive() as live:
        while True:
            for name, cmd in later.take_due() if later else []:
                group.start(name, cmd)
            for note in group.supervise():
                console.print(f"[yellow]{note}[/yellow]", soft_wrap=True)
            if engines is not None and engines.ledger.pending:
                engines.ledger.flush()  # restarts counted while Redis itself was restarting
            if disk is not None and time.monotonic() - disk_checked >= DISK_CHECK_S:
                disk.check()  # "disk full at PATH", once per fault (launcher/disk.py)
                disk_checked = time.monotonic()
            if group.exited("coordinator") == 0:
                return 0
            try:
                reply = httpx.get(f"{api}/v1/status", timeout=2.0, headers=bearer(token)).json()
                phase = RunStatus.model_validate(reply).phase  # the status contract, else a ValueError
                status = reply
                if not announced:
                    console.print(f"all services up in {time.time() - started:.0f}s: dashboard at {api}/, control "
                                  f"API docs at {api}/docs", soft_wrap=True)
                    announced = True
                for ev in new_evals(status, evals_shown):
                    console.print(eval_table(ev))
                progress.update(status)
                if engines is not None:
                    engines.update(status)
                if phase in ("done", "stopped"):
                    group.winding_down.set()
            except (httpx.HTTPError, ValueError):
                pass
            restarts = group.restart_counts()
            if console.is_terminal:
                live.update(status_table(status, restarts, progress), refresh=True)
            elif status and time.time() - last_print > 15:
                console.print(status_table(status, restarts, progress))
                last_print = time.time()
            (later.due if later and later.pending else waiter).wait(1.0)


class _NoLive:
    def __enter__(self) -> _NoLive:
        return self

    def __exit__(self, *exc: object) -> None:
        return None
