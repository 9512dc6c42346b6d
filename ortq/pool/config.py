"""``pool.toml``: which models a pool serves, on which adapters, with how many workers.

Parsed with the standard library's ``tomllib`` into frozen dataclasses. Every key is checked:
an unknown key, a wrong type or an out-of-range value raises ConfigurationError naming the
file, the table and the key (see docs/pool.md for the format).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortq import keys
from ortq.errors import ConfigurationError
from ortq.pool.tomltable import Env, Table
from ortq.settings import Settings, redacted_url
from ortq.shards import ENV_VAR as SHARDS_ENV_VAR
from ortq.shards import ShardMap
from ortq.worker import provider_options
from ortq.worker.custom_ops import PACKAGES as CUSTOM_OPS_PACKAGES
from ortq.worker.watchdog import DEFAULT_STALL_SECONDS

PROVIDERS = ("cpu", "cuda", "dml", "webgpu", "plugin", "auto")
POLICIES = ("prefer-gpu", "max-performance", "max-efficiency", "min-overall-power")

#: Variables an env table must not set, and why. The ORTQ_* ones are worker options the pool sets
#: from config keys; CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER would renumber the GPUs under one
#: worker only, so that it no longer sees the enumeration the pool planned against.
_FROM_KEY = {
    "ORTQ_MODEL": "path",
    "ORTQ_MODEL_NAME": "name",
    "ORTQ_PROVIDER": "provider",
    "ORTQ_ADAPTER": "adapter",
    "ORTQ_EP_LIBRARY": "ep_library",
    "ORTQ_EP_NAME": "ep_name",
    "ORTQ_THREADS": "threads",
    "ORTQ_MAX_BATCH": "max_batch",
    "ORTQ_MAX_WAIT_MS": "max_wait_ms",
    "ORTQ_ROWS_INDEPENDENT": "rows_independent",
    "ORTQ_STALL_SECONDS": "stall_seconds",
    "ORTQ_JOB_TIMEOUT": "job_timeout",
    "ORTQ_MODEL_VERSION": "version",
    "ORTQ_CUSTOM_OPS": "custom_ops",
    "ORTQ_PROVIDER_OPTIONS": "provider_options",
    "ORTQ_REDIS_URL": "redis_url in [pool] or [[model]]",
    SHARDS_ENV_VAR: "redis_url in [[model]], or the pool's own --shards / $ORTQ_REDIS_SHARDS",
    "ORTQ_METRICS_PORT": "metrics_port_base in [pool]",
    "ORTQ_METRICS_HOST": "metrics_host in [pool]",
}
RESERVED_ENV = {
    **{name: f"the pool sets it from {key}" for name, key in _FROM_KEY.items()},
    "ORTQ_WORKER_NAME": "the pool names its workers",
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


@dataclass(frozen=True)
class WorkerGroup:
    """``count`` workers of one model on one adapter."""

    count: int
    #: An ``--adapter`` spec (index, uuid:, luid:, name:, discrete, ...); None: the CPU (or, for
    #: cuda/dml, adapter 0, as ``ortq worker`` does).
    adapter: str | None = None
    env: Env = ()
    #: ``ortq worker --provider-option`` pairs for this group's workers, on top of the model's.
    provider_options: Env = ()


@dataclass(frozen=True)
class ModelConfig:
    """One ``[[model]]`` table: what ``ortq worker`` options its workers get."""

    name: str
    path: Path
    provider: str
    groups: tuple[WorkerGroup, ...]
    threads: int | None = None
    max_batch: int = 1
    max_wait_ms: float = 0.0
    rows_independent: bool = False
    policy: str = "prefer-gpu"
    allow_cpu_fallback: bool = False
    skip_canary: bool = False
    burst: bool = False
    #: The operator's own figure for one worker's memory on its adapter; replaces the estimate.
    memory_per_worker_bytes: int | None = None
    env: Env = ()
    #: This model's Redis (a shard of its own, ortq/shards.py); None: the pool's.
    redis_url: str | None = None
    #: provider "plugin": the EP's shared library, and which of its EPs (None: its only one).
    ep_library: Path | None = None
    ep_name: str | None = None
    #: ``ortq worker --stall-seconds`` (None: its default) and ``--job-timeout`` (None: no limit).
    stall_seconds: float | None = None
    job_timeout: float | None = None
    #: ``ortq worker --model-version`` (None: the model file's digest).
    version: str | None = None
    #: ``ortq worker --custom-ops``: a package name of ortq.worker.custom_ops.PACKAGES, or a library's
    #: absolute path (the file's relative to pool.toml's folder); None: none.
    custom_ops: str | None = None
    #: ``ortq worker --provider-option`` pairs for every worker of the model (a group's add to them).
    provider_options: Env = ()

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
    restart: RestartPolicy = RestartPolicy()
    env: Env = ()

    @property
    def worker_count(self) -> int:
        return sum(m.worker_count for m in self.models)

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
        "env": pool.env("pool.env", RESERVED_ENV),
    }
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
    provider = table.string("provider", "cpu") or "cpu"
    if provider == "winml":
        raise table.error(
            "provider 'winml' is not planned by ortq pool (Windows ML's devices come from its catalog at each "
            "worker's start): run `ortq worker --provider winml` under a service manager instead (deploy/)"
        )
    if provider not in PROVIDERS:
        raise table.error(f"provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")
    ep_library, ep_name = table.string("ep_library"), table.string("ep_name")
    if provider == "plugin" and ep_library is None:
        raise table.error("provider 'plugin' needs ep_library (the path of the execution provider's shared library)")
    if provider != "plugin" and (ep_library or ep_name):
        raise table.error(f"ep_library and ep_name apply to provider 'plugin' only, not {provider!r}")
    max_batch = table.integer("max_batch", 1, 1)
    max_wait_ms = table.number("max_wait_ms", 0.0, 0)
    memory_mib = table.integer("memory_per_worker_mib", None, 1)
    policy = table.string("policy", "prefer-gpu", POLICIES) or "prefer-gpu"
    model = ModelConfig(
        name=name,
        path=(base_dir / path).resolve(),
        provider=provider,
        groups=tuple(_group(t, provider) for t in table.tables("workers", "model.workers", f"{table.where} ")),
        threads=table.integer("threads", None, 1),
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        rows_independent=table.boolean("rows_independent", False),
        policy=policy,
        allow_cpu_fallback=table.boolean("allow_cpu_fallback", False),
        skip_canary=table.boolean("skip_canary", False),
        burst=table.boolean("burst", False),
        memory_per_worker_bytes=None if memory_mib is None else memory_mib * 1024**2,
        env=table.env("model.env", RESERVED_ENV),
        redis_url=_redis_url(table),
        ep_library=None if ep_library is None else (base_dir / ep_library).resolve(),
        ep_name=ep_name,
        stall_seconds=table.number("stall_seconds", None, 0),
        job_timeout=table.number("job_timeout", None, 0, above=True),
        version=_version(table),
        custom_ops=_custom_ops(table, base_dir),
        provider_options=table.provider_options("model.provider_options"),
    )
    table.finish()
    _check_provider_options(table, model)
    if not model.groups:
        raise table.error("no [[model.workers]] tables: say how many workers, e.g. [[model.workers]] count = 1")
    if max_wait_ms > 0 and max_batch == 1:
        raise table.error("max_wait_ms only applies with max_batch > 1")
    if max_batch > 1 and not model.rows_independent:
        raise table.error(
            "max_batch > 1 needs rows_independent = true: batching joins several jobs' rows into one run, "
            "which is only safe when each output row depends on the same input row alone (docs/pool.md, 'Batching')"
        )
    if policy != "prefer-gpu" and provider != "auto":
        raise table.error(f"policy applies to provider 'auto' only, not {provider!r}")
    stall = DEFAULT_STALL_SECONDS if model.stall_seconds is None else model.stall_seconds
    if model.job_timeout is not None and 0 < stall <= model.job_timeout:
        raise table.error(f"job_timeout ({model.job_timeout:g}) must be shorter than stall_seconds ({stall:g})")
    return model


def _group(table: Table, provider: str) -> WorkerGroup:
    group = WorkerGroup(
        count=table.integer("count", 0, 1),
        adapter=table.string("adapter"),
        env=table.env("model.workers.env", RESERVED_ENV),
        provider_options=table.provider_options("model.workers.provider_options"),
    )
    table.finish()
    if group.count == 0:
        raise table.error("count is missing (how many workers)")
    if group.adapter is not None and provider in ("cpu", "auto"):
        raise table.error(f"adapter does not apply to provider {provider!r} (a CPU pool says only how many: count = N)")
    return group


def _custom_ops(table: Table, base_dir: Path) -> str | None:
    """A model's ``custom_ops``: a package name as it is, a library's path relative to the file's folder."""
    spec = table.string("custom_ops")
    if spec is None or spec in CUSTOM_OPS_PACKAGES:
        return spec
    return str((base_dir / spec).resolve())


def group_provider_options(model: ModelConfig, group: WorkerGroup) -> Env:
    """What a group's workers get as --provider-option: the model's, then the group's (which win)."""
    return tuple({**dict(model.provider_options), **dict(group.provider_options)}.items())


def _check_provider_options(table: Table, model: ModelConfig) -> None:
    """Each group's options, checked as its workers will check them (ortq.worker.provider_options)."""
    for group in model.groups:
        try:
            provider_options.check(model.provider, group_provider_options(model, group))
        except ConfigurationError as exc:
            raise table.error(str(exc)) from None


def _version(table: Table) -> str | None:
    """A model's ``version`` (ortq worker --model-version), checked as the worker checks it."""
    version = table.string("version")
    if version is not None:
        try:
            keys.check_version_name(version)
        except ConfigurationError as exc:
            raise table.error(str(exc)) from None
    return version
