"""Commands packed for the wire by hiredis in one call, not argument by argument in Python.

redis-py's own packer (with hiredis installed) still encodes every argument in Python before
handing them to ``hiredis.pack_command``: a generator, an ``isinstance`` chain and an encoder call
per argument. An enqueue writes ~30 arguments a job (the job hash's fields), which cost a producer
35 us of CPU a job that way and 10 us here; ``submit_many`` takes 0.72x the CPU a job it took,
``AsyncProducer.submit_many`` 0.81x (CI VM, ``python -m bench.pack``, both side by side).
``hiredis.pack_command`` takes str, bytes, int and float as redis-py does (UTF-8, ``repr`` of a
float); what it does not take, and what redis-py treats apart, goes to redis-py's Python packer
unchanged: a command name with a space in it (``"CLIENT SETNAME"``), a memoryview (sent as it is,
not copied: ortq.settings.frame_argument), and any other type (redis-py's own error for it, e.g.
DataError for a bool or None).

Given to redis-py's synchronous connections as their ``command_packer``
(ortq.settings.Settings.connect); its asyncio connections take none, so ``packing`` makes a
connection class that packs with it (ortq.producer.aio, ortq.sentinel).
"""

from __future__ import annotations

from typing import Any

import hiredis  # redis[hiredis]: a dependency of ortq
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer

#: redis-py's size past which its Python packer sends an argument as a chunk of its own.
_BUFFER_CUTOFF = 6000


class CommandPacker:
    """A redis-py ``command_packer``: ``pack(*args)`` returns the command's bytes as a list of chunks."""

    def __init__(self) -> None:
        # The encoder of redis-py's default connection: UTF-8, strict, replies left as bytes.
        encoder = Encoder("utf-8", "strict", False)  # type: ignore[no-untyped-call]
        self._fallback: Any = PythonRespSerializer(_BUFFER_CUTOFF, encoder.encode)

    def pack(self, *args: Any) -> list[Any]:
        first = args[0]
        spaced = " " in first if isinstance(first, str) else isinstance(first, bytes) and b" " in first
        if spaced or memoryview in map(type, args):
            return self._fallback.pack(*args)  # type: ignore[no-any-return]
        try:
            return [hiredis.pack_command(args)]
        except TypeError:  # bytearray, bool, None, ...: as redis-py packs or refuses them
            return self._fallback.pack(*args)  # type: ignore[no-any-return]


#: One for every connection (it holds no state of its own); None with a hiredis before 2.0, which
#: has no ``pack_command`` (redis-py then packs as it always has).
PACKER = CommandPacker() if hasattr(hiredis, "pack_command") else None


_PACKING: dict[type[Any], type[Any]] = {}


def packing(connection_class: type[Any]) -> type[Any]:
    """``connection_class`` (a redis.asyncio connection class), its commands packed by :data:`PACKER`
    (both redis-py series pack a pipeline command by command through ``pack_command``); the class
    itself where there is no PACKER."""
    if PACKER is None:
        return connection_class
    made = _PACKING.get(connection_class)
    if made is None:
        made = _PACKING[connection_class] = type(
            connection_class.__name__, (connection_class,), {"pack_command": _pack_command, "__module__": __name__}
        )
    return made


def _pack_command(self: Any, *args: Any) -> list[Any]:
    assert PACKER is not None  # packing() makes no class without it
    return PACKER.pack(*args)
