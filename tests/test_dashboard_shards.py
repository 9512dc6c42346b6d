"""The dashboard over a shard map: every Redis in it, on ortq's page (a section each, the map's
warnings) and in rq-dashboard (an instance each), each read through ortq's own client; a Redis
that is down hides only its own section."""

from __future__ import annotations

import html
import re
from pathlib import Path

import numpy as np
import pytest

from ortq import keys
from ortq.dashboard.app import create_app
from ortq.errors import InferenceFailed
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.redisurls import redacted_url
from ortq.settings import Settings
from tests.conftest import WorkerProcesses
from tests.dashboard_support import PageFields

X = np.arange(8, dtype=np.float32).reshape(2, 4)


def test_every_redis_of_the_shard_map_is_shown_and_one_down_hides_only_itself(
    redis_url: str, model_name: str, tiny_path: Path, workers: WorkerProcesses
) -> None:
    home, moved, misplaced = f"{model_name}-home", f"{model_name}-moved", f"{model_name}-misplaced"
    with LocalRedis() as shard:
        settings = Settings.from_url(redis_url, redis_shards=f"{moved}={shard.url}")
        workers.serve(tiny_path, moved, shard.url)
        with Producer(settings=settings, validate=False, allow_unknown_models=True) as producer:
            [answered] = producer.submit_many(moved, [{"x": X}])
            np.testing.assert_array_equal(answered.result(timeout=30)["y"], X * 2 + 1)
            failed = producer.submit(moved, {"wrong": X})
            with pytest.raises(InferenceFailed, match="InvalidInput"):
                failed.result(timeout=30)
            waiting = producer.submit(home, {"x": X})  # on the default Redis: no worker there
        # A job of a model the map keeps on the default Redis, pushed onto the shard (a producer
        # with another map): the page warns.
        with Producer(settings=Settings.from_url(shard.url), validate=False, allow_unknown_models=True) as stray:
            stray.submit(misplaced, {"x": X})
        client = create_app(settings).test_client()

        page = client.get("/").text
        fields = PageFields(page).fields
        assert re.search(r'<h2 class="redis" data-redis="0">Redis redis://127\.0\.0\.1:\d+/0</h2>', page)
        assert f'<h2 class="redis" data-redis="1">Redis {redacted_url(shard.url)}</h2>' in page
        assert f'data-model="{moved}" data-redis="1"' in page and f'data-model="{home}" data-redis="0"' in page
        assert (fields[moved, None, "finished"], fields[moved, None, "failed"]) == ("1", "1")
        assert fields[home, None, "queued"] == "1"
        assert f'href="/rq/1/view/job/{failed.id}"' in page  # its latest failure, on its own instance
        assert f"/rq/1/view/jobs/{keys.queue_name(moved)}/finished/" in page
        warning = f"model {misplaced!r} has 0 worker(s) and 1 queued job(s) on {redacted_url(shard.url)}"
        assert f'<p class="bad warning">WARNING: {html.escape(warning).replace("&#x27;", "&#39;")}' in page

        # rq-dashboard: instance 1 is the shard, read through ortq's client; there is no instance 2.
        job_page = client.get(f"/rq/1/view/job/{answered.id}")
        assert job_page.status_code == 200 and answered.id in job_page.text
        on_shard = [q["name"] for q in client.get("/rq/1/data/queues.json").json["queues"]]
        on_default = [q["name"] for q in client.get("/rq/0/data/queues.json").json["queues"]]
        assert keys.queue_name(moved) in on_shard and keys.queue_name(moved) not in on_default
        assert keys.queue_name(home) in on_default and keys.queue_name(home) not in on_shard
        assert client.get("/rq/2/view/workers").status_code == 404

        info = client.get("/api/info").json
        where = {m["model"]: m["redis"] for m in info["models"] if m["model"].startswith(model_name)}
        assert where == {
            home: redacted_url(redis_url),
            moved: redacted_url(shard.url),
            misplaced: redacted_url(shard.url),
        }
        assert any(misplaced in warning for warning in info["warnings"])
        assert waiting.status() == "queued"
        workers.stop_all()

    # The shard is gone: its section says so, the default Redis's is still shown.
    page = client.get("/")
    assert page.status_code == 200
    assert re.search(
        r'<h2 class="redis" data-redis="1">Redis [^<]+</h2>\s*<p id="problem" class="bad">cannot reach', page.text
    )
    assert PageFields(page.text).fields[home, None, "queued"] == "1"
