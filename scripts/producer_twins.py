"""Count the lines that ``Producer`` and ``AsyncProducer`` (and their job handles) write twice.

A *twin line* is a line of a method that both classes of a pair define, equal in both but for
``async``/``await`` (and indentation): what the sync and the async producer would each have to be
changed in for one change of behaviour. What both send and check belongs in the I/O-free steps
(ortq/producer/steps.py); what stays twin is the public methods' signatures and docstrings (one
API, written for each class) and their short hand-over to the steps: the second number, twin
lines in the methods' bodies, is the one that says whether logic is written twice. Blank lines are
not counted.

    python scripts/producer_twins.py              # prints the counts
    python scripts/producer_twins.py -v           # and each method's
    python scripts/producer_twins.py --max-body 30  # exits 1 above 30 twin lines in bodies (for CI)
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: (file, class) of each sync class and its async twin.
PAIRS = [
    (("ortq/producer/producer.py", "Producer"), ("ortq/producer/aio.py", "AsyncProducer")),
    (("ortq/producer/producer.py", "InferenceJob"), ("ortq/producer/aio.py", "AsyncInferenceJob")),
]


def methods(root: Path, path: str, name: str) -> dict[str, tuple[list[str], list[str]]]:
    """Each method of class ``name`` in ``path``: all its lines (decorators included) and those of its
    body after any docstring, blank ones left out."""
    text = (root / path).read_text()
    lines = text.splitlines()
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            found = {}
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and item.end_lineno is not None:
                    start = min([item.lineno, *(d.lineno for d in item.decorator_list)])
                    body = item.body[1:] if ast.get_docstring(item) is not None else item.body
                    body_start = body[0].lineno if body else item.end_lineno + 1
                    found[item.name] = (
                        [line for line in lines[start - 1 : item.end_lineno] if line.strip()],
                        [line for line in lines[body_start - 1 : item.end_lineno] if line.strip()],
                    )
            return found
    raise SystemExit(f"no class {name} in {path}")


def unasync(line: str) -> str:
    """``line`` as its sync twin would say it."""
    line = re.sub(r"\basync\s+(?=def\b|with\b|for\b)", "", line.strip())
    return re.sub(r"\bawait\s+", "", line)


def twin_lines(sync: list[str], aio: list[str]) -> int:
    """How many lines of ``sync`` stand in ``aio`` too, in the same order, but for async/await."""
    matcher = difflib.SequenceMatcher(None, [unasync(x) for x in sync], [unasync(x) for x in aio], autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="print each method's count")
    parser.add_argument("--max-body", type=int, help="exit 1 when the bodies have more twin lines than this")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to read (default: this one)")
    args = parser.parse_args()
    twins = total = body_twins = body_total = 0
    for (sync_path, sync_class), (aio_path, aio_class) in PAIRS:
        sync, aio = methods(args.root, sync_path, sync_class), methods(args.root, aio_path, aio_class)
        for name in sorted(sync.keys() & aio.keys()):
            (whole, body), (aio_whole, aio_body) = sync[name], aio[name]
            count, in_body = twin_lines(whole, aio_whole), twin_lines(body, aio_body)
            twins, total = twins + count, total + len(whole)
            body_twins, body_total = body_twins + in_body, body_total + len(body)
            if args.verbose:
                print(f"  {sync_class}.{name}: {count} of {len(whole)}, in its body {in_body} of {len(body)}")
    print(
        f"{twins} twin lines of {total} in the same-named methods of the sync and async producers and jobs; "
        f"in their bodies {body_twins} of {body_total}"
    )
    if args.max_body is not None and body_twins > args.max_body:
        print(f"more than --max-body {args.max_body}: share what both do as I/O-free steps (ortq/producer/steps.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
