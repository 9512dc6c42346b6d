"""The serializer RQ uses for every ortq job: msgpack, never pickle.

RQ stores a job's ``(func_name, instance, args, kwargs)``, its ``meta`` and its return
value through a serializer; its default is pickle, which executes code chosen by whoever
can write to Redis. Every ortq path (producer, worker, ``ortq info``, the dashboard)
passes this class instead. Only msgpack's plain types round-trip: ``None``, bool, int,
float, str, bytes, list (tuples come back as lists) and maps.
"""

from __future__ import annotations

from typing import Any

import msgpack

# Limits for what RQ job fields may hold: they carry small metadata, never tensors.
_MAX_FIELD_BYTES = 1024 * 1024


class MsgpackSerializer:
    """RQ ``Serializer`` protocol (``dumps``/``loads``) on msgpack."""

    @staticmethod
    def dumps(obj: Any, /) -> bytes:
        packed: bytes = msgpack.packb(obj, use_bin_type=True)
        return packed

    @staticmethod
    def loads(data: bytes, /) -> Any:
        if len(data) > _MAX_FIELD_BYTES:
            raise ValueError(f"RQ field of {len(data)} bytes is larger than ortq allows ({_MAX_FIELD_BYTES})")
        return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
