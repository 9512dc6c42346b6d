"""``ortq pool``: the config file, planning against recorded adapter tables, the restart policy, and
real pools of CPU workers (real redis-server, real ``ortq worker`` processes, real jobs)."""

from __future__ import annotations

import os
import re
import signal
import sys
import textwrap
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ortq.demo import HOLDOUT_PATH, MODEL_PATH
from ortq.devices.adapters import Adapter
from ortq.errors import AdapterNotFound, AmbiguousAdapter, ConfigurationError
from ortq.pool.config import PoolConfig, RestartPolicy
from ortq.pool.plan import (
    PROCESS_OVERHEAD_BYTES,
    SESSION_FILE_FACTOR,
    SESSION_FIXED_BYTES,
    WorkerSlot,
    build_slots,
    format_plan,
    make_plan,
)
from ortq.pool.restart import Action, ExitHistory, decide
from ortq.pool.supervisor import Supervisor
from ortq.producer import Producer
from ortq.shards import ShardMap
from tests.cli_support import Result, invoke
from tests.conftest import REPO, Pool, eventually
from tests.test_adapters import LAPTOP

MiB, GiB = 1024**2, 1024**3

#: A workstation with two identical 24 GiB GPUs, as NVML and DXGI report them (the shape of
#: tests/test_adapters.py's WORKSTATION, with the memory both report).
TWIN_GPUS = [
    Adapter("cuda", 0, "NVIDIA GeForce RTX 4090", "discrete", uuid="GPU-5f3c0a9e-1111-2222-3333-444455556666",
            memory_bytes=24 * GiB),
    Adapter("cuda", 1, "NVIDIA GeForce RTX 4090", "discrete", uuid="GPU-9d01be42-aaaa-bbbb-cccc-ddddeeeeffff",
            memory_bytes=24 * GiB),
    Adapter("dml", 0, "NVIDIA GeForce RTX 4090", "discrete", luid="0x00000000000a1b01", memory_bytes=24 * GiB),
    Adapter("dml", 1, "NVIDIA GeForce RTX 4090", "discrete", luid="0x00000000000a1c77", memory_bytes=24 * GiB),
    Adapter("cpu", None, "AMD Ryzen Threadripper", "cpu", memory_bytes=128 * GiB),
]  # fmt: skip


#: A model table and a workers table, for configs built up in tests.
MODEL = '[[model]]\nname = "m"\npath = "digits.onnx"\n'
GROUP = "[[model.workers]]\ncount = 2\n"


def no_measure(path: Path, threads: int | None, max_batch: int, custom_ops: str | None) -> str:
    raise AssertionError("measure_memory = false: nothing may be measured")


def config(text: str, tmp_path: Path) -> PoolConfig:
    path = tmp_path / "pool.toml"
    path.write_text(textwrap.dedent(text))
    return PoolConfig.from_file(path)


def ortq(*args: str) -> Result:
    """``ortq ARGS`` in this process (tests/cli_support.py): ``pool --check`` plans and starts nothing."""
    return invoke(*args)


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    """The digits model next to the test's pool.toml (paths in it are relative to its folder)."""
    path = tmp_path / "digits.onnx"
    path.write_bytes(MODEL_PATH.read_bytes())
    return path


# ------------------------------------------------------------------------------------ 1. the config file


def test_check_prints_the_plan_and_starts_nothing(
    tmp_path: Path, model_file: Path, redis_url: str, producer: Producer, model_name: str
) -> None:
    path = tmp_path / "pool.toml"
    path.write_text(f'[[model]]\nname = "{model_name}"\npath = "digits.onnx"\nthreads = 1\n' + GROUP)
    done = ortq("pool", "--config", str(path), "--check", "--redis-url", redis_url)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith(model_name))
    assert re.search(rf"^{model_name}\s+cpu\s+.+\s+2\s+\d+ MiB \(measured\)$", row), done.stdout
    assert re.search(r"^cpu \(.+\)\s+2\s+\d+ MiB\s+none\s+[\d.]+ GiB\s+\d+%\s+ok$", done.stdout, re.M), done.stdout
    assert re.search(rf"{model_name}: \d+ MiB = process \d+ MiB \+ session \d+ MiB, measured", done.stdout)
    assert producer.workers(model_name) == []


BAD_CONFIGS = [
    ("[pools]\n", "the top level: unknown key 'pools'; did you mean 'pool'?"),
    ("[pool]\ngrace = 3\n", "[pool]: unknown key 'grace'; did you mean 'grace_seconds'?"),
    ("[pool]\n[pool.restart]\nbackoff_max_seconds = 0.5\n",
     "[pool.restart]: backoff_max_seconds (0.5) is less than backoff_initial_seconds (1)"),
    ("[pool]\nredis_url = 'http://x'\n", "[pool]: redis_url must start with redis://"),
    ("[pool]\nmetrics_port_base = 65535\n", "metrics_port_base 65535 + 2 workers passes 65535"),
    ("[pool.env]\nORTQ_ADAPTER = '1'\n", "[pool.env]: ORTQ_ADAPTER cannot be set here: the pool sets it from adapter"),
    ("[pool.env]\nCUDA_VISIBLE_DEVICES = '1'\n", "CUDA_VISIBLE_DEVICES cannot be set here: the pool gives"),
    ("[pool.env]\nFLAG = true\n", "FLAG must be a string or a number, got True (a boolean)"),
    ("[pool]\nmodel = 1\n", "[pool]: unknown key 'model'"),
]  # fmt: skip
BAD_MODELS = [
    ("max_batchs = 4\n", GROUP, "[[model]] #1 ('m'): unknown key 'max_batchs'; did you mean 'max_batch'?"),
    ("max_batch = '16'\n", GROUP, "[[model]] #1 ('m'): max_batch must be an integer >= 1, got '16' (a string)"),
    ("threads = 0\n", GROUP, "threads must be an integer >= 1, got 0"),
    ("provider = 'gpu'\n", GROUP, "provider must be one of dml, cuda, cpu, auto, webgpu, plugin, winml, got 'gpu'"),
    ("provider = 'winml'\n", GROUP, "provider 'winml' is not planned by ortq pool"),
    ("provider = 'plugin'\n", GROUP, "provider 'plugin' needs ep_library"),
    ("provider = 'cuda'\nep_library = 'libep.so'\n", GROUP,
     "ep_library applies to provider 'plugin' only, not provider 'cuda'"),
    ("provider = 'webgpu'\nep_name = 'X'\n", GROUP,
     "ep_name applies to provider 'plugin' (and winml) only, not provider 'webgpu'"),
    ("max_wait_ms = 2\n", GROUP, "max_wait_ms only applies with max_batch > 1"),
    ("max_batch = 4\n", GROUP, "max_batch joins the rows of several jobs into one run: that is only safe"),
    ("max_batch = 4\n", GROUP, "say so with rows_independent (docs/pool.md, 'Batching')"),
    ("policy = 'max-performance'\n", GROUP, "policy applies to provider 'auto' (and winml) only, not provider 'cpu'"),
    ("device_lost_pattern = 'lost('\n", GROUP, "device_lost_pattern 'lost(': missing ), unterminated subpattern"),
    ("", "", "[[model]] #1 ('m'): no [[model.workers]] tables"),
    ("", "[[model.workers]]\nadapter = 'discrete'\ncount = 1\n",
     "[[model]] #1 ('m') [[model.workers]] #1: adapter does not apply to provider 'cpu'"),
    ("", "[[model.workers]]\ncount = 1\ncuont = 2\n",
     "[[model.workers]] #1: unknown key 'cuont'; did you mean 'count'?"),
    ("", "[[model.workers]]\nadapter = '0'\n", "count is missing"),
    ("[model.env]\nORTQ_THREADS = '2'\n", GROUP, "ORTQ_THREADS cannot be set here: the pool sets it from threads"),
    ("stall_seconds = -1\n", GROUP, "stall_seconds must be a number >= 0"),
    ("job_timeout = 0\n", GROUP, "job_timeout must be a number > 0"),
    ("job_timeout = 700\n", GROUP, "job_timeout (700 s) must be shorter than stall_seconds (600 s)"),
    ("stall_seconds = 20\njob_timeout = 20\n", GROUP, "job_timeout (20 s) must be shorter than stall_seconds (20 s)"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), BAD_CONFIGS)
def test_bad_pool_tables_are_refused_naming_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        config(text + MODEL + GROUP, tmp_path)
    assert str(caught.value).startswith(f"{tmp_path / 'pool.toml'}: "), caught.value
    assert message in str(caught.value)


@pytest.mark.parametrize(("model", "group", "message"), BAD_MODELS)
def test_bad_model_tables_are_refused_naming_file_and_key(tmp_path: Path, model: str, group: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        config(MODEL + model + group, tmp_path)
    assert str(caught.value).startswith(f"{tmp_path / 'pool.toml'}: "), caught.value
    assert message in str(caught.value)


def test_more_config_refusals(tmp_path: Path, model_file: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"pool.toml: not valid TOML: .*line 1"):
        config("[[model]\n", tmp_path)
    with pytest.raises(ConfigurationError, match="no \\[\\[model\\]\\] tables"):
        config("[pool]\n", tmp_path)
    with pytest.raises(ConfigurationError, match="two \\[\\[model\\]\\] tables are named 'm'"):
        config(MODEL + GROUP + MODEL + GROUP, tmp_path)
    with pytest.raises(ConfigurationError, match="invalid model name 'no spaces'"):
        config(MODEL.replace('"m"', '"no spaces"') + GROUP, tmp_path)
    with pytest.raises(ConfigurationError, match="cannot read pool config"):
        PoolConfig.from_file(tmp_path / "missing.toml")
    # Planning checks what parsing cannot: the files and the adapter specs.
    missing = config(MODEL.replace("digits.onnx", "gone.onnx") + GROUP, tmp_path)
    with pytest.raises(ConfigurationError, match=r"\[\[model\]\] 'm': path .*gone.onnx is not a file"):
        make_plan(missing, TWIN_GPUS, measure=no_measure)
    fastest = config(MODEL + "provider = 'cuda'\n[[model.workers]]\nadapter = 'fastest'\ncount = 1\n", tmp_path)
    with pytest.raises(ConfigurationError, match=r"#1: adapter 'fastest': unknown adapter spec"):
        make_plan(fastest, TWIN_GPUS, measure=no_measure)


def test_stall_seconds_and_job_timeout_reach_the_workers_command_line(tmp_path: Path, model_file: Path) -> None:
    text = (
        "[pool]\nmeasure_memory = false\n"
        + MODEL
        + "stall_seconds = 90\njob_timeout = 30.5\n"
        + GROUP
        + MODEL.replace('"m"', '"n"')
        + GROUP
    )
    slots = build_slots(make_plan(config(text, tmp_path), TWIN_GPUS, measure=no_measure), ShardMap("redis://h:1/0"))
    timed, untimed = (slot.argv[slot.argv.index("worker") + 1 :] for slot in (slots[0], slots[-1]))
    assert timed[timed.index("--stall-seconds") + 1 :][:3] == ("90", "--job-timeout", "30.5")
    assert "--stall-seconds" not in untimed and "--job-timeout" not in untimed  # the worker's defaults
    never = config(MODEL + "stall_seconds = 0\njob_timeout = 5000\n" + GROUP, tmp_path)
    assert never.models[0].option("stall_seconds") == 0


def test_the_command_line_refuses_a_bad_config_with_one_line(tmp_path: Path, model_file: Path) -> None:
    path = tmp_path / "pool.toml"
    path.write_text(MODEL + "max_batchs = 4\n" + GROUP)
    done = ortq("pool", "--config", str(path), "--check")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"ortq: ConfigurationError: {path}: [[model]] #1 ('m'): unknown key 'max_batchs'; did you mean 'max_batch'?"
    )


def test_the_example_config_parses(tmp_path: Path) -> None:
    example = PoolConfig.from_file(REPO / "deploy" / "pool.example.toml")
    assert example.worker_count >= 3 and {m.provider for m in example.models} >= {"cpu", "cuda"}
    # Its commented WebGPU and plugin models parse once uncommented.
    text = (REPO / "deploy" / "pool.example.toml").read_text()
    head, others = text.split(" other providers\n")
    tables = [line[2:] for line in others.splitlines() if re.match(r"# (\[\[|\w+ = )", line)]
    (tmp_path / "pool.toml").write_text(head + "\n" + "\n".join(tables) + "\n")
    uncommented = PoolConfig.from_file(tmp_path / "pool.toml")
    providers = {m.provider: m.groups[0].adapter for m in uncommented.models[-2:]}
    assert providers == {"webgpu": "high-performance", "plugin": "npu"}
    assert uncommented.models[-1].ep_library == "/opt/my-ep/libmy_ep.so"


# ------------------------------------------------------------------------------------ 2. planning


def test_twin_gpus_each_worker_gets_its_device_by_a_stable_spec(tmp_path: Path, model_file: Path) -> None:
    pool = config(
        """
        [pool]
        metrics_port_base = 9300
        measure_memory = false
        [[model]]
        name = "resnet"
        path = "digits.onnx"
        provider = "cuda"
        max_batch = 8
        max_wait_ms = 2
        rows_independent = true
        [[model.workers]]
        adapter = "0"
        count = 2
        [[model.workers]]
        adapter = "uuid:GPU-9d01"
        count = 1
        [[model]]
        name = "bert"
        path = "digits.onnx"
        provider = "dml"
        [[model.workers]]
        adapter = "luid:0xa1c77"
        count = 1
        [[model]]
        name = "cpu-side"
        path = "digits.onnx"
        [[model.workers]]
        count = 1
        """,
        tmp_path,
    )
    plan = make_plan(pool, TWIN_GPUS, measure=no_measure)
    slots = build_slots(plan, ShardMap("redis://127.0.0.1:6379/5"))
    adapter_of = {s.label: s.argv[s.argv.index("--adapter") + 1] if "--adapter" in s.argv else None for s in slots}
    assert adapter_of == {
        "resnet.0": "uuid:GPU-5f3c0a9e-1111-2222-3333-444455556666",
        "resnet.1": "uuid:GPU-5f3c0a9e-1111-2222-3333-444455556666",
        "resnet.2": "uuid:GPU-9d01be42-aaaa-bbbb-cccc-ddddeeeeffff",
        "bert.0": "luid:0x00000000000a1c77",
        "cpu-side.0": None,
    }
    ports = [s.argv[s.argv.index("--metrics-port") + 1] for s in slots]
    assert ports == ["9300", "9301", "9302", "9303", "9304"]
    resnet = slots[0]
    assert resnet.argv[:4] == (sys.executable, "-m", "ortq", "worker")
    assert "--max-batch" in resnet.argv and resnet.argv[resnet.argv.index("--max-wait-ms") + 1] == "2"
    assert dict(resnet.env)["ORTQ_REDIS_URL"] == "redis://127.0.0.1:6379/5"
    assert "redis://" not in " ".join(resnet.argv)  # a password in the URL stays out of the process list
    workers = {(load.adapter.provider, load.adapter.index): load.workers for load in plan.loads}
    assert workers == {("cuda", 0): 2, ("cuda", 1): 1, ("dml", 1): 1, ("cpu", None): 1}
    text = format_plan(plan)
    assert "uuid:GPU-9d01 -> uuid:GPU-9d01be42-aaaa-bbbb-cccc-ddddeeeeffff" in text


#: A Linux box whose Vulkan loader lists an NVIDIA GPU and Mesa's lavapipe (WebGPU rows, as
#: plugin_ep.vulkan_adapters makes them), and two plugin EP libraries' devices.
VULKAN_BOX = [
    Adapter("cuda", 0, "NVIDIA H200", "discrete", uuid="GPU-0c1d2e3f-1111-2222-3333-444455556666",
            memory_bytes=141 * GiB),
    Adapter("webgpu", 0, "NVIDIA H200", "discrete", uuid="GPU-0c1d2e3f-1111-2222-3333-444455556666",
            memory_bytes=141 * GiB, ep_name="WebGpuExecutionProvider"),
    Adapter("webgpu", 1, "llvmpipe (LLVM 19.1.7, 256 bits)", "software", software=True,
            uuid="6d657361-3235-2e30-2e37-000000000000", ep_name="WebGpuExecutionProvider"),
    Adapter("cpu", None, "Intel Xeon", "cpu", memory_bytes=128 * GiB),
]  # fmt: skip
ACME_ROWS = [
    Adapter("plugin", 0, "CPU", "cpu", ep_name="AcmeEP"),
    Adapter("plugin", 1, "Acme NPU", "npu", luid="0x0000000000001234", ep_name="AcmeEP"),
]
CPU_ONLY_ROWS = [Adapter("plugin", 0, "CPU", "cpu", ep_name="CpuOnlyEP")]


def test_webgpu_and_plugin_groups_are_planned_as_their_workers_resolve(tmp_path: Path, model_file: Path) -> None:
    (tmp_path / "libacme.so").write_bytes(b"")
    text = """
        [pool]
        measure_memory = false
        [[model]]
        name = "web"
        path = "digits.onnx"
        provider = "webgpu"
        [[model.workers]]
        count = 2
        [[model]]
        name = "acme"
        path = "digits.onnx"
        provider = "plugin"
        ep_library = "libacme.so"
        ep_name = "AcmeEP"
        [[model.workers]]
        count = 1
        [[model.workers]]
        adapter = "cpu"
        count = 1
        """
    pool = config(text, tmp_path)
    library = (tmp_path / "libacme.so").resolve()
    assert pool.models[1].ep_library == str(library)
    plan = make_plan(pool, VULKAN_BOX, measure=no_measure, plugins={(str(library), "AcmeEP"): ACME_ROWS})
    slots = build_slots(plan, ShardMap("redis://127.0.0.1:6379/5"))
    argv = {s.label: s.argv[s.argv.index("worker") + 1 :] for s in slots}
    # WebGPU by default: the GPU Dawn's high-performance preference picks, by its stable spec.
    assert argv["web.0"][argv["web.0"].index("--adapter") + 1] == "uuid:GPU-0c1d2e3f-1111-2222-3333-444455556666"
    assert "--ep-library" not in argv["web.0"]
    # The plugin EP: its first device that is not the CPU; the CPU only where asked for.
    acme = [argv["acme.0"], argv["acme.1"]]
    assert [a[a.index("--adapter") + 1] for a in acme] == ["luid:0x0000000000001234", "0"]
    assert all(a[a.index("--ep-library") + 1] == str(library) and a[a.index("--ep-name") + 1] == "AcmeEP" for a in acme)
    assert {(load.adapter.provider, load.adapter.index): load.workers for load in plan.loads} == {
        ("webgpu", 0): 2,
        ("plugin", 1): 1,
        ("plugin", 0): 1,
    }
    assert "256 MiB" in format_plan(plan) and "WebGPU device" in format_plan(plan)

    # A GPU no power preference reaches is refused, as its worker would refuse it.
    software = config(text.replace("count = 2", 'adapter = "name:llvmpipe"\ncount = 2'), tmp_path)
    with pytest.raises(
        ConfigurationError, match=r"\[\[model\]\] 'web' \[\[model.workers\]\] #1: .*no preference reaches"
    ):
        make_plan(software, VULKAN_BOX, measure=no_measure, plugins={(str(library), "AcmeEP"): ACME_ROWS})
    # An EP that offers only the CPU is not run there unasked; another library's devices are its own.
    cpu_only = config(text.replace('ep_name = "AcmeEP"', 'ep_name = "CpuOnlyEP"'), tmp_path)
    rows = {(str(library), "CpuOnlyEP"): CPU_ONLY_ROWS, (str(library), "AcmeEP"): ACME_ROWS}
    with pytest.raises(AdapterNotFound, match="CpuOnlyEP offers only CPU devices"):
        make_plan(cpu_only, VULKAN_BOX, measure=no_measure, plugins=rows)
    with pytest.raises(AdapterNotFound, match="no plugin adapters on this machine"):
        make_plan(pool, VULKAN_BOX, measure=no_measure, plugins={})


def test_estimates_say_what_was_measured(tmp_path: Path, model_file: Path) -> None:
    two_models = MODEL + "provider = 'cuda'\n" + GROUP + MODEL.replace('"m"', '"c"') + GROUP
    estimated = make_plan(config("[pool]\nmeasure_memory = false\n" + two_models, tmp_path), TWIN_GPUS,
                          measure=no_measure)  # fmt: skip
    by_model = {p.model.name: p.estimate for p in estimated.placements}
    session = SESSION_FILE_FACTOR * model_file.stat().st_size + SESSION_FIXED_BYTES
    assert by_model["m"].bytes == PROCESS_OVERHEAD_BYTES["cuda"] + session and by_model["m"].kind == "estimated"
    assert by_model["c"].bytes == PROCESS_OVERHEAD_BYTES["cpu"] + session and by_model["c"].kind == "estimated"
    # Measured for real: a CPU session of the model in a subprocess.
    measured = make_plan(config(two_models, tmp_path), TWIN_GPUS)
    by_model = {p.model.name: p.estimate for p in measured.placements}
    assert by_model["c"].kind == "measured" and by_model["m"].kind == "partly measured"
    cpu_session = by_model["c"].bytes - by_model["m"].bytes + PROCESS_OVERHEAD_BYTES["cuda"]
    assert 20 * MiB < cpu_session < 1 * GiB  # the process itself (interpreter, ortq, ONNX Runtime) is in it
    assert "measured on the CPU + CUDA context 512 MiB estimated" in by_model["m"].detail


def test_the_same_gpu_by_two_specs_is_one_load_and_memory_warns_then_refuses(tmp_path: Path, model_file: Path) -> None:
    def gpu_pool(second_count: int) -> PoolConfig:
        return config(
            f"""
            [[model]]
            name = "big"
            path = "digits.onnx"
            provider = "cuda"
            memory_per_worker_mib = {10 * 1024}
            [[model.workers]]
            adapter = "0"
            count = 1
            [[model.workers]]
            adapter = "uuid:GPU-5f3c"
            count = {second_count}
            """,
            tmp_path,
        )

    high = make_plan(gpu_pool(1), TWIN_GPUS, measure=no_measure)
    (load,) = high.loads
    assert (load.adapter.index, load.workers, load.total_bytes, load.verdict) == (0, 2, 20 * GiB, "high")
    assert high.warnings() == ["cuda 0 (NVIDIA GeForce RTX 4090): 2 workers need about 20.0 GiB of its 24.0 GiB (83%)"]
    assert high.refusals() == []
    over = make_plan(gpu_pool(2), TWIN_GPUS, measure=no_measure)
    assert over.loads[0].verdict == "over" and over.warnings() == []
    assert over.refusals() == ["cuda 0 (NVIDIA GeForce RTX 4090): 3 workers need about 30.0 GiB of its 24.0 GiB (125%)"]
    assert "REFUSED: cuda 0" in format_plan(over) and "configured" in format_plan(over)


def test_laptop_and_unknown_memory(tmp_path: Path, model_file: Path) -> None:
    pool = config(
        "[pool]\nmeasure_memory = false\n"
        + MODEL
        + "provider = 'dml'\n[[model.workers]]\nadapter = 'discrete'\ncount = 1\n"
        + "[[model.workers]]\nadapter = 'minimum-power'\ncount = 1\n"
        + "[[model.workers]]\nadapter = 'name:basic render'\ncount = 1\n",
        tmp_path,
    )
    plan = make_plan(pool, LAPTOP, measure=no_measure)
    assert [p.adapter_arg for p in plan.placements] == ["luid:0x0000000000012f41", "luid:0x0000000000011c2e",
                                                        "luid:0x0000000000013311"]  # fmt: skip
    verdicts = {load.adapter.kind: load.verdict for load in plan.loads}
    # An integrated GPU's 128 MiB is its dedicated carve-out, not what it can use (shared system
    # memory, which the adapter table does not carry); the software adapter reports none at all.
    assert verdicts == {"discrete": "ok", "integrated": "unknown", "software": "unknown"}
    assert re.search(r"^dml 0 \(Intel\(R\) Iris\(R\) Xe Graphics\)\s+1\s+\d+ MiB\s+none\s+shared\s+not checked$",
                     format_plan(plan), re.M), format_plan(plan)  # fmt: skip


def test_specs_that_match_several_or_no_adapters(tmp_path: Path, model_file: Path) -> None:
    ambiguous = config(MODEL + "provider = 'cuda'\n[[model.workers]]\nadapter = 'name:4090'\ncount = 1\n", tmp_path)
    with pytest.raises(AmbiguousAdapter) as caught:
        make_plan(ambiguous, TWIN_GPUS, measure=no_measure)
    assert "[[model]] 'm' [[model.workers]] #1: adapter 'name:4090': 2 cuda adapters match" in str(caught.value)
    no_cuda = config(MODEL + "provider = 'cuda'\n" + GROUP, tmp_path)
    with pytest.raises(AdapterNotFound, match=r"adapter '0': no cuda adapters on this machine \(no CUDA devices"):
        make_plan(no_cuda, LAPTOP, ["no CUDA devices (no NVIDIA driver, ...)"], measure=no_measure)


def test_force_accepts_what_check_refuses(tmp_path: Path, model_file: Path) -> None:
    path = tmp_path / "pool.toml"
    path.write_text(MODEL + f"memory_per_worker_mib = {64 * 1024**2}\n" + GROUP)  # 64 TiB per worker
    refused = ortq("pool", "--config", str(path), "--check")
    assert refused.returncode == 2, refused.stdout
    assert "REFUSED: cpu" in refused.stdout and "not enough memory: cpu" in refused.stderr
    forced = ortq("pool", "--config", str(path), "--check", "--force")
    assert forced.returncode == 0, forced.stderr


# ------------------------------------------------------------------------------------ 3. the restart policy

POLICY = RestartPolicy(backoff_initial_seconds=1, backoff_max_seconds=60, healthy_after_seconds=30,
                       configuration_retry_seconds=45, max_configuration_errors=3)  # fmt: skip


def run_exits(exits: list[tuple[int, float]], burst: bool = False) -> list[tuple[str, float]]:
    """(action, delay) for each (exit status, uptime) in turn, as one worker's history."""
    history, out = ExitHistory(), []
    for code, uptime in exits:
        decision = decide(POLICY, history, code, uptime, burst)
        history = decision.history
        out.append((decision.action.value, decision.delay))
    return out


def test_crashes_back_off_doubling_to_the_cap_and_a_healthy_run_resets() -> None:
    crashes = [(1, 2.0)] * 8 + [(-9, 31.0), (1, 1.0)]
    delays = [delay for _, delay in run_exits(crashes)]
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 1, 2]


def test_device_lost_restarts_at_once_the_first_time_only() -> None:
    assert run_exits([(75, 5.0), (75, 5.0), (75, 5.0)]) == [("restart", 0), ("restart", 1), ("restart", 2)]
    # After a healthy run it is "the first time" again.
    assert run_exits([(75, 5.0), (75, 40.0)]) == [("restart", 0), ("restart", 0)]


def test_configuration_errors_wait_long_then_give_up() -> None:
    assert run_exits([(2, 1.0)] * 3) == [("restart", 45), ("restart", 45), ("give up", 0)]
    # Only errors in a row count: a crash in between starts the count again.
    assert run_exits([(2, 1.0), (2, 1.0), (1, 1.0), (2, 1.0)])[-1] == ("restart", 45)


def test_clean_exits() -> None:
    assert run_exits([(0, 1.0)], burst=True) == [("finished", 0)]
    # Not asked by the pool: restarted, with the crash backoff so that repeated outside stops do not loop.
    assert run_exits([(0, 1.0), (0, 1.0)]) == [("restart", 1), ("restart", 2)]


def test_the_supervisor_restarts_a_real_exit_75_at_once(tmp_path: Path) -> None:
    """No real trigger makes a CPU worker lose its device: a real process exits 75 instead."""
    marker = tmp_path / "lost-once"
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        if not os.path.exists({str(marker)!r}):
            open({str(marker)!r}, "w").close()
            sys.exit(75)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        print("serving", flush=True)
        while True:
            time.sleep(1)
    """)
    output = tmp_path / "out.txt"
    with open(output, "w") as out:
        supervisor = Supervisor([WorkerSlot(0, "lossy.0", (sys.executable, "-c", script), ())],
                                replace(POLICY, backoff_initial_seconds=30), grace_seconds=10, output=out)  # fmt: skip
        result: list[int] = []
        thread = threading.Thread(target=lambda: result.append(supervisor.run()))
        thread.start()
        try:
            eventually(lambda: "lossy.0 | serving" in output.read_text(), timeout=30)
        finally:
            supervisor.request_stop()
            thread.join(30)
    (lost,) = supervisor.exits
    assert (lost.code, lost.decision.action, lost.decision.delay) == (75, Action.RESTART, 0.0)
    assert result == [0]


# ------------------------------------------------------------------------------------ 4. real pools


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def test_a_pool_serves_restarts_a_killed_worker_and_stops_cleanly(
    tmp_path: Path, model_file: Path, redis_url: str, producer: Producer, model_name: str, pools: list[Pool]
) -> None:
    path = tmp_path / "pool.toml"
    path.write_text(
        textwrap.dedent(f"""
        [pool]
        grace_seconds = 20
        [pool.restart]
        backoff_initial_seconds = 0.2
        [[model]]
        name = "{model_name}"
        path = "digits.onnx"
        threads = 1
        [[model.workers]]
        count = 2
    """)
    )
    pool = Pool(path, redis_url)
    pools.append(pool)
    first = {r["name"]: r["pid"] for r in producer.wait_for_workers(model_name, 2, timeout=60)}
    assert len(first) == 2

    import onnxruntime as ort

    session = ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
    pixels = np.load(HOLDOUT_PATH)["pixels"][:24]

    def check_jobs() -> None:
        jobs = producer.submit_many(model_name, [{"pixels": row[None]} for row in pixels])
        for got, row in zip(producer.results(jobs, timeout=60), pixels, strict=True):
            probabilities, label = session.run(["probabilities", "label"], {"pixels": row[None]})
            np.testing.assert_allclose(got["probabilities"], probabilities, rtol=1e-6)
            np.testing.assert_array_equal(got["label"], label)

    check_jobs()
    killed_name, killed_pid = sorted(first.items())[0]
    os.kill(killed_pid, signal.SIGKILL)
    eventually(lambda: {r["pid"] for r in producer.workers(model_name)} - set(first.values()), timeout=60)
    check_jobs()
    after = {r["name"]: r["pid"] for r in producer.workers(model_name)}
    (restarted_name,) = set(after) - set(first)
    assert restarted_name.startswith(killed_name.rsplit(".", 1)[0] + ".")  # same slot, next start number
    text = pool.text()
    assert re.search(rf"worker {model_name}\.\d \(pid {killed_pid}\) killed by SIGKILL after [\d.]+ s: crashed; "
                     r"restarting in 0.2 s", text), text  # fmt: skip
    assert re.search(rf"^{model_name}\.[01] \| .* serving model '{model_name}'", text, re.M), text

    pool.process.send_signal(signal.SIGTERM)
    assert pool.wait() == 0, pool.text()
    live = [pid for name, pid in after.items() if name != killed_name]
    assert len(live) == 2 and not any(alive(pid) for pid in live), "a worker outlived its pool"
    names_left = {r["name"] for r in producer.workers(model_name)}
    assert names_left <= {killed_name}, "a cleanly stopped worker did not unregister"
    assert "got SIGTERM: stopping 2 workers" in pool.text()
    assert_pool_exited_after_its_workers(pool.text(), model_name, live)


def assert_pool_exited_after_its_workers(text: str, model_name: str, pids: list[int]) -> None:
    """The pool's output ends with one line saying what stopped and its exit status, right after
    its workers' last words and its own note of each one's exit: nothing else was waited for."""
    lines = text.splitlines()
    assert re.search(r" ortq\.pool INFO pool stopped \(got SIGTERM\): 2 workers stopped cleanly; exit status 0$",
                     lines[-1]), text  # fmt: skip
    noted = [
        i
        for i, line in enumerate(lines)
        if re.search(rf"worker {model_name}\.\d \(pid ({'|'.join(map(str, pids))})\) stopped$", line)
    ]
    said = [
        i for i, line in enumerate(lines) if re.search(rf"^{model_name}\.\d \| .* stopped \(exit status 0\)$", line)
    ]
    assert len(noted) == 2 and len(said) == 2, text
    assert max(said) < min(noted) and noted == [len(lines) - 3, len(lines) - 2], text


def test_a_worker_that_cannot_start_is_not_restarted_in_a_loop(
    tmp_path: Path, redis_url: str, model_name: str, pools: list[Pool]
) -> None:
    """A file that is not an ONNX model: the worker exits 2 (ModelLoadError) every time."""
    (tmp_path / "broken.onnx").write_bytes(b"this is not an ONNX model")
    path = tmp_path / "pool.toml"
    path.write_text(
        textwrap.dedent(f"""
        [pool]
        measure_memory = false   # measuring would refuse the plan: the worker must be the one to fail
        [pool.restart]
        configuration_retry_seconds = 0.5
        max_configuration_errors = 2
        [[model]]
        name = "{model_name}"
        path = "broken.onnx"
        [[model.workers]]
        count = 1
    """)
    )
    pool = Pool(path, redis_url)
    pools.append(pool)
    assert pool.wait() == 2, pool.text()
    text = pool.text()
    assert len(re.findall(rf"worker {model_name}\.0 started", text)) == 2, text
    assert re.search(r"exit 2 \(configuration error\) after [\d.]+ s: refused to start \(exit 2, 1 of 2 before giving "
                     r"up\); restarting at once would not help; restarting in 0.5 s", text), text  # fmt: skip
    assert "refused to start 2 times in a row (exit 2): fix the configuration and restart the pool. GIVING UP" in text
    assert "ModelLoadError" in text  # the worker's own message, relayed
    assert f"no workers left to run: gave up on {model_name}.0" in text
