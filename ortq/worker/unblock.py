"""A stop that does not wait out an idle worker's blocking read.

An idle worker's feeder blocks in ``BLMOVE`` for up to a second at a time, and no signal cuts a
socket read short (PEP 475 retries it; Windows has no such signals at all). A pool that stops an
idle worker to make room for another model (ortq.pool.follow) then waits that second for nothing.
At a stop, ``CLIENT UNBLOCK`` (from a connection of its own) ends the read at once, as if it had
timed out: Redis answers nil and moves no job, so no reply is lost and nothing is left in the
intermediate list. The blocked connection's id is read with ``CLIENT INFO`` each time redis-py
(re)connects it, so it is never stale.

The worker's ACL rule needs ``+client|unblock`` for this (docs/security.md). Without it the stop
still happens, one read later, and the worker says so once.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

import redis

from ortq.settings import Settings, redis_message

log = logging.getLogger("ortq.worker")

_ID = re.compile(rb"(?:^|\s)id=([0-9]+)(?:\s|$)")


class Unblocker:
    """Knows the id of one client's connection and ends its blocking read on request."""

    def __init__(self, client: redis.Redis, settings: Settings, window: float) -> None:
        self.settings = settings
        #: How long a stop looks for a read to end: the longest read the client blocks in.
        self.window = window
        #: The id Redis gave the client's connection when it last connected; None: not known.
        self.client_id: int | None = None
        #: Set while the client is in a blocking read that a stop should end (Intake sets it).
        self.blocking = threading.Event()
        self._told_refused = False
        # redis-py calls this instead of on_connect for every connection the pool makes from now on
        # (the feeder's single connection, and its replacement after a reconnect).
        client.connection_pool.connection_kwargs["redis_connect_func"] = self._on_connect

    def _on_connect(self, connection: Any) -> None:
        connection.on_connect()
        try:
            connection.send_command("CLIENT", "INFO")
            info = connection.read_response()
        except redis.ResponseError as exc:  # Redis before 6.2, or a rule without +client|info
            log.debug("CLIENT INFO refused (%s): a stop waits out an idle read", redis_message(exc))
            self.client_id = None
            return
        if isinstance(info, str):
            info = info.encode()
        found = _ID.search(info) if isinstance(info, bytes) else None
        self.client_id = int(found.group(1)) if found else None

    def unblock(self) -> None:
        """End the client's blocking read, now or as soon as it begins one within ``window``
        seconds (the stop was asked for just before it): in a thread of its own, since this may
        be called from a signal handler, which must not wait on the network."""
        if self.client_id is not None:
            threading.Thread(target=self._send, name="ortq-unblock", daemon=True).start()

    def _send(self) -> None:
        deadline = time.monotonic() + self.window
        try:
            with self.settings.connect(check=False) as connection:
                while (left := deadline - time.monotonic()) > 0:
                    # UNBLOCK answers 0 while the read, marked just before it is sent, is not yet in Redis
                    client_id = self.client_id
                    if self.blocking.wait(left) and client_id is not None and connection.client_unblock(client_id):
                        log.info("the stop ended the idle read at once (CLIENT UNBLOCK)")
                        return
                    time.sleep(0.02)
        except redis.exceptions.NoPermissionError as exc:
            if not self._told_refused:
                self._told_refused = True
                log.warning("the worker's ACL rule lacks +client|unblock (docs/security.md): an idle worker's stop "
                            "waits for its read to end (up to %g s): %s", self.window, redis_message(exc))  # fmt: skip
        except (redis.RedisError, OSError) as exc:  # the read still ends by itself within its slice
            log.debug("CLIENT UNBLOCK failed: %s", exc)
