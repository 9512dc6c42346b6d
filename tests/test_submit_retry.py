"""``submit_retry_seconds`` (Settings, ``ORTQ_SUBMIT_RETRY_SECONDS``): a submit that finds Redis
unavailable is made again until Redis is back, where making it again cannot enqueue a job twice
(its ids chosen and unique; a failure before its write), and is raised at once otherwise, saying
how to have it retried. A real redis-server, stopped and started again on its port; the Sentinel
failover case is in test_sentinel.py."""

from __future__ import annotations

import logging
import socket
import threading
import uuid

import numpy as np
import pytest

from ortq import keys
from ortq.errors import BrokerUnavailable, ConfigurationError
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.producer.submitting import infer_options
from ortq.settings import Settings
from tests.conftest import PROCESS_SAFETY_SECONDS, eventually
from tests.tcp_proxy import CommandCuttingProxy

X = {"x": np.ones((1, 4), np.float32)}


class GoneAfterTheCut(CommandCuttingProxy):
    """Cuts the connection that sends the armed command before Redis gets it, and takes no
    connection after that: the write did not go in, and nothing can tell the producer so."""

    def _cut(self, client: socket.socket, upstream: socket.socket, data: bytes) -> bool:
        self._closed = True
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept blocked on it (close alone does not)
        self._listener.close()
        cut = super()._cut(client, upstream, data)
        self.reset_all()  # the producer's other connections too: no read-back can tell
        return cut


def _retried(caplog: pytest.LogCaptureFixture) -> int:
    return sum("trying the submit again" in r.getMessage() for r in caplog.records)


def test_a_unique_submit_is_tried_again_until_redis_is_back_and_enqueued_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "ortq.producer")
    with LocalRedis() as server:
        settings = Settings.from_url(server.url, submit_retry_seconds=PROCESS_SAFETY_SECONDS)
        with Producer(settings=settings, allow_unknown_models=True) as producer:
            producer.submit("retried", X)  # connected once: what follows is an outage, not a bad URL
            server.stop()
            job_id, got, failed = str(uuid.uuid4()), [], []

            def submit() -> None:
                try:
                    got.append(producer.submit("retried", X, job_id=job_id, unique=True))
                except Exception as exc:
                    failed.append(exc)

            thread = threading.Thread(target=submit, daemon=True)
            thread.start()
            # Redis comes back only once the submit has said it tries again (at least twice: a
            # second try found it still down): what the producer says, not a time.
            eventually(lambda: _retried(caplog) >= 2 or failed, PROCESS_SAFETY_SECONDS, "two tries again")
            assert not failed, failed
            server.start()
            thread.join(PROCESS_SAFETY_SECONDS)
            assert not thread.is_alive() and not failed, failed
            assert [job.id for job in got] == [job_id]
            connection = settings.connect()
            assert connection.lrange(keys.queue_key("retried"), 0, -1).count(job_id.encode()) == 1
            assert connection.hget(keys.job_key(job_id), "status") == b"queued"
            connection.close()


def test_a_submit_whose_write_may_have_gone_in_is_not_tried_again_and_says_how_it_would_be(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without chosen ids a second write could enqueue the jobs twice: the error is raised at once,
    ``maybe_enqueued``, with the way to a submit that is retried."""
    caplog.set_level(logging.WARNING, "ortq.producer")
    with LocalRedis() as server, GoneAfterTheCut(server.port) as proxy:
        settings = Settings.from_url(proxy.url, submit_retry_seconds=PROCESS_SAFETY_SECONDS)
        with Producer(settings=settings, allow_unknown_models=True) as producer:
            producer.submit("once", X)
            proxy.cut_next("before", "EXEC")
            with pytest.raises(BrokerUnavailable) as raised:
                producer.submit("once", X)
            assert proxy.cuts == 1 and raised.value.maybe_enqueued
            assert "a submit with job_id and unique=True would be" in str(raised.value)
            assert _retried(caplog) == 0


def test_without_the_setting_nothing_is_tried_again() -> None:
    with (
        LocalRedis() as server,
        Producer(settings=Settings.from_url(server.url), allow_unknown_models=True) as producer,
    ):
        producer.submit("plain", X)
        server.stop()
        with pytest.raises(BrokerUnavailable) as raised:
            producer.submit("plain", X, job_id=str(uuid.uuid4()), unique=True)
        assert "would be" not in str(raised.value)


def test_infer_gives_its_job_an_id_of_its_own_only_when_submits_are_retried() -> None:
    assert infer_options(Settings()) == {}
    chosen = infer_options(Settings(submit_retry_seconds=5))
    assert chosen["unique"] is True and str(uuid.UUID(chosen["job_id"])) == chosen["job_id"]
    with pytest.raises(ConfigurationError, match="submit_retry_seconds"):
        Settings(submit_retry_seconds=-1)
    assert Settings.from_env({"ORTQ_SUBMIT_RETRY_SECONDS": "30"}).submit_retry_seconds == 30
