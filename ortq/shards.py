"""Which Redis serves each model, when one Redis is not enough: the *shard map*.

Large tensors saturate one Redis (its one thread and its network) long before the workers are busy:
a conv model's 600 KB frames are ~1,000 times a small model's. Putting that model's queue on a
Redis of its own splits the load. The map names the models that live elsewhere than the default
Redis (``redis_url``); every model it does not name stays there, so a map with no entries is
exactly the single-Redis setup. Producers route each model's commands by it, ``ortq pool`` starts
each worker on its model's Redis, ``ortq infer`` and ``ortq info`` read it; a worker needs nothing
(it takes its model's one ``--redis-url``). docs/pool.md, "Sharding models over several Redis
instances", says when and how.

Written ``MODEL=URL`` entries separated by commas or white space (``$ORTQ_REDIS_SHARDS``,
``--shards``, ``Settings(redis_shards=...)``), or a mapping of model to URL (a TOML table, a
dict). A comma or white space inside a URL (a password) is written percent-encoded (``%2C``,
``%20``): redis-py decodes the user and password. A Sentinel URL's own commas, between its
sentinels, stay in the URL (``conv=redis+sentinel://a:26379,b:26379/ortq/0``; docs/ha.md).
Messages show URLs without their password.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from ortq import keys
from ortq.errors import ConfigurationError
from ortq.redisurls import check_redis_url, check_tls_options, redacted_url
from ortq.sentinel import is_sentinel_url

#: The environment variable producers and the ``ortq`` commands read the map from.
ENV_VAR = "ORTQ_REDIS_SHARDS"

_PIECES = re.compile(r"([,\s]+)")
#: How an entry starts: a model name (keys.check_model_name's characters) and "=".
_ENTRY_START = re.compile(r"[A-Za-z0-9_.-]+=")


class ShardMap:
    """Model name -> Redis URL, ``default_url`` for every model not listed. Immutable once made;
    every URL is checked as a ``redis_url`` is (scheme, database number, TLS options)."""

    __slots__ = ("_routes", "default_url")

    def __init__(self, default_url: str, routes: Mapping[str, str] | None = None, *, source: str = "shard map") -> None:
        _check_url(default_url, f"{source}: the default Redis")
        checked: dict[str, str] = {}
        for model, url in (routes or {}).items():
            _check_model(model, source)
            _check_url(url, f"{source}: model {model!r}")
            checked[model] = url
        self.default_url = default_url
        self._routes = checked

    @classmethod
    def parse(cls, spec: str, default_url: str, *, source: str = ENV_VAR) -> ShardMap:
        """The map written ``MODEL=URL,MODEL=URL`` (white space may separate entries too).
        ConfigurationError, naming ``source`` and the entry, for an entry that is no ``MODEL=URL``,
        an empty or invalid model name, a model given twice, or a bad URL."""
        routes: dict[str, str] = {}
        for number, entry in enumerate(_entries(spec), 1):
            model, equals, url = entry.partition("=")
            if not equals or "://" in model:
                raise ConfigurationError(
                    f"{source}: entry {number} ({redacted_url(entry)!r}) is not MODEL=URL "
                    "(e.g. conv=redis://redis-b:6379/0; entries are separated by commas)"
                )
            if model in routes:
                raise ConfigurationError(f"{source}: model {model!r} is given twice (entry {number})")
            routes[model] = url
        return cls(default_url, routes, source=source)

    # ------------------------------------------------------------------ reading

    def url_for(self, model: str) -> str:
        """The Redis URL of ``model``'s queue."""
        return self._routes.get(model, self.default_url)

    def listed(self, model: str) -> str | None:
        """The URL the map gives ``model``, or None when it does not list it (one dict lookup)."""
        return self._routes.get(model)

    @property
    def routes(self) -> dict[str, str]:
        """The listed models and their URLs (a copy)."""
        return dict(self._routes)

    def urls(self) -> list[str]:
        """Every distinct Redis URL: the default first, then the others in the order listed."""
        return list(dict.fromkeys([self.default_url, *self._routes.values()]))

    def models_on(self, url: str) -> list[str]:
        """The models the map lists on ``url`` (for the default URL: only those listed there)."""
        return [model for model, at in self._routes.items() if at == url]

    @property
    def sharded(self) -> bool:
        """Whether some model is on another Redis than the default."""
        return any(url != self.default_url for url in self._routes.values())

    def with_routes(self, routes: Iterable[tuple[str, str]], source: str) -> ShardMap:
        """This map with more entries; ConfigurationError where one names a model this map already
        gives another URL (producers using the one and workers the other would never meet)."""
        merged = dict(self._routes)
        for model, url in routes:
            if merged.get(model, url) != url:
                raise ConfigurationError(
                    f"{source}: model {model!r} is on {redacted_url(url)} there, but the shard map puts it on "
                    f"{redacted_url(merged[model])}: producers and workers must use the same Redis for a model"
                )
            merged[model] = url
        return ShardMap(self.default_url, merged, source=source)

    def spec(self) -> str:
        """The map as ``MODEL=URL,...`` (what :meth:`parse` reads). It holds the passwords: never print it."""
        return ",".join(f"{model}={url}" for model, url in self._routes.items())

    def describe(self) -> list[str]:
        """One line per Redis, passwords left out: its URL and the models on it."""
        lines = []
        for url in self.urls():
            models = ", ".join(self.models_on(url))
            if url == self.default_url:
                models = f"{models}, every other model" if models else "every model not listed"
            lines.append(f"{redacted_url(url)}: {models}")
        return lines

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardMap):
            return NotImplemented
        return (self.default_url, self._routes) == (other.default_url, other._routes)

    def __hash__(self) -> int:
        return hash((self.default_url, tuple(sorted(self._routes.items()))))

    def __repr__(self) -> str:
        routes = ", ".join(f"{model}={redacted_url(url)}" for model, url in self._routes.items())
        return f"ShardMap(default={redacted_url(self.default_url)}, {{{routes}}})"


def _entries(spec: str) -> list[str]:
    """The map's entries. A Sentinel URL lists its sentinels separated by commas too
    (``conv=redis+sentinel://a:26379,b:26379/ortq/0``): a piece after a comma that does not start
    with ``MODEL=`` (a sentinel's ``HOST[:PORT]``, which can hold no ``=``) goes on the Sentinel URL
    before it."""
    entries: list[str] = []
    pieces = _PIECES.split(spec)
    for piece, separator in zip(pieces[::2], ["", *pieces[1::2]], strict=True):
        if not piece:
            continue
        joins = separator == "," and entries and is_sentinel_url(entries[-1].partition("=")[2])
        if joins and not _ENTRY_START.match(piece):
            entries[-1] += "," + piece
        else:
            entries.append(piece)
    return entries


def _check_model(model: object, source: str) -> None:
    if not isinstance(model, str) or not model:
        raise ConfigurationError(f"{source}: a model name is empty (entries are MODEL=URL)")
    try:
        keys.check_model_name(model)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{source}: {exc}") from None


def _check_url(url: object, where: str) -> None:
    if not isinstance(url, str) or not url:
        raise ConfigurationError(f"{where}: the Redis URL is empty or not a string")
    try:
        check_redis_url(url)
        check_tls_options(url)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{where}: {exc}") from None
