"""Sending a pipeline once: redis-py's own retries turned off for one ``execute``.

redis-py sends a pipeline again after a connection error or a timeout (its default ``Retry``;
AsyncProducer's allows one). For an enqueue MULTI that is wrong once EXEC has run and only its
reply was lost: the jobs would go in twice, and a job whose second queue entry a worker takes
after the first has started would run twice (the second write sets its status back to
``queued``). A Round sent ``once`` (ortq.producer.steps.Round) runs here instead, and the steps
find out whether it ran before they send it again (ortq.producer.submitting).

The retry policy belongs to each pooled connection: the pipeline is given a connection of its
pool with no retry bound to it, and the connection's own policy is bound again before the
pipeline hands it back to the pool (its ``reset``), so no other command ever runs without it.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio
import redis.asyncio.retry
import redis.retry
from redis.backoff import NoBackoff

_NO_RETRY = redis.retry.Retry(NoBackoff(), 0)
_NO_RETRY_ASYNC = redis.asyncio.retry.Retry(NoBackoff(), 0)


def execute(pipe: redis.client.Pipeline) -> list[Any]:
    """``pipe.execute(raise_on_error=False)``, sent once: a connection error or timeout is raised."""
    connection = pipe.connection or _connection(pipe.connection_pool)
    pipe.connection = connection
    kept, connection.retry = connection.retry, _NO_RETRY
    reset = pipe.reset

    def rebind_then_reset() -> None:
        connection.retry = kept
        reset()

    pipe.reset = rebind_then_reset  # type: ignore[method-assign]  # called by execute, before the release
    try:
        return pipe.execute(raise_on_error=False)
    finally:
        connection.retry = kept


async def execute_async(pipe: redis.asyncio.client.Pipeline) -> list[Any]:
    """:func:`execute` of an asyncio pipeline."""
    connection = pipe.connection or await _connection_async(pipe.connection_pool)
    pipe.connection = connection
    kept, connection.retry = connection.retry, _NO_RETRY_ASYNC
    reset = pipe.reset

    async def rebind_then_reset() -> None:
        connection.retry = kept
        await reset()  # type: ignore[no-untyped-call]  # redis-py leaves it unannotated

    pipe.reset = rebind_then_reset  # type: ignore[method-assign]
    try:
        return await pipe.execute(raise_on_error=False)
    finally:
        connection.retry = kept


def _connection(pool: Any) -> Any:
    try:
        return pool.get_connection()
    except TypeError:  # redis-py < 5.3 names the command (any: it picks no connection by it)
        return pool.get_connection("MULTI")


async def _connection_async(pool: Any) -> Any:
    try:
        return await pool.get_connection()
    except TypeError:
        return await pool.get_connection("MULTI")
