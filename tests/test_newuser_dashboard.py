"""rq-dashboard's Requeue buttons on ortq jobs (issue 35, "What a new user met"): ortq refuses every
requeue of an ortq job (its request tensors went when it ended), so the patched pages show no
Requeue button on an ortq job's row or page, and no "Requeue All" on an ortq queue; another RQ
application's jobs keep theirs. The app as ``ortq dashboard`` makes it, on a real Redis, with job
records written by hand (tests/dashboard_support.py)."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import redis
from flask.testing import FlaskClient

from ortq import keys
from ortq.dashboard.app import create_app
from ortq.settings import Settings
from tests.dashboard_support import forge_job


@pytest.fixture
def client(redis_url: str) -> FlaskClient:
    return create_app(Settings.from_url(redis_url)).test_client()


def get_json(client: FlaskClient, path: str) -> Any:
    answer = client.get(path)
    assert answer.status_code == 200, answer.text
    return answer.json


def failed_rows(client: FlaskClient, queue: str) -> dict[str, dict[str, Any]]:
    """The rows of ``queue``'s failed-job list, by job id, as the jobs page fetches them."""
    listed = get_json(client, f"/rq/0/data/jobs/{queue}/failed/8/asc/1.json")
    return {row["id"]: row for row in listed["jobs"]}


def failed_page(client: FlaskClient, queue: str) -> str:
    answer = client.get(f"/rq/0/view/jobs/{queue}/failed/8/asc/1")
    assert answer.status_code == 200, answer.text
    return answer.text


def test_ortq_jobs_and_queues_show_no_requeue_buttons(
    client: FlaskClient, connection: redis.Redis, model_name: str
) -> None:
    ortq_queue, other_queue = keys.queue_name(model_name), f"other-{model_name}"
    ortq_job = forge_job(connection, ortq_queue)
    plain = forge_job(connection, other_queue, data=msgpack.packb(["app.tasks.resize", None, [], {}]))
    # ortq's job function in another application's queue: an ortq job all the same (refused too).
    elsewhere = forge_job(connection, other_queue)

    assert failed_rows(client, ortq_queue)[ortq_job]["requeue_refused"] is True
    others = failed_rows(client, other_queue)
    assert "requeue_refused" not in others[plain] and others[elsewhere]["requeue_refused"] is True
    assert get_json(client, f"/rq/0/data/job/{ortq_job}.json")["requeue_refused"] is True
    assert "requeue_refused" not in get_json(client, f"/rq/0/data/job/{plain}.json")

    # "Requeue All" is rendered by the server: gone on the ortq queue, there on the other.
    assert 'id="requeue-all-btn"' not in failed_page(client, ortq_queue)
    page = failed_page(client, other_queue)
    assert 'id="requeue-all-btn"' in page
    # A row's and the job page's buttons are drawn in the browser, from the JSON above.
    assert "<% if (d.exc_info && !d.requeue_refused) { %>" in page
    job_page = client.get(f"/rq/0/view/job/{ortq_job}")
    assert job_page.status_code == 200 and 'job.status === "failed" && !job.requeue_refused' in job_page.text
