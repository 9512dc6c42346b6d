"""Contract harness: ortq's worker must write to Redis exactly what RQ's own worker writes.

Pieces:

* :mod:`.snapshot` — ``snapshot(connection, ids, durations)`` reads every key about the given
  identifiers and normalizes it (placeholders for ids, classes for values, named TTLs);
  ``diff(ours, theirs, allowed)`` lists the differences, one readable line each;
  ``assert_same`` fails a test with those lines and both snapshots.
* :mod:`.reference` — RQ's ``SimpleWorker`` runs the scenarios ``success``, ``failure``,
  ``retry_now``, ``retry_later`` (stages ``queued``, ``started``, ``ended``) and ``worker``
  (``birth``, ``busy``, ``idle``, ``death``), each under fresh ids, enqueued with
  ``result_ttl=RESULT_TTL, failure_ttl=FAILURE_TTL, ttl=JOB_TTL, job_timeout=JOB_TIMEOUT``.
* ``python -m tests.rqcontract show|dump FILE|compare A B`` prints the reference for the
  installed RQ, or compares dumps made under two RQ versions (one venv each).

Everything here is marked ``rqcompat``: scripts/test.sh runs it under RQ 2.12 as well as under
the RQ of the main venv, so both series' writes are checked.

Taking ortq's side of a scenario (for the lead's contract tests)::

    from tests.rqcontract import reference
    from tests.rqcontract.snapshot import assert_same, snapshot

    def test_success_matches_rq(contract_url, contract_connection, workers, producer_for_contract):
        theirs = reference.success(contract_connection)
        # ortq's worker serves contract_url (tests/rqcontract/conftest.py: a database of its own);
        # the job is submitted with the same lifetimes as the reference's:
        #   result_ttl=reference.RESULT_TTL, failure_ttl=reference.FAILURE_TTL,
        #   ttl=reference.JOB_TTL, job_timeout=reference.JOB_TIMEOUT
        ids = {job.id: "<job>", keys.queue_name(model): "<queue>", worker_name: "<worker>"}
        started = snapshot(contract_connection, ids, reference.DURATIONS)  # while a slow job runs
        ...  # wait for the reply and RQ's bookkeeping
        ended = snapshot(contract_connection, ids, reference.DURATIONS)
        assert_same(started.without("ortq:*"), theirs["started"], ALLOWED_STARTED)
        assert_same(ended.without("ortq:*"), theirs["ended"], ALLOWED_ENDED)

Placeholders must be the ones the reference uses: ``<job>`` (``<job1>``, ``<job2>`` in the
``worker`` scenario), ``<queue>``, ``<worker>``; execution ids are found and named ``<exec>``
by ``snapshot`` itself. ortq's own keys (``ortq:req:<model>:<job>``, the producers' reply streams
``ortq:reply:<model>:<reply name>``, model keys) are not RQ's: drop them with ``.without("ortq:*")``;
compare only a worker's records with ``.select(lambda key: "<worker>" in key or key == "rq:workers")``.

``allowed`` maps fnmatch patterns over difference locations to the reason each is intended,
e.g.::

    ALLOWED_ENDED = {
        "rq:job:<job> field data": "ortq's job function and arguments, not the reference job's",
        "rq:job:<job> field description": "same",
        "rq:job:<job> field *_callback_name": "RQ's enqueue writes empty callback fields; ortq never writes them",
        "rq:job:<job> field group_id": "same",
        "rq:job:<job> field ortq_reply": "the reply stream ortq's producer reads; RQ has none",
        "rq:job:<job> field ortq_answer": "the job's entry in that stream; RQ has none",
        "rq:results:<job> entry 0 field return_value": "ortq's reply summary, not the reference job's value",
    }

An allowance that no longer matches anything is itself reported, so that none outlives its
reason. Where RQ 2.12 and RQ 3 differ (see tests/rqcontract/test_reference.py, and the lead's
notes), compare against the reference of the RQ that is installed: never against a recorded one.
"""
