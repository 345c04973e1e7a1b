"""``tandem up CONFIG``: embedded Redis and every service as child processes.

Order: Redis (embedded unless the config names one; its AOF under ``runs/<run>/redis``:
services/launcher/valkey.py) → the services (services/launcher/plan.py: per agent the rollout, which
starts the agent's real SGLang router and engines itself, or drives the router of the agent whose engines it
shares; the coordinator; per trained agent the buffer and trainer, a new run's once its first turn is
played: services/launcher/deferred.py). It prints the dashboard's address first, then runs the main loop
(services/launcher/watch.py): the live view from the coordinator's ``/v1/status`` and the supervision of
every child and the embedded Redis: one that dies is restarted in place within the restart budget
(``run.max_restarts`` in ``run.restart_window_s``), the count goes to the live view, the Redis hash
``state:restarts`` and ``summary.json`` (services/launcher/finish.py); past the budget the run stops naming
the service and saying that ``--resume`` continues it. Ctrl-C (SIGINT, handled explicitly) and SIGTERM stop
everything; ``tandem up CONFIG --resume`` then continues the run.
"""

from __future__ import annotations

import shutil
import signal
import threading
from pathlib import Path

import redis as redis_lib
from rich.console import Console

from services.common.embedded_redis import EmbeddedRedis, free_port
from services.common.weights_auth import SECRET_ENV, run_dir_secret
from services.contracts.config import TandemConfig
from services.contracts.streams import Streams
from services.launcher import run_lock
from services.launcher.deferred import AfterFirstTurn
from services.launcher.disk import DiskWatch
from services.launcher.finish import failed_episodes, report  # noqa: F401 (re-exported: the launcher's entry)
from services.launcher.live_view import LogEcho, status_table  # noqa: F401 (status_table: re-exported)
from services.launcher.plan import shared_fleet_env, start_services, trainer_command  # noqa: F401 (as above)
from services.launcher.processes import ProcessGroup, RestartBudget, ServiceFailed, child_env
from services.launcher.restarts import EngineRestarts, RestartLedger
from services.launcher.valkey import RedisProcess, start_embedded
from services.launcher.watch import watch


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
    env = {SECRET_ENV: run_dir_secret(run_dir), **shared_fleet_env(cfg)}  # secrets by environment, not Redis
    redis = start_embedded(cfg, run_dir, resume, console)
    if redis is not None:
        env["TANDEM_REDIS_URL"] = redis.url
    redis_url = redis.url if redis is not None else cfg.redis_url
    ledger = RestartLedger(redis_url, cfg.run.name)
    group = ProcessGroup(run_dir / "logs", child_env(env), LogEcho(console, verbose),
                         RestartBudget(cfg.run.max_restarts, cfg.run.restart_window_s), ledger.record)
    if redis is not None:
        group.others.append(RedisProcess("redis", server=redis))
    engines = EngineRestarts(ledger)
    code = 1
    try:
        code = run_services(cfg, config_path, group, api_port, redis_url, ledger, engines, resume, redis, console)
    finally:
        restarts = stop_run(group, ledger, engines, redis)
    return report(run_dir, code, restarts, console)


def run_services(cfg: TandemConfig, config_path: str, group: ProcessGroup, api_port: int, redis_url: str,
                 ledger: RestartLedger, engines: EngineRestarts, resume: bool, redis: EmbeddedRedis | None,
                 console: Console) -> int:
    """Start the services and run the main loop; the run's exit code (130: interrupted, 1: a service failed)."""
    run_dir = cfg.run_dir()
    try:
        # a new run starts its buffers and trainers after the first turn; a resumed one at once
        later = None if resume else AfterFirstTurn(redis_url, [Streams(cfg.run.name).turns(a) for a in cfg.agents])
        api = start_services(cfg, config_path, group, api_port, later)
        disk = DiskWatch([run_dir / "redis" if redis is not None else run_dir, run_dir, Path(cfg.run.checkpoint_root)],
                         lambda: ledger.client.info("persistence"),
                         lambda line: console.print(f"[red]{line}[/red]", soft_wrap=True))
        return watch(group, api, console, cfg.api.token, engines, later.watch() if later else None, disk)
    except KeyboardInterrupt:
        console.print("interrupted (Ctrl-C or SIGTERM): stopping every service"
                      f" (continue with `tandem up {config_path} --resume`)")
        return 130
    except RuntimeError as exc:  # ServiceFailed included
        console.print(f"[red]{exc}[/red]", soft_wrap=True)
        if isinstance(exc, ServiceFailed):
            console.print(f"nothing acknowledged is lost: once the cause is fixed, `tandem up {config_path} --resume` "
                          "continues the run where it stopped", soft_wrap=True)
        return 1


def stop_run(group: ProcessGroup, ledger: RestartLedger, engines: EngineRestarts,
             redis: EmbeddedRedis | None) -> dict[str, int]:
    """Stop every service, then the embedded Redis; the restarts per service (read before Redis stops)."""
    group.stop_all()
    for other in group.others:
        if isinstance(other, RedisProcess):
            other.join()  # a restart under way ends before the counts are read and the server stopped
    restarts = ledger.counts({**group.restart_counts(), **engines.total})
    ledger.client.close()
    if redis is not None:
        redis.stop()
    return restarts


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
