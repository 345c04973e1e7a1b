"""Every service that touches a Redis key against the key table (services/contracts/keys.py), read from the code.

A key is referenced through its ``Streams`` helper (``s.train_log(agent)``, ``streams.key("coord:run")``); a
reference is a write when it (or a name it was assigned to: ``self.k_x = s.helper(...)``, ``key = ...``, a
method that returns it) is the first argument of a Redis write (``hset``, ``rpush``, ...), a read for a
Redis read, and what a script's table entry says when it is in the script's ``keys=[...]``. Code in
``services/common`` counts for every service that imports the function or class that touches the key
(through the other common functions it calls). Then: a key touched by two services is in the table; every
service that touches a listed key is a writer or reader of it, every writer found writes it, and the table
holds no writer or reader the code does not have. The records' models read what was written before.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from services.contracts.flows import FLOWS
from services.contracts.keys import ANY_SERVICE, KEYS, SCRIPTS
from services.contracts.records import GroupState, LedgerEntry, SkipRecord, TrainLogRecord, Verdict
from services.contracts.streams import Streams

SERVICES = Path(__file__).resolve().parents[2] / "services"
HELPERS = {n for n in vars(Streams) if not n.startswith("_")} - set(FLOWS) - {"key", "name_of"}
WRITES = {"set", "setnx", "hset", "hsetnx", "hdel", "hincrby", "incr", "incrby", "decr", "rpush", "lpush", "ltrim",
          "lrem", "sadd", "srem", "zadd", "zrem", "zremrangebyscore", "delete", "expire", "getdel"}
READS = {"get", "hget", "hgetall", "hmget", "hkeys", "hlen", "hexists", "lrange", "lindex", "llen", "smembers",
         "smismember", "sismember", "scard", "zrangebyscore", "zscore", "zmscore", "zrange", "zcard", "exists"}
Access = tuple[str, str]  # (key, "touch" | "read" | "write")


def constants() -> dict[str, str]:
    """Module-level string constants of services/ (``SERVICE_STARTS = "service_starts"``)."""
    out = {}
    for path in SERVICES.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value,
                                                                                                 str):
                out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


CONSTANTS = constants()


def on_streams(node: ast.AST) -> bool:
    """A ``Streams`` object, for ``.key(name)``: ``s``, ``streams``, ``x.streams`` or ``Streams(run)``."""
    return ((isinstance(node, ast.Name) and node.id in ("s", "streams")) or
            (isinstance(node, ast.Attribute) and node.attr == "streams") or
            (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Streams"))


def key_of(node: ast.AST) -> str | None:
    """The key a helper call names (``done_set``, ``key:coord:run``; f-string fields become ``X``); "" for
    ``streams.key("")`` (the run's prefix, no key); None for anything else."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
        return None
    if node.func.attr in HELPERS:  # whatever holds the Streams (the names are the key's own)
        return node.func.attr
    if node.func.attr != "key" or len(node.args) != 1 or not on_streams(node.func.value):
        return None  # another object's ``key`` method (the ledger's ``self.key(agent)``)
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return f"key:{arg.value}" if arg.value else ""
    if isinstance(arg, ast.Name) and arg.id in CONSTANTS:
        return f"key:{CONSTANTS[arg.id]}"
    if isinstance(arg, ast.JoinedStr):
        return "key:" + "".join(v.value if isinstance(v, ast.Constant) else "X" for v in arg.values)
    return f"unreadable key {ast.unparse(node)}"


class Module:
    """One file's key accesses per top-level symbol, and the common names it imports."""

    def __init__(self, path: Path) -> None:
        self.path, self.tree = path, ast.parse(path.read_text())
        self.attrs: dict[str, str] = {}  # self.X = <key>
        self.methods: dict[str, str] = {}  # def X(...): return <key>
        self.scripts: dict[str, str] = {}  # self.X = redis.register_script(NAME)
        self.imports: dict[str, str] = {}  # name -> services.common module it comes from
        self.access: dict[str, set[Access]] = defaultdict(set)  # symbol -> accesses
        self.problems: list[str] = []
        self._index()
        for symbol in self.tree.body:
            name = getattr(symbol, "name", "<module>")
            for fn in [symbol] if not isinstance(symbol, ast.ClassDef) else symbol.body:
                self._scan(name, fn)

    def _index(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("services.common."):
                self.imports.update({a.asname or a.name: node.module for a in node.names})
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0],
                                                                                       ast.Attribute):
                if (k := key_of(node.value)) is not None:
                    self.attrs[node.targets[0].attr] = k
                elif (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
                      and node.value.func.attr == "register_script" and isinstance(node.value.args[0], ast.Name)):
                    self.scripts[node.targets[0].attr] = node.value.args[0].id
            elif isinstance(node, ast.FunctionDef) and len(node.body) >= 1 and isinstance(node.body[-1], ast.Return):
                if node.body[-1].value is not None and (k := key_of(node.body[-1].value)) is not None:
                    self.methods[node.name] = k

    def _scan(self, symbol: str, fn: ast.AST) -> None:
        names: dict[str, str] = {}  # local name -> key
        lists: dict[str, ast.List] = {}  # local name -> the list assigned to it (a script's keys)
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                pairs = ([(node.targets[0], node.value)] if not isinstance(node.targets[0], ast.Tuple) else
                         list(zip(node.targets[0].elts, getattr(node.value, "elts", []), strict=False)))
                for target, value in pairs:
                    if isinstance(target, ast.Name) and (k := key_of(value)):
                        names[target.id] = k
                    elif isinstance(target, ast.Name) and isinstance(value, ast.List):
                        lists[target.id] = value
        for node in ast.walk(fn):
            if (k := key_of(node)) is not None and k:
                if k.startswith("unreadable"):
                    self.problems.append(f"{self.where(node)}: {k}")
                self.access[symbol].add((k, "touch"))
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            op = node.func.attr
            if node.args and op in WRITES | READS and (k := self.resolve(node.args[0], names)):
                self.access[symbol].add((k, "write" if op in WRITES else "read"))
            keys = next((kw.value for kw in node.keywords if kw.arg == "keys"), None)
            if keys is not None:
                self._script(symbol, node, lists.get(keys.id) if isinstance(keys, ast.Name) else keys, names)

    def _script(self, symbol: str, call: ast.Call, keys: ast.AST | None, names: dict[str, str]) -> None:
        script = SCRIPTS.get(self.scripts.get(call.func.attr, ""))  # type: ignore[attr-defined]
        got = [self.resolve(k, names) for k in keys.elts] if isinstance(keys, ast.List) else [None]
        if script is None:  # a script on keys of no run (the Tinker API's own) is none of the table's business
            if any(got) or not isinstance(keys, ast.List):
                self.problems.append(f"{self.where(call)}: a script call on run keys the key table does not declare")
            return
        if got != [k for k, _ in script.keys]:
            self.problems.append(f"{self.where(call)}: {script.name} called with KEYS {got}, declared {script.keys}")
        self.access[symbol].update(script.keys)

    def resolve(self, node: ast.AST, names: dict[str, str]) -> str | None:
        if (k := key_of(node)) is not None:
            return k or None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return self.attrs.get(node.attr)
        if isinstance(node, ast.Name):
            return names.get(node.id)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value,
                                                                                             ast.Name):
            return self.methods.get(node.func.attr) if node.func.value.id == "self" else None
        return None

    def where(self, node: ast.AST) -> str:
        return f"{self.path.relative_to(SERVICES.parent)}:{getattr(node, 'lineno', 0)}"

    def uses(self, symbol: ast.AST) -> set[str]:
        return {n.id for n in ast.walk(symbol) if isinstance(n, ast.Name)}


def accesses() -> tuple[dict[str, set[Access]], list[str]]:
    """Per service, the keys it touches, reads and writes (common code included); and what cannot be read."""
    modules = {p: Module(p) for p in sorted(SERVICES.rglob("*.py")) if "contracts" not in p.parts}
    common: dict[tuple[str, str], set[Access]] = {}  # (module, symbol) -> accesses, through what it calls
    deps: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for path, m in modules.items():
        parts = path.relative_to(SERVICES.parent).with_suffix("").parts
        mod = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if not mod.startswith("services.common."):
            continue
        local = {getattr(s, "name", "") for s in m.tree.body}
        for name in m.imports.keys() - local:  # a name a package re-exports is the one it imports
            common[(mod, name)], deps[(mod, name)] = set(), {(m.imports[name], name)}
        for s in m.tree.body:
            if name := getattr(s, "name", None):
                common[(mod, name)] = set(m.access.get(name, ()))
                deps[(mod, name)] = {(mod, u) for u in m.uses(s) & local if u != name} | {
                    (m.imports[u], u) for u in m.uses(s) if u in m.imports}
    changed = True
    while changed:
        changed = False
        for sym, ds in deps.items():
            before = len(common[sym])
            for d in ds:
                common[sym] |= common.get(d, set())
            changed |= len(common[sym]) != before
    out: dict[str, set[Access]] = defaultdict(set)
    problems = []
    for path, m in modules.items():
        problems += m.problems
        service = path.relative_to(SERVICES).parts[0]
        if service == "common":
            continue
        for acc in m.access.values():
            out[service] |= acc
        for name, mod in m.imports.items():
            out[service] |= common.get((mod, name), set())
    return out, problems


def test_every_shared_key_and_its_services_are_in_the_key_table() -> None:
    per_service, problems = accesses()
    assert not problems, f"key accesses the key-table test cannot read: {problems}"
    touched: dict[str, set[str]] = defaultdict(set)
    written: dict[str, set[str]] = defaultdict(set)
    for service, acc in per_service.items():
        for key, mode in acc:
            touched[key].add(service)
            if mode == "write":
                written[key].add(service)
    shared = {k for k, ss in touched.items() if len(ss) > 1}
    assert shared <= set(KEYS), f"keys two services touch, not in the key table: {sorted(shared - set(KEYS))}"
    for key, entry in KEYS.items():
        assert key in touched, f"{entry.name}: in the key table, touched by no service"
        if ANY_SERVICE not in entry.services:
            assert touched[key] <= set(entry.services), (
                f"{entry.name}: touched by {sorted(touched[key] - set(entry.services))}, not in the key table")
        if ANY_SERVICE not in entry.writers:
            assert written[key] <= set(entry.writers), (
                f"{entry.name}: written by {sorted(written[key] - set(entry.writers))}; the table's writers "
                f"are {entry.writers}")
        # and the table holds nothing the code does not do
        for w in set(entry.writers) - {ANY_SERVICE}:
            assert w in written[key], f"{entry.name}: the table says {w} writes it; the code does not"
        for r in set(entry.readers) - {ANY_SERVICE}:
            assert r in touched[key], f"{entry.name}: the table says {r} reads it; the code does not"
        assert entry.owner == ANY_SERVICE or entry.owner in entry.writers, entry


def test_the_scripts_touch_only_their_declared_keys() -> None:
    """Each declared script's Lua text uses exactly the KEYS its entry lists."""
    import re

    texts = {}
    for path in SERVICES.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id in SCRIPTS and isinstance(node.value, ast.Constant)):
                texts[node.targets[0].id] = (path.relative_to(SERVICES).parts[0], node.value.value)
    assert set(texts) == set(SCRIPTS)
    for name, (service, text) in texts.items():
        assert service == SCRIPTS[name].service, name
        used = {int(i) for i in re.findall(r"KEYS\[(\d+)\]", text)}
        assert used == set(range(1, len(SCRIPTS[name].keys) + 1)), (name, used)


def test_records_written_before_still_read() -> None:
    for raw in (b"kept", "dropped:zero reward variance", "dropped:", "abandoned:timeout: incomplete 5s after emission",
                "dropped:non-finite training step"):
        text = raw.decode() if isinstance(raw, bytes) else raw
        assert Verdict.parse(raw).encode() == text
    assert Verdict.parse("abandoned:a:b") == Verdict(state=GroupState.ABANDONED, reason="a:b")
    assert Verdict(state=GroupState.KEPT).encode() == "kept" and GroupState.KEPT == "kept"
    for entry in ('{"state": "playing", "at": 1.5, "index": 3}',
                  '{"state": "emitted", "at": 2.0, "reward": 0.5, "samples": ["s1", "s2"], "version": 4}',
                  '{"state": "emitted", "at": 2.0, "reward": 0.5, "samples": ["s1"]}',  # before versions were kept
                  '{"state": "abandoned", "at": 3.0, "reason": "run stopped"}'):
        assert LedgerEntry.parse(entry).dump() == entry
    log = ('{"version": 3, "batch_id": "b", "sample_ids": ["s"], "path": "/p", "checksum": "c", "signature": "x", '
           '"engines": ["e"], "min_weight_version": 2, "metrics": {"loss": 0.5, "version": 3, "batch_step": 3}}')
    rec = TrainLogRecord.parse(log)
    assert (rec.weight_version, rec.batch_weight_version, rec.metrics) == (3, 3, {"loss": 0.5})
    assert rec.dump() == log
    bare = TrainLogRecord.parse('{"version": 1, "batch_id": "b1", "sample_ids": [], "path": "/p", "checksum": "c"}')
    assert bare.metrics is None and bare.signature == "" and bare.weight_version == 1
    skip = ('{"batch_id": "b", "batch_step": 2, "reason": "nan", "sample_ids": ["s"], "group_ids": ["g"], '
            '"consecutive": 1, "version": 1}')
    assert SkipRecord.parse(skip).dump() == skip and SkipRecord.parse(skip).batch_weight_version == 2
