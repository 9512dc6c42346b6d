"""ortq.redispack: every command packed as redis-py packs it, byte for byte, or refused as redis-py
refuses it; and a real Redis reads what it packs (the whole suite's sync clients use it too)."""

from __future__ import annotations

import uuid

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer

from ortq import redispack
from ortq.settings import Settings

pytestmark = pytest.mark.skipif(redispack.PACKER is None, reason="hiredis before 2.0 has no pack_command")
PACKER = redispack.PACKER
#: redis-py's Python packer: the reference (its hiredis packer sends the same bytes).
REFERENCE = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)  # type: ignore[no-untyped-call]

ARGUMENT = st.one_of(
    st.text(max_size=40),
    st.binary(max_size=40),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
)


def packed(packer: object, *args: object) -> bytes:
    """What ``packer`` (a command packer, or a connection) makes of a command, as one bytes."""
    pack = getattr(packer, "pack", None) or packer.pack_command  # type: ignore[attr-defined]
    return b"".join(bytes(chunk) for chunk in pack(*args))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["SET", "HSET", b"XADD", "EVALSHA"]), st.lists(ARGUMENT, max_size=12))
def test_it_packs_what_redis_py_packs(name: str | bytes, arguments: list[object]) -> None:
    assert packed(PACKER, name, *arguments) == packed(REFERENCE, name, *arguments)


def test_what_hiredis_does_not_take_goes_to_redis_py() -> None:
    for args in (("CLIENT SETNAME", "w"), (b"SCRIPT LOAD", "return 1"), ("SET", "k", bytearray(b"v"))):
        assert packed(PACKER, *args) == packed(REFERENCE, *args)
    frame = memoryview(b"f" * 100_000)  # a large frame: sent as it is, not copied into the command
    assert any(chunk is frame for chunk in PACKER.pack("SET", "k", frame))  # type: ignore[union-attr]
    for bad in (True, None, object()):
        with pytest.raises(redis.DataError):
            PACKER.pack("SET", "k", bad)  # type: ignore[union-attr]


def test_settings_connect_packs_with_it_and_redis_reads_it(redis_url: str) -> None:
    client = Settings.from_url(redis_url).connect()
    connection = client.connection_pool.get_connection()
    try:
        assert connection._command_packer is PACKER
    finally:
        client.connection_pool.release(connection)
    key = f"pack-{uuid.uuid4()}"
    values = {"text": "héllo wörld", "bytes": b"\x00\xff", "int": -12, "float": 0.1, "big": 2**64}
    client.hset(key, mapping=values)  # type: ignore[arg-type]
    assert client.hgetall(key) == {
        k.encode(): (v if isinstance(v, bytes) else str(v).encode()) for k, v in values.items()
    }
    with client.pipeline() as pipe:
        pipe.set(key + ":frame", memoryview(b"z" * 200_000)).strlen(key + ":frame").delete(key, key + ":frame")
        assert pipe.execute() == [True, 200_000, 2]
    client.close()


def test_the_async_producers_connections_pack_with_it_too(redis_url: str) -> None:
    """redis.asyncio's connections take no command_packer: AsyncProducer's pools (and a Sentinel
    URL's, ortq.sentinel) use a subclass of their connection class whose pack_command is PACKER's."""
    import asyncio

    import numpy as np

    from ortq.producer import AsyncProducer

    async def use() -> None:
        async with AsyncProducer(settings=Settings.from_url(redis_url), allow_unknown_models=True) as producer:
            pool = producer.connection.connection_pool
            connection = pool.make_connection()
            args = ("HSET", "k", "f", "héllo", "n", 3, "x", 0.5)
            assert connection.pack_command(*args) == PACKER.pack(*args)  # type: ignore[union-attr]
            assert packed(connection, *args) == packed(REFERENCE, *args)
            [job] = await producer.submit_many(f"pack-{uuid.uuid4().hex[:8]}", [{"x": np.ones((1, 4), np.float32)}])
            assert await producer.connection.exists(f"rq:job:{job.id}") == 1  # what Redis read of it

    asyncio.run(use())
