"""Reading one TOML table of ``pool.toml`` (ortq.pool.config): typed getters whose errors name the
file, the table and the key, and a :meth:`Table.finish` that refuses the keys nobody read."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar, overload

from ortq.errors import ConfigurationError

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

#: (name, value) pairs of strings, in the file's order: an env table, provider options.
Env = tuple[tuple[str, str], ...]
T = TypeVar("T")


class Table:
    """A TOML table being read: typed getters, and :meth:`finish` refuses the keys nobody read."""

    def __init__(self, data: Mapping[str, Any], where: str, source: str) -> None:
        self.data = data
        self.where = where
        self.source = source
        self._read: set[str] = set()

    def error(self, message: str) -> ConfigurationError:
        return ConfigurationError(f"{self.source}: {self.where}: {message}")

    def _get(self, key: str, default: T, check: Callable[[Any], bool], want: str) -> T:
        self._read.add(key)
        if key not in self.data:
            return default
        value = self.data[key]
        if not check(value):
            raise self.error(f"{key} must be {want}, got {value!r} ({_toml_type(value)})")
        return value  # type: ignore[no-any-return]

    def string(self, key: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str | None:
        value = self._get(key, default, lambda v: isinstance(v, str) and v != "", "a non-empty string")
        if value is not None and choices and value not in choices:
            raise self.error(f"{key} must be one of {', '.join(choices)}, got {value!r}")
        return value

    @overload
    def integer(self, key: str, default: int, minimum: int, maximum: int | None = None) -> int: ...
    @overload
    def integer(self, key: str, default: None, minimum: int, maximum: int | None = None) -> int | None: ...
    def integer(self, key: str, default: int | None, minimum: int, maximum: int | None = None) -> int | None:
        def check(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= minimum and (maximum is None or v <= maximum)

        bound = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        return self._get(key, default, check, f"an integer {bound}")

    @overload
    def number(self, key: str, default: float, minimum: float, above: bool = False) -> float: ...
    @overload
    def number(self, key: str, default: None, minimum: float, above: bool = False) -> float | None: ...
    def number(self, key: str, default: float | None, minimum: float, above: bool = False) -> float | None:
        def check(v: Any) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and (v > minimum if above else v >= minimum)

        value = self._get(key, default, check, f"a number {'>' if above else '>='} {minimum:g}")
        return None if value is None else float(value)

    def boolean(self, key: str, default: bool) -> bool:
        return self._get(key, default, lambda v: isinstance(v, bool), "true or false")

    def table(self, key: str, where: str) -> Table:
        return Table(
            self._get(key, {}, lambda v: isinstance(v, dict), f"a table ([{where}])"), f"[{where}]", self.source
        )

    def tables(self, key: str, where: str, inside: str = "") -> list[Table]:
        """The array of tables ``key``; ``inside`` (the enclosing table's name) prefixes their names."""

        def check(v: Any) -> bool:
            return isinstance(v, list) and all(isinstance(t, dict) for t in v)

        found: list[dict[str, Any]] = self._get(key, [], check, f"an array of tables ([[{where}]])")
        return [Table(t, f"{inside}[[{where}]] #{n}", self.source) for n, t in enumerate(found, 1)]

    def provider_options(self, where: str) -> Env:
        """The ``provider_options`` table: option names to strings (integers are turned into strings);
        the keys and values are checked as the worker checks them once the provider is known."""
        table = self.table("provider_options", where)
        table.where = f"{self.where} provider_options" if self.where.startswith("[[") else table.where
        pairs = []
        for key, value in table.data.items():
            table._read.add(key)
            if isinstance(value, bool) or not isinstance(value, str | int):
                raise table.error(f"{key} must be a string (or an integer), got {value!r} ({_toml_type(value)})")
            pairs.append((key, str(value)))
        return tuple(pairs)

    def env(self, where: str, reserved: Mapping[str, str]) -> Env:
        """The ``env`` table: variable names to strings (numbers are turned into strings); a name of
        ``reserved`` is refused with its reason."""
        table = self.table("env", where)
        table.where = f"{self.where} env" if self.where.startswith("[[") else table.where
        pairs = []
        for name, value in table.data.items():
            table._read.add(name)
            if not _ENV_NAME.fullmatch(name):
                raise table.error(f"{name!r} is not an environment variable name")
            if name.upper() in reserved:
                raise table.error(f"{name} cannot be set here: {reserved[name.upper()]}")
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                raise table.error(f"{name} must be a string or a number, got {value!r} ({_toml_type(value)})")
            pairs.append((name, str(value)))
        return tuple(pairs)

    def finish(self) -> None:
        unknown = [k for k in self.data if k not in self._read]
        if unknown:
            key = unknown[0]
            known = sorted(self._read)
            close = [k for k in known if k.startswith(key)] or difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known keys: {', '.join(sorted(self._read))}"
            raise self.error(f"unknown key {key!r}{hint}")


def _toml_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array", dict: "a table"}
    return names.get(type(value), type(value).__name__)
