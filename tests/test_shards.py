"""Models sharded over two real redis-servers: the shard map's parsing, ``Producer`` and
``AsyncProducer`` routing each model to its own Redis (real ``ortq worker`` processes, outputs
compared with a direct ``session.run``), ``ortq info`` / ``ortq infer`` with ``--shards``, and a
pool whose models' workers start on different Redis instances."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import AsyncProducer, keys
from ortq.errors import ConfigurationError, UnknownModel
from ortq.localredis import LocalRedis
from ortq.pool.config import PoolConfig
from ortq.pool.plan import build_slots, make_plan, worker_environment
from ortq.producer import Producer
from ortq.redisurls import redacted_url
from ortq.settings import DEFAULT_REDIS_URL, Settings
from ortq.shards import ShardMap
from tests.cli_support import Result, invoke
from tests.conftest import REPO, Pool, WorkerProcesses
from tests.test_pool import no_measure

PASSWORD = "s3cret-shard"
#: The two models, one per Redis: a small one on the suite's Redis, a conv net (600 KB frames) on its own.
SMALL = f"shard-small-{os.getpid()}"
BIG = f"shard-big-{os.getpid()}"


def ortq(*args: str, env: dict[str, str] | None = None) -> Result:
    """``ortq ARGS`` with these variables set, in this process (tests/cli_support.py): none of them serves."""
    return invoke(*args, env=env)


@pytest.fixture(scope="module")
def big_redis() -> Iterator[str]:
    """The second redis-server, with a password (which nothing may print): its URL."""
    with LocalRedis() as server:
        client = redis.Redis(port=server.port)
        client.config_set("requirepass", PASSWORD)
        client.close()
        yield f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"


@pytest.fixture(scope="module")
def served(
    tmp_path_factory: pytest.TempPathFactory, redis_server: LocalRedis, big_redis: str, tiny_path: Path, conv_path: Path
) -> Iterator[Settings]:
    """A worker of SMALL on the suite's Redis, one of BIG on the second; the producers' settings."""
    group = WorkerProcesses(tmp_path_factory.mktemp("shard-workers"))
    try:
        group.serve(tiny_path, SMALL, redis_server.url)
        group.serve(conv_path, BIG, big_redis)
        yield Settings.from_url(redis_server.url, redis_shards=f"{BIG}={big_redis}")
    finally:
        group.stop_all()


def direct(model_path: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, inputs), strict=True))


def assert_close(got: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def small_inputs(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.standard_normal((1, 4)).astype(np.float32)} for _ in range(n)]


def big_inputs(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(2)
    return [{"image": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)} for _ in range(n)]


def keys_naming(client: redis.Redis, *names: str) -> set[str]:
    """Every key of that Redis whose name holds one of ``names`` (a model, a job id). Other tests
    share the main Redis, and some leave keys whose names are not UTF-8 (tests/test_hostile_redis.py)."""
    found = {k.decode(errors="replace") for k in client.scan_iter(count=1000)}
    return {k for k in found if any(name in k for name in names)}


def connections(url: str) -> int:
    """This process's open TCP connections to that Redis (Linux: its socket fds in /proc/net/tcp):
    the worker's own connections to it come and go, and are not counted."""
    port = redis.ConnectionPool.from_url(url).connection_kwargs["port"]
    sockets = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            sockets.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile
            continue
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        established = fields[3] == "01"
        if established and int(fields[2].rpartition(":")[2], 16) == port and f"socket:[{fields[9]}]" in sockets:
            count += 1
    return count


# ------------------------------------------------------------------------------------ 1. the map


def test_the_spec_is_parsed_with_a_default_for_every_model_not_listed() -> None:
    spec = "conv=redis://:pw@big:6380/0, detector=rediss://gpu-redis:6379/2\n"
    shards = ShardMap.parse(spec, "redis://main:6379/0")
    assert shards.url_for("conv") == "redis://:pw@big:6380/0"
    assert shards.url_for("digits") == "redis://main:6379/0"
    assert shards.urls() == ["redis://main:6379/0", "redis://:pw@big:6380/0", "rediss://gpu-redis:6379/2"]
    assert shards.sharded and ShardMap.parse(spec, "redis://main:6379/0") == shards
    assert ShardMap.parse(shards.spec(), shards.default_url) == shards
    assert shards.describe() == [
        "redis://main:6379/0: every model not listed",
        "redis://big:6380/0: conv",
        "rediss://gpu-redis:6379/2: detector",
    ]
    assert "pw" not in repr(shards)
    # From the environment, through Settings; nothing set: no map, exactly the single-Redis settings.
    settings = Settings.from_env({"ORTQ_REDIS_URL": "redis://main:6379/0", "ORTQ_REDIS_SHARDS": spec})
    assert settings.shards == shards and "pw" not in repr(settings)
    assert Settings.from_env({}).shards is None and Settings.from_env({}) == Settings()
    assert settings.for_redis("redis://big:6380/0") == Settings(redis_url="redis://big:6380/0")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("conv", "entry 1 ('conv') is not MODEL=URL"),
        ("digits=redis://a:6379/0,redis://:s3cret@b:6379/0", "entry 2 ('redis://b:6379/0') is not MODEL=URL"),
        ("=redis://a:6379/0", "a model name is empty"),
        ("conv=redis://a:6379/0,conv=redis://b:6379/0", "model 'conv' is given twice (entry 2)"),
        (
            "conv=http://a:6379/0",
            "model 'conv': redis_url must start with redis://, rediss://, unix://, redis+sentinel://",
        ),
        ("conv=a:6379/0", "model 'conv': redis_url 'a:6379/0' has no scheme; did you mean redis://a:6379/0?"),
        ("conv=redis://:s3cret@a:6379/x", "model 'conv': redis_url 'redis://a:6379/x': after HOST:PORT comes the"),
        ("conv=rediss://a?ssl_ca_certs=/no/such.crt", "model 'conv': redis_url option ssl_ca_certs=/no/such.crt: no"),
        ("conv!=redis://a:6379/0", "invalid model name 'conv!'"),
    ],
)
def test_bad_maps_are_refused_naming_the_entry_and_never_the_password(spec: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        Settings(redis_shards=spec)
    assert str(refused.value).startswith("shard map (redis_shards, --shards, $ORTQ_REDIS_SHARDS): ")
    assert message in str(refused.value) and "s3cret" not in str(refused.value)


def test_a_second_source_must_agree_with_the_map() -> None:
    shards = ShardMap.parse("conv=redis://b:6379/0", "redis://a:6379/0")
    assert shards.with_routes([("conv", "redis://b:6379/0"), ("ocr", "redis://c:6379/0")], "x").url_for("ocr") == (
        "redis://c:6379/0"
    )
    with pytest.raises(ConfigurationError, match=r"x: model 'conv' is on redis://c:6379/0 there, but the shard map"):
        shards.with_routes([("conv", "redis://:s3cret@c:6379/0")], "x")


# ------------------------------------------------------------------------------------ 2. producers


def test_a_producer_sends_each_model_to_its_own_redis(
    served: Settings, redis_url: str, big_redis: str, tiny_path: Path, conv_path: Path
) -> None:
    before = connections(big_redis)
    with Producer(settings=served) as producer:
        # Lazily: until BIG is used, nothing connects to its Redis.
        small = producer.infer(SMALL, small_inputs(1)[0], timeout=30)
        assert connections(big_redis) == before
        np.testing.assert_allclose(small["y"], direct(tiny_path, small_inputs(1)[0])["y"], rtol=1e-6)
        big = producer.infer(BIG, big_inputs(1)[0], timeout=60)
        assert_close(big["logits"], direct(conv_path, big_inputs(1)[0])["logits"])
        assert connections(big_redis) == before + 1  # one client for the other Redis, reused

        small_jobs = producer.submit_many(SMALL, small_inputs(6))
        big_jobs = producer.submit_many(BIG, big_inputs(3))
        mixed = [job for pair in zip(small_jobs, big_jobs, strict=False) for job in pair] + small_jobs[3:]
        outputs = producer.results(mixed, timeout=60)
        for job, got in zip(mixed, outputs, strict=True):
            if job.model == SMALL:
                inputs = small_inputs(6)[small_jobs.index(job)]
                np.testing.assert_allclose(got["y"], direct(tiny_path, inputs)["y"], rtol=1e-6)
            else:
                inputs = big_inputs(3)[big_jobs.index(job)]
                assert_close(got["logits"], direct(conv_path, inputs)["logits"])
        assert producer.job(big_jobs[0].id, BIG).status() == "finished"
        assert producer.job(small_jobs[0].id, SMALL).status() == "finished"
        assert [r["model"] for r in producer.wait_for_workers(BIG, 1, timeout=5)] == [BIG]
        assert [r["model"] for r in producer.workers(SMALL)] == [SMALL]
        assert connections(big_redis) == before + 1
    assert connections(big_redis) == before  # closed with the producer

    main, big_client = redis.Redis.from_url(redis_url), redis.Redis.from_url(big_redis)
    try:
        small_ids = [job.id for job in small_jobs]
        big_ids = [job.id for job in big_jobs]
        assert all(main.exists(keys.job_key(i)) for i in small_ids)
        assert all(big_client.exists(keys.job_key(i)) for i in big_ids)
        assert big_client.exists(keys.signature_key(BIG)) and main.exists(keys.signature_key(SMALL))
        assert big_client.sismember(keys.RQ_QUEUES_SET, keys.queue_key(BIG))
        assert keys_naming(main, BIG, *big_ids) == set(), "a key of the big model on the main Redis"
        assert keys_naming(big_client, SMALL, *small_ids) == set(), "a key of the small model on the big one"
    finally:
        main.close()
        big_client.close()


def test_an_unknown_model_names_the_redis_the_map_gave_it(served: Settings, big_redis: str) -> None:
    settings = Settings.from_url(served.redis_url, redis_shards=f"{BIG}x={big_redis}")
    with Producer(settings=settings) as producer, pytest.raises(UnknownModel) as unknown:
        producer.submit(f"{BIG}x", big_inputs(1)[0])
    message = str(unknown.value)
    assert f"Models with workers: {BIG} on {redacted_url(big_redis)}, the Redis the shard map" in message
    assert f"Did you mean {BIG!r}?" in message and PASSWORD not in message


def test_an_async_producer_routes_the_same_way(
    served: Settings, redis_url: str, big_redis: str, tiny_path: Path, conv_path: Path
) -> None:
    before = connections(big_redis)

    async def main() -> dict[str, Any]:
        async with AsyncProducer(settings=served, max_reads=2) as producer:
            small = await producer.infer(SMALL, small_inputs(1)[0])
            untouched = connections(big_redis)
            big = await producer.infer(BIG, big_inputs(1)[0], timeout=60)
            small_jobs = await producer.submit_many(SMALL, small_inputs(4))
            big_jobs = await producer.submit_many(BIG, big_inputs(2))
            mixed = [big_jobs[0], *small_jobs, big_jobs[1]]
            outputs = await producer.results(mixed, timeout=60)
            one = await producer.job(big_jobs[1].id, BIG).result(timeout=5)
            return {
                "small": small, "big": big, "untouched": untouched, "small_jobs": small_jobs, "big_jobs": big_jobs,
                "outputs": outputs, "one": one, "status": await producer.job(big_jobs[0].id, BIG).status(),
                "workers": await producer.wait_for_workers(BIG, 1, timeout=5),
            }  # fmt: skip

    got = asyncio.run(main())
    assert got["untouched"] == before
    assert connections(big_redis) == before  # aclose closed the other Redis's pools too
    np.testing.assert_allclose(got["small"]["y"], direct(tiny_path, small_inputs(1)[0])["y"], rtol=1e-6)
    expected_big = [direct(conv_path, inputs)["logits"] for inputs in big_inputs(2)]
    assert_close(got["big"]["logits"], direct(conv_path, big_inputs(1)[0])["logits"])
    big_outputs = [got["outputs"][0], got["outputs"][-1]]
    for outputs, expected in zip(big_outputs, expected_big, strict=True):
        assert_close(outputs["logits"], expected)
    for outputs, inputs in zip(got["outputs"][1:-1], small_inputs(4), strict=True):
        np.testing.assert_allclose(outputs["y"], direct(tiny_path, inputs)["y"], rtol=1e-6)
    np.testing.assert_array_equal(got["one"]["logits"], got["outputs"][-1]["logits"])
    assert got["status"] == "finished" and [r["model"] for r in got["workers"]] == [BIG]

    big_client = redis.Redis.from_url(big_redis)
    main_client = redis.Redis.from_url(redis_url)
    try:
        big_ids = [job.id for job in got["big_jobs"]]
        small_ids = [job.id for job in got["small_jobs"]]
        assert all(big_client.exists(keys.job_key(i)) for i in big_ids)
        assert keys_naming(main_client, *big_ids) == set() and keys_naming(big_client, *small_ids) == set()
    finally:
        big_client.close()
        main_client.close()


# ------------------------------------------------------------------------------------ 3. the commands


def test_info_lists_every_redis_and_infer_follows_the_map(
    served: Settings, redis_url: str, big_redis: str, tmp_path: Path, conv_path: Path
) -> None:
    shards = f"{BIG}={big_redis}"
    shown_big = redacted_url(big_redis)
    table = ortq("info", "--redis-url", redis_url, "--shards", shards)
    assert table.returncode == 0, table.stderr
    assert PASSWORD not in table.stdout + table.stderr
    assert re.search(
        rf"^{BIG}\s+{re.escape(shown_big)}\s+\S+\s+0\s+0\s+0\s+\d+\s+0\s+1\s+image: float32", table.stdout, re.M
    )
    assert re.search(
        rf"^{SMALL}\s+{re.escape(redis_url)}\s+\S+\s+0\s+0\s+0\s+\d+\s+0\s+1\s+x: float32", table.stdout, re.M
    )
    assert re.search(
        rf"^{BIG}\.\S+\s+{BIG}\s+{re.escape(shown_big)}\s+\S+\s+\w+\s+CPUExecutionProvider", table.stdout, re.M
    )
    assert "WARNING" not in table.stdout

    # The map from the environment, in JSON; and a map that sends SMALL where its worker is not.
    misrouted = f"{shards},{SMALL}={big_redis}"
    as_json = json.loads(ortq("info", "--json", "--redis-url", redis_url, env={"ORTQ_REDIS_SHARDS": misrouted}).stdout)
    where = {m["model"]: m["redis"] for m in as_json["models"] if m["model"] in (SMALL, BIG)}
    assert where == {SMALL: redis_url, BIG: shown_big}
    assert as_json["warnings"] == [
        f"model {SMALL!r} has 1 worker(s) and 0 queued job(s) on {redis_url}, but the shard map sends its jobs to "
        f"{shown_big}"
    ]

    image = big_inputs(1)[0]["image"]
    np.save(tmp_path / "image.npy", image)
    out = tmp_path / "out.npz"
    args = ("infer", BIG, "--input", f"image={tmp_path / 'image.npy'}", "--output", str(out), "--redis-url", redis_url)
    done = ortq(*args, "--shards", shards)
    assert done.returncode == 0, done.stderr
    assert_close(np.load(out)["logits"], direct(conv_path, {"image": image})["logits"])
    unmapped = ortq(*args)  # without the map BIG goes to the main Redis, where nobody serves it
    assert unmapped.returncode == 2 and "UnknownModel" in unmapped.stderr


# ------------------------------------------------------------------------------------ 4. pools


def pool_file(tmp_path: Path, tiny_path: Path, conv_path: Path, big_line: str = "", small: str = SMALL) -> Path:
    path = tmp_path / ("sharded.toml" if big_line else "plain.toml")
    path.write_text(
        textwrap.dedent(f"""
        [pool]
        measure_memory = false
        grace_seconds = 20
        [[model]]
        name = "{small}"
        path = "{tiny_path}"
        threads = 1
        [[model.workers]]
        count = 1
        [[model]]
        name = "{small}-big"
        path = "{conv_path}"
        threads = 1
        {big_line}
        [[model.workers]]
        count = 1
    """)
    )
    return path


def test_stop_finds_workers_on_the_redis_the_map_gives(
    redis_url: str, big_redis: str, tiny_path: Path, tmp_path: Path
) -> None:
    """``ortq stop`` under a map: --model looks on that model's Redis only; --worker (or --host) on
    every Redis of the map; without the map a worker on the other Redis is not found."""
    small, big = f"stop-small-{os.getpid()}", f"stop-big-{os.getpid()}"
    shards = f"{big}={big_redis}"
    group = WorkerProcesses(tmp_path)
    try:
        group.serve(tiny_path, small, redis_url)
        group.serve(tiny_path, big, big_redis, 2)
        with Producer(settings=Settings.from_url(redis_url, redis_shards=shards)) as producer:
            [small_worker] = [r["name"] for r in producer.workers(small)]
            big_a, big_b = sorted(r["name"] for r in producer.workers(big))
            unmapped = ortq("stop", "--worker", big_a, "--redis-url", redis_url, "--wait", "0")
            assert unmapped.returncode == 1 and "no live worker matches" in unmapped.stderr
            by_model = ortq("stop", "--model", big, "--worker", big_a, "--redis-url", redis_url, "--shards", shards)
            assert by_model.returncode == 0, by_model.stderr
            assert by_model.stdout.splitlines() == [f"{big_a}: stopped"]
            both = ortq("stop", "--worker", small_worker, "--worker", big_b, "--redis-url", redis_url,
                        env={"ORTQ_REDIS_SHARDS": shards})  # fmt: skip
            assert both.returncode == 0, both.stderr
            assert sorted(both.stdout.splitlines()) == sorted([f"{small_worker}: stopped", f"{big_b}: stopped"])
            assert PASSWORD not in both.stdout + both.stderr
            assert producer.workers(small) == [] and producer.workers(big) == []
        for process, _ in group.processes:
            assert process.wait(30) == 0, group.logs()
    finally:
        group.stop_all()


def test_each_pool_worker_gets_its_models_redis(tmp_path: Path, tiny_path: Path, conv_path: Path) -> None:
    path = pool_file(tmp_path, tiny_path, conv_path, 'redis_url = "redis://:pw@big-redis:6380/0"')
    config = PoolConfig.from_file(path)
    shards = config.shard_map(Settings(redis_url="redis://main:6379/0"))
    slots = build_slots(make_plan(config, [], measure=no_measure), shards)
    assert [dict(s.env)["ORTQ_REDIS_URL"] for s in slots] == ["redis://main:6379/0", "redis://:pw@big-redis:6380/0"]
    assert [s.redis_url for s in slots] == ["redis://main:6379/0", "redis://:pw@big-redis:6380/0"]
    assert all("pw" not in " ".join(s.argv) for s in slots)  # the URL goes in the environment only
    assert worker_environment({"ORTQ_REDIS_SHARDS": "a=redis://x:6379/0", "HOME": "/h"}) == {"HOME": "/h"}

    # The same from the map the producers read; a file that disagrees with it is refused.
    plain = PoolConfig.from_file(pool_file(tmp_path, tiny_path, conv_path))
    from_env = Settings.from_env({"ORTQ_REDIS_SHARDS": f"{SMALL}-big=redis://:pw@big-redis:6380/0"})
    assert plain.shard_map(from_env).url_for(f"{SMALL}-big") == "redis://:pw@big-redis:6380/0"
    with pytest.raises(
        ConfigurationError, match=r"\[\[model\]\] redis_url: model '.+-big' is on redis://big-redis:6380/0"
    ):
        config.shard_map(Settings.from_env({"ORTQ_REDIS_SHARDS": f"{SMALL}-big=redis://other:6379/0"}))
    refused = ortq("pool", "--config", str(path), "--check", "--shards", f"{SMALL}-big=redis://other:6379/0")
    assert refused.returncode == 2 and "producers and workers must use the same Redis" in refused.stderr
    assert "pw" not in refused.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text(path.read_text().replace("threads = 1\n", 'threads = 1\nenv = { ORTQ_REDIS_SHARDS = "x" }\n', 1))
    with pytest.raises(ConfigurationError, match="ORTQ_REDIS_SHARDS cannot be set here: the pool sets it from"):
        PoolConfig.from_file(bad)


def test_the_example_pool_files_commented_shard_works_once_uncommented() -> None:
    text = (REPO / "deploy" / "pool.example.toml").read_text()
    uncommented = text.replace('# redis_url = "redis://redis-big', 'redis_url = "redis://redis-big', 1)
    assert uncommented != text
    config = PoolConfig.from_toml(uncommented, "pool.example.toml", REPO / "deploy")
    [spec] = re.findall(r"ORTQ_REDIS_SHARDS=(\S+)", text)
    pool = config.shard_map(Settings(redis_url=config.redis_url or DEFAULT_REDIS_URL))
    producers = Settings(redis_url=config.redis_url or DEFAULT_REDIS_URL, redis_shards=spec).shards
    assert pool.sharded and pool == producers  # the map the comment gives the producers is the pool's


def test_a_pool_starts_workers_on_two_redis_instances(
    tmp_path: Path, tiny_path: Path, conv_path: Path, redis_url: str, big_redis: str, model_name: str
) -> None:
    path = pool_file(tmp_path, tiny_path, conv_path, f'redis_url = "{big_redis}"', small=model_name)
    shown_big = redacted_url(big_redis)
    check = ortq("pool", "--config", str(path), "--check", "--redis-url", redis_url)
    assert check.returncode == 0, check.stderr
    assert f"redis (workers):\n  {redis_url}: {model_name} (1)\n  {shown_big}: {model_name}-big (1)" in check.stdout
    assert PASSWORD not in check.stdout + check.stderr

    pool = Pool(path, redis_url)
    try:
        settings = Settings.from_url(redis_url, redis_shards=f"{model_name}-big={big_redis}")
        with Producer(settings=settings) as producer:
            producer.wait_for_workers(model_name, 1, timeout=60)
            producer.wait_for_workers(f"{model_name}-big", 1, timeout=60)
            small = producer.infer(model_name, small_inputs(1)[0], timeout=30)
            big = producer.infer(f"{model_name}-big", big_inputs(1)[0], timeout=60)
        np.testing.assert_allclose(small["y"], direct(tiny_path, small_inputs(1)[0])["y"], rtol=1e-6)
        assert_close(big["logits"], direct(conv_path, big_inputs(1)[0])["logits"])
        with Producer(settings=Settings.from_url(redis_url)) as main:
            assert main.workers(f"{model_name}-big") == []  # its worker is on the other Redis only
    finally:
        pool.process.send_signal(signal.SIGTERM)
        assert pool.wait() == 0, pool.text()
    assert PASSWORD not in pool.text()


def test_a_worker_serves_its_model_from_the_redis_the_map_gives(
    redis_server: LocalRedis, big_redis: str, tiny_path: Path
) -> None:
    """``ortq worker`` with the producers' environment: ``--redis-url`` is the default Redis, and
    ``$ORTQ_REDIS_SHARDS`` puts this model on the other one, where the producers send it."""
    model = f"shard-worker-{os.getpid()}"
    shards = f"{model}={big_redis}"
    worker = subprocess.Popen(
        [sys.executable, "-m", "ortq", "worker", "--model", str(tiny_path), "--name", model,
         "--redis-url", redis_server.url, "--threads", "1"],
        cwd=REPO, env={**os.environ, "ORTQ_REDIS_SHARDS": shards}, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with Producer(settings=Settings.from_url(redis_server.url, redis_shards=shards)) as producer:
            producer.wait_for_workers(model, 1, timeout=60)
            x = small_inputs(1)[0]
            assert_close(producer.infer(model, x, timeout=30)["y"], direct(tiny_path, x)["y"])
        big, main = redis.Redis.from_url(big_redis), redis.Redis.from_url(redis_server.url)
        assert big.exists(keys.signature_key(model)) and not main.exists(keys.signature_key(model))
    finally:
        worker.send_signal(signal.SIGTERM)
        _, log = worker.communicate(timeout=30)
    assert worker.returncode == 0, log
    assert f"model {model!r} is on redis://127.0.0.1:" in log and PASSWORD not in log
