"""The Redis settings docs/operations.md recommends ("Redis settings") are the ones ortq's own
Redis and the deploy files use, and do what it says: a producer's reply stream with its first
answer, written by a real worker, is ~1 KB with ``stream-node-max-bytes 512`` where Redis 7's
default makes it ~4.7 KB.
And ``redis+sentinel://`` URLs (docs/ha.md) are read, checked and shown as documented;
tests/test_sentinel.py runs them against real sentinels."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import numpy as np
import onnxruntime as ort
import pytest
import redis

from ortq import keys
from ortq.errors import ConfigurationError
from ortq.localredis import STREAM_NODE_MAX_BYTES, LocalRedis
from ortq.producer import Producer
from ortq.redisurls import redacted_url
from ortq.sentinel import SentinelURL
from ortq.settings import Settings
from ortq.shards import ShardMap
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
            for node_bytes in (STREAM_NODE_MAX_BYTES, 4096):
                admin.config_set("stream-node-max-bytes", node_bytes)
                # A producer of its own for each setting: its reply stream is made under that setting.
                with Producer(settings=Settings.from_url(server.url)) as producer:
                    x = np.arange(4, dtype=np.float32).reshape(1, 4) * node_bytes
                    job = producer.submit("settings-tiny", {"x": x})
                    np.testing.assert_allclose(job.result(timeout=30)["y"], session.run(None, {"x": x})[0])
                    stream = keys.reply_key(job.model, producer.reply_name)
                    assert admin.xlen(stream) == 1  # the stream of its one answer, nothing else
                    sizes.append(admin.memory_usage(stream))
        finally:
            group.stop_all()
        admin.close()
    small, default = sizes
    assert small is not None and default is not None
    assert small < 1500 and default > 4096, sizes


# ---------------------------------------------------------------------------- Sentinel URLs (ortq/sentinel.py)

SECRET = "pa55,w0rd"  # a comma too: percent-encoded in URLs


@pytest.mark.parametrize(
    ("url", "parsed", "shown"),
    [
        (
            "redis+sentinel://h1:26379,h2:26380,h3/ortq/2",
            SentinelURL((("h1", 26379), ("h2", 26380), ("h3", 26379)), "ortq", 2),
            "redis+sentinel://h1:26379,h2:26380,h3:26379/ortq/2",
        ),
        (
            f"redis+sentinel://app:{quote(SECRET)}@[::1]:5000,h2/ortq?sentinel_password={quote(SECRET)}",
            SentinelURL((("::1", 5000), ("h2", 26379)), "ortq", 0, "app", SECRET, None, SECRET),
            "redis+sentinel://app@[::1]:5000,h2:26379/ortq",
        ),
        (
            "rediss+sentinel://h1/ortq/0?ssl_cert_reqs=none&sentinel_username=watch",
            SentinelURL(
                (("h1", 26379),),
                "ortq",
                0,
                sentinel_username="watch",
                tls=True,
                tls_options=(("ssl_cert_reqs", "none"),),
            ),
            "rediss+sentinel://h1:26379/ortq/0",
        ),
    ],
)
def test_a_sentinel_url_is_read_and_shown_without_its_passwords(url: str, parsed: SentinelURL, shown: str) -> None:
    Settings(redis_url=url)  # accepted
    assert SentinelURL.parse(url) == parsed
    assert redacted_url(url) == shown
    assert SECRET not in repr(SentinelURL.parse(url)) and quote(SECRET) not in redacted_url(url)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://h1:26379,h2:26379", "names no Sentinel service: after the sentinels comes the name"),
        ("redis+sentinel://h1:26379/", "names no Sentinel service"),
        ("redis+sentinel:///ortq/0", "names no sentinel (or an empty one between commas)"),
        ("redis+sentinel://h1,,h2/ortq", "names no sentinel (or an empty one between commas)"),
        ("redis+sentinel://h1:99999/ortq", "sentinel 'h1:99999' has no valid port (1-65535)"),
        ("redis+sentinel://h1:port/ortq", "sentinel 'h1:port' has no valid port"),
        ("redis+sentinel://[::1/ortq", "sentinel '[::1' is no [IPv6]:PORT"),
        ("redis+sentinel://h1/ortq/zero", "after /SERVICE comes the database number (/0), not '/zero'"),
        ("redis+sentinel://h1/ortq?socket_timeout=1", "unknown option socket_timeout; a Sentinel URL takes"),
        ("redis+sentinel://h1/ortq?ssl_cert_reqs=none", "needs the rediss+sentinel:// scheme (TLS)"),
        ("rediss+sentinel://h1/ortq?ssl_ca_certs=/no/such.crt", "ssl_ca_certs=/no/such.crt: no such file"),
    ],
)
def test_a_malformed_sentinel_url_is_one_clear_line_without_the_password(url: str, message: str) -> None:
    url = url.replace("://", f"://app:{quote(SECRET)}@", 1) if "://[" not in url and ":///" not in url else url
    with pytest.raises(ConfigurationError) as refused:
        Settings(redis_url=url)
    text = str(refused.value)
    assert message in text and "\n" not in text
    assert SECRET not in text and quote(SECRET) not in text


def test_a_shard_map_keeps_a_sentinel_urls_commas() -> None:
    sentinel = f"redis+sentinel://:{quote(SECRET)}@a:26379,b,c:26381/ortq/1?sentinel_password=x"
    settings = Settings(redis_shards=f"conv={sentinel},digits=redis://d:6379/0 big={sentinel}")
    assert settings.shards is not None
    assert settings.shards.routes == {"conv": sentinel, "digits": "redis://d:6379/0", "big": sentinel}
    assert ShardMap.parse(settings.shards.spec(), settings.redis_url) == settings.shards
    assert all(SECRET not in line and quote(SECRET) not in line for line in settings.shards.describe())
    with pytest.raises(ConfigurationError, match=r"model 'conv': redis_url .* names no Sentinel service"):
        Settings(redis_shards="conv=redis+sentinel://a:26379,b:26379")
