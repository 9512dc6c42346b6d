"""High-priority enqueues: ``enqueue_high.lua``, as a Redis function (``FCALL``) that producers
call, loaded by every worker, so that producers need no ``EVAL`` right (with it, any producer
could run arbitrary Lua, and a busy loop blocks the whole server; ``SCRIPT KILL`` cannot stop a
script that has written). Against a Redis without functions (before 7.0), or before any worker
has loaded it, producers fall back to ``EVAL`` of the same code where their ACL allows it.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path

import redis

log = logging.getLogger("ortq")

#: The Redis function library and function; the version in the name lets workers of different
#: ortq releases share one Redis without replacing each other's code.
LIBRARY = "ortq_v2"
FUNCTION = "ortq_enqueue_high_v2"


@cache
def _body() -> str:
    return (Path(__file__).parent / "enqueue_high.lua").read_text()


@cache
def library_source() -> str:
    """The library for FUNCTION LOAD."""
    body = "\n".join("  " + line for line in _body().splitlines())
    return (
        f"#!lua name={LIBRARY}\n"
        f"local function enqueue_high(keys, args)\n{body}\nend\n"
        f"redis.register_function('{FUNCTION}', enqueue_high)\n"
    )


@cache
def script_source() -> str:
    """The same code for EVAL."""
    return "local keys, args = KEYS, ARGV\n" + _body()


def ensure_functions(connection: redis.Redis) -> bool:
    """Load the library unless this Redis has it; False when it cannot (Redis < 7, or the ACL)."""
    try:
        if connection.function_list(library=LIBRARY):
            return True
        connection.function_load(library_source(), replace=True)
    except redis.ResponseError as exc:
        log.debug("cannot load ortq's Redis functions (%s); producers fall back to EVAL", exc)
        return False
    log.info("loaded ortq's Redis function library %s", LIBRARY)
    return True
