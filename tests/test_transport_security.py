"""TLS (``rediss://``) and Redis ACL users, against a real redis-server started here with TLS only
(``--port 0``), client certificates required, the ``default`` user off, and the ACL users of
docs/security.md. Certificates are made by the ``openssl`` CLI for each run.

What is shown: a real ``ortq worker`` (user ortq-worker) and a Producer (user ortq-producer) run
jobs end to end over TLS, outputs equal to a direct ``session.run``; Redis's ACL LOG records no
denied command, key or channel for either, but the two documented ones (RQ's CLIENT LIST and
INFO, which it copes without); the producer user is refused what only workers may do; ``ortq
info`` runs as a read-only user; wrong credentials and untrusted certificates are one clear
ConfigurationError, and a one-line exit 2 of ``ortq worker`` / ``ortq info``.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlencode
from uuid import uuid4

import numpy as np
import onnxruntime as ort
import pytest
import redis
from rq.utils import utcformat

from ortq import keys
from ortq.errors import BrokerUnavailable, ConfigurationError, InferenceFailed
from ortq.localredis import find_redis_server, free_port
from ortq.producer import Producer
from ortq.producer.enqueue import JobOptions, job_hash
from ortq.redisurls import redacted_url
from ortq.rqcompat.book import Book
from ortq.rqcompat.layout import QueueKeys
from ortq.settings import Settings
from ortq.wire import encode_request
from tests import onnx_models
from tests.cli_support import Result, invoke
from tests.conftest import REPO, WorkerProcesses, eventually, worker_command

# The ACL rules of docs/security.md, user by user (test_the_documented_rules_are_the_tested_ones
# keeps the two the same). Derived from the commands and keys in ortq/producer, ortq/worker,
# ortq/rqcompat (its scripts run each command with the caller's rights), ortq/info.py and
# ortq/control.py; see docs/security.md for why each is there.
PRODUCER_RULES = (
    "resetchannels resetkeys -@all +ping +select +multi +exec +discard +fcall "
    "+type +strlen +set +get +mget +expire +hset +hget +sadd +srandmember +rpush +lpush +linsert +llen +lrem "
    "+xread +zadd "
    "%W~ortq:req:* ~rq:job:* %W~rq:queues ~rq:queue:ortq:* ~ortq:last-high:* %R~ortq:reply:* "
    "%W~rq:canceled:ortq:* ~ortq:parked:*@* %R~ortq:signature:* %R~ortq:workers %R~ortq:worker:* "
    "(+del %W~ortq:req:* %W~rq:job:*)"
)
WORKER_RULES = (
    "resetchannels &rq:pubsub:* resetkeys ~rq:* ~ortq:* -@all +ping +select "
    "+client|setname +client|info +client|unblock "
    "+multi +exec +discard +evalsha +script|load +script|exists +function|list +function|load "
    "+type +exists +get +getrange +strlen +set +del +expire +ttl +persist +object|encoding +memory|usage "
    "+rpush +lpush +lpop +lrem +lrange +ltrim +lmove +blmove +llen "
    "+hset +hget +hmget +hdel +hexists +hlen +hstrlen +sadd +srem +srandmember "
    "+zadd +zrem +zscore +zmscore +zrange +zrangebyscore +zremrangebyscore +xadd +rename +subscribe +unsubscribe"
)
MONITOR_RULES = (
    "resetchannels resetkeys -@all +ping +select +scan +type +get +getrange +mget +scard +srandmember "
    "+hget +hmget +llen +zcard "
    "%R~ortq:signature:* %R~ortq:signatures %R~ortq:workers %R~ortq:worker:* %R~rq:worker:* %R~rq:queues "
    "%R~rq:queue:ortq:* %R~ortq:parked:* %R~ortq:pools %R~ortq:pool:* %R~rq:wip:ortq:* %R~rq:failed:ortq:* "
    "%R~rq:finished:ortq:*"
)
USERS = {"ortq-producer": PRODUCER_RULES, "ortq-worker": WORKER_RULES, "ortq-monitor": MONITOR_RULES}

#: The worker user is refused nothing: ortq's worker sends exactly the commands above.
WORKER_DENIED: set[tuple[str, str, str]] = set()

_CONFIG = """
[req]
distinguished_name = dn
[dn]
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
"""


def _openssl(directory: Path, *args: str) -> None:
    done = subprocess.run(["openssl", *args], cwd=directory, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"openssl {' '.join(args)}:\n{done.stderr}"


def _make_certificates(directory: Path) -> None:
    """ca.crt (and a second, unrelated rogue.crt), server.crt for 127.0.0.1, client.crt; EC P-256 keys."""
    (directory / "openssl.cnf").write_text(_CONFIG)
    for name in ("ca", "rogue", "server", "client"):
        _openssl(directory, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", f"{name}.key")
    config = ("-config", "openssl.cnf")
    for name in ("ca", "rogue"):
        subject = ("-subj", f"/CN=ortq test {name}")
        _openssl(directory, "req", "-new", "-x509", *config, "-extensions", "ca", "-key", f"{name}.key", *subject,
                 "-days", "2", "-out", f"{name}.crt")  # fmt: skip
    for serial, name in enumerate(("server", "client"), start=2):
        _openssl(
            directory, "req", "-new", *config, "-key", f"{name}.key", "-subj", f"/CN={name}", "-out", f"{name}.csr"
        )
        signed_by_ca = ("-CA", "ca.crt", "-CAkey", "ca.key", "-set_serial", str(serial), "-days", "2")
        _openssl(directory, "x509", "-req", "-in", f"{name}.csr", *signed_by_ca, "-extfile", "openssl.cnf",
                 "-extensions", name, "-out", f"{name}.crt")  # fmt: skip


@dataclass
class TlsRedis:
    """A TLS-only redis-server with ortq's ACL users; ``url(user)`` logs in as one of them."""

    port: int
    certs: Path
    passwords: dict[str, str]
    admin: redis.Redis = field(init=False)

    def url(self, user: str, password: str | None = None, ca: str = "ca.crt", client_cert: bool = True) -> str:
        query = {"ssl_ca_certs": str(self.certs / ca)}
        if client_cert:
            query |= {"ssl_certfile": str(self.certs / "client.crt"), "ssl_keyfile": str(self.certs / "client.key")}
        secret = self.passwords.get(user, "") if password is None else password
        return f"rediss://{user}:{secret}@127.0.0.1:{self.port}/0?{urlencode(query)}"

    def denied(self) -> set[tuple[str, str, str]]:
        """(user, reason, command or key) of everything Redis refused since the last ``reset``."""
        return {(e["username"], e["reason"], e["object"]) for e in self.admin.acl_log()}

    def reset(self) -> None:
        self.admin.acl_log_reset()


def _start(args: list[str], log_path: Path, admin: redis.Redis) -> subprocess.Popen[bytes]:
    """Start redis-server and wait until ``admin`` gets a PING through; skip if it cannot do TLS."""
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 15
    while True:
        try:
            admin.ping()
            return process
        except redis.ConnectionError:
            if process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            process.kill()
            process.wait()
            log = log_path.read_text(errors="replace")[-2000:]
            if re.search(r"tls|ssl", log, re.IGNORECASE):
                pytest.skip(f"{args[0]} cannot serve TLS (a build without BUILD_TLS=yes?): {log}")
            raise AssertionError(f"redis-server did not start:\n{log}") from None


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make the test certificates (apt-get install openssl)")
    directory = tmp_path_factory.mktemp("tls")
    _make_certificates(directory)
    passwords = {user: secrets.token_hex(16) for user in (*USERS, "admin")}
    # The aclfile holds SHA-256 hashes of the passwords, not the passwords.
    hashed = {user: hashlib.sha256(password.encode()).hexdigest() for user, password in passwords.items()}
    lines = ["user default off", f"user admin on #{hashed['admin']} ~* &* +@all"]
    lines += [f"user {user} on #{hashed[user]} {rules}" for user, rules in USERS.items()]
    (directory / "users.acl").write_text("\n".join(lines) + "\n")
    port = free_port()
    args = [
        find_redis_server(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
        "--appendonly", "no", "--dir", str(directory), "--aclfile", str(directory / "users.acl"),
        "--tls-cert-file", str(directory / "server.crt"), "--tls-key-file", str(directory / "server.key"),
        "--tls-ca-cert-file", str(directory / "ca.crt"), "--tls-auth-clients", "yes",
    ]  # fmt: skip
    server = TlsRedis(port, directory, passwords)
    server.admin = redis.Redis.from_url(server.url("admin"), socket_connect_timeout=1)
    process = _start(args, directory / "redis.log", server.admin)
    try:
        yield server
    finally:
        server.admin.close()
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def gather_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``y = table[idx]``: batchable, and an index outside [-4, 3] makes the run itself fail."""
    return onnx_models.gather_model(tmp_path_factory.mktemp("tls-models") / "gather.onnx")


@pytest.fixture(scope="module")
def served(tls_redis: TlsRedis, gather_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One batching ``ortq worker`` logged in as ortq-worker; yields the model name it serves."""
    group = WorkerProcesses(tmp_path_factory.mktemp("tls-workers"))
    model = "tls-gather"
    try:
        with pytest.MonkeyPatch.context() as env:
            # Short heartbeats: its scans for abandoned and stuck jobs run every 0.5 s.
            env.setenv("ORTQ_HEARTBEAT_SECONDS", "1")
            worker_url = tls_redis.url("ortq-worker")
            group.serve(gather_path, model, worker_url, 1, "--max-batch", "4", "--rows-independent",
                        watch_url=tls_redis.url("admin"))  # fmt: skip
        yield model
        assert all(p.poll() is None for p, _ in group.processes), group.logs()
    finally:
        group.stop_all()


@pytest.fixture
def producer(tls_redis: TlsRedis) -> Iterator[Producer]:
    with Producer(settings=Settings.from_url(tls_redis.url("ortq-producer"))) as p:
        yield p


@pytest.fixture(scope="module")
def session(gather_path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(gather_path), providers=["CPUExecutionProvider"])


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, cwd=REPO)


def _ortq(*args: str) -> Result:
    """``ortq ARGS`` in this process (tests/cli_support.py); workers run as processes (_run)."""
    return invoke(*args)


def test_jobs_run_end_to_end_over_tls_as_the_producer_and_worker_users(
    tls_redis: TlsRedis, served: str, producer: Producer, session: ort.InferenceSession
) -> None:
    tls_redis.reset()
    # First, so that its one-second backoff overlaps the rest: RQ's retry path, then the failure path.
    retried = producer.submit(served, {"idx": np.array([7])}, retries=1, retry_backoff=1)
    rng = np.random.default_rng(5)
    idxs = [rng.integers(-4, 4, size=int(rng.integers(1, 6))) for _ in range(7)]
    single = producer.infer(served, {"idx": idxs[0]}, timeout=30)
    jobs = producer.submit_many(served, [{"idx": idx} for idx in idxs[1:6]])  # one MULTI: the worker batches them
    urgent = producer.submit(served, {"idx": idxs[6]}, priority="high")  # ortq's Redis function (FCALL)
    outputs = [single, *producer.results([*jobs, urgent], timeout=30)]
    for idx, got in zip(idxs, outputs, strict=True):
        np.testing.assert_array_equal(got["y"], session.run(None, {"idx": idx})[0])
    assert tls_redis.admin.info("commandstats")["cmdstat_lpop"]["calls"] > 0  # a batch was taken (start.lua pops)

    unchecked = Producer(settings=Settings.from_url(tls_redis.url("ortq-producer")), validate=False)
    bad = unchecked.submit(served, {"nope": idxs[0]})
    with pytest.raises(InferenceFailed, match="InvalidInput"):
        bad.result(timeout=30)
    unchecked.close()
    with pytest.raises(InferenceFailed) as caught:
        retried.result(timeout=30)
    assert caught.value.remote_type != "InvalidInput"
    assert tls_redis.admin.hget(keys.job_key(retried.id), "retries_left") == b"0"
    failed = f"rq:failed:{keys.queue_name(served)}"
    for job in (bad, retried):  # RQ's failure bookkeeping follows the reply
        eventually(lambda job=job: tls_redis.admin.zscore(failed, job.id) is not None)

    # What else a producer does: status, worker records, cancelling a job no worker has taken.
    assert jobs[0].status() == "finished"
    [record] = producer.workers(served)
    assert record["provider"] == "CPUExecutionProvider"
    nobody_yet = Producer(settings=producer.settings, allow_unknown_models=True)  # a model no worker serves
    idle = nobody_yet.submit("tls-nobody", {"idx": idxs[0]})
    assert idle.cancel()
    assert idle.status() == "canceled"
    assert not tls_redis.admin.exists(keys.request_key("tls-nobody", idle.id))
    assert tls_redis.denied() <= WORKER_DENIED


def test_jobs_left_by_a_dead_worker_or_a_lost_reply_are_taken_back_under_the_worker_acl(
    tls_redis: TlsRedis, served: str, producer: Producer, session: ort.InferenceSession
) -> None:
    """The recovery and rescue scripts run as ortq-worker: a command denied there would crash the
    worker. The admin writes what each case leaves in Redis: a started job whose execution names a
    worker that sends no heartbeat (killed mid-run), and a queued job in the intermediate list (a
    dequeue whose reply was lost)."""
    tls_redis.reset()
    idx = np.array([3, 0, -1])
    abandoned, stuck, execution = str(uuid4()), str(uuid4()), uuid4().hex
    queue = keys.queue_name(served)
    options = JobOptions(request_ttl=600, result_ttl=600, failure_ttl=600, reply=keys.new_reply_name(600))
    fields = job_hash(served, options, utcformat(datetime.now(UTC)))
    with tls_redis.admin.pipeline() as pipe:
        for job_id, status in ((abandoned, "started"), (stuck, "queued")):
            pipe.set(keys.request_key(served, job_id), encode_request({"idx": idx}), ex=600)
            pipe.hset(keys.job_key(job_id), mapping={**fields, "status": status})
        pipe.hset(f"rq:execution:{abandoned}:{execution}", mapping={"id": execution, "worker_name": "ghost"})
        pipe.zadd(f"rq:wip:{queue}", {f"{abandoned}:{execution}": time.time() + 600})
        pipe.lpush(f"rq:queue:{queue}:intermediate", stuck)
        pipe.execute()
    for job_id in (abandoned, stuck):
        outputs = producer.job(job_id, served).result(timeout=30)
        np.testing.assert_array_equal(outputs["y"], session.run(None, {"idx": idx})[0])
    assert tls_redis.admin.hget(keys.job_key(abandoned), "ortq_recoveries") == b"1"
    assert tls_redis.denied() <= WORKER_DENIED


def test_every_upkeep_call_runs_under_the_worker_acl(tls_redis: TlsRedis) -> None:
    """The upkeep a worker runs every second to every minute (most of it never met by the tests
    above, which end sooner): cleanup of registries with expired entries and wrong-typed keys,
    the rescue, due retries, the recovery scan with a malformed entry to remove. A command of these
    outside the worker's rule would end a deployed worker (exit 2) a minute after it started."""
    tls_redis.reset()
    queue = keys.queue_name(f"tls-upkeep-{uuid4().hex[:6]}")
    layout_of = QueueKeys.of(queue)
    admin = tls_redis.admin
    admin.zadd(layout_of.canceled, {f"junk-{i}": 1 for i in range(50)})
    admin.zadd(layout_of.started, {"forged entry": 1})
    admin.set(layout_of.scheduled, "wrong type")
    admin.rpush(layout_of.intermediate, "no-such-job")
    worker_side = redis.Redis.from_url(tls_redis.url("ortq-worker"))
    book = Book(worker_side, "tls-upkeep-worker", queue)
    assert book.maintain(limit=20) == ([layout_of.scheduled], True)
    assert book.maintain(limit=20)[1] and not book.maintain(limit=20)[1]
    assert admin.zcard(layout_of.canceled) == 0
    book.rescue(grace=0.0)
    book.due_retries()
    assert book.abandoned(15.0, own=False) == [] and admin.zcard(layout_of.started) == 0
    worker_side.close()
    assert tls_redis.denied() == set()


def test_large_frames_are_read_from_the_tls_socket_as_the_worker_user(tls_redis: TlsRedis) -> None:
    """ortq.worker.largeframes reads the replies off redis-py's socket itself: a TLS one here."""
    from ortq.worker.largeframes import read_large_frames

    tls_redis.reset()
    frames = {keys.request_key("m", str(uuid4())): secrets.token_bytes(size) for size in (70_000, 602_112, 3)}
    for key, frame in frames.items():
        tls_redis.admin.set(key, frame, ex=60)
    worker_side = redis.Redis.from_url(tls_redis.url("ortq-worker"))
    assert read_large_frames(worker_side, list(frames), 1 << 20) == list(frames.values())
    assert worker_side.ping()  # the connection went back to the pool with nothing left to read
    worker_side.close()
    assert tls_redis.denied() == set()


def test_a_worker_starts_and_stops_under_its_acl(tls_redis: TlsRedis, gather_path: Path) -> None:
    """Birth, maintenance and death of a --burst worker, with nothing denied; a denial would show
    in the ACL LOG the other tests read, as a command outside the rules does here."""
    tls_redis.reset()
    command = worker_command(gather_path, "tls-burst", tls_redis.url("ortq-worker"), "--burst")
    done = _run(command)
    assert done.returncode == 0, done.stderr
    assert tls_redis.denied() == set()
    worker_side = redis.Redis.from_url(tls_redis.url("ortq-worker"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker_side.execute_command("CLIENT", "LIST")
    worker_side.close()
    assert tls_redis.denied() == {("ortq-worker", "command", "client|list")}


def test_the_producer_user_is_refused_what_only_workers_or_admins_may_do(
    tls_redis: TlsRedis, served: str, producer: Producer
) -> None:
    tls_redis.reset()
    [worker_name] = [record["name"] for record in producer.workers(served)]
    # RQ's queue set exists whether or not an earlier test of this module enqueued (the refused DEL
    # below is checked by its still being there)
    tls_redis.admin.sadd(keys.RQ_QUEUES_SET, keys.queue_key(served))
    signature_before = tls_redis.admin.get(keys.signature_key(served))
    refused = {
        "forge a worker record": ("SET", keys.worker_key("forged"), "{}"),
        "forge a model signature": ("SET", keys.signature_key(served), "{}"),
        "delete RQ's queue set": ("DEL", keys.RQ_QUEUES_SET),
        "delete a queue": ("DEL", keys.queue_key(served)),
        "write RQ's worker hash": ("HSET", f"rq:worker:{worker_name}", "state", "busy"),
        "mark a job started": ("ZADD", f"rq:wip:{keys.queue_name(served)}", "1", "x:y"),
        "send RQ's shutdown command": ("PUBLISH", f"rq:pubsub:{worker_name}", json.dumps({"command": "shutdown"})),
        "read another app's keys": ("GET", "app:secret"),
        "list keys": ("KEYS", "*"),
        "flush": ("FLUSHALL",),
        "read the config": ("CONFIG", "GET", "requirepass"),
    }
    for what, command in refused.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            producer.connection.execute_command(*command)
            pytest.fail(f"the producer user could {what}")
    # A script runs with its caller's rights: EVAL is no way around them.
    with pytest.raises(redis.ResponseError, match=r"can't access|no permissions"):
        producer.connection.eval("return redis.call('SET', 'ortq:worker:' .. ARGV[1], '{}')", 0, "forged")
    assert not tls_redis.admin.exists(keys.worker_key("forged"))
    assert tls_redis.admin.get(keys.signature_key(served)) == signature_before
    assert tls_redis.admin.exists(keys.RQ_QUEUES_SET)
    assert {user for user, _, _ in tls_redis.denied()} == {"ortq-producer"}
    # The read-only user reads no tensors and writes nothing; the worker user stays in rq:* and ortq:*.
    monitor = redis.Redis.from_url(tls_redis.url("ortq-monitor"))
    for command in (("GET", keys.request_key("m", "x")), ("LINDEX", keys.reply_key("m", "x"), "0"),
                    ("SREM", keys.WORKERS_SET, worker_name)):  # fmt: skip
        with pytest.raises(redis.exceptions.NoPermissionError):
            monitor.execute_command(*command)
    monitor.close()
    worker_side = redis.Redis.from_url(tls_redis.url("ortq-worker"))
    for command in (("SET", "app:secret", "x"), ("PUBLISH", f"rq:pubsub:{worker_name}", "{}"), ("FLUSHDB",)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker_side.execute_command(*command)
    worker_side.close()
    assert producer.workers(served), "the worker is still serving"
    tls_redis.reset()


def test_ortq_info_over_tls_as_the_read_only_user(tls_redis: TlsRedis, served: str) -> None:
    tls_redis.reset()
    done = _ortq("info", "--json", "--redis-url", tls_redis.url("ortq-monitor"))
    assert done.returncode == 0, done.stderr
    [model] = [m for m in json.loads(done.stdout)["models"] if m["model"] == served]
    [worker] = model["workers"]
    assert worker["provider"] == "CPUExecutionProvider"
    assert worker["state"] in ("idle", "busy")
    assert [s["name"] for s in model["signature"]["inputs"]] == ["idx"]
    assert tls_redis.denied() == set()


def test_bad_credentials_and_untrusted_certificates_are_clear_errors(tls_redis: TlsRedis, gather_path: Path) -> None:
    producer_password = tls_redis.passwords["ortq-producer"]
    login = "refused the login: invalid username-password pair or user is disabled"
    cases = {
        "wrong password": (tls_redis.url("ortq-producer", "wrong"), login),
        "unknown user": (tls_redis.url("nobody", producer_password), login),
        "no user (default is off)": (tls_redis.url("", ""), "refused the login"),
        "a CA that did not sign the server's certificate": (
            tls_redis.url("ortq-producer", ca="rogue.crt"),
            r"TLS with Redis at rediss://ortq-producer@127\.0\.0\.1:\d+/0 failed: ",
        ),
        "no client certificate": (tls_redis.url("ortq-producer", client_cert=False), "TLS with Redis at .* failed"),
    }
    for what, (url, message) in cases.items():
        with pytest.raises(ConfigurationError, match=message) as caught:
            Producer(settings=Settings.from_url(url))
        assert producer_password not in str(caught.value), what
    with pytest.raises(BrokerUnavailable):  # not TLS at all: the server drops the connection
        Producer(settings=Settings.from_url(f"redis://127.0.0.1:{tls_redis.port}/0"))

    # The CLI: one line on stderr and exit status 2, before and after loading a model.
    worker_password = tls_redis.passwords["ortq-worker"]
    wrong = tls_redis.url("ortq-worker", "wrong")
    started = _run(worker_command(gather_path, "tls-refused", wrong))  # a process: it loads its model first
    untrusted = _ortq("info", "--redis-url", tls_redis.url("ortq-worker", ca="rogue.crt"))
    assert untrusted.no_traceback(), untrusted.stderr
    for done, message in ((started, "refused the login"), (untrusted, "TLS with Redis at")):
        assert done.returncode == 2, done.stderr
        [line] = [line for line in done.stderr.splitlines() if line.startswith("ortq:")]
        assert line.startswith("ortq: ConfigurationError: ") and message in line, done.stderr
        assert "Traceback" not in done.stderr and worker_password not in done.stderr


def test_tls_options_are_checked_when_the_settings_are_made(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("not read here")
    Settings.from_url(f"rediss://u:p@127.0.0.1:6380/0?ssl_ca_certs={ca}&ssl_cert_reqs=required")
    with pytest.raises(ConfigurationError, match="unknown TLS option ssl_ca_cert in redis_url"):
        Settings.from_url(f"rediss://127.0.0.1:6380/0?ssl_ca_cert={ca}")
    with pytest.raises(ConfigurationError, match=r"ssl_certfile=.*/missing\.crt: no such file"):
        Settings.from_url(f"rediss://127.0.0.1:6380/0?ssl_certfile={tmp_path / 'missing.crt'}")
    with pytest.raises(ConfigurationError, match="needs the rediss:// scheme"):
        Settings.from_url(f"redis://127.0.0.1:6379/0?ssl_ca_certs={ca}")
    with pytest.raises(ConfigurationError) as caught:
        Settings.from_url("http://user:s3cret@host:1/0")
    assert "s3cret" not in str(caught.value)
    assert redacted_url(f"rediss://user:s3cret@10.0.0.2:6380/1?ssl_ca_certs={ca}") == "rediss://user@10.0.0.2:6380/1"


def test_the_documented_rules_are_the_tested_ones() -> None:
    security = (REPO / "docs" / "security.md").read_text()
    for user, rules in USERS.items():
        assert f"user {user} on #<sha256 of its password> {rules}\n" in security, user
