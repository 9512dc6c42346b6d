"""A Redis database of the contract tests' own, so that a snapshot's SCAN sees only their keys."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from ortq.localredis import LocalRedis

# Database 0 is every other test's; the contract tests empty this one before each test.
CONTRACT_DB = 9


@pytest.fixture
def contract_url(redis_server: LocalRedis) -> str:
    """URL of the contract database: give it to ortq's side of a scenario (workers, producer)."""
    return redis_server.url.rsplit("/", 1)[0] + f"/{CONTRACT_DB}"


@pytest.fixture
def contract_connection(contract_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(contract_url)
    client.flushdb()
    yield client
    client.close()
