"""Errors a user meets, said in one line with what to do: a --redis-url that is no Redis or no URL,
a provider this operating system cannot run, input files that are not arrays, and the exit status
of each kind of failure (docs/operations.md's table). Real Redis, real workers, a real HTTP server."""

from __future__ import annotations

import platform
import re
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
import redis

from ortq import redisfaults
from ortq.errors import ConfigurationError, ProviderUnavailable
from ortq.localredis import find_redis_server, free_port
from ortq.producer import Producer
from ortq.redisurls import redacted_url
from ortq.settings import Settings, redis_message
from ortq.worker.session import SessionPlan, install_advice, load_model, platform_refusal
from tests import onnx_models
from tests.cli_support import Result, invoke
from tests.conftest import REPO, WorkerProcesses, eventually, worker_command
from tests.test_cli import ortq

pytestmark = pytest.mark.rqcompat  # also in the second pass: redis-py 5.0's errors, as users see them

PASSWORD = "s3cret-pw"
ON_LINUX = pytest.mark.skipif(platform.system() != "Linux", reason="what this OS is told is tested on Linux")


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<!DOCTYPE html><html><body>hello</body></html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    """A real web server's address as a redis_url, with a password that must never be shown."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"redis://ortq:{PASSWORD}@127.0.0.1:{server.server_address[1]}/0"
    server.shutdown()
    server.server_close()


def one_line_error(stderr: str) -> str:
    """The one ``ortq: ...`` line of a failed command, checking that nothing else went wrong."""
    assert "Traceback" not in stderr and PASSWORD not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("ortq: ")]
    assert len(lines) == 1, stderr
    return lines[0]


# ------------------------------------------------------------------ a --redis-url that is not Redis


def test_a_web_server_as_redis_is_a_configuration_error_that_says_so(http_url: str) -> None:
    for connect in (
        lambda: Settings.from_url(http_url).connect(),
        lambda: Producer(settings=Settings.from_url(http_url)),
    ):
        with pytest.raises(ConfigurationError) as caught:
            connect()
        message = str(caught.value)
        assert "is not Redis (an HTTP server, by its answer)" in message
        assert "Check the host and port" in message
        assert redacted_url(http_url) in message and PASSWORD not in message


def test_every_command_says_in_one_line_that_the_server_is_not_redis(
    http_url: str, tiny_path: Path, tmp_path: Path
) -> None:
    np.save(tmp_path / "x.npy", np.zeros((1, 4), np.float32))
    commands = {
        "info": ("info",),
        "stop": ("stop", "--model", "m"),
        "infer": ("infer", "m", "--input", f"x={tmp_path / 'x.npy'}"),
        "dashboard": ("dashboard", "--port", "0"),
        "worker": ("worker", "--model", str(tiny_path), "--name", "m", "--threads", "1"),
        "demo": ("demo",),
    }
    for what, args in commands.items():
        if what == "worker":  # a process of its own (it loads its model first): what the interpreter prints
            done: subprocess.CompletedProcess[str] | Result = ortq(*args, "--redis-url", http_url)
        else:
            done = invoke(*args, "--redis-url", http_url)
            assert done.no_traceback(), (what, done.stderr)
        assert done.returncode == 2, (what, done.stderr)
        line = one_line_error(done.stderr)
        assert line.startswith("ortq: ConfigurationError: the server at redis://ortq@127.0.0.1:"), (what, line)
        assert "is not Redis" in line, what


def test_the_kind_of_server_is_read_from_either_parser_s_message() -> None:
    """hiredis (a dependency) quotes the first byte; redis-py's own parser, used where hiredis could
    not be installed, quotes the first line."""
    from ortq.settings import _not_redis_hint

    assert _not_redis_hint('Protocol error, got "<" as reply type byte') == " (an HTTP server, by its answer)"
    assert _not_redis_hint("Protocol Error: b'HTTP/1.0 400 Bad request'") == " (an HTTP server, by its answer)"
    tls = " (a TLS server, by its answer: use rediss:// for a TLS port)"
    assert _not_redis_hint('Protocol error, got "\\x15" as reply type byte') == tls
    assert _not_redis_hint("Protocol Error: b'\\x15\\x03\\x03\\x00\\x02'") == tls
    assert _not_redis_hint('Protocol error, got "S" as reply type byte') == ""


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl CLI for the server's certificate")
def test_a_plain_url_to_a_tls_port_hints_at_rediss(tmp_path: Path) -> None:
    """A Redis TLS port drops a plain connection without a word (tests/test_transport_security.py:
    BrokerUnavailable); the message says what to try."""
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-keyout", "key.pem", "-out", "cert.pem"],
        cwd=tmp_path, check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    server = subprocess.Popen(
        [find_redis_server(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--tls-cert-file", "cert.pem", "--tls-key-file", "key.pem", "--tls-auth-clients", "no"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        eventually(lambda: _accepts(port), timeout=15)
        done = invoke("info", "--redis-url", f"redis://127.0.0.1:{port}/0")
    finally:
        server.terminate()
        server.wait(10)
    assert done.returncode == 1, done.stderr
    line = one_line_error(done.stderr)
    assert line.startswith(f"ortq: BrokerUnavailable: cannot reach Redis at redis://127.0.0.1:{port}/0: ")
    assert "(if that port serves TLS, use rediss://)" in line, line


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("localhost:6379", "redis_url 'localhost:6379' has no scheme; did you mean redis://localhost:6379/0?"),
        ("localhost", "did you mean redis://localhost:6379/0?"),
        ("redis:6379", "did you mean redis://redis:6379/0?"),  # a host called redis (Compose)
        ("redis//cache:6380/2", "did you mean redis://cache:6380/2?"),
        ("/run/redis.sock", "did you mean unix:///run/redis.sock?"),
        (f"ortq:{PASSWORD}@cache:6379", "'cache:6379' has no scheme; did you mean redis://ortq:PASSWORD@cache:6379/0?"),
        (
            f"http://ortq:{PASSWORD}@cache:6379/0",
            "must start with redis://, rediss://, unix://, redis+sentinel:// or rediss+sentinel://, got 'http://ortq@cache",
        ),
        ("redis://cache:63796379/0", "redis_url 'redis://cache:63796379/0': Port out of range"),
        ("redis://cache:port/0", "redis_url 'redis://cache:port/0': Port could not be cast"),
        ("redis://cache:6379/zero", "after HOST:PORT comes the database number (/0), not '/zero'"),
        ("redis://cache:6379/0?db=one", "Invalid value for "),  # redis-py's words: 'db' (8), `db` (5)
    ],
)
def test_urls_redis_py_would_misread_are_refused_and_echoed_as_written(url: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        Settings.from_url(url)
    assert message in str(caught.value)
    assert PASSWORD not in str(caught.value)


def test_a_url_without_scheme_from_the_command_line() -> None:
    done = invoke("info", "--redis-url", "localhost:6379")
    assert done.returncode == 2 and done.no_traceback()
    assert one_line_error(done.stderr) == (
        "ortq: ConfigurationError: redis_url 'localhost:6379' has no scheme; did you mean redis://localhost:6379/0? "
        "(redis://HOST:PORT/DB, rediss:// for TLS, unix:///PATH for a socket)"
    )


def test_good_urls_still_pass_and_a_missing_database_is_said(redis_url: str) -> None:
    for url in ("redis://cache", "redis://cache:6379/", "rediss://u:p@cache:6380/3", "unix:///run/r.sock?db=2"):
        Settings.from_url(url)
    assert redacted_url("redis://[::1]:6390/1") == "redis://[::1]:6390/1"
    assert redacted_url("redis:///0") == "redis://localhost:6379/0"
    with pytest.raises(ConfigurationError, match=r"Redis at redis://127\.0\.0\.1:\d+/999 refused the connection: "):
        Settings.from_url(redis_url.rsplit("/", 1)[0] + "/999").connect()


# ------------------------------------------------------------------ providers per operating system


@pytest.mark.parametrize(
    ("provider", "system", "says"),
    [
        ("dml", "Linux", ["Windows-only", "no Linux build", "--provider cuda for an NVIDIA GPU", "--provider cpu"]),
        ("dml", "Darwin", ["Windows-only", "no macOS build", "Use --provider cpu"]),
        ("cuda", "Darwin", ["does not run on macOS", "Use --provider cpu"]),
    ],
)
def test_providers_this_os_cannot_run_say_so_and_what_to_use(provider: str, system: str, says: list[str]) -> None:
    refusal = platform_refusal(provider, system)
    assert refusal is not None
    for words in says:
        assert words in refusal
    assert "pip install onnxruntime-directml" not in refusal
    assert install_advice(provider, system, ["onnxruntime"]) == refusal


def test_providers_this_os_can_run_are_told_which_package_to_swap_in() -> None:
    for provider, system in (("dml", "Windows"), ("cuda", "Windows"), ("cuda", "Linux"), ("cpu", "Linux")):
        assert platform_refusal(provider, system) is None
    assert install_advice("cuda", "Linux", ["onnxruntime"]) == (
        "--provider cuda needs the onnxruntime-gpu package (pip uninstall -y onnxruntime && pip install 'ortq[cuda]')"
    )
    # ortq[cuda] installs nothing on Windows; DirectML runs on NVIDIA GPUs there too.
    assert install_advice("cuda", "Windows", ["onnxruntime-directml"]) == (
        "--provider cuda needs the onnxruntime-gpu package (pip uninstall -y onnxruntime-directml && "
        "pip install onnxruntime-gpu nvidia-ml-py); or --provider dml (onnxruntime-directml), which runs on NVIDIA "
        "GPUs too"
    )
    assert install_advice("dml", "Windows", ["onnxruntime"]) == (
        "--provider dml needs the onnxruntime-directml package (pip uninstall -y onnxruntime && "
        "pip install onnxruntime-directml)"
    )


@ON_LINUX
def test_dml_on_linux_refuses_with_the_platform_reason_or_falls_back(tiny_path: Path) -> None:
    with pytest.raises(ProviderUnavailable, match=r"DirectML .* is Windows-only") as caught:
        load_model(tiny_path, SessionPlan("dml", 0, None, allow_cpu_fallback=False))
    assert "pip install onnxruntime-directml" not in str(caught.value)
    model = load_model(tiny_path, SessionPlan("dml", 0, None, allow_cpu_fallback=True))
    assert model.fell_back_to_cpu and model.provider == "CPUExecutionProvider"
    with pytest.raises(
        ProviderUnavailable, match=re.escape("pip uninstall -y onnxruntime && pip install 'ortq[cuda]'")
    ):
        load_model(tiny_path, SessionPlan("cuda", 0, None, allow_cpu_fallback=False))  # this machine's CPU build


@ON_LINUX
def test_worker_with_dml_on_linux_exits_2_with_one_line(tiny_path: Path, redis_url: str) -> None:
    done = ortq(*worker_command(tiny_path, "m", redis_url, "--provider", "dml")[3:])  # the interpreter's own
    assert done.returncode == 2, done.stderr
    line = one_line_error(done.stderr)
    assert line.startswith("ortq: ProviderUnavailable: DirectML (--provider dml) is Windows-only"), line


# ------------------------------------------------------------------ ortq infer's input files and --cast


@pytest.fixture
def served(workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path) -> str:
    """A live worker of the tiny model (x: float32[batch, 4] -> y = 2x + 1)."""
    workers.serve(tiny_path, model_name, redis_url)
    return model_name


def test_infer_takes_npz_archives_by_name(served: str, redis_url: str, tmp_path: Path) -> None:
    x = np.array([[1, 2, 3, 4]], np.float32)
    np.savez(tmp_path / "named.npz", x=x)
    np.savez(tmp_path / "unnamed.npz", x * 3)  # one array called arr_0
    np.savez(tmp_path / "two.npz", a=x, b=x)
    for spec, factor in ((str(tmp_path / "named.npz"), 1), (f"x={tmp_path / 'unnamed.npz'}", 3)):
        out = tmp_path / "out.npz"
        done = invoke("infer", served, "--input", spec, "--output", str(out), "--redis-url", redis_url)
        assert done.returncode == 0, done.stderr
        np.testing.assert_array_equal(np.load(out)["y"], x * factor * 2 + 1)
    done = invoke("infer", served, "--input", f"x={tmp_path / 'two.npz'}", "--redis-url", redis_url)
    assert done.returncode == 2
    assert "holds 2 arrays (a, b) and none is called 'x'" in done.stderr
    assert f"give --input {tmp_path / 'two.npz'} to send them all by their names" in done.stderr
    np.save(tmp_path / "x.npy", x)
    done = invoke("infer", served, "--input", str(tmp_path / "x.npy"), "--redis-url", redis_url)
    assert done.returncode == 2 and "holds one array with no name" in done.stderr
    twice = ("--input", str(tmp_path / "named.npz"), "--input", f"x={tmp_path / 'x.npy'}")
    done = invoke("infer", served, *twice, "--redis-url", redis_url)
    assert done.returncode == 2 and "input x given twice (again by x=" in done.stderr


class _Planted:
    """Unpickling this creates the file it names: proof that nothing was unpickled if it is absent."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def test_infer_refuses_files_that_are_not_arrays_and_never_unpickles(
    served: str, redis_url: str, tmp_path: Path
) -> None:
    text = tmp_path / "x.txt"
    text.write_text("1 2 3 4\n")
    planted = tmp_path / "unpickled"
    np.save(tmp_path / "objects.npy", np.array([_Planted(planted)], dtype=object), allow_pickle=True)
    np.savez(tmp_path / "objects.npz", x=np.array([_Planted(planted)], dtype=object))
    (tmp_path / "cut.npz").write_bytes((tmp_path / "objects.npz").read_bytes()[:40])
    cases = {
        f"x={text}": "is neither a .npy array (numpy.save) nor a .npz archive of named arrays",
        f"x={tmp_path / 'objects.npy'}": "holds Python objects (a pickled object array), which ortq never loads",
        str(tmp_path / "objects.npz"): "holds Python objects (a pickled object array), which ortq never loads",
        str(tmp_path / "cut.npz"): "is a damaged .npy/.npz file",
        f"x={tmp_path / 'missing.npy'}": "No such file or directory",
    }
    for spec, message in cases.items():
        done = invoke("infer", served, "--input", spec, "--redis-url", redis_url)
        assert done.returncode == 2, (spec, done.stderr)
        assert message in done.stderr, (spec, done.stderr)
        assert "allow_pickle" not in done.stderr and "Traceback" not in done.stderr and done.no_traceback()
    assert not planted.exists()


def test_cast_converts_to_the_published_dtypes(served: str, redis_url: str, tmp_path: Path) -> None:
    x = np.array([[0.5, 1.5, -2.25, 4.0]], np.float64)
    np.save(tmp_path / "x64.npy", x)
    plain = invoke("infer", served, "--input", f"x={tmp_path / 'x64.npy'}", "--redis-url", redis_url)
    assert plain.returncode == 2
    assert "input 'x' has dtype float64, the model expects float32: pass --cast to convert it" in plain.stderr
    out = tmp_path / "out.npz"
    cast = invoke(
        "infer",
        served,
        "--input",
        f"x={tmp_path / 'x64.npy'}",
        "--cast",
        "--output",
        str(out),
        "--redis-url",
        redis_url,
    )
    assert cast.returncode == 0, cast.stderr
    np.testing.assert_array_equal(np.load(out)["y"], x.astype(np.float32) * 2 + 1)

    np.save(tmp_path / "big.npy", np.full((1, 4), 1e300))
    done = invoke("infer", served, "--input", f"x={tmp_path / 'big.npy'}", "--cast", "--redis-url", redis_url)
    assert done.returncode == 2 and "too large for float32" in done.stderr

    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(3):
        np.save(folder / f"{i}.npy", x + i)
    bulk = invoke("infer", served, "--input-dir", str(folder), "--output-dir", str(tmp_path / "o"), "--cast",
                  "--redis-url", redis_url)  # fmt: skip
    assert bulk.returncode == 0, bulk.stdout + bulk.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "o" / "2.npz")["y"], (x + 2).astype(np.float32) * 2 + 1)


def test_cast_needs_a_published_signature(redis_url: str, model_name: str, tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((1, 4)))
    done = invoke("infer", model_name, "--input", f"x={tmp_path / 'x.npy'}", "--cast", "--redis-url", redis_url)
    assert done.returncode == 2
    assert f"--cast needs the signature {model_name!r}'s workers publish, and none has" in one_line_error(done.stderr)


def test_cast_refuses_conversions_that_change_values() -> None:
    from ortq.errors import InvalidInput
    from ortq.producer.bulk import cast_inputs
    from ortq.signature import ModelSignature, TensorSpec

    signature = ModelSignature(
        inputs=(
            TensorSpec("f", "float32", (None,)),
            TensorSpec("i", "int32", (None,)),
            TensorSpec("b", "bool", (None,)),
        ),
        outputs=(),
    )
    ok = cast_inputs(
        {"f": np.arange(3, dtype=np.uint8), "i": np.arange(3, dtype=np.int64), "other": np.zeros(2)}, signature
    )
    assert ok["f"].dtype == np.float32 and ok["i"].dtype == np.int32 and ok["other"].dtype == np.float64
    refused = {
        "f": (np.array([1j]), "complex128 to float32"),
        "i": (np.array([1.5]), "float64 to int32"),
        "b": (np.array([2]), "int64 to bool"),
    }
    for name, (array, message) in refused.items():
        with pytest.raises(InvalidInput, match=message):
            cast_inputs({name: array}, signature)
    with pytest.raises(InvalidInput, match="outside int32's range"):
        cast_inputs({"i": np.array([2**40])}, signature)


# ------------------------------------------------------------------ exit statuses


def test_exit_status_says_what_kind_of_failure_it_was(
    workers: WorkerProcesses, redis_url: str, model_name: str, models_dir: Path, tmp_path: Path
) -> None:
    gather = onnx_models.gather_model(models_dir / "errors-gather.onnx")
    slow = onnx_models.slow_model(models_dir / "errors-slow.onnx")
    workers.serve(gather, model_name, redis_url)
    workers.serve(slow, model_name + "-slow", redis_url)
    np.save(tmp_path / "idx.npy", np.array([1, 7], np.int64))  # 7: Gather fails at run time
    np.save(tmp_path / "slow.npy", np.zeros((1, 256), np.float32))

    failed = ortq("infer", model_name, "--input", f"idx={tmp_path / 'idx.npy'}", "--redis-url", redis_url)
    assert failed.returncode == 3, failed.stderr
    assert one_line_error(failed.stderr).startswith("ortq: InferenceFailed: job ")

    late = ortq("infer", model_name + "-slow", "--input", f"x={tmp_path / 'slow.npy'}", "--timeout", "0.05",
                "--redis-url", redis_url)  # fmt: skip
    assert late.returncode == 1, late.stderr
    line = one_line_error(late.stderr)
    assert line.startswith("ortq: ResultTimeout: ") and "raise --timeout" in line

    # The two above are processes (the interpreter's statuses 3 and 1); the rest run in this one (a process's
    # BrokerUnavailable: tests/test_redis_faults.py).
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    for args in (("infer", model_name, "--input", f"idx={tmp_path / 'idx.npy'}"), ("info",), ("stop", "--model", "m")):
        done = invoke(*args, "--redis-url", nowhere)
        assert done.returncode == 1 and done.no_traceback(), (args, done.stderr)
        assert one_line_error(done.stderr).startswith("ortq: BrokerUnavailable: "), args

    bad = invoke("infer", model_name, "--input", f"wrong={tmp_path / 'idx.npy'}", "--redis-url", redis_url)
    assert bad.returncode == 2 and "InvalidInput" in bad.stderr


def test_a_refusal_after_the_ping_is_one_line(
    workers: WorkerProcesses, redis_url: str, model_name: str, tiny_path: Path, tmp_path: Path
) -> None:
    """Redis refusing a command after the PING check (here a read-only replica of the test's Redis,
    which has the model's signature, refusing the enqueue) is one line and status 2, no traceback."""
    from ortq import keys
    from ortq.localredis import LocalRedis

    workers.serve(tiny_path, model_name, redis_url)
    np.save(tmp_path / "x.npy", np.zeros((1, 4), np.float32))
    port = str(urlsplit(redis_url).port)
    with LocalRedis(extra_args=("--replicaof", "127.0.0.1", port)) as replica:
        client = redis.Redis.from_url(replica.url)

        def synced() -> bool:
            try:
                return bool(client.exists(keys.signature_key(model_name)) == 1)
            except redis.BusyLoadingError:  # still loading the primary's copy: not yet
                return False

        eventually(synced, timeout=30)
        client.close()
        # A process: the one test of run()'s redis.RedisError branch, as the interpreter ends it.
        done = ortq("infer", model_name, "--input", f"x={tmp_path / 'x.npy'}", "--redis-url", replica.url)
    assert done.returncode == 2, done.stderr
    assert "read only replica" in one_line_error(done.stderr)


def test_a_pipelined_refusal_does_not_quote_the_commands_bytes(connection: redis.Redis, model_name: str) -> None:
    """redis-py names the pipelined command Redis refused, with its arguments: for an enqueue, a
    request frame's bytes (newlines included, which would split the one-line error). ortq's message
    keeps what Redis said and leaves the command out."""
    frame = b"\x00\x01 frame\nbytes \xff" * 8
    connection.set(f"{model_name}-string", "x")
    with pytest.raises(redis.ResponseError) as caught, connection.pipeline(transaction=True) as pipe:
        pipe.set(f"{model_name}-frame", frame)
        pipe.rpush(f"{model_name}-string", frame)  # a push onto a string: WRONGTYPE, quoting the frame
        pipe.execute()
    assert "of pipeline caused error" in str(caught.value) and "frame" in str(caught.value)
    error = redisfaults.failure(caught.value, "could not enqueue 1 job(s)")
    assert str(error).startswith("could not enqueue 1 job(s): Redis error: ResponseError: WRONGTYPE"), error
    assert "frame" not in str(error) and "\n" not in str(error) and "Command #" not in str(error)
    assert redis_message(redis.ResponseError("ERR plain")) == "ERR plain"
    connection.delete(f"{model_name}-string", f"{model_name}-frame")


def test_the_exit_statuses_are_documented_where_users_look() -> None:
    help_text = invoke("--help").stdout
    operations = (REPO / "docs" / "operations.md").read_text()
    for status in ("0", "1", "2", "3", "75", "130"):
        assert re.search(rf"^\s+{status}\s+\S", help_text, re.M), status
        assert re.search(rf"^\| {status} \|", operations, re.M), status
