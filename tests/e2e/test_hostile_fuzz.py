"""Hostile input in a live run (issue 12; docs/architecture.md §2.3): well-formed but wrong messages, written
straight into the run's streams with the real codec by a "hostile local process" (this test, holding the Redis
password), never poison the weights, never hang the run, and are each dead-lettered with the reason.

The run: every service as a real process (``start_services``), a fresh tiny model, two agents. B's buffer is
SIGKILLed as soon as it has joined its stream, so the run stalls (B cannot train, the staleness gate holds
every new group) with A at version 2 and B's first groups waiting undelivered. Meanwhile the test injects:

* samples (A's stream, and B's waiting one): NaN and inf ``rollout_logprobs``, a token id of -5, a sample
  claiming ``group_samples: 1`` in a group the coordinator never emitted, a sample claiming membership of a
  real waiting group (a new id);
* two of B's real waiting samples replaced by copies (same id) with a token id of 10**6 (outside the
  vocabulary) and with a forged ``group_samples``: members that are wrong, so their groups are abandoned;
* engine replies with NaN logprobs and with a negative token id (refused by the wire contract), and with a
  token id outside the vocabulary (well formed: refused by the coordinator's reply check, replies.py);
* weights for A: a forged update (version 999, the start model, a bad HMAC), a corrupt one (validly signed
  with the run's secret, pointing at a copy of version 2 with a flipped byte), an old update replayed under a
  new id, and the same old entry replayed byte for byte (same message id: the done set absorbs it);
* ``POST /v1/stop`` without the API token and with a wrong one (401; the run goes on);
* events: a forged ``weights_loaded`` of A's version 999 and a ``train_step`` of a version never committed
  (the run must still train every step of A: the coordinator takes versions from their owners' records).

B's buffer is then restarted (as a supervisor would) and the run must complete every step.
``TANDEM_HOSTILE_LORA=1`` runs it with LoRA on both agents (adapter sync: each version is the adapter alone).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import torch
import yaml
from safetensors.torch import load_file

from services.common.embedded_redis import EmbeddedRedis, free_port
from services.common.weights_auth import run_secret, sign, weights_checksum
from services.contracts.codec import FIELD, decode, encode
from services.contracts.config import load_config
from services.contracts.messages import (
    DeadLetter,
    Event,
    GenerateReply,
    Sample,
    TrainStep,
    WeightsLoaded,
    WeightsUpdate,
)
from services.launcher.processes import ProcessGroup, child_env, python_module
from services.launcher.up import start_services
from tests.helpers import wait_until

pytestmark = pytest.mark.slow
RUN = "hostile"
TOTAL_STEPS = 4
TOKEN = "hostile-test-api-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def key(name: str) -> str:
    return f"tandem:{RUN}:{name}"


def _wait(predicate, timeout: float, what: str):
    return wait_until(predicate, timeout, what, errors=(httpx.HTTPError, redis.RedisError, KeyError, ValueError))


def write_config(d: Path, port: int, model: Path) -> Path:
    agent = {"model_path": str(model), "groups_per_batch": 2, "max_staleness": 1, "sampling": {"max_new_tokens": 4}}
    if os.environ.get("TANDEM_HOSTILE_LORA") == "1":  # the same run with adapter sync (LoRA on both agents)
        agent["lora"] = {"r": 4, "alpha": 8}
    cfg = {"run": {"name": RUN, "total_steps": TOTAL_STEPS, "concurrent_episodes": 8,
                   "checkpoint_root": str(d / "ckpt"), "output_dir": str(d / "runs"), "trim_interval_s": 0},
           "api": {"port": port, "token": TOKEN},
           "environment": {"name": "tictactoe", "group_size": 2, "roles": {"X": "A", "O": "B"},
                           "alternate_roles": True, "eval": {"episodes": 0}},
           "agents": {"A": dict(agent), "B": dict(agent)}}
    path = d / "hostile.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Injector:
    """Writes hostile entries with the real codec and remembers what each must be dead-lettered for."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.expected: list[tuple[str, str, str]] = []  # (stream, entry id, a phrase of the reason)

    def add(self, stream: str, msg: Any, reason: str) -> str:
        entry = self.client.xadd(stream, {FIELD: encode(msg)}).decode()
        self.expected.append((stream, entry, reason))
        return entry

    def swap(self, stream: str, entry_id: bytes, msg: Sample, reason: str) -> None:
        """Replace a waiting entry by ``msg`` (the same message id: a wrong copy of a real member)."""
        with self.client.pipeline(transaction=True) as pipe:
            pipe.xdel(stream, entry_id)
            pipe.xadd(stream, {FIELD: encode(msg)})
            new = pipe.execute()[1].decode()
        self.expected.append((stream, new, reason))


def forged(sample: Sample, **changes: Any) -> Sample:
    """A copy of ``sample`` with ``changes``, built without validation (as a hostile writer would)."""
    return Sample.model_construct(**{**dict(sample), **changes})  # its fields as they are (turns stay TurnSpans)


def waiting_samples(client: redis.Redis, agent: str) -> list[tuple[bytes, Sample]]:
    stream = key(f"samples:{agent}")
    group = next(g for g in client.xinfo_groups(stream) if g["name"] == b"buffer")
    return [(eid, decode(f[FIELD], Sample)) for eid, f in client.xrange(stream, min=b"(" + group["last-delivered-id"])]


def inject_samples(inj: Injector, client: redis.Redis) -> dict[str, Any]:
    """Junk on A's live stream and on B's waiting one; two of B's waiting members swapped for wrong copies."""
    waiting = waiting_samples(client, "B")
    by_group: dict[str, list[tuple[bytes, Sample]]] = {}
    for eid, s in waiting:
        by_group.setdefault(s.group_id, []).append((eid, s))
    assert len(by_group) >= 3, f"B has {len(by_group)} groups waiting; the test needs 3"
    (g_oov, oov), (g_size, size), *kept = list(by_group.items())
    a_sample = decode(client.xrange(key("samples:A"), count=1)[0][1][FIELD], Sample)
    kept_sample = kept[0][1][0][1]
    for agent, base in (("A", a_sample), ("B", kept_sample)):
        n, stream = len(base.tokens), key(f"samples:{agent}")
        inj.add(stream, forged(base, id=f"nan-{agent}", rollout_logprobs=[float("nan")] * n), "finite")
        inj.add(stream, forged(base, id=f"inf-{agent}", rollout_logprobs=[float("-inf")] * n), "finite")
        inj.add(stream, forged(base, id=f"neg-{agent}", tokens=[-5] * n), "greater than or equal to 0")
        inj.add(stream, forged(base, id=f"size-{agent}", group_id=f"forged-{agent}", group_samples=1),
                "emitted no group")
        inj.add(stream, forged(base, id=f"member-{agent}"), "not one of the")
    eid, s = oov[0]
    inj.swap(key("samples:B"), eid, forged(s, tokens=[10**6, *s.tokens[1:]]), "vocabulary")
    eid, s = size[0]
    inj.swap(key("samples:B"), eid, forged(s, group_samples=s.group_samples + 5), "disagrees with the coordinator")
    return {"abandoned": {g_oov, g_size}, "kept": {g for g, _ in kept}}


def inject_replies(inj: Injector) -> None:
    base = GenerateReply(request_id="forged", agent="A", episode_id="e", turn=0, output_ids=[5, 6],
                         output_logprobs=[-0.1, -0.2], finish_reason="length", weight_version=2, engine="x")
    stream = key("replies:coordinator")
    inj.add(stream, base.model_copy(update={"id": "reply-nan", "output_logprobs": [float("nan"), -0.2]}), "finite")
    inj.add(stream, base.model_copy(update={"id": "reply-neg", "output_ids": [-1, 6]}), "greater than or equal to 0")
    inj.add(stream, base.model_copy(update={"id": "reply-oov", "output_ids": [10**6, 6]}),  # well formed: the
            "rejected by coordinator: output_ids[0] = 1000000 is not a token id of the agent's vocabulary")  # check


def inject_weights(inj: Injector, client: redis.Redis, d: Path, start_model: Path) -> None:
    """Forged, corrupt and replayed updates for A, whose engines hold version 2 (or later)."""
    stream = key("weights:A")
    loaded = int(client.get(key("state:A:loaded_version")))
    updates = [(f, decode(f[FIELD], WeightsUpdate)) for _, f in client.xrange(stream)]
    v1 = next((f, u) for f, u in updates if u.weight_version == 1)
    v2 = next(u for _, u in updates if u.weight_version == loaded)
    inj.add(stream, WeightsUpdate(agent="A", weight_version=999, path=str(start_model),
                                  checksum=weights_checksum(start_model), signature="00" * 32), "bad signature")
    copy = d / "corrupt-v2"
    shutil.copytree(v2.path, copy)
    shard = next(copy.glob("*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF
    shard.write_bytes(bytes(raw))
    secret = run_secret()  # the run's secret: the environment's (tests/conftest.py), never Redis's
    checksum = weights_checksum(copy)
    inj.add(stream, WeightsUpdate(agent="A", weight_version=loaded, path=str(copy), checksum=checksum,
                                  signature=sign(secret, "A", loaded, str(copy), checksum)), "differs from the trainer")
    inj.add(stream, v1[1].model_copy(update={"id": "replayed-v1"}), "older than the loaded version")
    client.xadd(stream, v1[0])  # the very same entry again: same message id, absorbed by the done set


FORGER = "forger"  # the source the forged events claim; the run's real events never carry it


def inject_events(inj: Injector) -> None:
    """Issue 33's forgery: one XADD of ``weights_loaded`` version 999 ended A's training early; a ``train_step``
    of a version never committed. The coordinator reads the owners' records instead (facts.py)."""
    stream = key("events")
    inj.add(stream, WeightsLoaded(source=FORGER, agent="A", weight_version=999, path="/tmp/forged", engines=[]),
            "is not backed by the rollout's record")
    inj.add(stream, TrainStep(source=FORGER, agent="A", weight_version=999, batch_weight_version=998,
                              metrics={"loss": -1.0}), "the trainer never committed that version")


def stall_and_inject(client: redis.Redis, group: ProcessGroup, api: str, d: Path, model: Path,
                     path: Path) -> dict[str, Any]:
    stream_b = key("samples:B")
    _wait(lambda: client.exists(stream_b) and any(g["name"] == b"buffer" for g in client.xinfo_groups(stream_b)),
          300, "B's buffer to join its stream")
    buffer_b = next(c for c in group.children if c.name == "buffer.B")
    buffer_b.proc.send_signal(signal.SIGKILL)
    buffer_b.proc.wait(10)
    status = lambda: httpx.get(f"{api}/v1/status", headers=AUTH, timeout=5).json()  # noqa: E731
    _wait(lambda: status()["agents"]["A"]["weight_version"] >= 2, 600, "A's engines at version 2")
    _wait(lambda: len({s.group_id for _, s in waiting_samples(client, "B")}) >= 3, 300, "B's groups waiting")
    observed: dict[str, Any] = {"at_stall": status()}
    observed["stop_no_token"] = httpx.post(f"{api}/v1/stop", timeout=5).status_code
    observed["stop_bad_token"] = httpx.post(f"{api}/v1/stop", headers={"Authorization": "Bearer nope"},
                                            timeout=5).status_code
    inj = Injector(client)
    observed["groups"] = inject_samples(inj, client)
    inject_replies(inj)
    inject_weights(inj, client, d, model)
    inject_events(inj)
    observed["expected"] = inj.expected
    group.start("buffer.B", python_module("services.buffer", "--config", str(path), "--agent", "B"))
    return observed


def valid(entries: list[Any], model: Any) -> list[Any]:
    out = []
    for _, f in entries:
        try:
            out.append(decode(f[FIELD], model))
        except ValueError:  # pydantic's ValidationError is one
            continue
    return out


def collect(client: redis.Redis) -> dict[str, Any]:
    out: dict[str, Any] = {}
    out["letters"] = [decode(f[FIELD], DeadLetter) for _, f in client.xrange(key("deadletter"))]
    out["train_log"] = {a: [json.loads(x) for x in client.lrange(key(f"trainer:{a}:log"), 0, -1)] for a in "AB"}
    out["ledger"] = {a: {k.decode(): json.loads(v) for k, v in client.hgetall(key(f"coord:ledger:{a}")).items()}
                     for a in "AB"}
    out["verdicts"] = {a: {k.decode(): v.decode() for k, v in client.hgetall(key(f"buffer:{a}:verdicts")).items()}
                       for a in "AB"}
    out["events"] = [decode(f[FIELD], Event) for _, f in client.xrange(key("events"))]
    out["replies"] = valid(client.xrange(key("replies:coordinator")), GenerateReply)  # the injected ones fail
    out["loaded_weights"] = {a: json.loads(client.get(key(f"state:{a}:loaded_weights"))) for a in "AB"}
    out["pending_weights_A"] = client.xpending(key("weights:A"), "rollout")["pending"]
    out["rejected_replies"] = {k.decode(): int(v) for k, v in client.hgetall(key("coord:rejected_replies")).items()}
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir):
    d = tmp_path_factory.mktemp("hostile")
    port = free_port()
    path = write_config(d, port, tiny_model_dir)
    cfg = load_config(path)
    api = f"http://127.0.0.1:{port}"
    server = EmbeddedRedis(data_dir=d / "redis").start()
    client = redis.Redis.from_url(server.url)
    group = ProcessGroup(d / "logs", child_env({"TANDEM_REDIS_URL": server.url}), lambda name, line: None)
    try:
        start_services(cfg, str(path), group, port)
        observed = stall_and_inject(client, group, api, d, tiny_model_dir, path)
        coord = next(c for c in group.children if c.name == "coordinator")
        observed["returncode"] = coord.proc.wait(600)
        observed.update(collect(client))
    finally:
        group.stop_all()
        client.close()
        server.stop()
    observed["summary"] = json.loads((d / "runs" / RUN / "summary.json").read_text())
    observed["ckpt"] = d / "ckpt"
    observed["log"] = (d / "logs" / "coordinator.log").read_text(errors="replace")
    return observed


def test_the_run_completes_every_step_and_a_stop_without_the_token_is_refused(run):
    assert (run["stop_no_token"], run["stop_bad_token"]) == (401, 401)
    assert run["returncode"] == 0, run["log"][-3000:]
    assert run["summary"]["phase"] == "done"
    for agent in "AB":
        a = run["summary"]["agents"][agent]
        assert (a["steps"], a["weight_versions"], a["last_weight_version"]) == (TOTAL_STEPS,) * 3
        assert [r["version"] for r in run["train_log"][agent]] == list(range(1, TOTAL_STEPS + 1))


def test_no_published_version_holds_a_non_finite_tensor(run):
    dirs = sorted(p.parent for p in run["ckpt"].rglob("*.safetensors"))
    assert len(dirs) >= 2 * TOTAL_STEPS
    for directory in dirs:
        for shard in directory.glob("*.safetensors"):
            for name, t in load_file(shard).items():
                assert torch.isfinite(t).all(), f"{shard}: {name} is not finite"


def test_engines_load_only_the_versions_their_trainer_committed(run):
    for agent in "AB":
        commits = {r["version"]: r for r in run["train_log"][agent]}
        loads = [e for e in run["events"] if e.kind == "weights_loaded" and e.agent == agent and e.source != FORGER]
        assert [e.weight_version for e in loads] == list(range(1, TOTAL_STEPS + 1))  # never rolled back
        for e in loads:
            assert e.path == commits[e.weight_version]["path"]
        last = run["loaded_weights"][agent]
        assert (last["weight_version"], last["checksum"]) == (TOTAL_STEPS, commits[TOTAL_STEPS]["checksum"])
        served = {r.weight_version for r in run["replies"] if r.agent == agent and not r.error}
        assert served <= {0, *commits}
    assert run["pending_weights_A"] == 0  # the byte-for-byte replay was acknowledged, not left hanging


def test_every_rejected_item_is_dead_lettered_with_its_reason(run):
    letters = {(x.source_stream, x.entry_id): x.reason for x in run["letters"]}
    for stream, entry, phrase in run["expected"]:
        assert (stream, entry) in letters, f"{stream} {entry} ({phrase}) was not dead-lettered"
        assert phrase in letters[(stream, entry)], letters[(stream, entry)]
    assert len(run["letters"]) == len(run["expected"]), [x.reason for x in run["letters"]]
    assert run["rejected_replies"] == {"A": 1}  # the out-of-vocabulary reply, answering no pending turn


def test_good_samples_are_trained_and_a_group_that_lost_a_member_is_abandoned_and_counted(run):
    verdicts, ledger = run["verdicts"]["B"], run["ledger"]["B"]
    trained = {sid for r in run["train_log"]["B"] for sid in r["sample_ids"]}
    for gid in run["groups"]["abandoned"]:
        assert verdicts[gid].startswith("abandoned:dead-lettered sample"), verdicts[gid]
        assert not set(ledger[gid]["samples"]) & trained
    reasons = run["summary"]["agents"]["B"]["abandon_reasons"]
    assert reasons.get("dead-lettered sample", 0) == len(run["groups"]["abandoned"])
    for gid in run["groups"]["kept"]:  # groups a forged sample claimed or wrote junk to: trained whole
        assert verdicts[gid] == "kept", verdicts[gid]
        assert set(ledger[gid]["samples"]) <= trained
    for agent in "AB":
        assert not any(sid.startswith(("nan-", "inf-", "neg-", "size-", "member-"))
                       for r in run["train_log"][agent] for sid in r["sample_ids"])
