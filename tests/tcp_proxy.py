"""A TCP proxy in front of a real redis-server that can reset every connection through it at once
(an RST, as a dropped NAT entry, a load balancer's failover or a crashing sidecar gives), for
tests of what worker processes do when their connections keep breaking."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from types import TracebackType


class ResettingProxy:
    """Forwards 127.0.0.1:``port`` to ``upstream_port``; ``reset_all()`` breaks every connection."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._closed = False
        #: Connections reset so far.
        self.resets = 0
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), name="proxy-pump", daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while (data := source.recv(1 << 16)) and self._forward(source, sink, data):
                pass
        except OSError:
            pass
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def _forward(self, source: socket.socket, sink: socket.socket, data: bytes) -> bool:
        """Pass ``data`` on; whether to go on pumping."""
        sink.sendall(data)
        return True

    def reset_all(self) -> int:
        """Reset every open connection (the client side gets ECONNRESET); how many there were."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for client, upstream in pairs:
            _reset(client, upstream)
        self.resets += len(pairs)
        return len(pairs)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.reset_all()

    def __enter__(self) -> ResettingProxy:
        return self

    def __exit__(self, *exc: tuple[type[BaseException], BaseException, TracebackType] | None) -> None:
        self.close()


def _reset(client: socket.socket, upstream: socket.socket) -> None:
    """Break one proxied connection: the client gets ECONNRESET, Redis sees it closed."""
    # SO_LINGER 0: close sends an RST, not a FIN. SHUT_RD first wakes the pump blocked in recv on
    # it (closing alone would not), and sends nothing.
    for end, how in ((client, socket.SHUT_RD), (upstream, socket.SHUT_RDWR)):
        try:
            if end is client:
                end.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            end.shutdown(how)
        except OSError:
            pass
        end.close()


class CommandCuttingProxy(ResettingProxy):
    """A ResettingProxy that also breaks the connection that sends the next command of a name
    (once armed by ``cut_next``; ``EXEC`` by default), with whatever was sent with it:
    ``before`` Redis gets it (a transaction is discarded with the connection: nothing of it runs),
    or ``after`` Redis ran it, its reply lost (what redis-py sees either way: a reset
    connection). ``stall`` and ``mute`` leave the connection open instead, so that the client's
    read times out: the command held back (it never runs), or run with its reply held back."""

    def __init__(self, upstream_port: int) -> None:
        self._armed: str | None = None
        self._command = b""
        self._muted: set[socket.socket] = set()
        #: Connections cut so far.
        self.cuts = 0
        super().__init__(upstream_port)

    def cut_next(self, mode: str, command: str = "EXEC") -> None:
        assert mode in ("before", "after", "stall", "mute"), mode
        self._command = f"\r\n{command}\r\n".lower().encode()  # a RESP bulk string, in any case
        self._armed = mode

    def _forward(self, source: socket.socket, sink: socket.socket, data: bytes) -> bool:
        if self._armed and self._command in data.lower():
            with self._lock:
                from_client = any(source is client for client, _ in self._pairs)
            if from_client:
                return self._cut(source, sink, data)
        if source not in self._muted:
            sink.sendall(data)
        return True

    def _cut(self, client: socket.socket, upstream: socket.socket, data: bytes) -> bool:
        mode, self._armed = self._armed, None
        self.cuts += 1
        if mode in ("after", "mute"):
            self._muted.add(upstream)  # Redis's replies on this connection go nowhere
            upstream.sendall(data)
        if mode in ("stall", "mute"):
            return True
        if mode == "after":
            time.sleep(0.3)  # Redis runs it
        with self._lock:
            self._pairs = [pair for pair in self._pairs if pair[0] is not client]
        _reset(client, upstream)
        return False
