"""Every ``ortq worker`` option, once: its WorkerConfig field, command-line flag, environment
variable, ``pool.toml`` key, type, bounds, default and help. The worker command's flags
(:func:`click_options`), WorkerConfig's defaults and checks (:func:`check`), pool.toml's keys
(ortq.pool.config reads them with :func:`read_toml`), the pool's worker command lines
(:func:`command_line`) and the variables a pool's env tables may not set (:func:`pool_sets`) are all
made from :data:`OPTIONS`; tests/test_worker_options.py round-trips each option through them.

Kept free of ONNX Runtime: ``ortq --help`` and ``ortq pool`` import it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import click

from ortq import keys
from ortq.errors import ConfigurationError
from ortq.worker import custom_ops, provider_options
from ortq.worker.watchdog import DEFAULT_STALL_SECONDS

#: ``--provider`` values (ortq.worker.session maps each to ONNX Runtime's EP, or to a plugin EP).
PROVIDERS = ("dml", "cuda", "cpu", "auto", "webgpu", "plugin", "winml")
#: ``--policy`` values: ONNX Runtime's device-selection policies (ortq.worker.session.AUTO_POLICIES).
POLICIES = ("prefer-gpu", "max-performance", "max-efficiency", "min-overall-power")


class Kind(Enum):
    """An option's type, which decides its click type, its TOML reader and how it is written back."""

    TEXT = "text"  # a non-empty string, or None
    PATH = "path"  # a file's path (relative ones in pool.toml: to the file's folder)
    LIBRARY = "library"  # --custom-ops: a package name (ortq.worker.custom_ops.PACKAGES) or a path
    CHOICE = "choice"
    FLAG = "flag"  # a boolean, off unless given
    INTEGER = "integer"
    NUMBER = "number"
    PAIRS = "pairs"  # KEY=VALUE, repeatable (a TOML table of strings)


class Level(Enum):
    """Where ``pool.toml`` takes an option: not at all (the pool sets it itself), in each
    ``[[model]]``, in each ``[[model.workers]]`` group, or in both (the group's win, key by key)."""

    NONE = "none"
    MODEL = "model"
    GROUP = "group"
    BOTH = "both"


@dataclass(frozen=True)
class Option:
    """One ``ortq worker`` option."""

    field: str  # WorkerConfig's attribute
    flag: str
    kind: Kind
    default: Any
    help: str
    env: str | None = None
    #: pool.toml: the key (None: the field's name) and where it goes.
    level: Level = Level.MODEL
    toml_key: str | None = None
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    above: bool = False  # the minimum itself is out
    metavar: str | None = None
    show_default: bool = False
    #: Why a pool.toml env table may not set ``env`` when the option is not in pool.toml itself.
    pool_reason: str = ""

    @property
    def toml(self) -> str:
        return self.toml_key or self.field

    def describe(self, on_command_line: bool) -> str:
        """How messages name it: the flag, or the pool.toml key."""
        return self.flag if on_command_line else self.toml


#: ``--ort-log-level`` values, ONNX Runtime's severities 0-4 in order.
ORT_LOG_LEVELS = ("verbose", "info", "warning", "error", "fatal")

OPTIONS: tuple[Option, ...] = (
    Option("model_path", "--model", Kind.PATH, None, "The .onnx file to serve.", "ORTQ_MODEL",
           Level.MODEL, "path"),
    Option("model_name", "--name", Kind.TEXT, None, "Model name; the queue is ortq:<name>.", "ORTQ_MODEL_NAME",
           Level.MODEL, "name"),
    Option("provider", "--provider", Kind.CHOICE, "cpu",
           "DirectML (Windows only), CUDA (NVIDIA; Linux and Windows), the CPU, ONNX Runtime's choice by --policy "
           "(onnxruntime >= 1.23), the WebGPU plugin EP (ortq[webgpu]: D3D12 on Windows, Vulkan on Linux), any "
           "plugin EP (--ep-library), or Windows ML's EPs (ortq[winml]; Windows 11 24H2+).",
           "ORTQ_PROVIDER", choices=PROVIDERS, show_default=True),
    Option("ep_library", "--ep-library", Kind.PATH, None,
           "--provider plugin: the execution provider's shared library (.so/.dll) to register with ONNX Runtime.",
           "ORTQ_EP_LIBRARY"),
    Option("ep_name", "--ep-name", Kind.TEXT, None,
           "--provider plugin: the EP's ONNX Runtime name (needed when the library has several); "
           "--provider winml: only this EP of Windows ML's catalog.", "ORTQ_EP_NAME", metavar="NAME"),
    Option("adapter", "--adapter", Kind.TEXT, None,
           "Which GPU: an index, luid:..., uuid:..., name:SUBSTRING, discrete, integrated, high-performance or "
           "minimum-power; for plugin EPs also npu, software, cpu (see `ortq adapters`). Resolved at every start. "
           "Default: index 0 (plugin EPs: their first non-CPU device; webgpu: high-performance; winml: --policy).",
           "ORTQ_ADAPTER", Level.GROUP, metavar="SPEC"),
    Option("policy", "--policy", Kind.CHOICE, "prefer-gpu",
           "ONNX Runtime's device-selection policy, for --provider auto (and winml without --adapter).",
           "ORTQ_POLICY", choices=POLICIES, show_default=True),
    Option("allow_cpu_fallback", "--allow-cpu-fallback", Kind.FLAG, False,
           "Run on the CPU if the provider cannot start, instead of refusing to start.", "ORTQ_ALLOW_CPU_FALLBACK"),
    Option("skip_canary", "--skip-canary", Kind.FLAG, False,
           "Do not compare the provider's warm-up output with the CPU's before serving (unsafe).", "ORTQ_SKIP_CANARY"),
    Option("threads", "--threads", Kind.INTEGER, None, "ONNX Runtime intra-op threads.", "ORTQ_THREADS", minimum=1),
    Option("max_batch", "--max-batch", Kind.INTEGER, 1,
           "Run up to N queued jobs as one batch (concatenated on dim 0; needs a dynamic first dim).",
           "ORTQ_MAX_BATCH", minimum=1, show_default=True),
    Option("max_wait_ms", "--max-wait-ms", Kind.NUMBER, 0.0,
           "With --max-batch: how long to wait for more jobs after the first.", "ORTQ_MAX_WAIT_MS", minimum=0,
           show_default=True),
    Option("rows_independent", "--rows-independent", Kind.FLAG, False,
           "Declare that each output row depends only on the same input row (needed by --max-batch: batching joins "
           "the rows of several jobs into one run).", "ORTQ_ROWS_INDEPENDENT"),
    Option("prefetch", "--prefetch", Kind.INTEGER, None,
           "Batches a worker takes ahead of time while it runs one (they show as started meanwhile, and go back to "
           "the queue at a stop); 0: take the next only once the run in hand ends. Default: auto, which takes one "
           "ahead (two while the queue has a backlog) only while the last run was short next to a take's round trip "
           "to Redis (docs/design.md, 'Taking ahead').", "ORTQ_PREFETCH", minimum=0, metavar="N"),
    Option("burst", "--burst", Kind.FLAG, False, "Exit once the queue is empty.", "ORTQ_BURST"),
    Option("worker_name", "--worker-name", Kind.TEXT, None, "Name in Redis (default <model>.<host>.<pid>).",
           "ORTQ_WORKER_NAME", Level.NONE, pool_reason="the pool names its workers"),
    Option("metrics_port", "--metrics-port", Kind.INTEGER, 0,
           "Serve Prometheus /metrics, /live and /ready (200 while serving its queue, 503 while starting or "
           "stopping) on this port; 0: off.", "ORTQ_METRICS_PORT", Level.NONE, minimum=0, maximum=65535,
           pool_reason="the pool sets it from metrics_port_base in [pool]"),
    Option("metrics_host", "--metrics-host", Kind.TEXT, "127.0.0.1", "Address for --metrics-port.",
           "ORTQ_METRICS_HOST", Level.NONE, show_default=True,
           pool_reason="the pool sets it from metrics_host in [pool]"),
    Option("device_lost_pattern", "--device-lost-pattern", Kind.TEXT, None,
           "Also treat run errors matching REGEX as a lost GPU (requeue the jobs, exit with status 75).",
           "ORTQ_DEVICE_LOST_PATTERN", metavar="REGEX"),
    Option("stall_seconds", "--stall-seconds", Kind.NUMBER, DEFAULT_STALL_SECONDS,
           "A run lasting longer is taken as hung (a GPU driver that never returns): requeue this worker's jobs "
           "and exit with status 75 for a fresh process. 0: never.", "ORTQ_STALL_SECONDS", minimum=0,
           show_default=True),
    Option("job_timeout", "--job-timeout", Kind.NUMBER, None,
           "Stop a run after SECONDS for jobs that set no timeout of their own (JobTimeout); default: no limit.",
           "ORTQ_JOB_TIMEOUT", minimum=0, above=True, metavar="SECONDS"),
    Option("model_version", "--model-version", Kind.TEXT, None,
           "The version of the model this worker serves, which every answer names and producers may pin "
           "(docs/operations.md, 'Model versions'); default: the first 12 hex digits of the model file's SHA-256.",
           "ORTQ_MODEL_VERSION", toml_key="version", metavar="NAME"),
    Option("custom_ops", "--custom-ops", Kind.LIBRARY, None,
           "Register this custom-op library before the session is made: onnxruntime_extensions (that package's "
           "library, ortq[images]: e.g. its DecodeImage, so that jobs carry JPEG/PNG bytes) or a shared library's "
           "path.", "ORTQ_CUSTOM_OPS", metavar="LIBRARY"),
    Option("provider_options", "--provider-option", Kind.PAIRS, (),
           "An option for the execution provider, after ortq's own (repeatable; $ORTQ_PROVIDER_OPTIONS: several, "
           "space-separated), e.g. use_tf32=0 for CUDA. device_id is refused (use --adapter), and so is an option "
           "the provider does not report back after the session is made (docs/adapters.md).",
           "ORTQ_PROVIDER_OPTIONS", Level.BOTH, metavar="KEY=VALUE"),
    Option("ort_log_level", "--ort-log-level", Kind.CHOICE, "error",
           "The least severe of ONNX Runtime's own log lines the worker lets through (to stderr, as ONNX Runtime "
           "writes them, coloured): its warnings (a plugin EP's registration, nodes placed on the CPU) say nothing "
           "ortq does not check itself.", "ORTQ_ORT_LOG_LEVEL", Level.BOTH, choices=ORT_LOG_LEVELS,
           show_default=True),
)  # fmt: skip

BY_FIELD = {option.field: option for option in OPTIONS}
#: The defaults WorkerConfig's fields take.
DEFAULTS = {option.field: option.default for option in OPTIONS}


# ------------------------------------------------------------------ the command line


def click_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the ``worker`` command with a click option per :data:`OPTIONS`, plus ``--device-id``
    (the same as ``--adapter N``: a spelling of the adapter, not an option of its own)."""
    command = click.option("--device-id", type=click.IntRange(min=0), default=None, help="Same as --adapter N.")(
        command
    )
    for option in reversed(OPTIONS):
        command = _click_option(option)(command)
    return command


def _click_option(option: Option) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    # The variable goes in the help text itself: with show_envvar, click names it in every usage
    # error about the option too, as if the value had come from there.
    extra: dict[str, Any] = {"envvar": option.env, "help": f"{option.help} [${option.env}]"}
    extra["show_default"] = option.show_default
    if option.metavar:
        extra["metavar"] = option.metavar
    if option.field in ("model_path", "model_name"):
        extra["required"] = True
    else:
        extra["default"] = option.default
    if option.kind is Kind.FLAG:
        return click.option(option.flag, option.field, is_flag=True, **extra)
    if option.kind is Kind.PAIRS:
        extra.pop("default")
        return click.option(option.flag, option.field, multiple=True, **extra)
    return click.option(option.flag, option.field, type=_click_type(option), **extra)


def _click_type(option: Option) -> Any:
    if option.kind is Kind.PATH:
        return click.Path(dir_okay=False)
    if option.kind is Kind.CHOICE:
        return click.Choice(option.choices)
    if option.kind is Kind.INTEGER:
        low = None if option.minimum is None else int(option.minimum)
        high = None if option.maximum is None else int(option.maximum)
        return click.IntRange(low, high)
    if option.kind is Kind.NUMBER:
        return click.FloatRange(min=option.minimum, min_open=option.above)
    return None


def from_command_line(values: dict[str, Any]) -> dict[str, Any]:
    """The worker command's parsed values as WorkerConfig's keyword arguments: ``--device-id N``
    made ``--adapter N`` (both given: a usage error), provider options parsed, paths made so."""
    values = dict(values)
    device_id = values.pop("device_id", None)
    if device_id is not None:
        if values.get("adapter") is not None:
            raise click.UsageError("give --adapter or --device-id, not both")
        values["adapter"] = str(device_id)
    values["model_path"] = Path(values["model_path"])
    values["provider_options"] = tuple(provider_options.parse(text) for text in values.get("provider_options", ()))
    return values


def command_line(values: Mapping[str, Any]) -> list[str]:
    """``ortq worker`` arguments that give the options in ``values`` (field to value, in the
    WorkerConfig's types); an option at its default is left out."""
    argv: list[str] = []
    for option in OPTIONS:
        value = values.get(option.field, option.default)
        if value == option.default or value is None:
            continue
        if option.kind is Kind.FLAG:
            argv.append(option.flag)
        elif option.kind is Kind.PAIRS:
            for key, text in value:
                argv += [option.flag, f"{key}={text}"]
        else:
            argv += [option.flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return argv


# ------------------------------------------------------------------ pool.toml


def pool_sets() -> dict[str, str]:
    """The environment variables of worker options that a pool sets itself, and from what: a
    pool.toml env table may not set them (the pool's own would lose, or win, silently)."""
    reasons = {}
    for option in OPTIONS:
        if option.env is not None:
            reasons[option.env] = option.pool_reason or f"the pool sets it from {option.toml}"
    return reasons


def read_toml(table: Any, base_dir: Path, level: Level) -> dict[str, Any]:
    """The worker options a pool.toml table (an ortq.pool.tomltable.Table: ``[[model]]`` for
    Level.MODEL, ``[[model.workers]]`` for Level.GROUP) gives, as field to value, those left at
    their default left out; each checked for type and range as it is read (a wrong one names the
    file, the table and the key). ``model_path`` and ``model_name`` are the caller's."""
    found: dict[str, Any] = {}
    for option in OPTIONS:
        if option.level not in (level, Level.BOTH) or option.field in ("model_path", "model_name"):
            continue
        value = _read(table, option, base_dir, level)
        if value is not None and value != option.default:
            found[option.field] = value
    return found


def _read(table: Any, option: Option, base_dir: Path, level: Level) -> Any:
    key = option.toml
    if option.kind is Kind.FLAG:
        return table.boolean(key, option.default)
    if option.kind is Kind.INTEGER:
        top = None if option.maximum is None else int(option.maximum)
        return table.integer(key, None, int(option.minimum or 0), top)
    if option.kind is Kind.NUMBER:
        return table.number(key, None, option.minimum or 0, above=option.above)
    if option.kind is Kind.PAIRS:
        return table.provider_options("model.workers." + key if level is Level.GROUP else "model." + key)
    text = table.string(key, None, option.choices)
    if text is None or option.kind in (Kind.TEXT, Kind.CHOICE):
        return text
    if option.kind is Kind.LIBRARY and text in custom_ops.PACKAGES:
        return text
    return str((base_dir / text).resolve())


# ------------------------------------------------------------------ checks


@dataclass(frozen=True)
class Spelling:
    """How messages name options: as ``ortq worker``'s flags (``--provider cuda``) or as pool.toml's
    keys (``provider 'cuda'``): the same rules, in the words of wherever the option was given."""

    on_command_line: bool = True

    def name(self, field: str) -> str:
        return BY_FIELD[field].describe(self.on_command_line)

    def value(self, field: str, value: object) -> str:
        return f"{self.name(field)} {value}" if self.on_command_line else f"{self.name(field)} {value!r}"


def check(values: Mapping[str, Any], spelling: Spelling = Spelling()) -> None:
    """ConfigurationError unless the options in ``values`` (field to value; absent: the default)
    are each valid and make sense together."""
    get = {**DEFAULTS, **values}.__getitem__
    for rule in (_check_choices, _check_provider_pairs, _check_batching, _check_time_limits, _check_texts):
        rule(get, spelling)


Get = Callable[[str], Any]


def _check_choices(get: Get, say: Spelling) -> None:
    for field in ("provider", "policy"):
        if get(field) not in BY_FIELD[field].choices:
            raise ConfigurationError(
                f"unknown {field} {get(field)!r}; choose one of {', '.join(BY_FIELD[field].choices)}"
            )
    if get("policy") != "prefer-gpu" and get("provider") not in ("auto", "winml"):
        raise ConfigurationError(
            f"{say.name('policy')} applies to {say.value('provider', 'auto')} (and winml) only, "
            f"not {say.value('provider', get('provider'))}"
        )


def _check_provider_pairs(get: Get, say: Spelling) -> None:
    """The options that only some providers take."""
    provider = get("provider")
    if get("adapter") is not None and provider in ("cpu", "auto"):
        raise ConfigurationError(f"{say.name('adapter')} does not apply to {say.value('provider', provider)}")
    plugin = say.value("provider", "plugin")
    if provider == "plugin" and get("ep_library") is None:
        raise ConfigurationError(
            f"{plugin} needs {say.name('ep_library')} (the path of the execution provider's shared library)"
        )
    if provider != "plugin" and get("ep_library") is not None:
        raise ConfigurationError(
            f"{say.name('ep_library')} applies to {plugin} only, not {say.value('provider', provider)}"
        )
    if get("ep_name") is not None and provider not in ("plugin", "winml"):
        raise ConfigurationError(
            f"{say.name('ep_name')} applies to {plugin} (and winml) only, not {say.value('provider', provider)}"
        )
    if get("custom_ops") is not None and not str(get("custom_ops")).strip():
        raise ConfigurationError(
            f"{say.name('custom_ops')} needs onnxruntime_extensions or the path of a shared library"
        )


def _check_batching(get: Get, say: Spelling) -> None:
    max_batch, max_wait_ms = get("max_batch"), get("max_wait_ms")
    if max_batch < 1 or max_wait_ms < 0:
        raise ConfigurationError(f"need max_batch >= 1 and max_wait_ms >= 0, got {max_batch}, {max_wait_ms}")
    if max_wait_ms > 0 and max_batch == 1:
        raise ConfigurationError(f"{say.name('max_wait_ms')} only applies with {say.name('max_batch')} > 1")
    if max_batch > 1 and not get("rows_independent"):
        raise ConfigurationError(
            f"{say.name('max_batch')} joins the rows of several jobs into one run: that is only safe for a model "
            "whose output rows each depend on the same input row alone (not for one that mixes rows, e.g. "
            "x - mean(x, axis=0), or gathers rows by an index the job supplies); if each output row of this "
            f"model depends only on the same input row, say so with {say.name('rows_independent')} (docs/pool.md, "
            "'Batching')"
        )
    if get("threads") is not None and get("threads") < 1:
        raise ConfigurationError(f"threads must be >= 1, got {get('threads')}")


def _check_time_limits(get: Get, say: Spelling) -> None:
    stall, timeout = get("stall_seconds"), get("job_timeout")
    if stall < 0:
        raise ConfigurationError(f"{say.name('stall_seconds')} must be >= 0 (0: never), got {stall:g}")
    if timeout is not None and timeout <= 0:
        raise ConfigurationError(f"{say.name('job_timeout')} must be a positive number of seconds, got {timeout:g}")
    if timeout is not None and 0 < stall <= timeout:
        raise ConfigurationError(
            f"{say.name('job_timeout')} ({timeout:g} s) must be shorter than {say.name('stall_seconds')} "
            f"({stall:g} s): a run past the stall limit is taken as hung, and its worker exits"
        )


def _check_texts(get: Get, say: Spelling) -> None:
    if get("model_version") is not None:
        keys.check_version_name(get("model_version"))
    pattern = get("device_lost_pattern")
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigurationError(f"{say.name('device_lost_pattern')} {pattern!r}: {exc}") from exc
