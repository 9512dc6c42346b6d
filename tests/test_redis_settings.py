"""The Redis settings docs/operations.md recommends ("Redis settings") are the ones ortq's own
Redis and the deploy files use, and do what it says: a job's reply stream, written by a real
worker, is ~1 KB with ``stream-node-max-bytes 512`` where Redis 7's default makes it ~4.7 KB."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys
from ortq.localredis import STREAM_NODE_MAX_BYTES, LocalRedis
from ortq.producer import Producer
from ortq.settings import Settings
from tests.conftest import REPO, WorkerProcesses


def test_ortqs_local_redis_and_the_compose_file_set_the_documented_stream_node_size(connection: redis.Redis) -> None:
    assert connection.config_get("stream-node-max-bytes") == {"stream-node-max-bytes": str(STREAM_NODE_MAX_BYTES)}
    compose = (REPO / "deploy/docker/docker-compose.yml").read_text()
    [command] = [line for line in compose.splitlines() if line.startswith('    command: ["redis-server"')]
    assert f'"--stream-node-max-bytes", "{STREAM_NODE_MAX_BYTES}"' in command
    assert f"`stream-node-max-bytes {STREAM_NODE_MAX_BYTES}`" in (REPO / "docs/operations.md").read_text()


def test_a_reply_stream_takes_a_quarter_of_the_memory_with_the_setting(tiny_path: Path, tmp_path: Path) -> None:
    # A Redis of its own: the setting is changed on it halfway.
    session = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"])
    with LocalRedis() as server:
        admin = redis.Redis.from_url(server.url)
        if int(admin.info("server")["redis_version"].split(".")[0]) < 7:
            pytest.skip("Redis before 7 allocates no room ahead for a new stream")
        group = WorkerProcesses(tmp_path)
        try:
            group.serve(tiny_path, "settings-tiny", server.url, 1)
            sizes = []
            with Producer(settings=Settings.from_url(server.url)) as producer:
                for node_bytes in (STREAM_NODE_MAX_BYTES, 4096):
                    admin.config_set("stream-node-max-bytes", node_bytes)
                    x = np.arange(4, dtype=np.float32).reshape(1, 4) * node_bytes
                    job = producer.submit("settings-tiny", {"x": x})
                    np.testing.assert_allclose(job.result(timeout=30)["y"], session.run(None, {"x": x})[0])
                    sizes.append(admin.memory_usage(keys.reply_key(job.model, job.id)))
        finally:
            group.stop_all()
        admin.close()
    small, default = sizes
    assert small is not None and default is not None
    assert small < 1500 and default > 4096, sizes
