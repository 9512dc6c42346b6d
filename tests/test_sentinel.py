"""Redis Sentinel (``redis+sentinel://``, ortq/sentinel.py) with real processes: a primary
``redis-server``, one replica and three sentinels on free ports of 127.0.0.1, a real ``ortq worker``
(batching on) and producers (``Producer`` and ``AsyncProducer``) all given only the Sentinel URL.
Mid-drain the primary is failed over, by ``SENTINEL FAILOVER`` or by SIGKILL; every job whose
submit returned must then be answered exactly once (one reply stream entry, one RQ result on the
new primary) with the outputs of a direct ``session.run``. docs/ha.md explains the settings used
here (``min-replicas-to-write``) and what a failover does without them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys
from ortq.dashboard.app import create_app
from ortq.errors import BrokerUnavailable, ConfigurationError, OrtqError
from ortq.localredis import find_redis_server, free_port
from ortq.producer import AsyncProducer, Producer
from ortq.rqcompat import layout
from ortq.settings import Settings
from tests.conftest import WorkerProcesses, answers_of_many

#: Also in scripts/test.sh's second pass (redis-py 5.0's Sentinel clients) and third (Valkey's sentinels).
pytestmark = pytest.mark.rqcompat

SERVICE = "ortq-ha"
#: The producers' and workers' wait_replicas (ortq/replication.py): without it, an enqueue or an
#: answer the old primary acknowledged in the moment its replica was promoted is lost now and then
#: (about one job in a thousand here, docs/ha.md): the promoted replica never received it.
WAIT_REPLICAS = 1
#: How long the sentinels wait before taking an unanswering primary as down (SIGKILL case).
DOWN_AFTER_MS = 1000


def _sentinel_command(config: Path) -> list[str]:
    """``redis-sentinel CONFIG`` (Debian's redis-sentinel package), else the server binary in
    sentinel mode (the same program: ``redis-server CONFIG --sentinel``; valkey-server too)."""
    server = find_redis_server()
    if "valkey" not in Path(server).resolve().name and (binary := shutil.which("redis-sentinel")):
        return [binary, str(config)]
    return [server, str(config), "--sentinel"]


@dataclass
class SentinelGroup:
    """A primary, a replica and three sentinels, started on free ports and always stopped."""

    directory: Path
    data_ports: list[int] = field(default_factory=lambda: [free_port(), free_port()])
    sentinel_ports: list[int] = field(default_factory=lambda: [free_port(), free_port(), free_port()])
    processes: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def _start(self, port: int, args: list[str]) -> None:
        log = open(self.directory / f"{port}.log", "wb")  # noqa: SIM115 (kept open by the process)
        self.processes[port] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.directory)
        log.close()

    def _data_node(self, port: int, *extra: str) -> None:
        node_dir = self.directory / f"node-{port}"
        node_dir.mkdir(exist_ok=True)
        # appendonly yes (fsync every second): a node that restarts keeps what it had; no failover
        # depends on it. min-replicas-to-write 1: a primary whose replica left (promoted by the
        # sentinels) refuses writes at once instead of accepting writes that the next failover
        # step throws away (docs/ha.md, "What a failover loses").
        self._start(port, [
            find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(node_dir),
            "--save", "", "--appendonly", "yes", "--appendfsync", "everysec",
            "--min-replicas-to-write", "1", "--min-replicas-max-lag", "10", "--repl-diskless-sync-delay", "0",
            "--stream-node-max-bytes", "512", *extra,
        ])  # fmt: skip

    def restart(self, port: int) -> None:
        """Start the data node of ``port`` again (as a supervisor would after a crash): it comes back
        a primary of its own, from its append-only file, until the sentinels make it a replica."""
        self.processes[port].wait(10)
        self._data_node(port)

    def _listening(self, ports: list[int], index: int, start: Callable[[int], None]) -> None:
        """``start(ports[index])``, returning once that process answers on its port. A port that
        another process took between free_port() and the bind (a busy machine) makes the process
        exit: it is started again on a fresh port (at most 5 times)."""
        for _ in range(5):
            port = ports[index]
            start(port)
            process = self.processes[port]
            client = redis.Redis(port=port, socket_timeout=5)
            try:
                while process.poll() is None:
                    try:  # the answer must be this process's: the port's taker may answer too
                        if int(client.info("server")["process_id"]) == process.pid:
                            return
                    except redis.ConnectionError:
                        pass
                    time.sleep(0.05)
            finally:
                client.close()
            del self.processes[port]
            ports[index] = free_port()
        raise AssertionError(f"no free port held for {start}\n{self.logs()}")

    def _sentinel(self, port: int) -> None:
        config = self.directory / f"sentinel-{port}.conf"
        config.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {self.directory}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.data_ports[0]} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {SERVICE} 10000\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        self._start(port, _sentinel_command(config))

    def start(self) -> SentinelGroup:
        self._listening(self.data_ports, 0, self._data_node)
        self._listening(self.data_ports, 1, lambda port: self._data_node(port, "--replicaof", "127.0.0.1",
                                                                         str(self.data_ports[0])))  # fmt: skip
        admin = redis.Redis(port=self.data_ports[0], socket_timeout=5)
        _wait(lambda: _connected_replicas(admin) == 1, "the replica to connect", self)
        admin.close()
        for index in range(len(self.sentinel_ports)):
            self._listening(self.sentinel_ports, index, self._sentinel)
        for port in self.sentinel_ports:
            client = redis.Redis(port=port, socket_timeout=5)
            _wait(lambda c=client: _sees_everyone(c), f"sentinel {port} to see the replica and the others", self)
            client.close()
        return self

    def primary_port(self) -> int:
        client = redis.Redis(port=self.sentinel_ports[0], socket_timeout=5)
        try:
            _, port = client.sentinel_get_master_addr_by_name(SERVICE)
        finally:
            client.close()
        return int(port)

    def wait_for_new_primary(self, old: int) -> int:
        """Wait until every sentinel names another primary than ``old``, which then takes writes."""

        def switched() -> bool:
            for port in self.sentinel_ports:
                client = redis.Redis(port=port, socket_timeout=5)
                try:
                    if int(client.sentinel_get_master_addr_by_name(SERVICE)[1]) == old:
                        return False
                finally:
                    client.close()
            return True

        _wait(switched, "the sentinels to elect a new primary", self, timeout=60)
        new = self.primary_port()
        client = redis.Redis(port=new, socket_timeout=5)
        _wait(lambda: client.info("replication")["role"] == "master", "the new primary to take writes", self)
        client.close()
        return new

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.directory.glob("*.log"))

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.terminate()
        for process in self.processes.values():
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _connected_replicas(client: redis.Redis) -> int:
    """Replicas past their first sync (``connected_slaves`` counts those still waiting for it)."""
    info = client.info("replication")
    return sum(1 for name, value in info.items() if name.startswith("slave") and isinstance(value, dict)
               and value.get("state") == "online")  # fmt: skip


def _sees_everyone(client: redis.Redis) -> bool:
    state = client.sentinel_master(SERVICE)
    return int(state["num-slaves"]) == 1 and int(state["num-other-sentinels"]) == 2


def _wait(check: object, what: str, group: SentinelGroup, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():  # type: ignore[operator]
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{group.logs()}")
        time.sleep(0.1)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    directory = tmp_path / "sentinel"
    directory.mkdir()
    running = SentinelGroup(directory)
    try:
        yield running.start()
    finally:
        running.stop()


@dataclass
class Submitted:
    """What the producers sent and what they saw."""

    jobs: list[tuple[str, np.ndarray, str]] = field(default_factory=list)  # (job id, x, which producer)
    refused: list[str] = field(default_factory=list)  # BrokerUnavailable: unknown whether enqueued
    refused_at: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # any other error: a defect
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, job_id: str, x: np.ndarray, who: str) -> None:
        with self.lock:
            self.jobs.append((job_id, x, who))


def _own_ids(retry: float) -> dict[str, object]:
    """Submit options: with ``retry`` (submit_retry_seconds), an id of the submit's own and
    unique=True, which a retried submit cannot enqueue twice (ortq/producer/submitting.py)."""
    return {"job_id": str(uuid.uuid4()), "unique": True} if retry else {}


def _sync_producer(url: str, model: str, sent: Submitted, stop: threading.Event, retry: float = 0) -> None:
    rng = np.random.default_rng(1)
    settings = Settings.from_url(url, wait_replicas=WAIT_REPLICAS, submit_retry_seconds=retry)
    with Producer(settings=settings) as producer:
        while not stop.is_set():
            x = rng.standard_normal((1, 4)).astype(np.float32)
            try:
                sent.add(producer.submit(model, {"x": x}, **_own_ids(retry)).id, x, "sync")  # type: ignore[arg-type]
            except BrokerUnavailable as exc:
                sent.refused.append(f"sync: {exc}")
                sent.refused_at.append(time.monotonic())
            except OrtqError as exc:
                sent.errors.append(f"sync: {type(exc).__name__}: {exc}")
            time.sleep(0.01)


def _async_producer(url: str, model: str, sent: Submitted, stop: threading.Event, retry: float = 0) -> None:
    async def run() -> None:
        rng = np.random.default_rng(2)
        settings = Settings.from_url(url, wait_replicas=WAIT_REPLICAS, submit_retry_seconds=retry)
        async with AsyncProducer(settings=settings) as producer:
            while not stop.is_set():
                x = rng.standard_normal((1, 4)).astype(np.float32)
                try:
                    job = await producer.submit(model, {"x": x}, **_own_ids(retry))  # type: ignore[arg-type]
                    sent.add(job.id, x, "async")
                except BrokerUnavailable as exc:
                    sent.refused.append(f"async: {exc}")
                    sent.refused_at.append(time.monotonic())
                except OrtqError as exc:
                    sent.errors.append(f"async: {type(exc).__name__}: {exc}")
                await asyncio.sleep(0.01)

    asyncio.run(run())


def _drain_through_a_failover(
    group: SentinelGroup,
    tiny_path: Path,
    model: str,
    tmp_path: Path,
    fail_over: object,
    switched: object = None,
    retry: float = 0,
) -> tuple[Submitted, int]:
    """Workers and producers on the Sentinel URL; ``fail_over(primary_port)`` once ~100 jobs are
    in, ``switched(old_port)`` once the sentinels name the new primary; producers go on until ~100
    more are in on the new primary. ``retry``: the producers' submit_retry_seconds (their submits
    then have ids of their own, unique). Returns what was sent and the new primary's port."""
    os.environ["ORTQ_WAIT_REPLICAS"] = str(WAIT_REPLICAS)  # the workers', undone below
    workers = WorkerProcesses(tmp_path)
    sent, stop = Submitted(), threading.Event()
    threads = [
        threading.Thread(target=_sync_producer, args=(group.url, model, sent, stop, retry)),
        threading.Thread(target=_async_producer, args=(group.url, model, sent, stop, retry)),
    ]
    try:
        workers.serve(tiny_path, model, group.url, 1, "--max-batch", "8", "--rows-independent", "--max-wait-ms", "5")
        for thread in threads:
            thread.start()
        _wait(lambda: len(sent.jobs) >= 100, "the first 100 jobs", group)
        old = group.primary_port()
        fail_over(old)  # type: ignore[operator]
        new = group.wait_for_new_primary(old)
        if switched is not None:
            switched(old)  # type: ignore[operator]
        after = len(sent.jobs)
        _wait(lambda: len(sent.jobs) >= after + 100, "100 more jobs after the failover", group, timeout=60)
        stop.set()
        for thread in threads:
            thread.join(60)
        with Producer(settings=Settings.from_url(group.url)) as producer:
            session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
            missing = []
            deadline = time.monotonic() + 60  # for all of them: a lost job costs no more than the rest
            for job_id, x, who in sent.jobs:
                try:
                    outputs = producer.job(job_id, model).result(timeout=max(0.5, deadline - time.monotonic()))
                except OrtqError as exc:
                    missing.append(f"{who} job {job_id}: {type(exc).__name__}: {exc}")
                    continue
                np.testing.assert_array_equal(outputs["y"], session.run(None, {"x": x})[0])
        assert not missing, f"{len(missing)} of {len(sent.jobs)} jobs not answered: {missing[:5]}\n{workers.logs()}"
        assert all(process.poll() is None for process, _ in workers.processes), workers.logs()
    finally:
        del os.environ["ORTQ_WAIT_REPLICAS"]
        stop.set()
        for thread in threads:
            if thread.is_alive():
                thread.join(60)
        workers.stop_all()
    assert not sent.errors, sent.errors[:5]
    kinds: dict[str, int] = {}
    for line in sent.refused:
        kinds[line[:110]] = kinds.get(line[:110], 0) + 1
    if sent.refused_at:
        print(f"submits refused for {max(sent.refused_at) - min(sent.refused_at):.1f} s:", kinds)
    print("worker log:", [line for line in workers.logs().splitlines() if "WARNING" in line or "ERROR" in line][:12])
    return sent, new


def _answered_once(port: int, model: str, job_ids: list[str]) -> None:
    """Each job has one entry in its producer's reply stream and one RQ result entry on the new primary."""
    admin = redis.Redis(port=port, socket_timeout=10)
    answers = answers_of_many(admin, model, job_ids)
    with admin.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.xlen(layout.results_key(job_id))
        results = pipe.execute()
    admin.close()
    other = [(job_id, len(answers[job_id]), results[i]) for i, job_id in enumerate(job_ids)
             if (len(answers[job_id]), results[i]) != (1, 1)]  # fmt: skip
    assert not other, f"{len(other)} jobs answered other than once (id, replies, results): {other[:5]}"


def test_a_sentinel_failover_mid_drain_loses_nothing_and_answers_nothing_twice(
    group: SentinelGroup, tiny_path: Path, model_name: str, tmp_path: Path
) -> None:
    def fail_over(primary: int) -> None:
        client = redis.Redis(port=group.sentinel_ports[1], socket_timeout=10)
        assert client.sentinel_failover(SERVICE)
        client.close()

    sent, new = _drain_through_a_failover(group, tiny_path, model_name, tmp_path, fail_over)
    _answered_once(new, model_name, [job_id for job_id, _, _ in sent.jobs])
    print(f"{len(sent.jobs)} jobs answered once; {len(sent.refused)} submits refused during the failover")


def test_a_primary_killed_mid_drain_is_replaced_and_its_jobs_answered_once(
    group: SentinelGroup, tiny_path: Path, model_name: str, tmp_path: Path
) -> None:
    def kill(primary: int) -> None:
        group.processes[primary].send_signal(signal.SIGKILL)

    # The new primary, with min-replicas-to-write 1, takes writes once the old one is back as its replica.
    sent, new = _drain_through_a_failover(group, tiny_path, model_name, tmp_path, kill, group.restart)
    _answered_once(new, model_name, [job_id for job_id, _, _ in sent.jobs])
    print(f"{len(sent.jobs)} jobs answered once; {len(sent.refused)} submits refused during the failover")


def test_through_a_failover_a_submit_that_may_be_made_again_is_retried_not_refused(
    group: SentinelGroup, tiny_path: Path, model_name: str, tmp_path: Path
) -> None:
    """With submit_retry_seconds, producers whose submits have their own ids (unique) ride out a
    killed primary's window: no submit raises (before, each one in the window raised
    BrokerUnavailable), and every job is answered once."""

    def kill(primary: int) -> None:
        group.processes[primary].send_signal(signal.SIGKILL)

    sent, new = _drain_through_a_failover(group, tiny_path, model_name, tmp_path, kill, group.restart, retry=120)
    assert not sent.refused, sent.refused[:5]
    _answered_once(new, model_name, [job_id for job_id, _, _ in sent.jobs])
    assert len({job_id for job_id, _, _ in sent.jobs}) == len(sent.jobs)


def test_an_unknown_service_or_no_sentinel_is_a_clear_error(group: SentinelGroup) -> None:
    hosts = ",".join(f"127.0.0.1:{port}" for port in group.sentinel_ports)
    with pytest.raises(ConfigurationError, match=r"no sentinel of .* monitors a service named 'nosuch'.*ortq-ha"):
        Settings(redis_url=f"redis+sentinel://{hosts}/nosuch/0").connect()
    port = free_port()
    with pytest.raises(BrokerUnavailable, match="No master found for 'ortq-ha'") as refused:
        Producer(redis_url=f"redis+sentinel://127.0.0.1:{port}/{SERVICE}/0")
    # One line that names the sentinel and why, not redis-py's dump of its client (~1,200 characters).
    assert f"No master found for 'ortq-ha': 127.0.0.1:{port} Connection refused)" in str(refused.value)
    assert len(str(refused.value)) < 300, str(refused.value)


def test_info_the_dashboard_and_a_shard_map_take_a_sentinel_url(
    group: SentinelGroup, tiny_path: Path, model_name: str, tmp_path: Path, redis_url: str
) -> None:
    # The group's primary with a password, given in the URL (the sentinels have none here).
    primary = redis.Redis(port=group.primary_port())
    primary.config_set("requirepass", "s3cret")
    primary.close()
    hosts = ",".join(f"127.0.0.1:{port}" for port in group.sentinel_ports)
    url = f"redis+sentinel://:s3cret@{hosts}/{SERVICE}/0"
    workers = WorkerProcesses(tmp_path)
    try:
        workers.serve(tiny_path, model_name, url, 1)
        env = {**os.environ, "ORTQ_REDIS_URL": redis_url}  # the map's default: the session's Redis
        shards = f"{model_name}={url}"
        info = subprocess.run([sys.executable, "-m", "ortq", "info", "--shards", shards], env=env,
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert info.returncode == 0, info.stdout + info.stderr
        assert model_name in info.stdout and "s3cret" not in info.stdout + info.stderr
        with Producer(settings=Settings(redis_url=redis_url, redis_shards=shards)) as producer:
            x = np.ones((2, 4), np.float32)
            np.testing.assert_array_equal(producer.infer(model_name, {"x": x}, timeout=30)["y"], 2 * x + 1)
        client = create_app(Settings.from_url(url)).test_client()
        page = client.get("/")
        assert page.status_code == 200 and model_name in page.get_data(as_text=True)
        queues = client.get("/rq/0/data/queues.json")
        assert queues.status_code == 200 and keys.queue_name(model_name) in queues.get_data(as_text=True)
        assert "s3cret" not in page.get_data(as_text=True)
    finally:
        workers.stop_all()
    with pytest.raises(ConfigurationError, match="refused the login") as refused:
        Settings(redis_url=f"redis+sentinel://:wrong@{hosts}/{SERVICE}/0").connect()
    assert "wrong" not in str(refused.value)


def _sockets_to(ports: list[int]) -> int:
    """This process's open TCP sockets whose peer is one of ``ports`` on 127.0.0.1 (Linux's
    /proc: the socket inodes of this process's descriptors, looked up in /proc/self/net/tcp)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    peers = {f"0100007F:{port:04X}" for port in ports}
    rows = Path("/proc/self/net/tcp").read_text().splitlines()[1:]
    return sum(1 for row in rows if (fields := row.split())[2] in peers and fields[9] in inodes)


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="counts sockets through Linux's /proc")
def test_closing_a_client_closes_its_connections_to_the_sentinels(group: SentinelGroup) -> None:
    ports = group.sentinel_ports
    assert _sockets_to(ports) == 0
    client = Settings(redis_url=group.url).connect()
    client.ping()
    assert _sockets_to(ports) > 0  # the primary was asked for: the count sees the sentinels' clients
    client.close()
    assert _sockets_to(ports) == 0
    with Producer(redis_url=group.url) as producer:
        assert producer.signature("nosuch") is None
        assert _sockets_to(ports) > 0
    assert _sockets_to(ports) == 0

    async def use_and_close() -> int:
        async with AsyncProducer(redis_url=group.url) as producer:
            assert await producer.signature("nosuch") is None
            return _sockets_to(ports)

    assert asyncio.run(use_and_close()) > 0
    assert _sockets_to(ports) == 0
