"""``unique=True`` without a chosen id is refused (issue 35, "What a new user met"): uniqueness is
by the id the caller chooses, so without one the flag would be accepted and do nothing. Both
producers refuse it with ConfigurationError before any command is sent."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis

from ortq.errors import ConfigurationError
from ortq.producer import AsyncProducer, Producer
from ortq.settings import Settings

pytestmark = pytest.mark.timeout(60)

X = np.array([[1, 2, 3, 4]], np.float32)
REFUSED = r"^unique=True needs a job_id \(job_ids for submit_many\)"
#: Nothing listens here: a producer that sent any command would raise BrokerUnavailable instead.
NO_REDIS = "redis://127.0.0.1:1/0"


def _model_keys(connection: redis.Redis, model_name: str) -> list[bytes]:
    return list(connection.scan_iter(match=f"*{model_name}*"))


def test_the_producer_refuses_unique_without_a_job_id(model_name: str, redis_url: str, connection: redis.Redis) -> None:
    with Producer(settings=Settings.from_url(redis_url), allow_unknown_models=True) as producer:
        with pytest.raises(ConfigurationError, match=REFUSED):
            producer.submit(model_name, {"x": X}, unique=True)
        with pytest.raises(ConfigurationError, match=REFUSED):
            producer.submit_many(model_name, [{"x": X}, {"x": X}], unique=True)
        assert _model_keys(connection, model_name) == []
        # The same submit with an id goes through: the refusal is about the missing id alone.
        job = producer.submit(model_name, {"x": X}, job_id=f"{model_name}-1", unique=True)
        assert job.id == f"{model_name}-1" and _model_keys(connection, model_name) != []
    # Refused before any I/O: against no Redis at all (a client of its own: the producer's own PINGs) it is
    # still a ConfigurationError.
    settings = Settings.from_url(NO_REDIS)
    unreachable = Producer(settings=settings, connection=redis.Redis.from_url(NO_REDIS), allow_unknown_models=True)
    with pytest.raises(ConfigurationError, match=REFUSED):
        unreachable.submit(model_name, {"x": X}, unique=True)
    unreachable.close()


def test_the_async_producer_refuses_unique_without_a_job_id(
    model_name: str, redis_url: str, connection: redis.Redis
) -> None:
    async def main() -> None:
        async with AsyncProducer(settings=Settings.from_url(redis_url), allow_unknown_models=True) as producer:
            with pytest.raises(ConfigurationError, match=REFUSED):
                await producer.submit(model_name, {"x": X}, unique=True)
            with pytest.raises(ConfigurationError, match=REFUSED):
                await producer.submit_many(model_name, [{"x": X}], unique=True)
            assert _model_keys(connection, model_name) == []
            job = await producer.submit(model_name, {"x": X}, job_id=f"{model_name}-1", unique=True)
            assert job.id == f"{model_name}-1"
        unreachable = AsyncProducer(settings=Settings.from_url(NO_REDIS), allow_unknown_models=True)
        with pytest.raises(ConfigurationError, match=REFUSED):
            await unreachable.submit(model_name, {"x": X}, unique=True)
        await unreachable.aclose()

    asyncio.run(main())
    assert _model_keys(connection, model_name) != []
