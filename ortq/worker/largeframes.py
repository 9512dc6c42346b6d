"""Large request frames read with one copy: from the socket straight into the buffer the frame's
tensors are decoded from.

Through redis-py with hiredis a bulk reply is copied three times after the kernel's: into
redis-py's read buffer, into hiredis's, and into the ``bytes`` object it returns (with the
hiredis buffer grown by reallocation on the way). A conv-sized job's worker is CPU-bound, and
reading its frames here took its CPU a job on the H200 down by a fifth to a third
(docs/results/performance-history.md, fifth pass; ``python -m bench.frame_read`` compares the two readers). So
frames over the inline size (ortq.worker.intake) are read here: redis-py still owns the
connection (its pool, AUTH, TLS, timeouts, reconnects) and packs and sends the commands; only the
replies, which are bulk strings or errors from ``GETRANGE``, are read from its socket by this
module. Any fault leaves the connection disconnected, so nothing half-read is ever taken for the
next reply.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any, cast

import redis

#: At most this is read ahead for a reply's header line: a frame's bytes go to its own buffer.
HEADER_READ = 256
#: The longest header line a GETRANGE reply has ("$" and up to 20 digits, or an error message).
MAX_LINE = 4096


def read_large_frames(connection: redis.Redis, keys: Sequence[str], limit: int) -> list[bytes | bytearray | Exception]:
    """``GETRANGE key 0 limit`` of each key, pipelined in one round trip: each value as a
    bytearray of its own (empty when the key is missing; bytes from redis-py over RESP3), or the
    error Redis answered for it (a key holding no string). Raises redis.ConnectionError or
    redis.TimeoutError when the connection fails, as redis-py would."""
    pool = connection.connection_pool
    if str(pool.connection_kwargs.get("protocol") or 2) != "2":
        # RESP3 may put push messages among the replies: redis-py reads those (copying).
        return read_through_redis_py(connection, keys, limit)
    conn: Any  # redis-py's Connection: its send and pack methods are not annotated
    try:
        conn = pool.get_connection()
    except TypeError:  # redis-py before 5.3 wants a command name (5.3 and later warn about one)
        conn = pool.get_connection("GETRANGE")
    try:
        conn.send_packed_command(conn.pack_commands([("GETRANGE", key, 0, limit) for key in keys]))
        sock = conn._sock  # redis-py's own socket (plain or TLS), connected by the send above
        if sock is None:
            raise redis.ConnectionError("the connection closed while sending")
        replies = _Replies(sock, limit)
        return [replies.next() for _ in keys]
    except BaseException as exc:
        conn.disconnect()  # a reply left half-read must not be read as the next command's
        if isinstance(exc, socket.timeout):
            raise redis.TimeoutError(f"Timeout reading from socket: {exc}") from exc
        if isinstance(exc, OSError):
            raise redis.ConnectionError(f"Error reading from socket: {exc}") from exc
        raise
    finally:
        pool.release(conn)


def read_through_redis_py(
    connection: redis.Redis, keys: Sequence[str], limit: int
) -> list[bytes | bytearray | Exception]:
    """The same reads through redis-py's own reader (copying; it knows RESP3's push messages)."""
    with connection.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.getrange(key, 0, limit)
        return cast(list[bytes | bytearray | Exception], pipe.execute(raise_on_error=False))


class _Replies:
    """RESP2 replies to GETRANGE read from a socket: bulk strings and errors, nothing else."""

    def __init__(self, sock: socket.socket, limit: int) -> None:
        self.sock = sock
        self.limit = limit
        self.ahead = bytearray()  # read past the last reply: the start of the next

    def next(self) -> bytearray | Exception:
        line = self._line()
        kind, rest = line[:1], bytes(line[1:])
        if kind == b"-":
            return redis.ResponseError(rest.decode(errors="replace"))
        if kind != b"$" or not rest.isdigit() or int(rest) > self.limit + 1:
            # GETRANGE answers a string of at most limit + 1 bytes (0..limit) or an error.
            raise redis.InvalidResponse(f"unexpected reply to GETRANGE: {bytes(line[:40])!r}")
        size = int(rest)
        frame = bytearray(size)
        have = min(size, len(self.ahead))
        frame[:have] = self.ahead[:have]
        del self.ahead[:have]
        view = memoryview(frame)
        while have < size:
            got = self.sock.recv_into(view[have:])
            if not got:
                raise redis.ConnectionError("Redis closed the connection while sending a frame")
            have += got
        while len(self.ahead) < 2:
            self._read_ahead()
        if self.ahead[:2] != b"\r\n":
            raise redis.InvalidResponse("a GETRANGE reply does not end where its length says")
        del self.ahead[:2]
        return frame

    def _line(self) -> bytearray:
        while (end := self.ahead.find(b"\r\n")) < 0:
            if len(self.ahead) > MAX_LINE:
                raise redis.InvalidResponse("a reply's first line is too long")
            self._read_ahead()
        line = self.ahead[:end]
        del self.ahead[: end + 2]
        return line

    def _read_ahead(self) -> None:
        chunk = self.sock.recv(HEADER_READ)
        if not chunk:
            raise redis.ConnectionError("Redis closed the connection")
        self.ahead += chunk
