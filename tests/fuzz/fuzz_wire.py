"""Coverage-guided fuzzing (atheris, i.e. libFuzzer for Python) of ortq's frame codec and of the
job hash parsing a worker does before anything of a job runs.

    .venv/bin/pip install atheris          # a manylinux wheel for CPython 3.11 on x86-64 Linux
    .venv/bin/python tests/fuzz/fuzz_wire.py tests/fuzz/corpus/wire -max_total_time=60

Each input goes through :func:`tests.fuzz.targets.check_input` (request and response decoders,
the models' signature checks, re-encoding, ``JobRecord.parse``); any exception other than the
ones it allows is a crash, which libFuzzer saves as ``crash-<sha1>`` in the current directory.
New interesting inputs are added to the corpus directory given; to keep the committed corpus
small, fuzz into a scratch directory and merge back (README.md in this directory).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Coverage feedback only from ortq and the checks; numpy and msgpack are native code anyway.
with atheris.instrument_imports(include=["ortq", "tests.fuzz"]):
    from tests.fuzz.targets import check_input


def main() -> None:
    # libFuzzer runs argv[0] through the shell for -merge=1 (and -jobs); name this interpreter
    # and script there, so that it works without an executable bit or a shebang.
    program = f"{shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))}"
    atheris.Setup([program, *sys.argv[1:]], check_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
