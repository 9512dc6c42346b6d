"""Read everything Redis holds about some identifiers, normalized so two workers' writes compare.

``snapshot(connection, {job_id: "<job>", queue_name: "<queue>", worker_name: "<worker>"})``
SCANs the whole database (use one that only the test writes to) and keeps

* every key whose name mentions an identifier, whole;
* every other set, sorted set, list or hash (``rq:workers``, ``rq:queues``...) that mentions
  one in a member or field, with only those members or fields.

Key names, members and values have identifiers replaced by their placeholders; execution ids
are found from RQ's execution records (``rq:execution:<job>:<id>``, ``rq:executions:<job>``,
``<job>:<id>`` registry members, the results stream's ``execution_id``) and become ``<exec>``
(``<exec1>``, ``<exec2>``... oldest first when one job has several). Values become classes
(:mod:`tests.rqcontract.classify`), TTLs and scores become durations named by ``durations``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import redis

from tests.rqcontract.classify import Identifiers, Value, classify, score_class, ttl_class

_EXECUTION_KEY = re.compile(r".*:execution:(?P<job>.+?):(?P<exec>[^:]+)")
_EXECUTIONS_KEY = re.compile(r".*:executions:(?P<job>.+)")
_RESULTS_KEY = re.compile(r".*:results:(?P<job>.+)")
# Sets, sorted sets and lists larger than this are read only when their name mentions an identifier.
_GLOBAL_KEY_LIMIT = 10_000


@dataclass(frozen=True)
class Record:
    """One key, normalized. Only the part that belongs to its type is filled in."""

    type: str
    ttl: str
    fields: dict[str, Value] = field(default_factory=dict)  # hash
    members: tuple[str, ...] = ()  # set (sorted), list (in order)
    scores: dict[str, str] = field(default_factory=dict)  # sorted set: member -> score class
    entries: tuple[dict[str, Value], ...] = ()  # stream, oldest first
    value: Value | None = None  # string
    partial: bool = False  # a key without an identifier in its name: only the matching parts

    def to_json(self) -> dict[str, Any]:
        return {
            "type": self.type, "ttl": self.ttl, "partial": self.partial,
            "fields": {k: str(v) for k, v in self.fields.items()}, "members": list(self.members),
            "scores": self.scores, "entries": [{k: str(v) for k, v in e.items()} for e in self.entries],
            "value": None if self.value is None else str(self.value),
        }  # fmt: skip

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Record:
        return cls(
            type=data["type"], ttl=data["ttl"], partial=data["partial"],
            fields={k: Value.parse(v) for k, v in data["fields"].items()}, members=tuple(data["members"]),
            scores=dict(data["scores"]),
            entries=tuple({k: Value.parse(v) for k, v in e.items()} for e in data["entries"]),
            value=None if data["value"] is None else Value.parse(data["value"]),
        )  # fmt: skip

    def lines(self) -> list[str]:
        head = f"{self.type} ttl={self.ttl}" + (" (matching parts only)" if self.partial else "")
        body = [f"  {k} = {v}" for k, v in sorted(self.fields.items())]
        body += [f"  member {m}" for m in self.members]
        body += [f"  member {m} score {s}" for m, s in self.scores.items()]
        for n, entry in enumerate(self.entries):
            body += [f"  entry {n} {k} = {v}" for k, v in entry.items()]
        if self.value is not None:
            body.append(f"  value = {self.value}")
        return [head, *body]


@dataclass
class Snapshot:
    """Normalized keys (``rq:job:<job>`` -> :class:`Record`) and the identifiers that were replaced."""

    records: dict[str, Record]
    ids: dict[str, str]

    def __getitem__(self, key: str) -> Record:
        return self.records[key]

    def __contains__(self, key: object) -> bool:
        return key in self.records

    def select(self, keep: Callable[[str], bool]) -> Snapshot:
        return Snapshot({k: r for k, r in self.records.items() if keep(k)}, self.ids)

    def without(self, *patterns: str) -> Snapshot:
        """Drop keys matching any fnmatch pattern, e.g. ortq's own ``ortq:*`` keys."""
        return self.select(lambda key: not any(fnmatchcase(key, p) for p in patterns))

    def render(self) -> str:
        out: list[str] = []
        for key in sorted(self.records):
            head, *body = self.records[key].lines()
            out += [f"{key}: {head}", *body]
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        return {"records": {k: r.to_json() for k, r in self.records.items()}, "ids": self.ids}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Snapshot:
        return cls({k: Record.from_json(r) for k, r in data["records"].items()}, dict(data["ids"]))


def _bytes(raw: object) -> bytes:
    """A reply as bytes, whether or not the client decodes responses."""
    if isinstance(raw, bytes):
        return raw
    return str(raw).encode("utf-8")


def _text(raw: object) -> str:
    return _bytes(raw).decode("utf-8", "backslashreplace")


# Typed readers over redis-py's loosely typed replies.
def _type(connection: redis.Redis, key: str) -> str:
    return _text(connection.type(key))


def _hash(connection: redis.Redis, key: str) -> dict[bytes, bytes]:
    reply: Any = connection.hgetall(key)
    return {_bytes(k): _bytes(v) for k, v in reply.items()}


def _members(connection: redis.Redis, key: str, kind: str) -> list[bytes]:
    reply: Any = connection.smembers(key) if kind == "set" else connection.lrange(key, 0, -1)
    return [_bytes(m) for m in reply]


def _zset(connection: redis.Redis, key: str) -> list[tuple[bytes, float]]:
    reply: Any = connection.zrange(key, 0, -1, withscores=True)
    return [(_bytes(m), float(s)) for m, s in reply]


def _stream(connection: redis.Redis, key: str) -> list[tuple[str, dict[bytes, bytes]]]:
    reply: Any = connection.xrange(key)
    return [(_text(i), {_bytes(k): _bytes(v) for k, v in entry.items()}) for i, entry in reply]


def _execution_ids(connection: redis.Redis, keys: list[str], job_ids: Iterable[str]) -> dict[str, str]:
    """Execution id -> placeholder, numbered per job by first sighting (oldest first)."""
    jobs = set(job_ids)
    seen: dict[str, tuple[str, float]] = {}  # exec id -> (job id, time first seen)
    for key in keys:
        for job, exec_id, when in _sightings(connection, key):
            if job in jobs and exec_id and (exec_id not in seen or when < seen[exec_id][1]):
                seen[exec_id] = (job, when)
    return _numbered(seen)


#: A sighting of an execution: (job id, execution id, when it was made, inf where unknown).
Sighting = tuple[str, str, float]


def _sightings(connection: redis.Redis, key: str) -> Iterator[Sighting]:
    """The executions ``key`` shows: in its name (an execution hash: made at its ``created_at``), in
    its entries (a results stream: at each entry's time), in its members (``<job>:<exec>``, or the
    execution ids of an executions index)."""
    kind = _type(connection, key)
    if m := _EXECUTION_KEY.fullmatch(key):
        yield m["job"], m["exec"], _created_at(connection, key, kind)
    if (m := _RESULTS_KEY.fullmatch(key)) and kind == "stream":
        for entry_id, entry in _stream(connection, key):
            if raw_exec := entry.get(b"execution_id"):
                yield m["job"], _text(raw_exec), int(entry_id.split("-")[0]) / 1000
    if kind in ("set", "zset"):
        yield from _member_sightings(connection, key, kind)


def _created_at(connection: redis.Redis, key: str, kind: str) -> float:
    """An execution hash's ``created_at`` (epoch seconds); inf where it has none that reads."""
    created = _hash(connection, key).get(b"created_at") if kind == "hash" else None
    try:
        return float(created) if created else float("inf")
    except ValueError:
        return float("inf")


def _member_sightings(connection: redis.Redis, key: str, kind: str) -> Iterator[Sighting]:
    """The executions a set or sorted set names: members ``<job>:<exec>`` (a registry), and every
    member of an executions index (``...:executions:<job>``), all at an unknown time."""
    members = _members(connection, key, kind) if kind == "set" else [m for m, _ in _zset(connection, key)]
    executions_of = m["job"] if (m := _EXECUTIONS_KEY.fullmatch(key)) and kind == "zset" else None
    for member in members:
        if executions_of is not None:
            yield executions_of, _text(member), float("inf")
        job, colon, exec_id = _text(member).rpartition(":")
        if colon:
            yield job, exec_id, float("inf")


def _numbered(seen: Mapping[str, tuple[str, float]]) -> dict[str, str]:
    """Execution id -> placeholder: ``<exec>`` for a job's only one, else ``<exec1>``, ``<exec2>``...
    in the order they were first seen."""
    per_job: dict[str, list[tuple[float, str]]] = {}
    for exec_id, (job, when) in seen.items():
        per_job.setdefault(job, []).append((when, exec_id))
    names: dict[str, str] = {}
    for sightings in per_job.values():
        ordered = [exec_id for _, exec_id in sorted(sightings)]
        for n, exec_id in enumerate(ordered, 1):
            names[exec_id] = "<exec>" if len(ordered) == 1 else f"<exec{n}>"
    return names


def _read(connection: redis.Redis, key: str, kind: str, ids: Identifiers, now: float, whole: bool,
          durations: Mapping[str, int]) -> Record | None:  # fmt: skip
    ttl = ttl_class(int(connection.ttl(key)), durations)
    if kind == "hash":
        fields: dict[str, Value] = {}
        for raw_name, raw_value in _hash(connection, key).items():
            name = _text(raw_name)
            if whole or ids.mentioned_in(name) or ids.mentioned_in(_text(raw_value)):
                fields[ids.replace(name)] = classify(raw_value, ids, name)
        return Record(kind, ttl, fields=fields, partial=not whole) if fields else None
    if kind in ("set", "list"):
        texts = [_text(m) for m in _members(connection, key, kind)]
        members = [ids.replace(t) for t in texts if whole or ids.mentioned_in(t)]
        if kind == "set":
            members.sort()
        return Record(kind, ttl, members=tuple(members), partial=not whole) if members or whole else None
    if kind == "zset":
        scores = {
            ids.replace(_text(m)): score_class(s, now, durations)
            for m, s in _zset(connection, key)
            if whole or ids.mentioned_in(_text(m))
        }
        return Record(kind, ttl, scores=scores, partial=not whole) if scores or whole else None
    if kind == "stream" and whole:
        entries = tuple(
            {ids.replace(_text(k)): classify(v, ids, _text(k), stream=True) for k, v in entry.items()}
            for _, entry in _stream(connection, key)
        )
        return Record(kind, ttl, entries=entries)
    if kind == "string":
        raw = _bytes(connection.get(key) or b"")
        if whole or ids.mentioned_in(_text(raw)):
            return Record(kind, ttl, value=classify(raw, ids), partial=not whole)
    return None


def _size(connection: redis.Redis, key: str, kind: str) -> int:
    sizes = {"set": connection.scard, "zset": connection.zcard, "list": connection.llen, "hash": connection.hlen}
    return int(sizes[kind](key)) if kind in sizes else 0


def snapshot(connection: redis.Redis, ids: Mapping[str, str], durations: Mapping[str, int] | None = None) -> Snapshot:
    """Everything ``connection``'s database holds about ``ids`` (identifier -> placeholder)."""
    names = Identifiers(ids)
    now = time.time()
    all_keys = sorted(_text(k) for k in connection.scan_iter(count=1000))
    mentioning = [k for k in all_keys if names.mentioned_in(k)]
    job_ids = [i for i, placeholder in ids.items() if placeholder.startswith("<job")]
    executions = _execution_ids(connection, mentioning, job_ids)
    names = names.with_more(executions)
    records: dict[str, Record] = {}
    for key in all_keys:
        whole = names.mentioned_in(key)
        kind = _type(connection, key)
        if kind == "none" or (not whole and _size(connection, key, kind) > _GLOBAL_KEY_LIMIT):
            continue
        record = _read(connection, key, kind, names, now, whole, durations or {})
        if record is not None:
            records[names.replace(key)] = record
    return Snapshot(records, names.ids)


def diff(ours: Snapshot, theirs: Snapshot, allowed: Mapping[str, str] | None = None, *,
         report_unused: bool = True) -> list[str]:  # fmt: skip
    """Every difference between two snapshots, one readable line each; [] when they agree.

    Each line starts with its location: ``<key>`` (present on one side only), ``<key> type``,
    ``<key> ttl``, ``<key> field <name>``, ``<key> member <m>``, ``<key> score <m>``,
    ``<key> entries``, ``<key> entry <n> field <name>``, ``<key> value``. ``allowed`` maps fnmatch
    patterns over locations to the reason the difference is intended; matching differences are
    dropped, and (with ``report_unused``) a pattern that matched nothing is reported, so that an
    allowance cannot outlive its reason.
    """
    found: list[tuple[str, str]] = []
    for key in sorted(ours.records.keys() | theirs.records.keys()):
        a, b = ours.records.get(key), theirs.records.get(key)
        if a is None or b is None:
            present = a or b
            assert present is not None
            found.append((key, f"only in {'ours' if a else 'theirs'}: {'; '.join(x.strip() for x in present.lines())}"))
            continue
        found += _record_differences(key, a, b)
    return _not_allowed(found, allowed or {}, report_unused)


def _record_differences(key: str, a: Record, b: Record) -> list[tuple[str, str]]:
    """(location, what differs) for each difference between ``key``'s two records: its type (and
    then nothing else), ttl, fields, members, scores, stream entries, value."""
    found: list[tuple[str, str]] = []

    def differ(location: str, a: object, b: object) -> None:
        if a != b:
            found.append((location, f"ours {a}, theirs {b}"))

    differ(f"{key} type", a.type, b.type)
    if a.type != b.type:
        return found
    differ(f"{key} ttl", a.ttl, b.ttl)
    _compare_maps(f"{key} field", a.fields, b.fields, differ)
    if a.type == "list":
        differ(f"{key} members", list(a.members), list(b.members))
    else:
        for member in sorted(set(a.members) ^ set(b.members)):
            found.append((f"{key} member {member}", f"only in {'ours' if member in a.members else 'theirs'}"))
    for member in sorted(a.scores.keys() - b.scores.keys()):
        found.append((f"{key} member {member}", f"only in ours (score {a.scores[member]})"))
    for member in sorted(b.scores.keys() - a.scores.keys()):
        found.append((f"{key} member {member}", f"only in theirs (score {b.scores[member]})"))
    for member in sorted(a.scores.keys() & b.scores.keys()):
        differ(f"{key} score {member}", a.scores[member], b.scores[member])
    differ(f"{key} entries", len(a.entries), len(b.entries))
    for n, (entry_a, entry_b) in enumerate(zip(a.entries, b.entries, strict=False)):
        _compare_maps(f"{key} entry {n} field", entry_a, entry_b, differ)
    differ(f"{key} value", a.value, b.value)
    return found


def _not_allowed(found: list[tuple[str, str]], allowed: Mapping[str, str], report_unused: bool) -> list[str]:
    """The lines of the differences ``found`` that no pattern of ``allowed`` matches, then (with
    ``report_unused``) one for each pattern that matched none."""
    used: set[str] = set()
    lines = []
    for location, text in found:
        matching = [p for p in allowed if fnmatchcase(location, p)]
        used.update(matching)
        if not matching:
            lines.append(f"{location}: {text}")
    if report_unused:
        lines += [f"allowed but not found: {p!r} ({allowed[p]})" for p in allowed if p not in used]
    return lines


def _compare_maps(prefix: str, a: Mapping[str, Value], b: Mapping[str, Value],
                  differ: Callable[[str, object, object], None]) -> None:  # fmt: skip
    for name in sorted(a.keys() | b.keys()):
        differ(f"{prefix} {name}", a.get(name, "absent"), b.get(name, "absent"))


def dumps(snapshots: Mapping[str, Mapping[str, Snapshot]]) -> str:
    """Scenario -> stage -> snapshot as JSON, to compare runs made in different venvs."""
    return json.dumps({s: {t: snap.to_json() for t, snap in st.items()} for s, st in snapshots.items()}, indent=1)


def loads(text: str) -> dict[str, dict[str, Snapshot]]:
    data = json.loads(text)
    return {s: {t: Snapshot.from_json(snap) for t, snap in st.items()} for s, st in data.items()}


def assert_same(ours: Snapshot, theirs: Snapshot, allowed: Mapping[str, str] | None = None) -> None:
    """Fail with every difference and both snapshots, unless ``diff`` finds none."""
    lines = diff(ours, theirs, allowed)
    if lines:
        raise AssertionError(
            f"{len(lines)} difference(s) from RQ's own writes:\n" + "\n".join(lines)
            + f"\n--- ours\n{ours.render()}\n--- theirs (RQ)\n{theirs.render()}"
        )  # fmt: skip
