"""Every producer and consumer in services/ against the flow table (services/contracts/flows.py), read from the
code: each ``publish``/``xadd`` names a stream its service may produce on, with that stream's message type
(and, on ``events``, a kind that service sends); each ``consume``/``watch_control`` reads with a consumer group the
table lists; and every producer and group the table lists exists in the code. The Bus enforces the message types
at run time too."""

from __future__ import annotations

import ast
import asyncio
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

from services.common.bus import Bus
from services.contracts import messages
from services.contracts.flows import ANY_SERVICE, EVENT_PRODUCERS, FLOWS
from services.contracts.messages import Control
from tests.helpers import read_all

SERVICES = Path(__file__).resolve().parents[2] / "services"
EVENT_KIND = {t.__name__: t.model_fields["kind"].default for t in messages.EVENT_TYPES}


def stream_of(node: ast.AST) -> str | None:
    """The flow name a stream expression refers to: ``s.turns(agent)`` -> turns, ``req.reply_stream`` -> replies."""
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and n.attr in FLOWS:
            return n.attr
        if isinstance(n, ast.Attribute) and n.attr == "reply_stream":
            return "replies"
    return None


def group_of(node: ast.AST) -> str | None:
    """A consumer group literal; an f-string's fields become ``X`` (``control-rollout-{agent}``: control-rollout-X)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "X" for v in node.values)
    return None


def sites() -> tuple[list[tuple[str, str, str, str | None]], list[tuple[str, str, str]], list[str]]:
    """(where, service, stream, message class) per produce site; (where, stream, group) per consume site;
    and the sites whose stream or group cannot be read."""
    produced, consumed, unread = [], [], []
    for path in sorted(SERVICES.rglob("*.py")):
        service = path.relative_to(SERVICES).parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            where = f"{path.relative_to(SERVICES.parent)}:{node.lineno}"
            if name in ("publish", "xadd"):
                stream = stream_of(node.args[0])
                msg = node.args[1] if len(node.args) > 1 else None
                cls = msg.func.id if isinstance(msg, ast.Call) and isinstance(msg.func, ast.Name) else None
                if stream is not None:
                    produced.append((where, service, stream, cls if name == "publish" else None))
                elif service != "common":  # the Bus's own publish passes any stream on
                    unread.append(where)
            elif name == "consume" or name == "watch_control":
                stream = "control" if name == "watch_control" else stream_of(node.args[0])
                group = group_of(node.args[1]) if len(node.args) > 1 else None
                if stream is not None and group is not None:
                    consumed.append((where, stream, group))
                elif service != "common":
                    unread.append(where)
    return produced, consumed, unread


def test_every_producer_and_consumer_is_in_the_flow_table() -> None:
    produced, consumed, unread = sites()
    assert not unread, f"streams or groups the flow-table test cannot read: {unread}"
    for where, service, stream, cls in produced:
        flow = FLOWS[stream]
        assert service in flow.producers or ANY_SERVICE in flow.producers, (
            f"{where}: {service} produces on {stream}; the flow table lists {flow.producers}")
        if cls is not None and cls in vars(messages):
            assert cls in {t.__name__ for t in flow.types}, f"{where}: {cls} on {stream} (table: {flow.message_name})"
        if stream == "events" and cls in EVENT_KIND:
            assert EVENT_KIND[cls] in EVENT_PRODUCERS[service], f"{where}: {service} sends {EVENT_KIND[cls]}"
    for where, stream, group in consumed:
        groups = FLOWS[stream].groups  # fnmatch patterns
        assert any(fnmatchcase(group, g) for g in groups), f"{where}: group {group!r} on {stream} ({groups})"
    # and the table holds nothing the code does not do
    for flow in FLOWS.values():
        for producer in set(flow.producers) - {ANY_SERVICE}:
            assert any(s == flow.name and p == producer for _, p, s, _ in produced), (flow.name, producer)
        for pattern in flow.groups:
            assert any(s == flow.name and fnmatchcase(g, pattern) for _, s, g in consumed), (flow.name, pattern)
    for service, kinds in EVENT_PRODUCERS.items():
        sent = {EVENT_KIND[c] for _, p, s, c in produced if p == service and s == "events" and c in EVENT_KIND}
        assert sent == set(kinds), (service, sent, kinds)


async def test_the_bus_takes_the_message_type_from_the_table(redis_url: str) -> None:
    bus = Bus(redis_url, "t", "test")
    with pytest.raises(TypeError, match="Control cannot go on tandem:t:samples:A: the flow table says Sample"):
        await bus.publish(bus.streams.samples("A"), Control(command="stop"))
    with pytest.raises(KeyError, match="not in the flow table"):
        await bus.publish(bus.streams.key("elsewhere"), Control(command="stop"))
    with pytest.raises(ValueError, match="not a stream of run 't'"):
        await bus.publish("tandem:other:control", Control(command="stop"))
    await bus.publish(bus.streams.control, Control(command="stop"))
    got: list[Control] = []
    stop = asyncio.Event()

    async def handler(msg: Control) -> None:
        got.append(msg)
        stop.set()

    await asyncio.wait_for(bus.consume(bus.streams.control, "control-coordinator", "c", handler, stop), 10)
    assert [type(m) for m in got] == [Control]
    assert isinstance((await read_all(bus, bus.streams.control))[0], Control)
    await bus.close()
