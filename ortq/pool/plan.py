"""Planning a pool: which adapter each worker gets, what it will cost, and the command that starts it.

Every adapter spec is resolved once, against one fresh enumeration, to one concrete adapter; the
worker is then started with that adapter's *stable* spec (``uuid:GPU-...`` for CUDA, ``luid:0x...``
for DirectML) rather than with the index or the pool.toml spec. ``ortq worker`` resolves its
``--adapter`` again against its own fresh enumeration (docs/adapters.md), so a restart after the
order changed (a GPU reset or hot-plugged, a driver update) still lands on the same physical GPU,
or refuses to start (exit 2) if it is gone, instead of quietly taking whichever GPU now has that
index. CUDA_VISIBLE_DEVICES is not used to pin a worker: it renumbers the devices under that one
process, so its record, its logs and `ortq adapters` would all speak of "device 0" for every GPU.

Memory: see :func:`estimate`; docs/pool.md lists the factors and what is measured.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ortq.devices.adapters import Adapter
from ortq.errors import AdapterNotFound, ConfigurationError
from ortq.pool.config import RESERVED_ENV, ModelConfig, PoolConfig, WorkerGroup, group_options
from ortq.pool.devices import PluginDevices, candidates, choose
from ortq.pool.follow import Elastic
from ortq.pool.measure import SessionFootprint, measure_session
from ortq.pool.tomltable import Env
from ortq.redisurls import redacted_url
from ortq.shards import ShardMap
from ortq.worker import options as worker_options

MiB = 1024**2
GiB = 1024**3

#: Without a measurement, a session is estimated at this many times the model file (the weights
#: once, plus about as much again for ONNX Runtime's arena and activations; a rough rule) ...
SESSION_FILE_FACTOR = 2
#: ... plus this much that any session allocates (~14 MiB measured for a 20 KB model on the CPU).
SESSION_FIXED_BYTES = 16 * MiB
#: What one worker process costs on its device before any session (estimated, never measured by the
#: plan): the CPU row is the interpreter + ortq + ONNX Runtime (~65 MiB measured with the CPU build on
#: Linux, rounded up); CUDA's is its context plus cuBLAS/cuDNN handles; DirectML's a D3D12 device;
#: WebGPU's and a plugin EP's their device (Dawn's, the EP's), estimated alike.
PROCESS_OVERHEAD_BYTES = {
    "cpu": 100 * MiB, "cuda": 512 * MiB, "dml": 256 * MiB, "webgpu": 256 * MiB, "plugin": 256 * MiB, "auto": 100 * MiB
}  # fmt: skip
_DEVICE = {"cpu": "process", "cuda": "CUDA context", "dml": "D3D12 device", "webgpu": "WebGPU device",
           "plugin": "EP device", "auto": "process"}  # fmt: skip
#: Above this share of an adapter's memory the plan warns; above 1.0 it refuses (unless --force).
WARN_FRACTION = 0.8

#: (model file, threads, max_batch, custom_ops) -> its CPU session's footprint, or why not measured.
Measure = Callable[[Path, int | None, int, str | None], SessionFootprint | str]


@dataclass(frozen=True)
class Estimate:
    """One worker's memory on its adapter, and how the number was obtained."""

    bytes: int
    #: "measured", "partly measured", "estimated" or "configured".
    kind: str
    #: Its parts, each marked measured or estimated.
    detail: str


@dataclass(frozen=True)
class Placement:
    """One ``[[model.workers]]`` group, resolved."""

    model: ModelConfig
    group: WorkerGroup
    #: The adapter its workers run on; None for provider "auto" (ONNX Runtime chooses).
    adapter: Adapter | None
    #: What the workers' --adapter gets (a stable spec); None for cpu / auto.
    adapter_arg: str | None
    estimate: Estimate


@dataclass(frozen=True)
class AdapterLoad:
    """All the pool's workers on one adapter against that adapter's memory (and budget)."""

    adapter: Adapter
    #: The most workers (every elastic group at max_workers) and their memory.
    workers: int
    total_bytes: int
    #: What the workers always running need (fixed counts, min_workers).
    least_bytes: int = 0
    #: The pool's budget on this adapter ([pool] memory_budget_*); None: none.
    budget_bytes: int | None = None

    @property
    def peak_bytes(self) -> int:
        """The most the workers may hold at once: all of them, or the budget where it is less."""
        return self.total_bytes if self.budget_bytes is None else min(self.total_bytes, self.budget_bytes)

    @property
    def fraction(self) -> float | None:
        """The share of the adapter's memory, where it is known. An integrated GPU's (or a software
        adapter's) memory is shared system memory, which DXGI's dedicated figure does not describe."""
        memory = self.adapter.memory_bytes
        if not memory or self.adapter.kind in ("integrated", "software"):
            return None
        return self.peak_bytes / memory

    @property
    def verdict(self) -> str:
        """ "ok", "high" (above WARN_FRACTION), "over" (above the adapter's memory) or "unknown"."""
        fraction = self.fraction
        if fraction is None:
            return "unknown"
        return "over" if fraction > 1 else "high" if fraction > WARN_FRACTION else "ok"


@dataclass(frozen=True)
class WorkerSlot:
    """One worker process the pool keeps running."""

    #: Position in the pool, 0-based in file order (its metrics port is base + number).
    number: int
    #: "<model>.<n>", n counting the model's workers from 0: log prefix, log file, worker name.
    label: str
    #: The command, without --worker-name (the supervisor adds one per start).
    argv: tuple[str, ...]
    #: Variables set on top of the pool's environment.
    env: Env
    burst: bool = False
    #: The worker's Redis (its ORTQ_REDIS_URL), where a stop command for it goes; None: the pool's.
    redis_url: str | None = None
    #: A slot of an elastic group (max_workers): run only while ortq.pool.follow wants it.
    elastic: Elastic | None = None


@dataclass(frozen=True)
class Plan:
    config: PoolConfig
    placements: tuple[Placement, ...]
    loads: tuple[AdapterLoad, ...]
    #: What could not be measured.
    notes: tuple[str, ...] = ()

    def warnings(self) -> list[str]:
        return [_load_message(load) for load in self.loads if load.verdict == "high"]

    def refusals(self) -> list[str]:
        return [_load_message(load) for load in self.loads if load.verdict == "over"]

    def budget_refusals(self) -> list[str]:
        """Budgets the plan cannot keep: the workers always running need more, or one worker of an
        elastic group needs more than all of it (it could never start). --force does not start these."""
        found = []
        for load in self.loads:
            budget = load.budget_bytes
            if budget is None:
                continue
            name = _adapter_name(load.adapter)
            if load.least_bytes > budget:
                found.append(
                    f"{name}: the workers always running (count, min_workers) need about {_size(load.least_bytes)}, "
                    f"more than its budget of {_size(budget)}"
                )
            for p in self.placements:
                if p.adapter == load.adapter and p.group.elastic and p.estimate.bytes > budget:
                    found.append(
                        f"{name}: one {p.model.name} worker needs about {_size(p.estimate.bytes)}, more than "
                        f"its budget of {_size(budget)}: it could never start"
                    )
        return found


def _load_message(load: AdapterLoad) -> str:
    memory = load.adapter.memory_bytes or 0
    return (
        f"{_adapter_name(load.adapter)}: {load.workers} worker{'s' if load.workers > 1 else ''} "
        f"need{'' if load.workers > 1 else 's'} about {_size(load.total_bytes)} "
        f"of its {_size(memory)} ({100 * (load.fraction or 0):.0f}%)"
    )


# --------------------------------------------------------------------------- resolution


def stable_spec(adapter: Adapter) -> str:
    """The --adapter spec that names this adapter whatever the enumeration order."""
    if adapter.uuid:
        return f"uuid:{adapter.uuid}"
    if adapter.luid:
        return f"luid:{adapter.luid}"
    return str(adapter.index)


def _where(config: PoolConfig, model: ModelConfig, number: int) -> str:
    return f"{config.source}: [[model]] {model.name!r} [[model.workers]] #{number}"


def resolve(
    config: PoolConfig, model: ModelConfig, number: int, adapters: Sequence[Adapter], notes: Sequence[str]
) -> tuple[Adapter | None, str | None]:
    """The adapter of group ``number`` (1-based) of ``model`` and the spec its workers get;
    ``adapters``: the model's candidates (ortq.pool.devices.candidates)."""
    group = model.groups[number - 1]
    if model.provider == "auto":
        return None, None
    if model.provider == "cpu":
        cpu = next((a for a in adapters if a.provider == "cpu"), None)
        return cpu or Adapter("cpu", None, "CPU", "cpu"), None
    # Without a spec: what the provider's workers take by default.
    shown = group.adapter or {"webgpu": "high-performance", "plugin": "the EP's first non-CPU device"}.get(
        model.provider, "0"
    )
    if not any(a.provider == model.provider for a in adapters):
        why = "; ".join(notes) or "none enumerated"
        raise AdapterNotFound(
            f"{_where(config, model, number)}: adapter {shown!r}: no {model.provider} adapters on this machine ({why})"
        )
    try:
        adapter = choose(model, group.adapter, adapters)
    except ConfigurationError as exc:  # AdapterNotFound, AmbiguousAdapter, a bad spec: keep the class
        raise type(exc)(f"{_where(config, model, number)}: adapter {shown!r}: {exc}") from None
    return adapter, stable_spec(adapter)


# --------------------------------------------------------------------------- memory


def estimate(model: ModelConfig, footprint: SessionFootprint | None) -> Estimate:
    """One worker's memory on its adapter.

    - ``memory_per_worker_mib`` in pool.toml: that, as configured.
    - CPU workers, measured: the measuring process's resident memory after its run (interpreter,
      ortq, ONNX Runtime, the session and one run's arena): all measured.
    - GPU workers, measured: the CPU session's growth (standing in for weights + arena on the
      device) plus the provider's per-process overhead (estimated).
    - Not measured: ``SESSION_FILE_FACTOR`` x the model file + ``SESSION_FIXED_BYTES``, plus the
      provider's per-process overhead, all estimated.
    """
    if model.memory_per_worker_bytes is not None:
        return Estimate(model.memory_per_worker_bytes, "configured", "memory_per_worker_mib in the pool config")
    overhead = PROCESS_OVERHEAD_BYTES[model.provider]
    device = _DEVICE[model.provider]
    if footprint is not None and model.provider in ("cpu", "auto"):
        return Estimate(
            footprint.baseline_bytes + footprint.session_bytes,
            "measured",
            f"process {_size(footprint.baseline_bytes)} + session {_size(footprint.session_bytes)}, measured",
        )
    if footprint is not None:
        return Estimate(
            overhead + footprint.session_bytes,
            "partly measured",
            f"session {_size(footprint.session_bytes)} measured on the CPU + {device} {_size(overhead)} estimated",
        )
    size = model.path.stat().st_size
    session = SESSION_FILE_FACTOR * size + SESSION_FIXED_BYTES
    return Estimate(
        overhead + session,
        "estimated",
        f"session {SESSION_FILE_FACTOR} x {_size(size)} file + {_size(SESSION_FIXED_BYTES)}"
        f" + {device} {_size(overhead)}, estimated",
    )


def _footprint(model: ModelConfig, config: PoolConfig, measure: Measure, notes: list[str]) -> SessionFootprint | None:
    if not config.measure_memory or model.memory_per_worker_bytes is not None:
        return None
    result = measure(model.path, model.threads, model.max_batch, model.custom_ops)
    if isinstance(result, SessionFootprint):
        return result
    if model.provider == "cpu":  # the worker would fail the same way
        raise ConfigurationError(f"{config.source}: [[model]] {model.name!r}: its CPU session failed: {result}")
    notes.append(f"{model.name}: not measured ({result}); estimated from the file size instead")
    return None


# --------------------------------------------------------------------------- the plan


def make_plan(
    config: PoolConfig,
    adapters: Sequence[Adapter],
    notes: Sequence[str] = (),
    measure: Measure = measure_session,
    plugins: PluginDevices | None = None,
) -> Plan:
    """Resolve every group against ``adapters`` (one fresh enumeration; ``plugins``: each plugin
    library's devices, ortq.pool.devices.enumerate_for) and estimate its memory.

    Raises ConfigurationError for a missing model file, an adapter spec that matches no adapter or
    several, and a CPU model whose session cannot be created.
    """
    # The enumeration's notes matter only where a provider had no adapters: resolve() then says them.
    found_notes: list[str] = []
    placements: list[Placement] = []
    cache: dict[tuple[Path, int | None, int, str | None], SessionFootprint | None] = {}
    for model in config.models:
        if not model.path.is_file():
            raise ConfigurationError(f"{config.source}: [[model]] {model.name!r}: path {model.path} is not a file")
        mine = candidates(model, adapters, plugins or {})
        resolved = [resolve(config, model, n, mine, notes) for n in range(1, len(model.groups) + 1)]
        key = (model.path, model.threads, model.max_batch, model.custom_ops)
        if key not in cache:
            cache[key] = _footprint(model, config, measure, found_notes)
        cost = estimate(model, cache[key])
        for group, (adapter, arg) in zip(model.groups, resolved, strict=True):
            placements.append(Placement(model, group, adapter, arg, cost))
    totals: dict[Adapter, tuple[int, int, int]] = {}
    for p in placements:
        if p.adapter is not None:
            workers, total, least = totals.get(p.adapter, (0, 0, 0))
            count, bytes_ = p.group.count, p.estimate.bytes
            totals[p.adapter] = (workers + count, total + count * bytes_, least + p.group.least * bytes_)
    loads = tuple(
        AdapterLoad(a, workers, total, least, budget_of(config, a)) for a, (workers, total, least) in totals.items()
    )
    return Plan(config, tuple(placements), loads, tuple(found_notes))


def budget_of(config: PoolConfig, adapter: Adapter) -> int | None:
    """``adapter``'s budget by ``[pool]`` memory_budget_mib or memory_budget_fraction (of its
    memory: the CPU's is the host's); None without either. A fraction of an adapter whose memory is
    not known is refused: the budget would be a guess."""
    if config.memory_budget_bytes is not None:
        return config.memory_budget_bytes
    if config.memory_budget_fraction is None:
        return None
    if not adapter.memory_bytes:
        raise ConfigurationError(
            f"{config.source}: [pool] memory_budget_fraction: the memory of {_adapter_name(adapter)} is not known; "
            "give memory_budget_mib instead"
        )
    return int(config.memory_budget_fraction * adapter.memory_bytes)


def worker_environment(base: Mapping[str, str]) -> dict[str, str]:
    """The pool's environment as a worker inherits it: without the ORTQ_* variables of the worker
    options the pool sets from its config (an ORTQ_ADAPTER in the operator's shell would otherwise
    reach CPU workers, which then refuse it)."""
    return {k: v for k, v in base.items() if not (k.startswith("ORTQ_") and k in RESERVED_ENV)}


def build_slots(plan: Plan, shards: ShardMap, verbose: bool = False) -> list[WorkerSlot]:
    """Every worker process of the plan, in file order, each on its model's Redis in ``shards``
    (:meth:`PoolConfig.shard_map`)."""
    config = plan.config
    slots: list[WorkerSlot] = []
    per_model: dict[str, int] = {}
    for group, p in enumerate(plan.placements):
        m = p.model
        # The Redis URL (which may carry a password) goes in the environment, not on the command line.
        redis_url = shards.url_for(m.name)
        env = {**dict(config.env), **dict(m.env), **dict(p.group.env), "ORTQ_REDIS_URL": redis_url}
        env["PYTHONUNBUFFERED"] = "1"  # the pool relays its workers' output line by line
        elastic = _elastic(plan, group, p)
        for _ in range(p.group.count):
            number = len(slots)
            port = config.metrics_port_base + number if config.metrics_port_base else 0
            n = per_model.get(m.name, 0)
            per_model[m.name] = n + 1
            options = worker_arguments(p, port, config.metrics_host)
            argv = (sys.executable, "-m", "ortq", *(["-v"] if verbose else []), "worker", *options)
            slots.append(WorkerSlot(number, f"{m.name}.{n}", argv, tuple(env.items()), m.burst, redis_url, elastic))
    return slots


def _elastic(plan: Plan, group: int, placement: Placement) -> Elastic | None:
    """What the follower needs of an elastic group's slots; None for a fixed count."""
    if placement.group.min_workers is None:
        return None
    adapter = placement.adapter
    return Elastic(
        model=placement.model.name,
        group=group,
        adapter="auto" if adapter is None else _adapter_name(adapter),
        budget_bytes=None if adapter is None else budget_of(plan.config, adapter),
        worker_bytes=placement.estimate.bytes,
        min_workers=placement.group.min_workers,
        max_workers=placement.group.count,
        idle_seconds=placement.group.idle_seconds,
        min_residency_seconds=plan.config.min_residency_seconds,
    )


def worker_arguments(placement: Placement, metrics_port: int = 0, metrics_host: str = "127.0.0.1") -> list[str]:
    """``ortq worker``'s arguments for one worker of ``placement``: its model's options, its group's
    adapter and provider options, its metrics port (ortq.worker.options.command_line writes them)."""
    model = placement.model
    given = group_options(dict(model.options), placement.group)
    given["adapter"] = placement.adapter_arg or None  # the spec as planned (a stable one), not as written
    if metrics_port:
        given.update(metrics_port=metrics_port, metrics_host=metrics_host)
    return ["--model", str(model.path), "--name", model.name, *worker_options.command_line(given)]


# --------------------------------------------------------------------------- output


def _size(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n / 1024:.0f} KiB"


def _adapter_name(adapter: Adapter) -> str:
    index = "" if adapter.index is None else f" {adapter.index}"
    return f"{adapter.provider}{index} ({adapter.name})"


def _columns(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def format_plan(plan: Plan, shards: ShardMap | None = None) -> str:
    """The plan as ``ortq pool --check`` prints it: workers, adapter totals, how memory was obtained,
    and, when ``shards`` puts the pool's models on several Redis instances, which is on which."""
    most = "at most " if plan.config.elastic else ""
    lines = [f"pool plan for {plan.config.source}: {most}{plan.config.worker_count} workers", ""]
    rows = [("model", "provider", "adapter", "index", "--adapter", "workers", "memory/worker")]
    for p in plan.placements:
        adapter = "chosen by ONNX Runtime" if p.adapter is None else p.adapter.name
        index = "" if p.adapter is None or p.adapter.index is None else str(p.adapter.index)
        spec = p.adapter_arg or ""
        if p.group.adapter and p.group.adapter != p.adapter_arg:
            spec = f"{p.group.adapter} -> {spec}"
        memory = f"{_size(p.estimate.bytes)} ({p.estimate.kind})"
        workers = str(p.group.count)
        if p.group.elastic:
            workers = f"{p.group.least}..{p.group.count}, idle {p.group.idle_seconds:g} s"
        rows.append((p.model.name, p.model.provider, adapter, index, spec, workers, memory))
    lines += _columns(rows)
    lines += ["", *_columns(_load_rows(plan))]
    lines += ["", "memory per worker:"]
    seen: set[str] = set()
    for p in plan.placements:
        if p.model.name not in seen:
            seen.add(p.model.name)
            lines.append(f"  {p.model.name}: {_size(p.estimate.bytes)} = {p.estimate.detail}")
    lines += _redis_lines(plan, shards)
    lines += [f"note: {note}" for note in plan.notes]
    lines += [f"WARNING: {w} (above {WARN_FRACTION:.0%})" for w in plan.warnings()]
    lines += [f"REFUSED: {r}: more than it has (--force starts it anyway)" for r in plan.refusals()]
    lines += [f"REFUSED: {r}" for r in plan.budget_refusals()]
    return "\n".join(lines)


def _redis_lines(plan: Plan, shards: ShardMap | None) -> list[str]:
    if shards is None:
        return []
    by_url: dict[str, list[str]] = {}
    for model in plan.config.models:
        by_url.setdefault(shards.url_for(model.name), []).append(f"{model.name} ({model.worker_count})")
    if len(by_url) < 2:
        return []
    return ["", "redis (workers):", *(f"  {redacted_url(url)}: {', '.join(on)}" for url, on in by_url.items())]


def _load_rows(plan: Plan) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = [("adapter", "workers", "total memory", "budget", "adapter memory", "use", "")]
    for load in plan.loads:
        memory = load.adapter.memory_bytes
        use = "" if load.fraction is None else f"{100 * load.fraction:.0f}%"
        verdict = {"ok": "ok", "high": "WARNING", "over": "REFUSED", "unknown": "not checked"}
        shared = load.adapter.kind in ("integrated", "software")
        rows.append(
            (
                _adapter_name(load.adapter),
                str(load.workers),
                _size(load.total_bytes),
                "none" if load.budget_bytes is None else _size(load.budget_bytes),
                "shared" if shared else _size(memory) if memory else "unknown",
                use,
                verdict[load.verdict],
            )
        )
    auto = sum(p.group.count for p in plan.placements if p.adapter is None)
    if auto:
        rows.append(("auto (ONNX Runtime chooses)", str(auto), "", "none", "unknown", "", "not checked"))
    return rows
