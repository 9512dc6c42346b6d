"""ortq's Redis functions, which producers call (``FCALL``) and every worker loads: high-priority
enqueues (``enqueue_high.lua``), enqueues under a chosen id and stop requests. As functions,
producers need no ``EVAL`` right (with it, any producer could run arbitrary Lua, and a busy loop
blocks the whole server; ``SCRIPT KILL`` cannot stop a script that has written). Against a Redis
without functions (before 7.0), or before any worker has loaded them, producers fall back to
``EVAL`` of the same code where their ACL allows it.

The Lua files are the producer's package data (``ortq/producer/*.lua``).
"""

from __future__ import annotations

import hashlib
import logging
from functools import cache
from pathlib import Path

import redis

log = logging.getLogger("ortq")

#: The Redis function library and function; the version in the name lets workers of different
#: ortq releases share one Redis without replacing each other's code.
LIBRARY = "ortq_v2"
FUNCTION = "ortq_enqueue_high_v2"


#: Where the Lua lives.
_LUA = Path(__file__).parent / "producer"


@cache
def _lua(name: str) -> str:
    return (_LUA / f"{name}.lua").read_text()


@cache
def library_source() -> str:
    """The library for FUNCTION LOAD."""
    return (
        f"#!lua name={LIBRARY}\n"
        f"local function enqueue_high(keys, args)\n{_indented(_lua('enqueue_high'))}\nend\n"
        f"redis.register_function('{FUNCTION}', enqueue_high)\n"
    )


@cache
def script_source() -> str:
    """The same code for EVAL."""
    return "local keys, args = KEYS, ARGV\n" + _lua("enqueue_high")


#: The library of the calls on one job that need to look before they write: an enqueue under a
#: producer's own job id (``enqueue_unique.lua``, which inserts a high-priority job with the code
#: above, as a local function of its own) and a stop request (``request_stop.lua``). v2: the stop
#: request writes the job's stop token (:func:`stop_token`), not the time; v3 (wire protocol 4):
#: the unique enqueue takes no reply key (answers go to the producer's reply stream).
JOBS_LIBRARY = "ortq_jobs_v3"
UNIQUE_FUNCTION = "ortq_enqueue_unique_v3"
STOP_FUNCTION = "ortq_request_stop_v3"

#: The job hash field a stop request writes: the job's stop token (docs/wire-format.md, 3.7).
STOP_FIELD = "ortq_stop"
#: A stop token's length: SHA-256 in lowercase hex digits.
STOP_TOKEN_LENGTH = 64


def stop_token(proof: bytes) -> bytes:
    """What a job's stop mark must hold for its worker to stop it: SHA-256 of ``stop``, a newline
    and the job's proof (wire.proof_of: SHA-256 of its model, a newline and its request's nonce),
    as lowercase hex. Only the job's producer knows the nonce before the job's answer publishes the
    proof, and no other producer can read a request frame, so a mark anyone else writes (any
    producer may HSET any job hash) is none that its worker honours."""
    return hashlib.sha256(b"stop\n" + proof).hexdigest().encode()


def _indented(body: str) -> str:
    return "\n".join("  " + line for line in body.splitlines())


@cache
def jobs_library_source() -> str:
    """The jobs library for FUNCTION LOAD."""
    return (
        f"#!lua name={JOBS_LIBRARY}\n"
        f"local function enqueue_high(keys, args)\n{_indented(_lua('enqueue_high'))}\nend\n"
        f"local function enqueue_unique(keys, args)\n{_indented(_lua('enqueue_unique'))}\nend\n"
        f"local function request_stop(keys, args)\n{_indented(_lua('request_stop'))}\nend\n"
        f"redis.register_function('{UNIQUE_FUNCTION}', enqueue_unique)\n"
        f"redis.register_function('{STOP_FUNCTION}', request_stop)\n"
    )


@cache
def unique_script_source() -> str:
    """The unique enqueue for EVAL."""
    return (
        f"local function enqueue_high(keys, args)\n{_indented(_lua('enqueue_high'))}\nend\n"
        f"local keys, args = KEYS, ARGV\n{_lua('enqueue_unique')}"
    )


@cache
def stop_script_source() -> str:
    """The stop request for EVAL."""
    return f"local keys, args = KEYS, ARGV\n{_lua('request_stop')}"


def ensure_functions(connection: redis.Redis) -> bool:
    """Load the libraries unless this Redis has them; False when it cannot (Redis < 7, or the ACL)."""
    for library, source in ((LIBRARY, library_source), (JOBS_LIBRARY, jobs_library_source)):
        try:
            if connection.function_list(library=library):
                continue
            connection.function_load(source(), replace=True)
        except redis.ResponseError as exc:
            log.debug("cannot load ortq's Redis functions (%s); producers fall back to EVAL", exc)
            return False
        log.info("loaded ortq's Redis function library %s", library)
    return True
