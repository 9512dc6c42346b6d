"""deploy/ha-local/start.sh, docs/ha.md's runnable recipe (issue 35: the page had none): the group
it starts serves a worker and a producer through its redis+sentinel:// URL, and stop.sh ends it."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import redis

from ortq.localredis import find_redis_server, free_port
from ortq.producer import Producer
from ortq.settings import Settings
from tests.test_worker_inprocess import Serving, make_worker

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "ha-local"
SETTLE_SECONDS = 60.0  # only if the sentinels neither settle nor fail: what they say ends the wait


def _settled(port: int) -> bool:
    """Sentinel ``port`` sees the replica and the two other sentinels (their hello messages)."""
    client = redis.Redis(port=port, socket_timeout=5)
    try:
        state = client.sentinel_master("ortq")
        return int(state["num-slaves"]) == 1 and int(state["num-other-sentinels"]) == 2
    except redis.RedisError:
        return False
    finally:
        client.close()


def _replica_online(port: int) -> bool:
    """The primary on ``port`` has its replica past its first sync (writes need one: start.sh sets
    min-replicas-to-write 1)."""
    client = redis.Redis(port=port, socket_timeout=5)
    try:
        info = client.info("replication")
        return any(
            k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online" for k, v in info.items()
        )
    except redis.RedisError:
        return False
    finally:
        client.close()


def _script(name: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(DEPLOY / name)], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_the_local_sentinel_group_serves_ortq_and_stops(tmp_path: Path, tiny_path: Path, model_name: str) -> None:
    sentinels = [free_port(), free_port(), free_port()]
    directory = tmp_path / "ha"
    env = {
        **os.environ,
        "PATH": f"{Path(find_redis_server()).parent}:{os.environ['PATH']}",
        "ORTQ_HA_DIR": str(directory),
        "ORTQ_HA_PRIMARY": str(free_port()),
        "ORTQ_HA_REPLICA": str(free_port()),
        "ORTQ_HA_SENTINELS": " ".join(map(str, sentinels)),
    }
    started = _script("start.sh", env)
    try:
        assert started.returncode == 0, started.stderr
        url = started.stdout.strip().splitlines()[-1]
        assert url == "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in sentinels) + "/ortq/0"
        deadline = time.monotonic() + SETTLE_SECONDS
        primary = int(env["ORTQ_HA_PRIMARY"])
        while not (_replica_online(primary) and all(_settled(port) for port in sentinels)):
            logs = "\n".join(p.read_text() for p in directory.glob("*.log"))
            assert time.monotonic() < deadline, f"the sentinels did not see the replica and each other:\n{logs}"
            time.sleep(0.2)
        settings = Settings.from_url(url, heartbeat_seconds=0.5)
        serving = Serving(make_worker(tiny_path, model_name, settings))
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        with Producer(settings=settings) as producer:
            producer.wait_for_workers(model_name, 1, timeout=60)
            outputs = producer.infer(model_name, {"x": x}, timeout=30)
        assert serving.stop() == 0
        direct = ort.InferenceSession(str(tiny_path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_array_equal(outputs["y"], direct)
    finally:
        stopped = _script("stop.sh", env)
    assert stopped.returncode == 0, stopped.stderr
    assert not directory.exists()
    assert not any(_settled(port) for port in sentinels)
