"""Which client a producer sends a model's commands through, under a shard map (ortq/shards.py).

``Producer`` and ``AsyncProducer`` hold one of these only when ``Settings.redis_shards`` lists some
model; without one every model uses the producer's one connection, as before sharding existed.
The default Redis's client is the producer's own; each other Redis gets one client, opened at the
first use of one of its models and closed with the producer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from ortq.redisurls import redacted_url
from ortq.shards import ShardMap

C = TypeVar("C")


class Routes(Generic[C]):
    """Model -> client (``C``: a redis-py client, or whatever a producer keeps per Redis)."""

    def __init__(self, shards: ShardMap, default: C, open_client: Callable[[str], C]) -> None:
        self.shards = shards
        self.default = default
        self._open_client = open_client
        self._opened: dict[str, C] = {}
        self._opening = threading.Lock()  # a Producer may be shared by threads: one client per Redis

    def client(self, model: str) -> C:
        """``model``'s client: one dict lookup for a model the map does not list."""
        url = self.shards.listed(model)
        if url is None or url == self.shards.default_url:
            return self.default
        client = self._opened.get(url)
        if client is None:
            with self._opening:
                client = self._opened.get(url)
                if client is None:
                    client = self._opened[url] = self._open_client(url)
        return client

    def where(self, model: str) -> str:
        """``model``'s Redis for messages, password left out."""
        return redacted_url(self.shards.url_for(model))

    def opened(self) -> list[C]:
        """The clients opened for the other Redis instances (the caller closes them)."""
        return list(self._opened.values())

    def group(self, models: Sequence[str]) -> list[tuple[C, list[int]]]:
        """The positions of ``models`` by client, each client once, in order of first appearance."""
        groups: dict[int, tuple[C, list[int]]] = {}
        for position, model in enumerate(models):
            client = self.client(model)
            groups.setdefault(id(client), (client, []))[1].append(position)
        return list(groups.values())
