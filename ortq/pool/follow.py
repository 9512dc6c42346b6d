"""Following the queues: which of a pool's elastic workers run, within each adapter's memory budget.

A ``[[model.workers]]`` group with ``max_workers`` (docs/pool.md, "Many models, one GPU") has that
many slots; the supervisor runs a slot only while :class:`Follower` wants it. Every
:data:`FOLLOW_SECONDS`, and whenever an elastic worker exits, the follower reads each model's queue
length, whether its started registry holds a job, and each running worker's RQ state
(:class:`QueueReader`). A model *waits* while it has queued jobs, or started ones and no worker
running (a stopped or killed worker's orphans, which only a worker of the model takes back). A
worker *serves* from the first look that finds it registered with RQ; before that it loads its
model. Then, in this order:

1. **Minimum**: a group below ``min_workers`` starts one, memory allowing.
2. **Idle**: a serving worker whose model has had no queued job and no busy worker for
   ``idle_seconds`` stops, unless that takes its group below ``min_workers``.
3. **Waiting models**, those with no worker first, then the one waiting longest: a waiting model
   with fewer workers than ``max_workers`` starts one if its adapter's budget has room. If not,
   it makes room: a worker of another model on that adapter, above its minimum, that has served
   at least ``min_residency_seconds`` is stopped, the one idle longest first; a busy one only for
   a model that has no worker at all (of the model with the most workers, then the longest
   running). A worker still loading is never stopped. The room made is kept for the model it was
   made for, and no second worker is stopped for it while the first is stopping. A stopped worker
   hands back what it took ahead and finishes its run (SIGTERM); the waiting model starts once
   that worker has exited.

So a model with waiting jobs and no worker gets one within ``min_residency_seconds`` plus the run
its victim is in, its exit and one model load, whatever the other models' load; a worker is never
stopped for another before it served ``min_residency_seconds``, so the pool does not thrash. The
decisions are a pure function of what was read and the clock (:meth:`Follower.decide`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ortq import keys
from ortq.rqcompat import layout

log = logging.getLogger("ortq.pool")

#: How often the follower reads the queues and decides.
FOLLOW_SECONDS = 1.0


@dataclass(frozen=True)
class Elastic:
    """What the follower knows of one elastic slot (a worker of a ``max_workers`` group)."""

    model: str
    #: The group's position in the plan: its slots share min, max and idle.
    group: int
    #: The adapter whose budget the worker counts against (a plan label) and that budget in bytes
    #: (None: no budget; max_workers alone bounds the group).
    adapter: str
    budget_bytes: int | None
    #: One worker's memory on the adapter (the plan's estimate).
    worker_bytes: int
    min_workers: int
    max_workers: int
    idle_seconds: float
    min_residency_seconds: float


class SlotState(Enum):
    OFF = "off"
    RUNNING = "running"  # starting or serving
    STOPPING = "stopping"  # asked to stop, not exited yet: its memory is still held


@dataclass(frozen=True)
class SlotView:
    """One elastic slot as the supervisor sees it now."""

    number: int
    spec: Elastic
    state: SlotState
    #: Monotonic time the running worker started; 0 when off.
    started_at: float = 0.0
    #: Its worker's name (RQ's worker hash), for its state; "" when off.
    worker_name: str = ""
    #: The restart policy gave up on it (exit 2 too often): never started again.
    given_up: bool = False


@dataclass(frozen=True)
class QueueState:
    """What was read of one model: its queued jobs (None: the read failed), its busy workers'
    names, and whether its started registry holds any job."""

    queued: int | None
    busy: frozenset[str] = frozenset()
    started: bool = False
    #: The pool's workers of it that have registered with RQ (their hash has a state): serving,
    #: no longer loading their model.
    ready: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Action:
    """Start or stop slot ``number``, and why (the pool's log line); ``evicts``: a stop that makes
    room for another model."""

    start: bool
    number: int
    why: str
    evicts: bool = False


@dataclass
class _Model:
    #: Monotonic time the model last had a queued job or a busy worker (its start, before any).
    active_at: float
    #: Since when it has waited (module docstring; None: it does not).
    waiting_since: float | None = None


@dataclass
class Follower:
    """The decisions, with what it remembers between ticks: when each model was last active and
    since when it has waited, when each worker was first seen serving, and for which model room
    is being made on an adapter (no other model takes that room)."""

    models: dict[str, _Model] = field(default_factory=dict)
    ready_at: dict[str, float] = field(default_factory=dict)
    reserved: dict[str, str] = field(default_factory=dict)

    def decide(self, now: float, slots: Sequence[SlotView], queues: Mapping[str, QueueState]) -> list[Action]:
        """What to start and stop now (module docstring), from ``slots`` and what was read."""
        self._remember(now, slots, queues)
        plan = _Tick(now, list(slots), queues, self)
        plan.minimum()
        plan.idle()
        plan.waiting()
        return plan.actions

    def _remember(self, now: float, slots: Sequence[SlotView], queues: Mapping[str, QueueState]) -> None:
        """What this read changes in what is remembered between ticks."""
        running = [s for s in slots if s.state is SlotState.RUNNING]
        names = {s.worker_name for s in running}
        self.ready_at = {name: at for name, at in self.ready_at.items() if name in names}
        for read in queues.values():
            for name in read.ready & names:
                self.ready_at.setdefault(name, now)
        for view in slots:
            model = self.models.setdefault(view.spec.model, _Model(now))
            queue = queues.get(view.spec.model)
            if queue is not None and queue.queued is not None:
                mine = [s for s in running if s.spec.model == view.spec.model]
                busy = any(s.worker_name in queue.busy for s in mine)
                if queue.queued > 0 or busy:
                    model.active_at = now
                # Started jobs with no worker of the pool running: a stopped or killed worker's
                # orphans (or another host's jobs), which only a worker of the model takes back.
                if queue.queued > 0 or (queue.started and not mine):
                    model.waiting_since = model.waiting_since if model.waiting_since is not None else now
                else:
                    model.waiting_since = None
        for adapter, waiting in list(self.reserved.items()):
            if self.models[waiting].waiting_since is None:
                del self.reserved[adapter]  # it waits no more: the room is anyone's


class _Tick:
    """One tick's decisions, each applied to the views as it is made (a started slot counts at once)."""

    def __init__(self, now: float, slots: list[SlotView], queues: Mapping[str, QueueState], follower: Follower) -> None:
        self.now, self.slots, self.queues = now, slots, queues
        self.models, self.ready_at, self.reserved = follower.models, follower.ready_at, follower.reserved
        self.actions: list[Action] = []

    def _served(self, view: SlotView) -> float | None:
        """How long the worker has served (since RQ first showed it); None while it loads."""
        at = self.ready_at.get(view.worker_name)
        return None if at is None else self.now - at

    def _set(self, view: SlotView, state: SlotState, why: str, evicts: bool = False) -> None:
        self.slots[self.slots.index(view)] = SlotView(view.number, view.spec, state, self.now, view.worker_name)
        self.actions.append(Action(state is SlotState.RUNNING, view.number, why, evicts))

    def _live(self, group: int | None = None, model: str | None = None) -> list[SlotView]:
        return [
            s
            for s in self.slots
            if s.state is SlotState.RUNNING
            and (group is None or s.spec.group == group)
            and (model is None or s.spec.model == model)
        ]

    def _used(self, adapter: str) -> int:
        held = [s for s in self.slots if s.spec.adapter == adapter and s.state is not SlotState.OFF]
        return sum(s.spec.worker_bytes for s in held)

    def _room(self, spec: Elastic) -> bool:
        return spec.budget_bytes is None or self._used(spec.adapter) + spec.worker_bytes <= spec.budget_bytes

    def _off(self, group: int) -> SlotView | None:
        off = [s for s in self.slots if s.spec.group == group and s.state is SlotState.OFF and not s.given_up]
        return off[0] if off else None

    def _groups(self) -> dict[int, Elastic]:
        return {s.spec.group: s.spec for s in self.slots}

    def minimum(self) -> None:
        for group, spec in self._groups().items():
            if len(self._live(group)) < spec.min_workers and (off := self._off(group)) and self._room(spec):
                self._set(off, SlotState.RUNNING, f"{spec.model} keeps min_workers = {spec.min_workers}")

    def idle(self) -> None:
        for view in list(self._live()):
            served = self._served(view)
            if served is None or self._is_busy(view):  # loading, busy, or its queue unread
                continue
            spec, model = view.spec, self.models[view.spec.model]
            idle_for = min(self.now - model.active_at, served)
            if idle_for >= spec.idle_seconds and len(self._live(spec.group)) > spec.min_workers:
                self._set(view, SlotState.STOPPING, f"{spec.model} had no job for {idle_for:.0f} s (idle_seconds)")

    def waiting(self) -> None:
        # A model with no worker first (so the room made for it is not taken by one that has a
        # worker), then the one waiting longest.
        waiting = sorted(
            (bool(self._live(model=name)), m.waiting_since, name)
            for name, m in self.models.items()
            if m.waiting_since is not None
        )
        for _, _, name in waiting:
            groups = [spec for spec in self._groups().values() if spec.model == name]
            if len(self._live(model=name)) >= sum(g.max_workers for g in groups):
                continue
            for spec in groups:
                off = self._off(spec.group)
                if off is None:
                    continue
                if self.reserved.get(spec.adapter, name) != name:
                    break  # room is being made there for another model: it goes first
                if self._room(spec):
                    self.reserved.pop(spec.adapter, None)
                    self._set(off, SlotState.RUNNING, f"{name} has waiting jobs")
                elif not self._freeing(spec) and self._make_room(spec, starving=not self._live(model=name)):
                    self.reserved[spec.adapter] = name
                break

    def _freeing(self, spec: Elastic) -> bool:
        """Whether workers already stopping on the adapter free enough for one of ``spec``'s."""
        stopping = sum(
            s.spec.worker_bytes for s in self.slots if s.spec.adapter == spec.adapter and s.state is SlotState.STOPPING
        )
        assert spec.budget_bytes is not None  # _room said no
        return self._used(spec.adapter) - stopping + spec.worker_bytes <= spec.budget_bytes

    def _make_room(self, spec: Elastic, starving: bool) -> bool:
        """Stop one worker of another model on ``spec``'s adapter (module docstring, rule 3); False
        when none may be stopped yet. A worker still loading its model is never taken."""
        candidates = [
            s
            for s in self._live()
            if s.spec.adapter == spec.adapter
            and s.spec.model != spec.model
            and len(self._live(s.spec.group)) > s.spec.min_workers
            and (served := self._served(s)) is not None
            and served >= s.spec.min_residency_seconds
        ]
        idle = [s for s in candidates if not self._is_busy(s)]
        victim: SlotView | None = None
        if idle:
            victim = min(idle, key=lambda s: max(self.models[s.spec.model].active_at, s.started_at))
            why = "idle longest"
        elif starving and candidates:
            victim = min(candidates, key=lambda s: (-len(self._live(model=s.spec.model)), s.started_at))
            why = f"served {self._served(victim) or 0:.0f} s, past min_residency_seconds"
        if victim is None:
            return False
        why = f"making room for {spec.model} (waiting jobs): {victim.spec.model} {why}"
        self._set(victim, SlotState.STOPPING, why, evicts=True)
        return True

    def _is_busy(self, view: SlotView) -> bool:
        queue = self.queues.get(view.spec.model)
        if queue is None or queue.queued is None:
            return True  # unknown: not taken for idle
        return queue.queued > 0 or view.worker_name in queue.busy


class QueueReader:
    """Reads what the follower decides on: per model the length of its queue and of its
    intermediate list (taken by a BLMOVE, not yet started), whether its started registry holds a
    job, and which of the pool's workers of it are busy (RQ's worker hash ``state``), one pipeline
    per Redis; with the workers' own credentials (``+llen +zrange +hget`` are in the worker rule,
    docs/security.md)."""

    def __init__(self, connect: Callable[[str], Any], url_for: Callable[[str], str]) -> None:
        self._connect, self._url_for = connect, url_for
        self._connections: dict[str, Any] = {}
        self._failing: set[str] = set()

    def read(self, workers: Mapping[str, Sequence[str]]) -> dict[str, QueueState]:
        """``workers``: model -> the names of its running workers."""
        by_url: dict[str, list[str]] = {}
        for model in workers:
            by_url.setdefault(self._url_for(model), []).append(model)
        states: dict[str, QueueState] = {}
        for url, models in by_url.items():
            try:
                connection = self._connections.get(url) or self._connections.setdefault(url, self._connect(url))
                pipe = connection.pipeline(transaction=False)
                for model in models:
                    queue = layout.QueueKeys.of(keys.queue_name(model))
                    pipe.llen(queue.queue)
                    # A job a worker's BLMOVE moved there and that worker never started (killed
                    # in between): it waits for a worker of the model to put it back (rescue.lua).
                    pipe.llen(queue.intermediate)
                    pipe.zrange(queue.started, 0, 0)
                    for name in workers[model]:
                        pipe.hget(layout.worker_key(name), "state")
                replies = iter(pipe.execute())
                for model in models:
                    queued, started = int(next(replies)) + int(next(replies)), bool(next(replies))
                    state = {name: keys.as_text(value) for name in workers[model] if (value := next(replies))}
                    busy = frozenset(name for name, value in state.items() if value == "busy")
                    states[model] = QueueState(queued, busy, started, frozenset(state))
                self._failing.discard(url)
            except Exception as exc:  # Redis down or refusing: decide nothing for these models
                if url not in self._failing:
                    names = ", ".join(models)
                    log.warning("cannot read the queues of %s (%s): their workers stay as they are", names, exc)
                    self._failing.add(url)
                states.update((model, QueueState(None)) for model in models)
        return states
