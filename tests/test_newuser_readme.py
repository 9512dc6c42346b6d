"""The README's FastAPI snippet (issue 35, "What a new user met": users copy it verbatim, and it
answered a bare 500 while Redis was down). It compiles, the ortq errors it names exist, it maps
them to 422/503/504, and run against a real Redis that then stops it answers 503.

FastAPI is no dependency of ortq: where it is not installed, a stand-in with the two names the
snippet takes from it (``FastAPI``'s ``post`` decorator, ``HTTPException``) lets the snippet's own
code run; Redis and the producer are real."""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.util
import re
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ortq import errors
from ortq.localredis import LocalRedis
from tests.conftest import REPO

SNIPPET_URL = "redis://127.0.0.1:6379/0"


def fastapi_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    [snippet] = [b for b in blocks if "from fastapi import" in b]
    return str(snippet)


def http_status_by_error(tree: ast.AST) -> dict[str, int]:
    """For each ``except NAME`` of the snippet, the status of the HTTPException it raises."""
    found = {}
    for handler in ast.walk(tree):
        if isinstance(handler, ast.ExceptHandler) and isinstance(handler.type, ast.Name):
            [call] = [
                n for n in ast.walk(handler) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "HTTPException"
            ]
            status = call.args[0]
            assert isinstance(status, ast.Constant), ast.dump(call)
            found[handler.type.id] = status.value
    return found


def test_the_snippet_compiles_names_real_errors_and_maps_them() -> None:
    tree = ast.parse(fastapi_snippet())
    compile(tree, "README.md (FastAPI snippet)", "exec")
    imported = [(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    for module, name in imported:
        if module is not None and module.startswith("ortq"):
            assert issubclass(getattr(importlib.import_module(module), name), errors.OrtqError), (module, name)
    assert http_status_by_error(tree) == {"InvalidInput": 422, "BrokerUnavailable": 503, "ResultTimeout": 504}


class _HTTPException(Exception):
    def __init__(self, status_code: int, detail: Any = None) -> None:
        super().__init__(status_code, detail)
        self.status_code, self.detail = status_code, detail


class _FastAPI:
    """What the snippet uses of ``fastapi.FastAPI``: its lifespan, and ``post`` as a decorator that
    returns the function (as FastAPI's does)."""

    def __init__(self, lifespan: Callable[..., Any]) -> None:
        self.router = types.SimpleNamespace(lifespan_context=lifespan)

    def post(self, path: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return lambda endpoint: endpoint


@pytest.fixture
def fastapi_module(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if importlib.util.find_spec("fastapi") is None:
        monkeypatch.setitem(
            sys.modules, "fastapi", types.SimpleNamespace(FastAPI=_FastAPI, HTTPException=_HTTPException)
        )
    yield


@pytest.mark.usefixtures("fastapi_module")
def test_the_snippet_answers_503_while_redis_is_down() -> None:
    server = LocalRedis().start()
    try:
        snippet = fastapi_snippet()
        assert SNIPPET_URL in snippet
        namespace: dict[str, Any] = {"__name__": "readme_fastapi"}
        exec(compile(snippet.replace(SNIPPET_URL, server.url), "README.md", "exec"), namespace)
        app, digits, http_exception = namespace["app"], namespace["digits"], namespace["HTTPException"]

        async def request_while_redis_is_down() -> Any:
            async with app.router.lifespan_context(app):  # the app's start: the producer PINGs Redis
                server.stop()
                with pytest.raises(Exception) as answered:
                    await digits([0.0] * 64)
                return answered.value

        answer = asyncio.run(request_while_redis_is_down())
    finally:
        server.stop()
    assert isinstance(answer, http_exception) and answer.status_code == 503, repr(answer)
    assert isinstance(answer.__cause__, errors.BrokerUnavailable)
