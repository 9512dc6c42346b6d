"""Every ``ortq worker`` option round-trips through each place it can be given (ortq/worker/options.py,
one table): a value written as the pool writes a worker's command line, parsed by the worker
command's own click options, is the WorkerConfig field's value; so is the same value given as its
environment variable, and as its pool.toml key once the pool has turned the file into that command
line. No process is started: the click command object parses, as ``ortq worker`` would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ortq import cli
from ortq.errors import ConfigurationError
from ortq.pool.config import RESERVED_ENV, PoolConfig
from ortq.pool.plan import Estimate, Placement, Plan, build_slots
from ortq.shards import ShardMap
from ortq.worker import options
from ortq.worker.options import OPTIONS, Kind, Level
from ortq.worker.serve import WorkerConfig
from ortq.worker.session import AUTO_POLICIES, EXECUTION_PROVIDERS, PLUGIN_PROVIDERS

IDENTITY = {"model_path": Path("/models/m.onnx"), "model_name": "m"}
LIBRARY = "/opt/ep/libmy_ep.so"
#: A value other than the default for every option, and what else it needs to be valid.
SAMPLES: dict[str, tuple[Any, dict[str, Any]]] = {
    "provider": ("cuda", {}),
    "ep_library": (LIBRARY, {"provider": "plugin"}),
    "ep_name": ("MyEP", {"provider": "plugin", "ep_library": LIBRARY}),
    "adapter": ("uuid:GPU-5f3c", {"provider": "cuda"}),
    "policy": ("max-efficiency", {"provider": "auto"}),
    "allow_cpu_fallback": (True, {}),
    "skip_canary": (True, {}),
    "threads": (3, {}),
    "max_batch": (8, {"rows_independent": True}),
    "max_wait_ms": (2.5, {"max_batch": 4, "rows_independent": True}),
    "rows_independent": (True, {}),
    "prefetch": (0, {}),
    "burst": (True, {}),
    "worker_name": ("m.box.7", {}),
    "metrics_port": (9107, {}),
    "metrics_host": ("0.0.0.0", {"metrics_port": 9107}),
    "device_lost_pattern": ("GPU (gone|lost)", {}),
    "stall_seconds": (120.0, {}),
    "job_timeout": (30.0, {}),
    "model_version": ("v2", {}),
    "custom_ops": ("onnxruntime_extensions", {}),
    "provider_options": ((("use_tf32", "0"), ("gpu_mem_limit", "1024")), {"provider": "cuda"}),
    "ort_log_level": ("warning", {}),
}
CASES = [pytest.param(field, *SAMPLES[field], id=field) for field in SAMPLES]


def parse(argv: list[str]) -> WorkerConfig:
    """``ortq worker ARGV`` parsed by the command's own click options, as a WorkerConfig."""
    with cli.worker.make_context("worker", list(argv)) as context:
        values = dict(context.params)
    values.pop("redis_url")
    return WorkerConfig(**options.from_command_line(values))


def identity_argv() -> list[str]:
    return ["--model", str(IDENTITY["model_path"]), "--name", IDENTITY["model_name"]]


def test_every_option_has_a_sample_and_one_definition() -> None:
    fields = [option.field for option in OPTIONS]
    assert set(SAMPLES) == set(fields) - set(IDENTITY), "a new option needs a sample here"
    assert len(fields) == len(set(fields)) and len({o.flag for o in OPTIONS}) == len(OPTIONS)
    # WorkerConfig is made of the table: the same fields, with the table's defaults.
    config = WorkerConfig(**IDENTITY)  # type: ignore[arg-type]
    assert set(WorkerConfig.__dataclass_fields__) == set(fields)
    assert all(getattr(config, o.field) == o.default for o in OPTIONS if o.field not in IDENTITY)
    # The provider and policy names the session maps to ONNX Runtime's are the table's choices.
    assert set(options.PROVIDERS) == {*EXECUTION_PROVIDERS, "auto", *PLUGIN_PROVIDERS}
    assert tuple(AUTO_POLICIES) == options.POLICIES
    # Every option's variable is one a pool.toml env table may not set (the pool sets it).
    assert all(o.env in RESERVED_ENV for o in OPTIONS if o.env is not None)
    assert [o.field for o in OPTIONS if o.env is None] == []


@pytest.mark.parametrize(("field", "value", "needs"), CASES)
def test_an_option_round_trips_through_the_command_line(field: str, value: Any, needs: dict[str, Any]) -> None:
    given = {**needs, field: value}
    config = parse(identity_argv() + options.command_line(given))
    assert {name: getattr(config, name) for name in given} == given
    assert options.command_line(given) != [] and options.command_line({}) == []


@pytest.mark.parametrize(("field", "value", "needs"), CASES)
def test_an_option_round_trips_through_its_environment_variable(
    field: str, value: Any, needs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    given = {**needs, field: value}
    for name, text in given.items():
        option = options.BY_FIELD[name]
        assert option.env is not None
        monkeypatch.setenv(option.env, _env_text(option.kind, text))
    config = parse(identity_argv())
    assert {name: getattr(config, name) for name in given} == given


@pytest.mark.parametrize(("field", "value", "needs"), CASES)
def test_an_option_round_trips_through_pool_toml(field: str, value: Any, needs: dict[str, Any], tmp_path: Path) -> None:
    given = {**needs, field: value}
    model, group, pool = "", "count = 1\n", ""
    for name, item in given.items():
        option = options.BY_FIELD[name]
        line = f"{option.toml} = {_toml(option.kind, item)}\n"
        if name == "metrics_port":
            pool += f"metrics_port_base = {item}\n"
        elif name == "metrics_host":
            pool += line
        elif option.level is Level.NONE:
            assert option.pool_reason and RESERVED_ENV[str(option.env)] == option.pool_reason
            return  # the pool sets it itself (the worker's name)
        elif option.level is Level.GROUP:
            group += line
        else:
            model += line
    text = f"[pool]\n{pool}[[model]]\nname = 'm'\npath = 'm.onnx'\n{model}[[model.workers]]\n{group}"
    config = PoolConfig.from_toml(text, base_dir=tmp_path)
    [model_config] = config.models
    placement = Placement(
        model_config, model_config.groups[0], None, given.get("adapter"), Estimate(0, "configured", "")
    )
    [slot] = build_slots(Plan(config, (placement,), ()), ShardMap("redis://127.0.0.1:6379/0"))
    argv = list(slot.argv[slot.argv.index("worker") + 1 :])
    assert argv[:4] == ["--model", str(tmp_path / "m.onnx"), "--name", "m"]
    parsed = parse(argv)
    assert {name: getattr(parsed, name) for name in given} == given


def test_an_option_in_a_group_adds_to_the_models_and_wins(tmp_path: Path) -> None:
    text = (
        "[[model]]\nname = 'm'\npath = 'm.onnx'\nprovider = 'cuda'\n"
        "provider_options = { use_tf32 = '0', gpu_mem_limit = '1' }\n"
        "[[model.workers]]\ncount = 1\nprovider_options = { gpu_mem_limit = '2' }\n"
    )
    [model] = PoolConfig.from_toml(text, base_dir=tmp_path).models
    placement = Placement(model, model.groups[0], None, "0", Estimate(0, "configured", ""))
    [slot] = build_slots(Plan(PoolConfig.from_toml(text, base_dir=tmp_path), (placement,), ()), ShardMap("redis://h/0"))
    parsed = parse(list(slot.argv[slot.argv.index("worker") + 1 :]))
    assert parsed.provider_options == (("use_tf32", "0"), ("gpu_mem_limit", "2")) and parsed.adapter == "0"


@pytest.mark.parametrize(
    ("argv", "key", "message"),
    [
        (["--max-wait-ms", "2"], "max_wait_ms = 2", "only applies with {max_batch} > 1"),
        (["--job-timeout", "700"], "job_timeout = 700", "{job_timeout} (700 s) must be shorter than {stall_seconds}"),
        (["--device-lost-pattern", "lost("], "device_lost_pattern = 'lost('", "{device_lost_pattern} 'lost('"),
        (["--policy", "max-efficiency"], "policy = 'max-efficiency'", "{policy} applies to {auto} (and winml) only"),
        (["--max-batch", "4"], "max_batch = 4", "say so with {rows_independent}"),
    ],
)
def test_the_same_rule_refuses_a_flag_and_a_key_each_in_its_own_words(
    argv: list[str], key: str, message: str, tmp_path: Path
) -> None:
    """One check (options.check) for both; its message names flags on the command line, keys in pool.toml."""
    flags = {o.field: o.flag for o in OPTIONS} | {"auto": "--provider auto"}
    keys = {o.field: o.toml for o in OPTIONS} | {"auto": "provider 'auto'"}
    with pytest.raises(ConfigurationError) as on_command_line:
        parse(identity_argv() + argv)
    assert message.format(**flags) in str(on_command_line.value)
    text = f"[[model]]\nname = 'm'\npath = 'm.onnx'\n{key}\n[[model.workers]]\ncount = 1\n"
    with pytest.raises(ConfigurationError) as in_pool_toml:
        PoolConfig.from_toml(text, base_dir=tmp_path)
    assert message.format(**keys) in str(in_pool_toml.value)


def _env_text(kind: Kind, value: Any) -> str:
    if kind is Kind.FLAG:
        return "1" if value else "0"
    if kind is Kind.PAIRS:
        return " ".join(f"{k}={v}" for k, v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _toml(kind: Kind, value: Any) -> str:
    if kind is Kind.FLAG:
        return "true" if value else "false"
    if kind is Kind.PAIRS:
        return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value) + " }"
    return json.dumps(value)
