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
    return b"".join(bytes(chunk) for chunk in packer.pack(*args))  # type: ignore[attr-defined]


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
