"""ortq.worker.largeframes reads GETRANGE replies from redis-py's socket itself: against a real
redis-server, what it reads equals what redis-py reads, errors come back per key, and a read cut
short leaves the connection closed, never holding half a reply for the next command."""

from __future__ import annotations

import os
import threading

import pytest
import redis

from ortq.worker.largeframes import read_large_frames

LIMIT = 800_000


@pytest.fixture
def stored(connection: redis.Redis) -> dict[str, bytes | None]:
    """Keys of every kind a batch's frames may be: sizes around the socket reads, one over the
    limit, an empty string, a missing key, and one holding a list."""
    prefix = f"ortq:test-large:{os.urandom(4).hex()}:"
    values: dict[str, bytes | None] = {
        f"{prefix}{size}": os.urandom(size) for size in (1, 255, 256, 257, 70_000, 602_112, LIMIT + 1, 1_000_000)
    }
    values[f"{prefix}empty"] = b""
    for key, value in values.items():
        connection.set(key, value)  # type: ignore[arg-type]
    values[f"{prefix}missing"] = None
    values[f"{prefix}list"] = None
    connection.rpush(f"{prefix}list", b"x")
    return values


def test_each_frame_is_what_redis_py_reads_and_errors_come_back_per_key(
    connection: redis.Redis, stored: dict[str, bytes | None]
) -> None:
    keys = list(stored)
    expected = connection.pipeline(transaction=False)
    for key in keys:
        expected.getrange(key, 0, LIMIT)
    want = expected.execute(raise_on_error=False)
    got = read_large_frames(connection, keys + keys[::-1], LIMIT)  # twice, in both orders
    for key, mine, theirs in zip(keys + keys[::-1], got, want + want[::-1], strict=True):
        if isinstance(theirs, Exception):
            assert isinstance(mine, redis.ResponseError) and str(mine) == str(theirs), key
            assert key.endswith("list")
        else:
            assert type(mine) is bytearray and mine == theirs, key
    assert [len(g) for g in got[:8] if isinstance(g, bytearray)] == [
        1,
        255,
        256,
        257,
        70_000,
        602_112,
        LIMIT + 1,
        LIMIT + 1,
    ]
    assert connection.ping() and connection.getrange(keys[0], 0, LIMIT) == stored[keys[0]]  # nothing left unread


def test_a_read_cut_short_leaves_no_half_read_reply_behind(redis_url: str, stored: dict[str, bytes | None]) -> None:
    client = redis.Redis.from_url(redis_url, socket_timeout=0.3)
    admin = redis.Redis.from_url(redis_url)
    keys = [k for k in stored if k.endswith(("602112", "70000"))]
    assert read_large_frames(client, keys, LIMIT) == [stored[k] for k in keys]
    admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")  # Redis holds every reply past the client's timeout
    try:
        with pytest.raises(redis.TimeoutError):
            read_large_frames(client, keys, LIMIT)
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
    # A reply sent late must not be read as the next one: the connection was closed, and a fresh one answers.
    assert read_large_frames(client, keys[::-1], LIMIT) == [stored[k] for k in keys[::-1]]
    assert client.get(keys[0]) == stored[keys[0]]
    client.close()
    admin.close()


def test_threads_reading_through_one_client_each_get_their_own_frames(
    connection: redis.Redis, stored: dict[str, bytes | None]
) -> None:
    # redis-py's pool gives each caller its own connection: the reader takes one from the pool, too.
    keys = [k for k in stored if stored[k]]
    failures: list[str] = []

    def read(order: list[str]) -> None:
        for _ in range(5):
            if read_large_frames(connection, order, LIMIT) != [stored[k][: LIMIT + 1] for k in order]:  # type: ignore[index]
                failures.append(",".join(order))

    threads = [threading.Thread(target=read, args=(keys[i:] + keys[:i],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures


def test_over_resp3_the_frames_come_through_redis_py_alike(redis_url: str, stored: dict[str, bytes | None]) -> None:
    # RESP3 may put push messages among replies, which only redis-py's reader knows.
    client = redis.Redis.from_url(redis_url, protocol=3)
    keys = list(stored)
    got = read_large_frames(client, keys, LIMIT)
    for key, frame in zip(keys, got, strict=True):
        if key.endswith("list"):
            assert isinstance(frame, redis.ResponseError)
        else:
            assert frame == (stored[key] or b"")[: LIMIT + 1], key
    client.close()
