"""The Node.js client of clients/node (written from docs/wire-format.md alone) against real workers.

Its outputs must be bit-exact with a direct ``onnxruntime`` run of the same model; a worker's
error must reach it typed; high priority must work by FCALL and by the EVAL fallback; answers
come through its own reply streams (protocol 4: one per producer per model, named in every job
hash it writes), or, for a job another process submitted, through the job hash's ``ortq_answer``;
a reply that does not carry its request's proof (SHA-256 of the model, a newline and the
request's nonce) must be refused, but for the errors a worker gives without having read the
request; and workers of another protocol must be refused before anything is enqueued. Needs
``node`` and ``npm`` (Node 20+); the client's dependencies are installed once with ``npm ci``
into clients/node/node_modules (gitignored) and reused while package-lock.json is unchanged.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys, redisfunctions, wire
from ortq.localredis import LocalRedis
from ortq.rqcompat.book import Book
from tests import onnx_models
from tests.conftest import REPO, WorkerProcesses, eventually
from tests.tcp_proxy import CommandCuttingProxy
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


def node_export(node_client: Path, name: str) -> str:
    """The string the client's module exports as ``name``."""
    assert NODE is not None
    code = f"import('./ortq.mjs').then((m) => process.stdout.write(m.{name}))"
    return subprocess.run([NODE, "-e", code], cwd=node_client, capture_output=True, text=True, check=True).stdout


def test_eval_script_is_the_docs(node_client: Path) -> None:
    assert node_export(node_client, "ENQUEUE_HIGH_SCRIPT") == doc_high_priority_script()
    # The unique enqueue's fallback (section 3.6) is the one ortq sends, as the docs give it.
    assert node_export(node_client, "ENQUEUE_UNIQUE_SCRIPT") == redisfunctions.unique_script_source()


def reply_name(r: redis.Redis, job: str) -> str:
    """The reply stream name a job's hash names (``ortq_reply``), checked as workers check it."""
    name = r.hget(f"rq:job:{job}", "ortq_reply")
    assert name is not None and keys.reply_keep(name) is not None, name
    return keys.as_text(name)


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
    # The client's reply stream: one entry a job, its job hash naming it (kept result_ttl: 600 s).
    name = reply_name(r, answer["job"])
    assert keys.reply_keep(name) == 600 and 0 < r.ttl(f"ortq:reply:{model_name}:{name}") <= 600
    [(entry, fields)] = r.xrange(f"ortq:reply:{model_name}:{name}")
    assert fields[b"id"] == answer["job"].encode() and r.hget(f"rq:job:{answer['job']}", "ortq_answer") == entry
    # A large answer (64 KiB or more): its entry's frame is empty, the frame in the job's own stream,
    # read by the client that waits in its reply stream and by one that looks the job up.
    big = np.random.default_rng(1).standard_normal((5000, 4)).astype(np.float32)
    answer = cli("infer", redis_url, model_name, stdin=as_json({"x": big}))
    assert_bit_exact(answer["outputs"], run_directly(tiny_path, {"x": big}))
    name = reply_name(r, answer["job"])
    [(_, fields)] = r.xrange(f"ortq:reply:{model_name}:{name}")
    assert fields == {b"id": answer["job"].encode(), b"frame": b""}
    assert r.exists(f"ortq:reply:{model_name}:{answer['job']}")
    submitted = cli("submit", redis_url, model_name, stdin=as_json({"x": big}))
    answer = cli("result", redis_url, submitted["job"], "--model", model_name, "--nonce", submitted["nonce"])
    assert_bit_exact(answer["outputs"], run_directly(tiny_path, {"x": big}))


def test_answers_read_before_anyone_waits_are_kept(
    node_client: Path, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path
) -> None:
    """submit(), then result() later, in any order: a wait takes from the client's reply stream the
    answers of its other jobs too, and keeps them for their own waits; a job of another model gets
    a reply stream of its own (one XREAD reads both)."""
    workers.serve(tiny_path, model_name, redis_url)
    workers.serve(tiny_path, f"{model_name}-b", redis_url)
    script = """
import { Client } from './ortq.mjs';
const [url, model] = process.argv.slice(1);
const client = new Client(url);
const x = (v) => ({ x: { dtype: 'float32', shape: [1, 4], data: new Float32Array(4).fill(v) } });
try {
  const ids = [];
  for (let i = 0; i < 4; i += 1) ids.push(await client.submit(i % 2 ? `${model}-b` : model, x(i)));
  const outputs = [];
  for (const id of [ids[3], ids[0], ids[2], ids[1]]) outputs.push(Array.from((await client.result(id, 30000)).y.data));
  const together = await Promise.all([client.submit(model, x(7)), client.submit(`${model}-b`, x(8))]);
  const both = await Promise.all(together.map((id) => client.result(id, 30000)));
  console.log(JSON.stringify({ outputs, both: both.map((o) => Array.from(o.y.data)), name: client.replyName,
    cursors: client.cursors.size, left: client.jobs.size + client.expected.size + client.kept.size }));
} finally {
  await client.close();
}
"""
    assert NODE is not None
    done = subprocess.run(
        [NODE, "--input-type=module", "-e", script, redis_url, model_name],
        cwd=node_client,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    got = json.loads(done.stdout)
    assert got["outputs"] == [[7.0] * 4, [1.0] * 4, [5.0] * 4, [3.0] * 4]
    assert got["both"] == [[15.0] * 4, [17.0] * 4]
    assert got["cursors"] == 2 and got["left"] == 0
    r = redis.Redis.from_url(redis_url)
    for model, count in [(model_name, 3), (f"{model_name}-b", 3)]:
        assert r.xlen(f"ortq:reply:{model}:{got['name']}") == count


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


def test_an_input_of_no_declared_shape_takes_any_rank(
    node_client: Path, workers: WorkerProcesses, redis_url: str, model_name: str, tmp_path: Path
) -> None:
    """The record's ``"any_shape": true`` (docs/wire-format.md, section 5): the client checks such an
    input's dtype alone, and a declared 0-d input is still 0-d."""
    path = onnx_models.shapeless_model(tmp_path / "shapeless.onnx")
    workers.serve(path, model_name, redis_url)
    s = np.array(0.5, np.float32)
    for x in [np.array(2, np.float32), np.arange(24, dtype=np.float32).reshape(2, 3, 4)]:
        answer = cli("infer", redis_url, model_name, stdin=as_json({"x": x, "s": s}))
        assert_bit_exact(answer["outputs"], run_directly(path, {"x": x, "s": s}))
    for wrong in [{"x": x.astype(np.float64), "s": s}, {"x": x, "s": s[None]}]:
        refused = cli("infer", redis_url, model_name, stdin=as_json(wrong), expect=2)
        assert refused["error"]["type"] == "InvalidInput" and refused["job"] is None


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
    r = redis.Redis.from_url(redis_url)
    assert not r.exists("rq:job:no.dots", f"ortq:req:{model_name}:no.dots")
    # A reply read with another nonce than its request's does not carry the proof made from it:
    # refused (exit 1).
    submitted = cli("submit", redis_url, model_name, stdin=as_json({"x": x}))
    assert submitted["model"] == model_name
    job, nonce = submitted["job"], submitted["nonce"]
    mismatch = cli("result", redis_url, job, "--model", model_name, "--nonce", "00" * 16, expect=1)
    assert mismatch["error"]["type"] == "ResponseMismatch" and mismatch["job"] == job
    answer = cli("result", redis_url, job, "--model", model_name, "--nonce", nonce)
    assert_bit_exact(answer["outputs"], {"y": x * 2 + 1})
    # The same answer in another model's reply stream (as if a worker of that model had run the
    # job): the proof binds the model too, so the right nonce does not make it an answer.
    name = reply_name(r, job)
    assert r.copy(f"ortq:reply:{model_name}:{name}", f"ortq:reply:{model_name}-other:{name}")
    other = cli("result", redis_url, job, "--model", f"{model_name}-other", "--nonce", nonce, expect=1)
    assert other["error"]["type"] == "ResponseMismatch"
    # result needs the model of a job it did not submit (exit 2).
    refused = cli("result", redis_url, job, expect=2)
    assert refused["error"]["type"] == "ConfigurationError"
    # No worker has served this model: refused (exit 2), or, enqueued anyway, the wait runs out (exit 1).
    unknown = cli("infer", redis_url, f"{model_name}-none", stdin=as_json({"x": x}), expect=2)
    assert unknown["error"]["type"] == "UnknownModel"
    args = ("--allow-unknown-model", "--timeout-ms", "300")
    late = cli("infer", redis_url, f"{model_name}-none", *args, stdin=as_json({"x": x}), expect=1)
    assert late["error"]["type"] == "ResultTimeout"
    assert r.hget(f"rq:job:{late['job']}", "status") == b"canceled"
    assert not r.exists(f"ortq:req:{model_name}-none:{late['job']}")


def test_proof_rule(node_client: Path, redis_url: str, model_name: str) -> None:
    """Replies written here by hand to jobs no worker serves, as a worker writes them (an entry in
    the reply stream the job hash names, its id in the hash's ``ortq_answer``): the client takes a
    reply that carries its request's proof, or one without a proof that is an error a worker gives
    without having read the request; it refuses every other (ResponseMismatch, exit 1)."""
    r = redis.Redis.from_url(redis_url)
    y = {"y": np.full((1, 4), 3, dtype=np.float32)}

    def answer_with(
        reply: Callable[[bytes], bytes], *, check: bool = True, expect: int = 0, large: bool = False
    ) -> dict[str, Any]:
        """Submit a job, write reply(the job's own proof) as its answer and read it back."""
        submitted = cli("submit", redis_url, model_name, "--allow-unknown-model", stdin=as_json({"x": y["y"]}))
        job, nonce = submitted["job"], submitted["nonce"]
        frame = reply(wire.proof_of(model_name, bytes.fromhex(nonce)))
        if large:  # the frame in the job's own stream, the entry's frame empty
            r.xadd(f"ortq:reply:{model_name}:{job}", {"frame": frame})
            frame = b""
        entry = r.xadd(f"ortq:reply:{model_name}:{reply_name(r, job)}", {"id": job, "frame": frame})
        r.hset(f"rq:job:{job}", "ortq_answer", entry)
        checked = ("--nonce", nonce) if check else ()
        return cli("result", redis_url, job, "--model", model_name, *checked, "--timeout-ms", "5000", expect=expect)

    assert_bit_exact(answer_with(lambda proof: wire.encode_response(y, proof=proof))["outputs"], y)
    assert_bit_exact(answer_with(lambda proof: wire.encode_response(y, proof=proof), large=True)["outputs"], y)
    failed = answer_with(lambda proof: wire.encode_error("InvalidInput", "no", proof=proof), expect=3)
    assert failed["error"] == {"type": "InvalidInput", "message": "no"}
    # No proof: the errors of a worker that could not read the request are answers ...
    expired = answer_with(lambda _: wire.encode_error("RequestExpired", "the request frame is gone"), expect=3)
    assert expired["error"]["type"] == "RequestExpired"
    # ... outputs or any other error are not.
    for frame in [wire.encode_response(y), wire.encode_error("InvalidInput", "no")]:
        assert answer_with(lambda _, f=frame: f, expect=1)["error"]["type"] == "ResponseMismatch"
    # Another request's or model's proof is refused; a reply read unchecked (no nonce) is taken.
    others = wire.encode_response(y, proof=wire.proof_of(f"{model_name}-other", b"\0" * 16))
    assert answer_with(lambda _: others, expect=1)["error"]["type"] == "ResponseMismatch"
    assert_bit_exact(answer_with(lambda _: others, check=False)["outputs"], y)


def test_protocol_mismatch(node_client: Path, redis_url: str, model_name: str) -> None:
    """A signature record of workers that speak another protocol (protocol 2's records say none):
    the client enqueues nothing (ProtocolMismatch, exit 2); a protocol 4 record is fine, and the job
    hash names the client's reply stream."""
    r = redis.Redis.from_url(redis_url)
    spec = [{"name": "x", "dtype": "float32", "shape": [None, 4]}]
    record: dict[str, Any] = {"model": model_name, "inputs": spec, "outputs": [{**spec[0], "name": "y"}]}
    x = np.ones((1, 4), dtype=np.float32)
    for protocol in [2, None, 3, 5]:
        written = record if protocol is None else {**record, "protocol": protocol}
        r.set(f"ortq:signature:{model_name}", json.dumps(written))
        for command, stdin in [("submit", as_json({"x": x})), ("many", [as_json({"x": x})] * 2)]:
            refused = cli(command, redis_url, model_name, stdin=stdin, expect=2)
            assert refused["error"]["type"] == "ProtocolMismatch", refused
            assert f"protocol {protocol or 2} and this client 4" in refused["error"]["message"]
    assert not r.exists(f"rq:queue:ortq:{model_name}")
    assert list(r.scan_iter(f"ortq:req:{model_name}:*")) == []
    r.set(f"ortq:signature:{model_name}", json.dumps({**record, "protocol": 4}))
    job = cli("submit", redis_url, model_name, stdin=as_json({"x": x}))["job"]
    assert r.lrange(f"rq:queue:ortq:{model_name}", 0, -1) == [job.encode()]
    assert r.exists(f"ortq:req:{model_name}:{job}", f"rq:job:{job}") == 2
    assert keys.reply_keep(reply_name(r, job)) == 600


def test_high_priority(
    node_client: Path, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path
) -> None:
    """Jobs queued before any worker serves the model: the first high-priority one while ortq's
    Redis function is missing (the EVAL fallback), the second by FCALL; both go ahead of the
    normal ones, in order."""
    r = redis.Redis.from_url(redis_url)
    with contextlib.suppress(redis.ResponseError):  # not loaded (yet)
        r.function_delete(redisfunctions.LIBRARY)
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    # Before any worker has served the model: enqueued for workers that start later.
    EARLY = ("--allow-unknown-model",)

    def calls(command: str) -> int:
        return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))

    normal = [cli("submit", redis_url, model_name, *EARLY, stdin=as_json({"x": x + i})) for i in range(2)]
    evals = calls("eval")
    high1 = cli("submit", redis_url, model_name, *EARLY, "--priority", "high", stdin=as_json({"x": x + 10}))
    assert calls("eval") == evals + 1
    assert redisfunctions.ensure_functions(r)  # what every worker does at start-up
    fcalls = calls("fcall")
    high2 = cli("submit", redis_url, model_name, *EARLY, "--priority", "high", stdin=as_json({"x": x + 20}))
    assert calls("fcall") == fcalls + 1
    queued = [i.decode() for i in r.lrange(f"rq:queue:ortq:{model_name}", 0, -1)]
    assert queued == [high1["job"], high2["job"], normal[0]["job"], normal[1]["job"]]
    assert r.hget(f"rq:job:{high2['job']}", "ortq_priority") == b"high"
    assert reply_name(r, high1["job"]) != reply_name(r, high2["job"])  # one reply name a client
    assert r.ttl(f"rq:job:{high2['job']}") > 0

    workers.serve(tiny_path, model_name, redis_url)
    for job, offset in [(high1, 10), (high2, 20), (normal[0], 0), (normal[1], 1)]:
        answer = cli("result", redis_url, job["job"], "--model", model_name, "--nonce", job["nonce"])
        assert_bit_exact(answer["outputs"], {"y": (x + offset) * 2 + 1})


def test_high_priority_without_fcall(node_client: Path) -> None:
    """A Redis without functions (6.2, here 7 with FCALL renamed away) refuses FCALL as it is
    queued, which discards the whole transaction: the client sends it again with EVAL."""
    with LocalRedis(extra_args=("--rename-command", "FCALL", '""')) as server:
        r = redis.Redis.from_url(server.url)
        EARLY = ("--allow-unknown-model",)
        with pytest.raises(redis.ResponseError, match="unknown command"):
            r.execute_command("FCALL", redisfunctions.FUNCTION, 0)
        x = {"x": np.ones((1, 4), dtype=np.float32)}
        normal = cli("submit", server.url, "m", *EARLY, stdin=as_json(x))
        high = cli("submit", server.url, "m", *EARLY, "--priority", "high", stdin=as_json(x))
        assert [i.decode() for i in r.lrange("rq:queue:ortq:m", 0, -1)] == [high["job"], normal["job"]]
        assert r.exists(f"ortq:req:m:{high['job']}", f"rq:job:{high['job']}") == 2
        assert r.get("ortq:last-high:m") == high["job"].encode()
        assert r.info("commandstats")["cmdstat_eval"]["calls"] == 1
        # An id of your own: its FCALL refused, the same code by EVAL (section 3.6).
        own = cli("submit", server.url, "m", *EARLY, "--job-id", "m-own-1", stdin=as_json(x))
        assert own["job"] == "m-own-1" and r.info("commandstats")["cmdstat_eval"]["calls"] == 2
        assert [i.decode() for i in r.lrange("rq:queue:ortq:m", 0, -1)] == [high["job"], normal["job"], "m-own-1"]
        assert reply_name(r, "m-own-1") != reply_name(r, normal["job"])


def test_an_id_of_your_own_goes_in_by_eval_before_any_worker_loaded_the_function(node_client: Path) -> None:
    """Section 3.6: on a Redis no worker has loaded ortq's functions into (Function not found), the
    unique enqueue goes by EVAL of the same code, and still never overwrites a job."""
    with LocalRedis() as server:
        r = redis.Redis.from_url(server.url)
        x = {"x": np.ones((1, 4), dtype=np.float32)}
        EARLY = ("--allow-unknown-model", "--job-id", "m-own-1")
        first = cli("submit", server.url, "m", *EARLY, "--priority", "high", stdin=as_json(x))
        assert first["job"] == "m-own-1" and r.info("commandstats")["cmdstat_eval"]["calls"] == 1
        again = cli("submit", server.url, "m", *EARLY, stdin=as_json(x), expect=1)
        assert again["error"]["type"] == "JobExists" and r.info("commandstats")["cmdstat_eval"]["calls"] == 2
        assert r.lrange("rq:queue:ortq:m", 0, -1) == [b"m-own-1"] and r.get("ortq:last-high:m") == b"m-own-1"
        assert r.hget("rq:job:m-own-1", "ortq_priority") == b"high" and keys.reply_keep(reply_name(r, "m-own-1")) == 600


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


@pytest.mark.parametrize("mode", ["before", "after"])
def test_an_enqueue_cut_at_exec_goes_in_once(node_client: Path, redis_url: str, model_name: str, mode: str) -> None:
    """Section 3.2: the client never sends its MULTI again blind (ioredis would, after it
    reconnects): a connection broken before Redis got the EXEC, or after it ran it, leaves the job
    queued once (tests/test_enqueue_once.py does the same to the Python producers)."""
    r = redis.Redis.from_url(redis_url)
    with CommandCuttingProxy(urlparse(redis_url).port or 6379) as proxy:
        proxy.cut_next(mode)
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        answer = cli("submit", proxy.url, model_name, "--allow-unknown-model", stdin=as_json({"x": x}))
        assert proxy.cuts == 1
    assert [keys.as_text(e) for e in r.lrange(keys.queue_key(model_name), 0, -1)] == [answer["job"]]  # type: ignore[union-attr]
    assert r.hget(f"rq:job:{answer['job']}", "status") == b"queued"


def test_an_id_of_your_own_never_overwrites_a_job(node_client: Path, redis_url: str, model_name: str) -> None:
    """Section 3.6: under an id of the caller's own, a job goes in by ortq's function, which never
    overwrites one of that id (the plain MULTI of 3.2 did: the job queued twice, its request and
    nonce replaced); a second submit is JobExists (exit 1). And its lost reply is read back, not
    sent again blind: the job goes in once, this submit's own."""
    r = redis.Redis.from_url(redis_url)
    redisfunctions.ensure_functions(r)  # what a worker does at its start
    x = np.ones((1, 4), dtype=np.float32)
    job_id = f"{model_name}-order-1"
    first = cli("submit", redis_url, model_name, "--allow-unknown-model", "--job-id", job_id, stdin=as_json({"x": x}))
    request = r.get(f"ortq:req:{model_name}:{job_id}")
    again = cli(
        "submit", redis_url, model_name, "--allow-unknown-model", "--job-id", job_id, stdin=as_json({"x": x}), expect=1
    )
    assert again["error"]["type"] == "JobExists" and "nothing was overwritten" in again["error"]["message"]
    assert r.get(f"ortq:req:{model_name}:{job_id}") == request and first["job"] == job_id
    with CommandCuttingProxy(urlparse(redis_url).port or 6379) as proxy:
        proxy.cut_next("after", "FCALL")
        cut = cli(
            "submit", proxy.url, model_name, "--allow-unknown-model", "--job-id", f"{job_id}-b", stdin=as_json({"x": x})
        )
        assert proxy.cuts == 1 and cut["job"] == f"{job_id}-b"
        proxy.cut_next("before", "FCALL")  # it never ran: read back as not there, sent again
        cut = cli(
            "submit", proxy.url, model_name, "--allow-unknown-model", "--job-id", f"{job_id}-c", stdin=as_json({"x": x})
        )
        assert proxy.cuts == 2 and cut["job"] == f"{job_id}-c"
    queued = [keys.as_text(e) for e in r.lrange(keys.queue_key(model_name), 0, -1)]  # type: ignore[union-attr]
    assert queued == [job_id, f"{job_id}-b", f"{job_id}-c"]


@pytest.mark.parametrize("mode", ["before", "after"])
def test_a_wait_goes_on_through_a_broken_xread(
    node_client: Path, workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, mode: str
) -> None:
    """Section 4.1: an XREAD whose connection breaks (before Redis got it, or its reply lost) is
    not sent again as it was (ioredis would resend it after reconnecting): the wait reads its reply
    stream again from 0-0 (Redis may have restarted, numbering new entries below the cursor), and
    its answer still comes."""
    workers.serve(tiny_path, model_name, redis_url)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    with CommandCuttingProxy(urlparse(redis_url).port or 6379) as proxy:
        proxy.cut_next(mode, "XREAD")
        answer = cli("infer", proxy.url, model_name, "--timeout-ms", "20000", stdin=as_json({"x": x}))
        assert proxy.cuts == 1
    assert_bit_exact(answer["outputs"], {"y": x * 2 + 1})


def test_a_cancel_takes_a_job_parked_for_its_version_off_its_parked_list(
    node_client: Path, redis_url: str, model_name: str
) -> None:
    """Section 3.7: a job pinned to v9 that a worker of v1 parked (start.lua itself) is in no queue;
    the client's cancel reads its pin and takes it off ortq:parked:<model>@v9, then cancels it."""
    r = redis.Redis.from_url(redis_url)
    x = np.ones((1, 4), dtype=np.float32)
    job = cli("submit", redis_url, model_name, "--allow-unknown-model", stdin=as_json({"x": x}))["job"]
    r.hset(keys.job_key(job), "ortq_version", "v9")  # as a producer pinning it writes it
    book = Book(r, "parker", keys.queue_name(model_name), version="v1", parked_ttl=600)
    reply, moment, _ = book.start(b"", 10)
    assert [(s.entry.decode(), s.reason) for s in book.parse_start(reply, moment)[1]] == [(job, "parked")]
    assert cli("cancel", redis_url, job, "--model", model_name) == {"job": job, "cancelled": True}
    assert r.llen(keys.parked_key(model_name, "v9")) == 0 and r.hget(keys.job_key(job), "status") == b"canceled"
    assert cli("cancel", redis_url, job, "--model", model_name) == {"job": job, "cancelled": False}


def test_a_cancel_whose_lrem_reply_was_lost_cancels_the_job(node_client: Path, redis_url: str, model_name: str) -> None:
    """Section 3.7: an infer whose wait runs out cancels its job; the LREM's reply lost (Redis ran it),
    the job is still cancelled, not left off its queue and never run."""
    r = redis.Redis.from_url(redis_url)
    x = np.ones((1, 4), dtype=np.float32)
    with CommandCuttingProxy(urlparse(redis_url).port or 6379) as proxy:
        proxy.cut_next("after", "LREM")
        args = ("--allow-unknown-model", "--timeout-ms", "300")
        late = cli("infer", proxy.url, model_name, *args, stdin=as_json({"x": x}), expect=1)
        assert late["error"]["type"] == "ResultTimeout" and proxy.cuts == 1
    assert r.hget(f"rq:job:{late['job']}", "status") == b"canceled"
    assert r.llen(keys.queue_key(model_name)) == 0


def test_an_infer_that_gives_up_stops_the_run_of_its_job(
    node_client: Path,
    redis_url: str,
    model_name: str,
    models_dir: Path,
    workers: WorkerProcesses,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Section 3.7: cancel of a started job asks its worker to stop it, as the Python producers' does
    (it returned false and left the job running): an infer whose wait runs out while its job runs
    leaves the job stopped, its 12 s run ended early."""
    monkeypatch.setenv("ORTQ_HEARTBEAT_SECONDS", "0.5")
    slow = onnx_models.timed_slow_model(models_dir / "node-slow.onnx", 12.0)
    workers.serve(slow, model_name, redis_url)
    r = redis.Redis.from_url(redis_url)
    began = time.monotonic()
    x = np.ones((1, 256), dtype=np.float32)
    late = cli("infer", redis_url, model_name, "--timeout-ms", "1500", stdin=as_json({"x": x}), expect=1)
    assert late["error"]["type"] == "ResultTimeout"
    eventually(lambda: r.hget(f"rq:job:{late['job']}", "status") == b"stopped", 10)
    assert time.monotonic() - began < 8, "the run was not stopped: it ran to its end"
