"""Message round-trips, rejection of malformed payloads, config validation."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from pydantic import ValidationError

from services.contracts.codec import decode, encode
from services.contracts.config import ConfigError, load_config, parse_config
from services.contracts.messages import (
    EVENT_TYPES,
    Batch,
    BatchReleased,
    Control,
    DeadLetter,
    EngineStatus,
    Event,
    GenerateReply,
    GenerateRequest,
    GroupDone,
    RolloutLoad,
    Sample,
    SamplingParams,
    TrainStep,
    WeightsLoaded,
    WeightsUpdate,
)

SAMPLE = Sample(agent="A", role="X", episode_id="e1", group_id="g1", group_samples=2, tokens=[1, 2, 3, 4],
                loss_mask=[0, 0, 1, 1], rollout_logprobs=[0.0, 0.0, -0.5, -0.1], reward=1.0,
                weight_versions=[3], engines=["A-0"], reply_ids=["r1"])

MESSAGES = [
    GenerateRequest(agent="A", episode_id="e", group_id="g", turn=0, role="X", input_ids=[1, 2],
                    sampling=SamplingParams(temperature=0.7, max_new_tokens=4), reply_stream="s"),
    GenerateReply(request_id="r", agent="A", episode_id="e", turn=0, output_ids=[5, 6],
                  output_logprobs=[-0.1, -0.2], finish_reason="stop", weight_version=2, engine="A-0"),
    SAMPLE,
    Batch(agent="A", weight_version=1, samples=[SAMPLE]),
    WeightsUpdate(agent="A", weight_version=1, path="/tmp/x", checksum="ab", signature="cd"),
    TrainStep(source="t", agent="A", weight_version=1, batch_weight_version=1,
              metrics={"loss": 0.5, "backend": "torch"}),
    WeightsLoaded(source="t", agent="A", weight_version=1, path="/tmp/x", engines=["http://e0"]),
    GroupDone(source="t", agent="A", group_id="g", outcome="abandoned", reason="a sample was dead-lettered"),
    BatchReleased(source="t", agent="A", weight_version=1, samples=4),
    RolloutLoad(source="t", agent="A", queue_depth=1, engines=[EngineStatus(url="http://e0", healthy=True)]),
    Control(command="pause"),
    DeadLetter(source_stream="s", entry_id="1-0", service="t", reason="bad", payload=b"\x00\x01"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip_is_exact(msg):
    again = decode(encode(msg), type(msg))
    assert again == msg
    assert again.schema_version == 3 and again.id == msg.id and again.created_at == msg.created_at


def test_events_decode_to_their_kind_and_bad_ones_name_the_field():
    events = [m for m in MESSAGES if isinstance(m, EVENT_TYPES)]
    assert {e.kind for e in events} == {"train_step", "weights_loaded", "group_done", "batch_released",
                                        "rollout_load"}
    for e in events:
        again = decode(encode(e), Event)
        assert type(again) is type(e) and again == e
    with pytest.raises(ValidationError, match="outcome"):
        decode(encode(GroupDone(source="t", agent="A", group_id="g", outcome="kept")).replace(b"kept", b"lost"),
               Event)
    for kind in ("health", "error"):  # declared once, never sent: gone
        with pytest.raises(ValidationError, match="kind"):
            decode(msgpack.packb({"kind": kind, "source": "t", "agent": "A"}), Event)
    with pytest.raises(ValidationError, match="data"):  # schema 1's untyped dict
        decode(msgpack.packb({"kind": "train_step", "source": "t", "agent": "A", "weight_version": 1,
                              "batch_weight_version": 1, "metrics": {}, "data": {}}), Event)
    with pytest.raises(ValidationError, match="schema_version"):
        decode(msgpack.packb({**BatchReleased(source="t", agent="A", weight_version=1, samples=1).model_dump(),
                              "schema_version": 1}), Event)
    with pytest.raises(ValidationError, match="command"):
        Control(command="eval")
    with pytest.raises(ValidationError, match="schema_version"):  # schema 2's names (``step``): refused by version
        decode(msgpack.packb({"kind": "batch_released", "source": "t", "agent": "A", "step": 1, "samples": 1,
                              "schema_version": 2}), Event)


def test_schema_3_weights_updates_are_signed():
    """``signature`` came with schema 3: a schema-2 update is refused for its schema, a schema-3 one without a
    signature for the missing field (before any rollout checks it)."""
    signed = WeightsUpdate(agent="A", weight_version=1, path="/tmp/x", checksum="ab", signature="cd").model_dump()
    unsigned = {k: v for k, v in signed.items() if k != "signature"}
    with pytest.raises(ValidationError, match="schema_version"):
        decode(msgpack.packb({**unsigned, "schema_version": 2}), WeightsUpdate)
    with pytest.raises(ValidationError, match="signature"):
        decode(msgpack.packb(unsigned), WeightsUpdate)
    with pytest.raises(ValidationError, match="signature"):
        decode(msgpack.packb({**signed, "signature": ""}), WeightsUpdate)
    assert decode(msgpack.packb(signed), WeightsUpdate).signature == "cd"


def test_ids_are_unique():
    assert len({Control(command="stop").id for _ in range(100)}) == 100


@pytest.mark.parametrize("raw, fragment", [
    (b"\xc1garbage", "not valid msgpack"),
    (msgpack.packb([1, 2, 3]), "must be a map"),
    (msgpack.packb({"command": "explode"}), "command"),
    (msgpack.packb({"command": "stop", "surprise": 1}), "surprise"),
    (msgpack.packb({"command": "stop", "schema_version": 99}), "schema_version"),
])
def test_malformed_payloads_are_rejected_with_reason(raw, fragment):
    with pytest.raises((ValueError, ValidationError)) as err:
        decode(raw, Control)
    assert fragment in str(err.value)


def test_sample_alignment_is_enforced():
    with pytest.raises(ValidationError, match="one length"):
        Sample(**{**SAMPLE.model_dump(), "loss_mask": [0, 1]})
    with pytest.raises(ValidationError, match="covers no token"):
        Sample(**{**SAMPLE.model_dump(), "loss_mask": [0, 0, 0, 0]})
    with pytest.raises(ValidationError):  # a NaN reward would poison the advantages
        Sample(**{**SAMPLE.model_dump(), "reward": float("nan")})


def _demo() -> dict:
    import yaml

    return yaml.safe_load(Path("configs/demo.yaml").read_text())


def test_demo_config_is_valid():
    cfg = load_config("configs/demo.yaml")
    assert set(cfg.agents) == {"A", "B"}


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d["agents"]["A"].update(max_staleness=-1), "agents.A.max_staleness"),
    (lambda d: d["agents"]["B"].update(lr=0.1), "agents.B.lr"),
    (lambda d: d["agents"]["A"]["algorithm"].update(name="ppo-magic"), "agents.A.algorithm.name"),
    (lambda d: d["environment"]["roles"].update(X="C"), "environment.roles.X"),
    (lambda d: d["run"].update(name="bad name!"), "run.name"),
    (lambda d: d["agents"]["A"].update(engine="vllm"), "agents.A.engine"),
])
def test_bad_config_names_the_field(mutate, field):
    data = _demo()
    mutate(data)
    with pytest.raises(ConfigError) as err:
        parse_config(data, "demo")
    assert field in str(err.value)


def test_env_overrides_single_fields():
    cfg = load_config("configs/demo.yaml", environ={"TANDEM_REDIS_URL": "redis://x:1/0",
                                                   "TANDEM__agents__B__max_staleness": "3"})
    assert cfg.redis_url == "redis://x:1/0" and cfg.agents["B"].max_staleness == 3


@pytest.mark.parametrize("mutate, field, reason", [
    (lambda d: d["agents"]["A"]["algorithm"].update(lr=float("inf")), "agents.A.algorithm.lr", "finite"),
    (lambda d: d["agents"]["B"]["algorithm"].update(clip_eps_high=float("nan")), "agents.B.algorithm.clip_eps_high",
     "finite"),
    (lambda d: d["run"].update(trim_interval_s=float("inf")), "run.trim_interval_s", "finite"),
    (lambda d: d["environment"]["eval"].update(temperature=float("inf")), "environment.eval.temperature", "finite"),
    (lambda d: d["agents"]["A"]["sampling"].update(temperature=float("inf")), "agents.A.sampling", "finite"),
    (lambda d: d["agents"]["A"]["algorithm"].update(lr="0.001"), "agents.A.algorithm.lr", "valid number"),
    (lambda d: d["agents"]["A"]["sampling"].update(temperature="1.0"), "agents.A.sampling.temperature",
     "valid number"),
    (lambda d: d["agents"]["A"].update(groups_per_batch="16"), "agents.A.groups_per_batch", "valid integer"),
    (lambda d: d["run"].update(total_steps=12.0), "run.total_steps", "valid integer"),
    (lambda d: d["agents"]["A"].update(train="yes"), "agents.A.train", "valid boolean"),
    (lambda d: d["run"].update(max_restarts=-1), "run.max_restarts", "greater than or equal"),
    (lambda d: d["run"].update(restart_window_s=0), "run.restart_window_s", "greater than"),
    (lambda d: d["run"].update(redis_appendfsync="no"), "run.redis_appendfsync", "everysec"),
])
def test_config_is_strict_and_finite(mutate, field, reason):
    data = _demo()
    mutate(data)
    with pytest.raises(ConfigError) as err:
        parse_config(data, "demo")
    assert field in str(err.value) and reason in str(err.value), str(err.value)


def test_config_numbers_read_as_meant(tmp_path):
    text = Path("configs/demo.yaml").read_text().replace("lr: 0.001", "lr: 1e-3").replace("total_steps: 72",
                                                                                          "total_steps: 7_2")
    path = tmp_path / "demo.yaml"
    path.write_text(text)
    cfg = load_config(path, environ={"TANDEM__agents__B__algorithm__lr": "2e-4", "TANDEM__run__max_restarts": "0"})
    assert cfg.agents["A"].algorithm.lr == 0.001 and cfg.agents["B"].algorithm.lr == 0.0002
    assert cfg.run.total_steps == 72 and cfg.run.max_restarts == 0
    assert (cfg.run.restart_window_s, cfg.run.redis_appendfsync) == (600.0, "always")


def test_redis_password_file_goes_into_the_url(tmp_path):
    secret = tmp_path / "redis-password"
    secret.write_text("p@ss/word\n")
    cfg = load_config("configs/demo.yaml", environ={"TANDEM_REDIS_URL": "redis://redis:6379/0",
                                                   "TANDEM_REDIS_PASSWORD_FILE": str(secret)})
    assert cfg.redis_url == "redis://:p%40ss%2Fword@redis:6379/0"
    import redis

    assert redis.Redis.from_url(cfg.redis_url).connection_pool.connection_kwargs["password"] == "p@ss/word"
    with pytest.raises(ConfigError, match="TANDEM_REDIS_PASSWORD_FILE: cannot read"):
        load_config("configs/demo.yaml", environ={"TANDEM_REDIS_URL": "redis://redis:6379/0",
                                                 "TANDEM_REDIS_PASSWORD_FILE": str(tmp_path / "missing")})
