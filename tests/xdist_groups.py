"""Which tests must share one pytest-xdist worker (scripts/test.sh runs ``-n N --dist loadgroup``).

Each xdist worker is a pytest process of its own, with its own ``redis_server`` (tests/conftest.py)
and its own temporary directories, so tests go to whichever worker is free, except:

* tests/windows, all on one worker: its modules share one Wine prefix, which one session holds at
  a time (winenv.WineSession's lock; ``wineserver -k`` would end another session's processes);
* a module's tests that share a module- (or class-, package-) scoped fixture (workers started once,
  a dashboard, a TLS Redis, ``npm ci`` into clients/node): on one worker, so that the fixture is
  built once, not once per worker, and never by two workers at the same time;
* tests marked ``xdist_group(NAME)``: NAME's worker.

xdist's own ``loadgroup`` puts a test's group into its node id, which pytest 9.2 no longer lets it
change (pytest-dev/pytest-xdist#1386: the marks are silently ignored). So the groups travel beside
the ids instead: each worker writes them to a file once it has collected (every worker collects
the same tests), and the scheduler built here for ``--dist loadgroup`` reads them before it hands
out the first test. Without xdist (``-n 0``, ``-p no:xdist``) none of this runs; nor with another
``--dist`` (plain ``pytest -n N`` is ``--dist load``: give it ``--dist loadgroup``).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

#: Scopes of fixtures that outlive a test.
SHARED_SCOPES = {"module", "class", "package"}
_WORKERINPUT_KEY = "ortq_xdist_groups_dir"
_groups_dir_key = pytest.StashKey[Path]()


def group_of(item: pytest.Item) -> str | None:
    """The group ``item`` runs in, or None for a test that may go to any worker."""
    marks = [str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
             for mark in item.iter_markers("xdist_group")]  # fmt: skip
    if marks:
        return "_".join(sorted(set(marks)))
    module = item.nodeid.split("::", 1)[0]
    if module.startswith("tests/windows/"):
        return "tests/windows"
    fixture_info = getattr(item, "_fixtureinfo", None)  # the fixtures the test uses, by name
    definitions = fixture_info.name2fixturedefs.values() if fixture_info is not None else ()
    if any(defs and defs[-1].scope in SHARED_SCOPES for defs in definitions):
        return module
    return None


@pytest.hookimpl(trylast=True)  # after -k/-m deselection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is None or _WORKERINPUT_KEY not in workerinput:
        return
    groups = {item.nodeid: group for item in items if (group := group_of(item)) is not None}
    path = Path(workerinput[_WORKERINPUT_KEY]) / f"{workerinput['workerid']}.json"
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(groups))
    partial.replace(path)  # whole or not at all


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Controller side, before each worker starts: where it writes its groups."""
    config: pytest.Config = node.config
    if config.getvalue("dist") != "loadgroup":
        return
    if _groups_dir_key not in config.stash:
        config.stash[_groups_dir_key] = Path(tempfile.mkdtemp(prefix="ortq-xdist-groups-"))
    node.workerinput[_WORKERINPUT_KEY] = str(config.stash[_groups_dir_key])


def pytest_unconfigure(config: pytest.Config) -> None:
    groups_dir = config.stash.get(_groups_dir_key, None)
    if groups_dir is not None:
        shutil.rmtree(groups_dir, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """xdist's loadscope with this module's groups as scopes, each other test a scope of its own."""

        groups: dict[str, str] | None = None

        def schedule(self) -> None:
            if self.groups is None:  # every worker has collected (and written its file) by now
                files = sorted(config.stash[_groups_dir_key].glob("*.json"))
                assert files, "no xdist worker wrote its groups (tests/xdist_groups.py)"
                self.groups = json.loads(files[0].read_text())
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            return (self.groups or {}).get(nodeid, nodeid)

    return GroupScheduling(config, log)
