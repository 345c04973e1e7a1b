"""kill -9 the trainer mid-run, three ways, and restart it: it resumes and no sample is trained twice.

Real processes (buffer and trainer) on a real Redis. The trainer is killed with
SIGKILL (1) from outside at whatever point it has reached, (2) after it trained a
step and wrote its state but before the Redis commit, (3) after the commit but
before acknowledging the batch. After the last restart the run must finish with
versions 1..N each trained once, every sample in exactly one step, and final
weights equal to an uninterrupted in-process run over the same batches — which
also shows the optimizer, scheduler and version were restored exactly. The run keeps its
last 3 weight versions (``run.checkpoint_retention``) and the one the evaluation plays: the
others are pruned and resume is unaffected.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
import yaml

from services.common.bus import Bus
from services.contracts.codec import FIELD, decode
from services.contracts.config import load_config
from services.contracts.messages import Batch, Event, Sample
from services.contracts.streams import Streams
from services.training.backends import make_policy
from tests.helpers import emit, make_sample, wait_until

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
STEPS = 8  # room for the three kills wherever the first one lands
KEEP_LAST, EVAL_EVERY = 3, 4  # versions 6-8 kept as the last 3, version 4 as the one evaluated


def wait(pred, timeout: float, what: str):  # type: ignore[no-untyped-def]
    return wait_until(pred, timeout, what, errors=(), interval=0.1)  # any error of ``pred`` fails the test


def samples() -> list[Sample]:
    out = []
    for g in range(STEPS):
        for k in range(2):
            tokens = [5, 6, 7, 8] + [20 + 3 * g + k, 30 + k, 40 + g]
            mask = [0, 0, 0, 0, 1, 1, 1]
            out.append(make_sample(f"g{g}", float(k), id=f"s{g}-{k}", episode_id=f"e{g}-{k}", tokens=tokens,
                                   loss_mask=mask, logprobs=[-5.5 * m for m in mask]))
    return out


async def emit_all(redis_url: str, run: str) -> None:
    bus = Bus(redis_url, run, "coordinator")
    try:
        await emit(bus, *samples())
    finally:
        await bus.close()


@pytest.mark.parametrize("backend", ["torch", "megatron"])
def test_kill_dash_nine_and_resume(tmp_path: Path, redis_url: str, tiny_model_dir: Path, backend: str) -> None:
    run = f"resume{os.getpid()}{backend}"
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "run": {"name": run, "total_steps": STEPS, "checkpoint_root": str(tmp_path / "ckpt"),
                "checkpoint_retention": {"keep_last": KEEP_LAST}},
        "redis_url": redis_url,
        "environment": {"name": "tictactoe", "group_size": 2, "roles": {"X": "A", "O": "A"},
                        "eval": {"every_n_steps": EVAL_EVERY}},
        "agents": {"A": {"model_path": str(tiny_model_dir), "backend": backend, "groups_per_batch": 1,
                         "max_staleness": 100,
                         "algorithm": {"name": "grpo", "lr": 0.01, "lr_scheduler": "linear", "decay_steps": 10}}},
    }))
    r = redis.Redis.from_url(redis_url)
    s = Streams(run)
    published = lambda: int(r.get(s.published_weight_version("A")) or 0)  # noqa: E731
    procs: list[subprocess.Popen] = []

    def start(service: str, failpoint: str | None = None) -> subprocess.Popen:
        env = {**os.environ, "TANDEM_TRAINER_FAILPOINT": failpoint or ""}
        p = subprocess.Popen([sys.executable, "-m", f"services.{service}", "--config", str(cfg_path), "--agent", "A"],
                             cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        procs.append(p)
        return p

    try:
        start("buffer")
        asyncio.run(emit_all(redis_url, run))  # as the coordinator emits: entries and their ledger records
        # (1) kill -9 from outside as soon as the first version is committed, wherever the trainer then is
        t = start("trainer")
        wait(lambda: published() >= 1, 90, "version 1")
        t.send_signal(signal.SIGKILL)
        assert t.wait(10) == -signal.SIGKILL
        # (2) dies after training step 3 and writing its state, before the commit
        committed = published()
        t = start("trainer", f"after_state:{committed + 1}")
        assert t.wait(90) == -signal.SIGKILL, t.stderr.read().decode()[-2000:] if t.stderr else ""
        assert published() == committed
        assert (tmp_path / "ckpt" / run / "A" / "state" / f"v{committed + 1:05d}").is_dir()  # written, uncommitted
        # (3) dies right after committing the next version, before acknowledging its batch
        t = start("trainer", f"after_commit:{committed + 2}")
        assert t.wait(90) == -signal.SIGKILL
        assert published() == committed + 2
        # the last start finishes the run
        t = start("trainer")
        wait(lambda: published() == STEPS, 90, f"version {STEPS}")
        wait(lambda: not r.xpending(s.batches("A"), "trainer")["pending"], 30, "every batch acknowledged")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


    log = [json.loads(x) for x in r.lrange(s.train_log("A"), 0, -1)]
    assert [rec["version"] for rec in log] == list(range(1, STEPS + 1))
    trained = [sid for rec in log for sid in rec["sample_ids"]]
    assert sorted(trained) == sorted(x.id for x in samples())  # every sample exactly once
    assert {m.decode() for m in r.smembers(s.trained_samples("A"))} == set(trained)
    state_root = tmp_path / "ckpt" / run / "A" / "state"
    assert sorted(p.name for p in state_root.iterdir()) == [f"v{STEPS - 1:05d}", f"v{STEPS:05d}"]
    weights = sorted(p.name for p in (tmp_path / "ckpt" / run / "A").glob("v*"))
    assert weights == [f"v{v:05d}" for v in (EVAL_EVERY, *range(STEPS - KEEP_LAST + 1, STEPS + 1))]

    # per-step metrics on the events stream (what the coordinator serves at /v1/metrics)
    events = [decode(f[FIELD], Event) for _, f in r.xrange(s.events)]
    steps = {e.weight_version: e.metrics for e in events if e.kind == "train_step" and e.agent == "A"}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for key in ("loss", "pg_loss", "entropy", "clip_frac", "grad_norm", "lr", "tokens_per_s", "stale_frac"):
        assert all(isinstance(m[key], float) for m in steps.values()), key
    assert steps[2]["stale_frac"] == 1.0 and steps[2]["tis_ratio_max"] > 0  # samples of version 0, trainer at 1

    # an uninterrupted in-process run over the same batches ends at the same weights
    batches = [decode(f[FIELD], Batch) for _, f in r.xrange(s.batches("A"))]
    assert [b.weight_version for b in batches] == list(range(1, STEPS + 1))
    acfg = load_config(cfg_path).agents["A"]
    reference = make_policy(acfg, 1.0)
    for b in batches:
        reference.train_step(b.samples)
    resumed = make_policy(acfg, 1.0)
    assert resumed.load_state(state_root / f"v{STEPS:05d}") == STEPS
    for (name, a), b in zip(reference.model.named_parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
