"""ortq's adapter to RQ: everything that must match RQ's key layout and field formats, for RQ 2.12
and RQ 3.x, lives in this package and nowhere else.

- :mod:`ortq.rqcompat.layout`: key names (with RQ 3's ``RQ_KEY_PREFIX``), timestamp format, the
  fields of a worker's birth, which RQ series is installed;
- :mod:`ortq.rqcompat.book`: the per-job scripts (``lua/*.lua``): start, finish, fail (and retry),
  take back, answer what is no job, rescue, due retries, registry upkeep;
- :mod:`ortq.rqcompat.records`: the worker's own RQ records: birth, heartbeats, death.

tests/rqcontract compares what these write with what RQ's own worker writes for the same job.
"""
