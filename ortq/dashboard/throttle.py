"""Failed logins lock their client address out for a while, longer with each further failure, so
that the dashboard's HTTP Basic login cannot be guessed at the speed of the network.

A client address may fail ``FREE_FAILURES`` times in a row; each failure after those locks it out
for ``FIRST_LOCKOUT`` seconds, doubled with each further one up to ``LONGEST_LOCKOUT``. While
locked out, every request from it is refused (429 with ``Retry-After``), right login or not:
checking the login then would still tell a guesser when a guess was right. A right login resets
the count; a count whose last failure is older than ``FORGET_AFTER`` starts again from nothing.

Only requests that carry a Basic login count (a browser's first request carries none: it is asked
for one). An IPv6 client counts by its /64 network, which one host can fill with addresses. At
most ``MAX_CLIENTS`` addresses are remembered (the longest unseen is forgotten first), so a flood
of addresses costs bounded memory. Behind a reverse proxy every client has the proxy's address:
one guesser then locks everyone out, and the proxy's own limits are the better place for this.
"""

from __future__ import annotations

import ipaddress
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

FREE_FAILURES = 10
FIRST_LOCKOUT = 1.0
LONGEST_LOCKOUT = 900.0
FORGET_AFTER = 3600.0
MAX_CLIENTS = 10_000


@dataclass(slots=True)
class _Client:
    failures: int
    last_failure: float
    locked_until: float


class LoginThrottle:
    """Failed logins per client address (see the module's docstring); safe across threads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_clients: int = MAX_CLIENTS) -> None:
        self._clock = clock
        self._max_clients = max_clients
        self._clients: OrderedDict[str, _Client] = OrderedDict()
        self._lock = threading.Lock()

    def retry_after(self, address: str | None) -> int:
        """Whole seconds before ``address`` may try again; 0 when it may now."""
        with self._lock:
            client = self._clients.get(_key(address))
            if client is None:
                return 0
            return max(0, math.ceil(client.locked_until - self._clock()))

    def failed(self, address: str | None) -> None:
        """``address`` sent a wrong login."""
        now, key = self._clock(), _key(address)
        with self._lock:
            client = self._clients.pop(key, None)
            if client is None or now - client.last_failure > FORGET_AFTER:
                client = _Client(0, now, now)
            client.failures += 1
            client.last_failure = now
            beyond = client.failures - FREE_FAILURES
            if beyond > 0:
                client.locked_until = now + min(FIRST_LOCKOUT * 2 ** min(beyond - 1, 32), LONGEST_LOCKOUT)
            self._clients[key] = client  # last: the most recently seen
            while len(self._clients) > self._max_clients:
                self._clients.popitem(last=False)

    def succeeded(self, address: str | None) -> None:
        """``address`` sent the right login: its failures are forgotten."""
        with self._lock:
            self._clients.pop(_key(address), None)


def _key(address: str | None) -> str:
    """The address a client's failures count under: an IPv6 address's /64 network."""
    if not address:
        return ""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)
