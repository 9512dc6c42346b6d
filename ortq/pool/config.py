"""``pool.toml``: which models a pool serves, on which adapters, with how many workers.

Parsed with the standard library's ``tomllib`` into frozen dataclasses. Every key is checked:
an unknown key, a wrong type or an out-of-range value raises ConfigurationError naming the
file, the table and the key (see docs/pool.md for the format).
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from ortq import keys
from ortq.errors import ConfigurationError
from ortq.pool.tomltable import Env, Table
from ortq.redisurls import redacted_url
from ortq.settings import Settings
from ortq.shards import ENV_VAR as SHARDS_ENV_VAR
from ortq.shards import ShardMap
from ortq.worker import options as worker_options
from ortq.worker import provider_options
from ortq.worker.options import Level, Spelling

T = TypeVar("T")

#: Variables an env table must not set, and why: the ORTQ_* variables of the worker options the
#: pool sets itself (ortq.worker.options), and CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER, which
#: would renumber the GPUs under one worker only, so that it no longer sees the enumeration the
#: pool planned against.
RESERVED_ENV = {
    **worker_options.pool_sets(),
    "ORTQ_REDIS_URL": "the pool sets it from redis_url in [pool] or [[model]]",
    SHARDS_ENV_VAR: "the pool sets it from redis_url in [[model]], or the pool's own --shards / $ORTQ_REDIS_SHARDS",
    "CUDA_VISIBLE_DEVICES": "the pool gives each worker its GPU by --adapter; set it in the pool's own environment",
    "CUDA_DEVICE_ORDER": "the pool gives each worker its GPU by --adapter; set it in the pool's own environment",
}


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead worker is started again (ortq.pool.restart.decide applies it)."""

    #: A crashed worker waits this long before its first restart, doubling up to backoff_max_seconds.
    backoff_initial_seconds: float = 1.0
    backoff_max_seconds: float = 60.0
    #: A worker that ran this long counts as healthy: its backoff and failure counts start again.
    healthy_after_seconds: float = 60.0
    #: After exit 2 (a configuration error at start) the worker waits this long ...
    configuration_retry_seconds: float = 60.0
    #: ... and after this many exit-2s in a row the pool gives up on it.
    max_configuration_errors: int = 3


#: An elastic group's workers stop after this long without a job, by default (idle_seconds).
IDLE_SECONDS = 300.0
#: A worker serves at least this long before it is stopped for another model, by default.
MIN_RESIDENCY_SECONDS = 30.0


@dataclass(frozen=True)
class WorkerGroup:
    """``count`` workers of one model on one adapter; an elastic group (``max_workers``) runs
    between ``min_workers`` and ``count`` of them as its queue asks (ortq.pool.follow)."""

    #: The group's workers: all of them always (``count``), or at most (``max_workers``).
    count: int
    #: An ``--adapter`` spec (index, uuid:, luid:, name:, discrete, ...); None: the CPU (or, for
    #: cuda/dml, adapter 0, as ``ortq worker`` does).
    adapter: str | None = None
    env: Env = ()
    #: ``ortq worker --provider-option`` pairs for this group's workers, on top of the model's.
    provider_options: Env = ()
    #: An elastic group's fewest workers (0: none while its queue is empty); None: a fixed count.
    min_workers: int | None = None
    #: An elastic group's worker stops after this many seconds without a job for its model.
    idle_seconds: float = IDLE_SECONDS

    @property
    def elastic(self) -> bool:
        return self.min_workers is not None

    @property
    def least(self) -> int:
        """The workers the group always runs."""
        return self.count if self.min_workers is None else self.min_workers


class _WorkerOption(Generic[T]):
    """A ModelConfig attribute that reads the ``ortq worker`` option of its own name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = name

    def __get__(self, model: ModelConfig, owner: type | None = None) -> T:
        value: T = model.option(self.field)
        return value


@dataclass(frozen=True)
class ModelConfig:
    """One ``[[model]]`` table: what ``ortq worker`` options its workers get."""

    name: str
    path: Path
    groups: tuple[WorkerGroup, ...]
    #: The ``ortq worker`` options the table gives (ortq.worker.options: field and value, in the
    #: worker's types; those at their default left out). Read them with :meth:`option`.
    options: tuple[tuple[str, Any], ...] = ()
    #: The operator's own figure for one worker's memory on its adapter; replaces the estimate.
    memory_per_worker_bytes: int | None = None
    env: Env = ()
    #: This model's Redis (a shard of its own, ortq/shards.py); None: the pool's.
    redis_url: str | None = None

    def option(self, field: str) -> Any:
        """The value of ``ortq worker`` option ``field`` (a WorkerConfig field) its workers get."""
        return dict(self.options).get(field, worker_options.DEFAULTS[field])

    # The options the pool's planning reads, by name (ep_library and custom_ops: absolute paths, or
    # custom_ops a package name of ortq.worker.custom_ops.PACKAGES).
    provider = _WorkerOption[str]()
    ep_library = _WorkerOption[str | None]()
    ep_name = _WorkerOption[str | None]()
    threads = _WorkerOption[int | None]()
    max_batch = _WorkerOption[int]()
    custom_ops = _WorkerOption[str | None]()
    burst = _WorkerOption[bool]()

    @property
    def worker_count(self) -> int:
        return sum(g.count for g in self.groups)


@dataclass(frozen=True)
class PoolConfig:
    """A whole ``pool.toml``."""

    source: str
    models: tuple[ModelConfig, ...]
    redis_url: str | None = None
    #: Worker i (0-based, in file order) serves /metrics on metrics_port_base + i; 0: off.
    metrics_port_base: int = 0
    metrics_host: str = "127.0.0.1"
    #: Seconds the workers get to finish their job and unregister after the stop request.
    grace_seconds: float = 30.0
    #: Each worker's output goes to <log_dir>/<model>.<n>.log; None: prefixed lines on the pool's stderr.
    log_dir: Path | None = None
    #: Measure each model's session footprint (a CPU session in a subprocess) when planning.
    measure_memory: bool = True
    #: Each adapter's memory budget for the pool's workers: bytes, or a share of the adapter's
    #: memory (the CPU's: the host's); None for both: none (elastic groups bounded by max_workers).
    memory_budget_bytes: int | None = None
    memory_budget_fraction: float | None = None
    #: An elastic worker serves at least this long before it is stopped for another model.
    min_residency_seconds: float = MIN_RESIDENCY_SECONDS
    restart: RestartPolicy = RestartPolicy()
    env: Env = ()

    @property
    def worker_count(self) -> int:
        return sum(m.worker_count for m in self.models)

    @property
    def elastic(self) -> bool:
        """Whether any group follows its queue (max_workers)."""
        return any(g.elastic for m in self.models for g in m.groups)

    def shard_map(self, settings: Settings) -> ShardMap:
        """Each model's Redis: its ``redis_url`` key, else the entry of ``settings``' shard map
        (``--shards`` / $ORTQ_REDIS_SHARDS), else the pool's ``settings.redis_url``. A model that the
        file and the map put on different Redis instances is refused: the producers reading that map
        would send its jobs where none of these workers wait."""
        shards = settings.shards or ShardMap(settings.redis_url)
        given = [(m.name, m.redis_url) for m in self.models if m.redis_url is not None]
        return shards.with_routes(given, f"{self.source}: [[model]] redis_url") if given else shards

    @classmethod
    def from_file(cls, path: Path) -> PoolConfig:
        """Read and check ``path``; relative paths in it are relative to its folder."""
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigurationError(f"cannot read pool config {path}: {exc.strerror or exc}") from None
        return cls.from_toml(text, source=str(path), base_dir=path.resolve().parent)

    @classmethod
    def from_toml(cls, text: str, source: str = "<pool.toml>", base_dir: Path | None = None) -> PoolConfig:
        """Parse and check the TOML ``text``; ``source`` names it in error messages."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigurationError(f"{source}: not valid TOML: {exc}") from None
        return _parse(Table(data, "the top level", source), base_dir or Path.cwd())


def _parse(top: Table, base_dir: Path) -> PoolConfig:
    pool = top.table("pool", "pool")
    restart_table = pool.table("restart", "pool.restart")
    model_tables = top.tables("model", "model")
    top.finish()

    log_dir = pool.string("log_dir")
    fields: dict[str, Any] = {
        "redis_url": _redis_url(pool),
        "metrics_port_base": pool.integer("metrics_port_base", 0, 0, 65535),
        "metrics_host": pool.string("metrics_host", "127.0.0.1"),
        "grace_seconds": pool.number("grace_seconds", 30.0, 0, above=True),
        "log_dir": None if log_dir is None else base_dir / log_dir,
        "measure_memory": pool.boolean("measure_memory", True),
        "min_residency_seconds": pool.number("min_residency_seconds", MIN_RESIDENCY_SECONDS, 0),
        "env": pool.env("pool.env", RESERVED_ENV),
    }
    budget_mib = pool.integer("memory_budget_mib", None, 1)
    fields["memory_budget_bytes"] = None if budget_mib is None else budget_mib * 1024**2
    fields["memory_budget_fraction"] = pool.number("memory_budget_fraction", None, 0, above=True)
    if budget_mib is not None and fields["memory_budget_fraction"] is not None:
        raise pool.error("memory_budget_mib and memory_budget_fraction both given: one budget an adapter")
    if (fields["memory_budget_fraction"] or 0) > 1:
        fraction = fields["memory_budget_fraction"]
        raise pool.error(f"memory_budget_fraction must be at most 1 (all of an adapter), got {fraction:g}")
    pool.finish()
    fields["restart"] = _restart(restart_table)

    if not model_tables:
        raise top.error("no [[model]] tables: a pool needs at least one model")
    models = tuple(_model(t, base_dir) for t in model_tables)
    seen: set[str] = set()
    for model in models:
        if model.name in seen:
            raise top.error(f"two [[model]] tables are named {model.name!r}: one model, one queue, one table")
        seen.add(model.name)
    config = PoolConfig(source=top.source, models=models, **fields)
    last_port = config.metrics_port_base + config.worker_count - 1
    if config.metrics_port_base and last_port > 65535:
        raise pool.error(f"metrics_port_base {config.metrics_port_base} + {config.worker_count} workers passes 65535")
    return config


def _redis_url(table: Table) -> str | None:
    """The table's ``redis_url`` (its scheme checked here; the rest where the map or settings are made)."""
    url = table.string("redis_url")
    schemes = ("redis://", "rediss://", "unix://", "redis+sentinel://", "rediss+sentinel://")
    if url is not None and not url.startswith(schemes):
        expected = f"{', '.join(schemes[:-1])} or {schemes[-1]}"
        raise table.error(f"redis_url must start with {expected}, got {redacted_url(url)!r}")
    return url


def _restart(table: Table) -> RestartPolicy:
    policy = RestartPolicy(
        backoff_initial_seconds=table.number("backoff_initial_seconds", 1.0, 0, above=True),
        backoff_max_seconds=table.number("backoff_max_seconds", 60.0, 0, above=True),
        healthy_after_seconds=table.number("healthy_after_seconds", 60.0, 0, above=True),
        configuration_retry_seconds=table.number("configuration_retry_seconds", 60.0, 0),
        max_configuration_errors=table.integer("max_configuration_errors", 3, 1),
    )
    table.finish()
    if policy.backoff_max_seconds < policy.backoff_initial_seconds:
        raise table.error(
            f"backoff_max_seconds ({policy.backoff_max_seconds:g}) is less than "
            f"backoff_initial_seconds ({policy.backoff_initial_seconds:g})"
        )
    return policy


def _model(table: Table, base_dir: Path) -> ModelConfig:
    """A ``[[model]]`` table: its name and path, the worker options it gives (each checked as
    ``ortq worker`` checks it, in pool.toml's words), its groups of workers."""
    name = table.string("name")
    if name is None:
        raise table.error("name is missing (the model's queue name)")
    try:
        keys.check_model_name(name)
    except ConfigurationError as exc:
        raise table.error(f"name: {exc}") from None
    table.where = f"{table.where} ({name!r})"
    path = table.string("path")
    if path is None:
        raise table.error("path is missing (the .onnx file)")
    given = worker_options.read_toml(table, base_dir, Level.MODEL)
    if given.get("provider") == "winml":
        raise table.error(
            "provider 'winml' is not planned by ortq pool (Windows ML's devices come from its catalog at each "
            "worker's start): run `ortq worker --provider winml` under a service manager instead (deploy/)"
        )
    _check(table, given)
    memory_mib = table.integer("memory_per_worker_mib", None, 1)
    groups = tuple(_group(t, given, base_dir) for t in table.tables("workers", "model.workers", f"{table.where} "))
    model = ModelConfig(
        name=name,
        path=(base_dir / path).resolve(),
        groups=groups,
        options=tuple(given.items()),
        memory_per_worker_bytes=None if memory_mib is None else memory_mib * 1024**2,
        env=table.env("model.env", RESERVED_ENV),
        redis_url=_redis_url(table),
    )
    table.finish()
    if not model.groups:
        raise table.error("no [[model.workers]] tables: say how many workers, e.g. [[model.workers]] count = 1")
    return model


def _group(table: Table, model_options: dict[str, Any], base_dir: Path) -> WorkerGroup:
    """A ``[[model.workers]]`` table; its options checked with its model's."""
    given = worker_options.read_toml(table, base_dir, Level.GROUP)
    count = table.integer("count", None, 1)
    most = table.integer("max_workers", None, 1)
    least = table.integer("min_workers", None, 0)
    idle = table.number("idle_seconds", None, 0, above=True)
    env = table.env("model.workers.env", RESERVED_ENV)
    table.finish()
    if count is not None and (most, least, idle) != (None, None, None):
        raise table.error("count is a fixed number of workers: give it or max_workers (with min_workers, idle_seconds)")
    if count is None and most is None and (least, idle) != (None, None):
        raise table.error("min_workers and idle_seconds need max_workers (the most workers the group runs)")
    if count is None and most is None:
        raise table.error("count is missing (how many workers; or max_workers, to follow the queue)")
    if most is not None and least is not None and least > most:
        raise table.error(f"min_workers ({least}) is more than max_workers ({most})")
    group = WorkerGroup(
        count=count or most or 0,
        adapter=given.get("adapter"),
        env=env,
        provider_options=given.get("provider_options", ()),
        min_workers=None if most is None else least or 0,
        idle_seconds=IDLE_SECONDS if idle is None else idle,
    )
    _check(table, group_options(model_options, group))
    return group


def _check(table: Table, values: dict[str, Any]) -> None:
    """``values`` (worker options) checked as ``ortq worker`` checks them, the error in ``table``'s name."""
    try:
        provider = values.get("provider", worker_options.DEFAULTS["provider"])
        provider_options.check(provider, values.get("provider_options", ()))
        worker_options.check(values, Spelling(on_command_line=False))
    except ConfigurationError as exc:
        raise table.error(str(exc)) from None


def group_options(model_options: Mapping[str, Any], group: WorkerGroup) -> dict[str, Any]:
    """The ``ortq worker`` options (field to value) a group's workers get: their model's, the group's
    adapter, and as provider options the model's and then the group's (which win, key by key)."""
    merged = {**dict(model_options.get("provider_options", ())), **dict(group.provider_options)}
    return {**model_options, "adapter": group.adapter, "provider_options": tuple(merged.items())}
