"""The Node.js client of clients/node (written from docs/wire-format.md alone) against real workers.

Its outputs must be bit-exact with a direct ``onnxruntime`` run of the same model; a worker's
error must reach it typed; high priority must work by FCALL and by the EVAL fallback; and a
reply that does not carry its request's nonce must be refused. Needs ``node`` and ``npm``
(Node 20+); the client's dependencies are installed once with ``npm ci`` into
clients/node/node_modules (gitignored) and reused while package-lock.json is unchanged.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq.localredis import LocalRedis
from ortq.producer import priority
from tests.conftest import REPO, WorkerProcesses
from tests.test_raw_redis import doc_high_priority_script

CLIENT = REPO / "clients" / "node"
NODE = shutil.which("node")
NPM = shutil.which("npm")

pytestmark = pytest.mark.skipif(
    NODE is None or NPM is None, reason="the Node.js client's tests need `node` and `npm` (Node 20+) on PATH"
)


@pytest.fixture(scope="module")
def node_client() -> Path:
    """clients/node with its dependencies installed (npm ci, skipped while the lock file is unchanged)."""
    assert NODE is not None and NPM is not None
    version = subprocess.run([NODE, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    assert int(version.lstrip("v").split(".")[0]) >= 20, f"the client needs Node 20 or later, found {version}"
    lock = hashlib.sha256((CLIENT / "package-lock.json").read_bytes()).hexdigest()
    stamp = CLIENT / "node_modules" / ".ortq-lock-sha256"
    if not stamp.exists() or stamp.read_text() != lock:
        done = subprocess.run(
            [NPM, "ci", "--no-audit", "--no-fund", "--prefer-offline"],
            check=False,
            cwd=CLIENT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"npm ci failed:\n{done.stdout}\n{done.stderr}"
        stamp.write_text(lock)
    return CLIENT


def cli(*args: str, stdin: object = None, expect: int = 0) -> dict[str, Any]:
    """Run the client's CLI; its one line of JSON output, after checking its exit status."""
    assert NODE is not None
    done = subprocess.run(
        [NODE, str(CLIENT / "cli.mjs"), *args],
        check=False,
        input=None if stdin is None else json.dumps(stdin),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == expect, f"exit {done.returncode}:\n{done.stdout}\n{done.stderr}"
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def as_json(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Inputs as the CLI reads them: dtype, shape and the little-endian bytes in base64."""
    return {
        name: {
            "dtype": a.dtype.name,
            "shape": list(a.shape),
            "base64": base64.b64encode(a.astype(a.dtype.newbyteorder("<")).tobytes()).decode(),
        }
        for name, a in arrays.items()
    }


def assert_bit_exact(outputs: dict[str, Any], expected: dict[str, np.ndarray]) -> None:
    assert set(outputs) == set(expected)
    for name, want in expected.items():
        got = outputs[name]
        assert (got["dtype"], got["shape"]) == (want.dtype.name, list(want.shape)), name
        assert base64.b64decode(got["base64"]) == want.astype(want.dtype.newbyteorder("<")).tobytes(), name


def run_directly(model_path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def test_frame_codec_unit_tests(node_client: Path) -> None:
    """node --test: the doc's worked example byte for byte, and hostile response frames."""
    assert NODE is not None
    command = [NODE, "--test", "test/"]
    done = subprocess.run(command, check=False, cwd=node_client, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_eval_script_is_the_docs(node_client: Path) -> None:
    assert NODE is not None
    code = "import('./ortq.mjs').then((m) => process.stdout.write(m.ENQUEUE_HIGH_SCRIPT))"
    done = subprocess.run([NODE, "-e", code], cwd=node_client, capture_output=True, text=True, check=True)
    assert done.stdout == doc_high_priority_script()


def test_tiny_model_bit_exact(
    node_client: Path, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path
) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    x[0, :] = [np.inf, -0.0, np.float32(1e-40), np.finfo(np.float32).max]
    answer = cli("infer", redis_url, model_name, stdin=as_json({"x": x}))
    assert_bit_exact(answer["outputs"], run_directly(tiny_path, {"x": x}))
    # Inputs as JSON numbers (JSON has no inf): a float32 goes through a double and back unchanged.
    x[0] = [1.5, -0.0, 3.0, 4.0]
    answer = cli("infer", redis_url, model_name, stdin={"x": {"dtype": "float32", "shape": [3, 4], "data": x.tolist()}})
    assert_bit_exact(answer["outputs"], run_directly(tiny_path, {"x": x}))
    r = redis.Redis.from_url(redis_url)
    assert r.hget(f"rq:job:{answer['job']}", "status") == b"finished"


def test_multi_dtype_bit_exact(
    node_client: Path, workers: WorkerProcesses, redis_url: str, model_name: str, multi_dtype_path: Path
) -> None:
    workers.serve(multi_dtype_path, model_name, redis_url)
    inputs = {
        "f16": np.array([1.5, -2.25, np.inf, 6.1e-5], dtype=np.float16),
        "i64": np.array([[np.iinfo(np.int64).min, np.iinfo(np.int64).max], [-1, 2**53 + 1]] * 2, dtype=np.int64),
        "u8": np.array([0, 128, 255], dtype=np.uint8),
        "flag": np.array([True, False, True, True]),
        "f64": np.array(-1.0 / 3.0),  # 0-d
    }
    answer = cli("infer", redis_url, model_name, stdin=as_json(inputs))
    expected = run_directly(multi_dtype_path, inputs)
    assert_bit_exact(answer["outputs"], expected)
    # int64 values beyond 2**53 reach JavaScript whole (BigInt64Array), printed as strings.
    assert answer["outputs"]["i64_out"]["data"][:2] == [str(np.iinfo(np.int64).min), str(np.iinfo(np.int64).max)]


def test_errors(node_client: Path, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path) -> None:
    workers.serve(tiny_path, model_name, redis_url)
    x = np.ones((1, 4), dtype=np.float32)
    # Inputs that do not fit the published signature: refused before anything is sent (exit 2) ...
    refused = cli("infer", redis_url, model_name, stdin=as_json({"x": x[0]}), expect=2)
    assert refused["error"]["type"] == "InvalidInput" and refused["job"] is None
    # ... or, sent unchecked, the worker's InvalidInput, typed (exit 3).
    failed = cli("infer", redis_url, model_name, "--no-validate", stdin=as_json({"not_x": x}), expect=3)
    assert failed["error"]["type"] == "InvalidInput" and "not_x" in failed["error"]["message"]
    # A job id outside the rule is refused before anything is sent (exit 2).
    refused = cli("submit", redis_url, model_name, "--job-id", "no.dots", stdin=as_json({"x": x}), expect=2)
    assert refused["error"]["type"] == "ConfigurationError"
    assert not redis.Redis.from_url(redis_url).exists("rq:job:no.dots", "ortq:req:no.dots")
    # A reply read with another nonce than its request's is refused (exit 1).
    submitted = cli("submit", redis_url, model_name, stdin=as_json({"x": x}))
    mismatch = cli("result", redis_url, submitted["job"], "--nonce", "00" * 16, expect=1)
    assert mismatch["error"]["type"] == "ResponseMismatch"
    answer = cli("result", redis_url, submitted["job"], "--nonce", submitted["nonce"])
    assert_bit_exact(answer["outputs"], {"y": x * 2 + 1})
    # No worker has served this model: refused (exit 2), or, enqueued anyway, the wait runs out (exit 1).
    unknown = cli("infer", redis_url, f"{model_name}-none", stdin=as_json({"x": x}), expect=2)
    assert unknown["error"]["type"] == "UnknownModel"
    args = ("--allow-unknown-model", "--timeout-ms", "300")
    late = cli("infer", redis_url, f"{model_name}-none", *args, stdin=as_json({"x": x}), expect=1)
    assert late["error"]["type"] == "ResultTimeout"
    assert redis.Redis.from_url(redis_url).hget(f"rq:job:{late['job']}", "status") == b"canceled"


def test_high_priority(
    node_client: Path, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path
) -> None:
    """Jobs queued before any worker serves the model: the first high-priority one while ortq's
    Redis function is missing (the EVAL fallback), the second by FCALL; both go ahead of the
    normal ones, in order."""
    r = redis.Redis.from_url(redis_url)
    with contextlib.suppress(redis.ResponseError):  # not loaded (yet)
        r.function_delete(priority.LIBRARY)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    # Before any worker has served the model: enqueued for workers that start later.
    EARLY = ("--allow-unknown-model",)

    def calls(command: str) -> int:
        return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))

    normal = [cli("submit", redis_url, model_name, *EARLY, stdin=as_json({"x": x + i})) for i in range(2)]
    evals = calls("eval")
    high1 = cli("submit", redis_url, model_name, *EARLY, "--priority", "high", stdin=as_json({"x": x + 10}))
    assert calls("eval") == evals + 1
    assert priority.ensure_functions(r)  # what every worker does at start-up
    fcalls = calls("fcall")
    high2 = cli("submit", redis_url, model_name, *EARLY, "--priority", "high", stdin=as_json({"x": x + 20}))
    assert calls("fcall") == fcalls + 1
    queued = [i.decode() for i in r.lrange(f"rq:queue:ortq:{model_name}", 0, -1)]
    assert queued == [high1["job"], high2["job"], normal[0]["job"], normal[1]["job"]]
    assert r.hget(f"rq:job:{high2['job']}", "ortq_priority") == b"high"
    assert r.ttl(f"rq:job:{high2['job']}") > 0

    workers.serve(tiny_path, model_name, redis_url)
    for job, offset in [(high1, 10), (high2, 20), (normal[0], 0), (normal[1], 1)]:
        answer = cli("result", redis_url, job["job"], "--nonce", job["nonce"])
        assert_bit_exact(answer["outputs"], {"y": (x + offset) * 2 + 1})


def test_high_priority_without_fcall(node_client: Path) -> None:
    """A Redis without functions (6.2, here 7 with FCALL renamed away) refuses FCALL as it is
    queued, which discards the whole transaction: the client sends it again with EVAL."""
    with LocalRedis(extra_args=("--rename-command", "FCALL", '""')) as server:
        r = redis.Redis.from_url(server.url)
        EARLY = ("--allow-unknown-model",)
        with pytest.raises(redis.ResponseError, match="unknown command"):
            r.execute_command("FCALL", priority.FUNCTION, 0)
        x = {"x": np.ones((1, 4), dtype=np.float32)}
        normal = cli("submit", server.url, "m", *EARLY, stdin=as_json(x))
        high = cli("submit", server.url, "m", *EARLY, "--priority", "high", stdin=as_json(x))
        assert [i.decode() for i in r.lrange("rq:queue:ortq:m", 0, -1)] == [high["job"], normal["job"]]
        assert r.exists(f"ortq:req:{high['job']}", f"rq:job:{high['job']}") == 2
        assert r.get("ortq:last-high:m") == high["job"].encode()
        assert r.info("commandstats")["cmdstat_eval"]["calls"] == 1


def test_many_jobs_in_one_transaction(
    node_client: Path, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path
) -> None:
    """submitMany: every job in one MULTI/EXEC (section 3.2), waited for with one XREAD of all
    their reply streams; a bad job fails alone."""
    workers.serve(tiny_path, model_name, redis_url)
    r = redis.Redis.from_url(redis_url)
    execs = int(r.info("commandstats").get("cmdstat_exec", {}).get("calls", 0))
    xs = [np.full((i + 1, 4), i, dtype=np.float32) for i in range(5)]
    many = [as_json({"x": x}) for x in xs] + [as_json({"not_x": xs[0]})]
    answer = cli("many", redis_url, model_name, "--no-validate", stdin=many, expect=3)
    assert int(r.info("commandstats")["cmdstat_exec"]["calls"]) == execs + 1
    assert len(set(answer["jobs"])) == 6
    for result, x in zip(answer["results"], xs, strict=False):
        assert_bit_exact(result["outputs"], {"y": x * 2 + 1})
    assert answer["results"][-1]["error"]["type"] == "InvalidInput"
