"""Put on PYTHONPATH by tests/test_reliability.py: any unpickling in this process is recorded
(in the file named by ORTQ_PICKLE_TRAP) and refused, even where the caller would swallow the
error."""

import os
import pickle

_trap = os.environ.get("ORTQ_PICKLE_TRAP")


def _refuse(*args: object, **kwargs: object) -> None:
    if _trap:
        with open(_trap, "a") as log:
            log.write(f"pickle used in pid {os.getpid()}\n")
    raise RuntimeError("unpickling is banned in this test")


class _RefusingUnpickler(pickle.Unpickler):
    def __init__(self, *args: object, **kwargs: object) -> None:
        _refuse()


pickle.loads = _refuse  # type: ignore[assignment]
pickle.load = _refuse  # type: ignore[assignment]
pickle.Unpickler = _RefusingUnpickler  # type: ignore[misc]
