"""``--provider-option KEY=VALUE`` (and ``--custom-ops``) on ``ortq worker``, ``$ORTQ_PROVIDER_OPTIONS`` /
``$ORTQ_CUSTOM_OPS``, ``provider_options`` / ``custom_ops`` in pool.toml: what reaches the session,
the refusals (malformed, ``device_id``, an option the provider does not report back), and the round
trip pool.toml -> the worker's command line -> the options the worker parses."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import onnxruntime as ort
import pytest

from ortq.cli import worker as worker_command
from ortq.errors import EXIT_CONFIGURATION, ConfigurationError, ProviderOptionRejected
from ortq.pool.config import PoolConfig
from ortq.pool.plan import build_slots, make_plan, worker_environment
from ortq.producer import Producer
from ortq.shards import ShardMap
from ortq.worker import provider_options
from ortq.worker.serve import WorkerConfig
from ortq.worker.session import SessionPlan, load_model
from tests.conftest import REPO, WorkerProcesses
from tests.test_plugin_ep import MISSING, REQUIRED
from tests.test_pool import TWIN_GPUS, no_measure

#: Worker starts with options: also under onnxruntime 1.20 (scripts/test.sh's second pass).
pytestmark = pytest.mark.rqcompat

#: The WebGPU EP needs onnxruntime >= 1.24.4: under the second pass's 1.20 it cannot be installed, so
#: CI's rule that WebGPU must run (tests/test_plugin_ep.py) holds only where it can.
_WEBGPU_POSSIBLE = tuple(int(part) for part in ort.__version__.split(".")[:3]) >= (1, 24, 4)
needs_webgpu = pytest.mark.skipif(
    MISSING is not None and not (REQUIRED and _WEBGPU_POSSIBLE), reason=f"WebGPU cannot run here: {MISSING}"
)

#: What a CUDA session made with ``{"device_id": "0", "use_tf32": "0"}`` reports for its EP, all as
#: strings: recorded by bench/gpu/tf32.py with onnxruntime-gpu 1.31.1 on a lent H100 (2026-12-06,
#: docs/results/tf32-2026-12-06.json).
CUDA_REPORTED = {
    "sdpa_kernel": "0", "use_tf32": "0", "fuse_conv_bias": "0", "prefer_nhwc": "0",
    "tunable_op_max_tuning_duration_ms": "0", "tunable_op_enable": "0", "tunable_op_tuning_enable": "0",
    "enable_cudnn": "1", "use_ep_level_unified_stream": "0", "device_id": "0", "has_user_compute_stream": "0",
    "external_data_loader_reading_threads": "4", "gpu_external_empty_cache": "0",
    "cudnn_conv_algo_search": "EXHAUSTIVE", "cudnn_conv1d_pad_to_nc1d": "0",
    "gpu_mem_limit": "18446744073709551615", "gpu_external_alloc": "0", "gpu_external_free": "0",
    "arena_extend_strategy": "kNextPowerOfTwo", "do_copy_in_default_stream": "1", "enable_cuda_graph": "0",
    "user_compute_stream": "0", "cudnn_conv_use_max_workspace": "1",
}  # fmt: skip


def refused_worker(*args: str) -> subprocess.CompletedProcess[str]:
    """``ortq worker`` expected to stop at start-up, before it reaches Redis (none at that port)."""
    command = [sys.executable, "-m", "ortq", "worker", "--name", "refused", "--redis-url", "redis://127.0.0.1:1/0",
               "--threads", "1", *args]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO, check=False)


# ------------------------------------------------------------------------------------ the session


def test_the_users_options_follow_ortqs_own() -> None:
    plan = SessionPlan("cuda", 1, None, False, user_options=(("use_tf32", "0"), ("cudnn_conv_algo_search", "DEFAULT")))
    [(ep, options)] = plan.providers() or []
    assert ep == "CUDAExecutionProvider"
    assert list(options.items()) == [("device_id", "1"), ("use_tf32", "0"), ("cudnn_conv_algo_search", "DEFAULT")]
    # The canary's CPU reference and a CPU fallback do not get options meant for CUDA.
    assert plan.cpu().providers() == [("CPUExecutionProvider", {})]


def test_device_id_is_ortqs_a_users_is_a_clear_error() -> None:
    with pytest.raises(ProviderOptionRejected, match=r"device_id is set by ortq from --adapter .* use --adapter"):
        WorkerConfig(Path("m.onnx"), "m", provider="cuda", provider_options=(("device_id", "1"),))
    # Where DirectML chooses by preference (no adapters enumerated), that preference is ortq's too.
    dml = SessionPlan("dml", None, None, False, extra_options=(("performance_preference", "high_performance"),),
                      user_options=(("performance_preference", "minimum_power"),))  # fmt: skip
    with pytest.raises(ProviderOptionRejected, match="performance_preference is set by ortq for this adapter"):
        dml.providers()
    done = refused_worker("--model", "m.onnx", "--provider", "cuda", "--provider-option", "device_id=1")
    assert done.returncode == EXIT_CONFIGURATION
    assert done.stderr.strip() == (
        "ortq: ProviderOptionRejected: provider option device_id is set by ortq from --adapter for --provider cuda: "
        "use --adapter instead"
    )


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ((("", "1"),), "key '': must be a non-empty string"),
        ((("a=b", "1"),), "key 'a=b': must be a non-empty string without '='"),
        ((("use tf32", "1"),), "without '=' or spaces"),
        ((("use_tf32", ""),), "use_tf32: the value must be a non-empty string, got ''"),
        ((("use_tf32", 0),), "the value must be a non-empty string, got 0"),
        ((("use_tf32", "0"), ("use_tf32", "1")), "use_tf32 is given twice"),
    ],
)
def test_malformed_options_are_refused(options: tuple[tuple[object, object], ...], says: str) -> None:
    with pytest.raises(ProviderOptionRejected, match=says):
        provider_options.check("cuda", options)


def test_the_command_line_form() -> None:
    assert provider_options.parse("gpu_mem_limit=2147483648") == ("gpu_mem_limit", "2147483648")
    assert provider_options.parse("key=a=b") == ("key", "a=b")  # the value may hold '='
    with pytest.raises(ProviderOptionRejected, match="'use_tf32': expected KEY=VALUE"):
        provider_options.parse("use_tf32")
    with pytest.raises(ProviderOptionRejected, match="does not apply to --provider auto"):
        WorkerConfig(Path("m.onnx"), "m", provider="auto", provider_options=(("x", "1"),))


def test_cuda_reports_its_options_and_a_misspelt_one_is_caught() -> None:
    assert (
        provider_options.not_taken((("use_tf32", "0"), ("cudnn_conv_algo_search", "EXHAUSTIVE")), CUDA_REPORTED) == []
    )
    assert provider_options.not_taken((("use_tf32", "false"),), CUDA_REPORTED) == []  # read as one boolean
    assert provider_options.not_taken((("use_tf23", "0"), ("use_tf32", "1")), CUDA_REPORTED) == [
        "use_tf23=0 (not among the options it reports)",
        "use_tf32=1 (it reports use_tf32=0)",
    ]


def test_onnx_runtimes_own_refusal_is_the_same_error() -> None:
    # CUDA's options parser refuses a key it does not know when the session is made, in these words
    # (onnxruntime/core/framework/provider_options_utils.h): no CPU fallback, the option is wrong anywhere.
    message = '[ONNXRuntimeError] : 1 : FAIL : Unknown provider option: "use_tf23".'
    refusal = provider_options.refused_by_runtime(message, (("use_tf23", "0"),))
    assert isinstance(refusal, ProviderOptionRejected)
    assert str(refusal) == f"ONNX Runtime refused a --provider-option: {message}"
    assert provider_options.refused_by_runtime("CUDA failure 100: no CUDA-capable device", (("x", "1"),)) is None
    assert provider_options.refused_by_runtime(message, ()) is None  # no option of the user's: not theirs


def test_the_cpu_provider_takes_no_option_and_the_worker_refuses_to_start(tiny_path: Path) -> None:
    # ONNX Runtime's CPU EP ignores every option, known or not: get_provider_options() shows none.
    with pytest.raises(
        ProviderOptionRejected, match=r"CPUExecutionProvider did not take --provider-option use_arena=0"
    ):
        load_model(tiny_path, SessionPlan("cpu", None, 1, False, user_options=(("use_arena", "0"),)))
    done = refused_worker("--model", str(tiny_path), "--provider-option", "use_arena=0")
    assert done.returncode == EXIT_CONFIGURATION
    assert done.stderr.strip() == (
        "ortq: ProviderOptionRejected: CPUExecutionProvider did not take --provider-option use_arena=0 (not among "
        "the options it reports). ONNX Runtime ignores options a provider does not know, so this one would have "
        "no effect; the options CPUExecutionProvider reports: none"
    )
    assert load_model(tiny_path, SessionPlan("cpu", None, 1, False)).provider_options == {}


@needs_webgpu
def test_an_option_reaches_a_real_workers_session(
    tiny_path: Path, producer: Producer, workers: WorkerProcesses, redis_url: str, model_name: str
) -> None:
    # A plugin EP reports what it was given: the WebGPU EP (on lavapipe) shows the worker's option.
    workers.serve(tiny_path, model_name, redis_url, 1, "--provider", "webgpu", "--provider-option",
                  "validationMode=disabled")  # fmt: skip
    [record] = producer.workers(model_name)
    assert record["provider"] == "WebGpuExecutionProvider"
    assert record["provider_options"] == {"validationMode": "disabled"}


# ------------------------------------------------------------------------------------ the round trip

POOL = """
    [pool]
    measure_memory = false
    [[model]]
    name = "resnet"
    path = "digits.onnx"
    provider = "cuda"
    custom_ops = "onnxruntime_extensions"
    provider_options = { use_tf32 = "0", cudnn_conv_algo_search = "HEURISTIC" }
    [[model.workers]]
    adapter = "0"
    count = 1
    [[model.workers]]
    adapter = "1"
    count = 1
    provider_options = { cudnn_conv_algo_search = "DEFAULT", gpu_mem_limit = 2147483648 }
    [[model]]
    name = "local"
    path = "digits.onnx"
    custom_ops = "lib/libmy_ops.so"
    [[model.workers]]
    count = 1
"""


def _pool(tmp_path: Path, text: str = POOL) -> PoolConfig:
    (tmp_path / "digits.onnx").write_bytes(b"not read: measure_memory = false")
    (tmp_path / "pool.toml").write_text(textwrap.dedent(text))
    return PoolConfig.from_file(tmp_path / "pool.toml")


def test_pool_toml_to_command_line_to_the_workers_options(tmp_path: Path) -> None:
    slots = build_slots(make_plan(_pool(tmp_path), TWIN_GPUS, measure=no_measure), ShardMap("redis://h:1/0"))
    parsed = []
    for slot in slots:
        argv = list(slot.argv[slot.argv.index("worker") + 1 :])
        context = worker_command.make_context("worker", argv)  # what `ortq worker` reads of them
        parsed.append((context.params["custom_ops"], context.params["provider_options"]))
    assert parsed == [
        ("onnxruntime_extensions", ("use_tf32=0", "cudnn_conv_algo_search=HEURISTIC")),
        ("onnxruntime_extensions", ("use_tf32=0", "cudnn_conv_algo_search=DEFAULT", "gpu_mem_limit=2147483648")),
        (str(tmp_path / "lib" / "libmy_ops.so"), ()),  # a path is relative to pool.toml's folder
    ]


def test_the_environment_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORTQ_PROVIDER_OPTIONS", "use_tf32=0 cudnn_conv_algo_search=HEURISTIC")
    monkeypatch.setenv("ORTQ_CUSTOM_OPS", "onnxruntime_extensions")
    context = worker_command.make_context("worker", ["--model", "m.onnx", "--name", "m"])
    assert context.params["provider_options"] == ("use_tf32=0", "cudnn_conv_algo_search=HEURISTIC")
    assert context.params["custom_ops"] == "onnxruntime_extensions"
    # The pool sets both from its keys: its own environment's are not passed on, nor may env tables set them.
    assert worker_environment({"ORTQ_PROVIDER_OPTIONS": "x=1", "ORTQ_CUSTOM_OPS": "y", "HOME": "/h"}) == {"HOME": "/h"}


@pytest.mark.parametrize(
    ("model", "group", "says"),
    [
        ('provider = "cuda"\nprovider_options = { device_id = "1" }\n', "",
         "[[model]] #1 ('m'): provider option device_id is set by ortq from --adapter"),
        ('provider = "cuda"\n', 'provider_options = { "a=b" = "1" }\n', "key 'a=b': must be a non-empty string"),
        ('provider = "cuda"\nprovider_options = { use_tf32 = false }\n', "",
         "[[model]] #1 ('m') provider_options: use_tf32 must be a string (or an integer), got False (a boolean)"),
        ('provider = "cuda"\nprovider_options = { use_tf32 = "" }\n', "", "use_tf32: the value must be a non-empty"),
        ('provider = "auto"\nprovider_options = { x = "1" }\n', "", "does not apply to --provider auto"),
        ("[model.env]\nORTQ_PROVIDER_OPTIONS = 'use_tf32=0'\n", "",
         "ORTQ_PROVIDER_OPTIONS cannot be set here: the pool sets it from provider_options"),
        ("[model.env]\nORTQ_CUSTOM_OPS = 'x'\n", "",
         "ORTQ_CUSTOM_OPS cannot be set here: the pool sets it from custom_ops"),
    ],
)  # fmt: skip
def test_bad_pool_options_are_refused(tmp_path: Path, model: str, group: str, says: str) -> None:
    text = f'[[model]]\nname = "m"\npath = "digits.onnx"\n{model}[[model.workers]]\ncount = 1\n{group}'
    with pytest.raises(ConfigurationError) as refused:
        _pool(tmp_path, text)
    assert says in str(refused.value)
