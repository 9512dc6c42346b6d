"""``ortq worker --provider-option KEY=VALUE``: options for the execution provider, passed after the
ones ortq sets itself, and the check that the provider really took them.

ONNX Runtime is not consistent about options it does not know: the CPU EP ignores every option
(``get_provider_options()`` reports none), plugin EPs report back whatever they were given, and
CUDA refuses a key it does not know when the session is made ("Unknown provider option", from its
options parser) and reports its whole configuration afterwards. So a refusal of ONNX Runtime's is
this error too (no CPU fallback: the option is wrong on any adapter), and after the session is
created the worker reads ``session.get_provider_options()`` for its EP and refuses to start
(``ProviderOptionRejected``, exit 2) unless each option given is there with the value given: a
misspelt ``use_tf32`` is then an error at start, not a silent no-op (docs/adapters.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ortq.errors import ProviderOptionRejected

Options = tuple[tuple[str, str], ...]

#: Options ortq sets from its own flags, per provider, and the flag to use instead. A user's option of
#: the same key is refused rather than let win: it would move the session to another adapter than the
#: one the worker resolved, published and was planned on (``ortq pool``).
OWNED = {
    "cuda": {"device_id": "--adapter"},
    "dml": {"device_id": "--adapter", "performance_preference": "--adapter", "device_filter": "--adapter"},
}
#: Providers whose EP is chosen by ONNX Runtime (or Windows ML's catalog) while the session is made,
#: so that there is no EP to give options to beforehand.
NO_OPTIONS = {"auto": "ONNX Runtime chooses the EP", "winml": "Windows ML's catalog chooses the EPs"}

# ONNX Runtime's words when its options parser (provider_options_utils.h) refuses an option.
_RUNTIME_REFUSALS = ("Unknown provider option", "Failed to parse provider option")

# What a value may be reported as for what was given: ONNX Runtime's parsers read these as one boolean.
_BOOLEANS = {"true": "1", "false": "0", "1": "1", "0": "0"}


def parse(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` (the value may itself hold ``=``) as a pair; ProviderOptionRejected otherwise."""
    key, sep, value = text.partition("=")
    if not sep:
        raise ProviderOptionRejected(f"--provider-option {text!r}: expected KEY=VALUE")
    return key, value


def check(provider: str, options: Iterable[tuple[object, object]]) -> Options:
    """``options`` checked for ``provider``: keys non-empty strings without '=' or whitespace, each once,
    values non-empty strings, no key ortq sets itself. Returns them as a tuple of pairs."""
    pairs = tuple(options)
    if pairs and provider in NO_OPTIONS:
        raise ProviderOptionRejected(
            f"--provider-option does not apply to --provider {provider}: {NO_OPTIONS[provider]}"
        )
    checked: list[tuple[str, str]] = []
    for key, value in pairs:
        if not isinstance(key, str) or not key or "=" in key or any(c.isspace() for c in key):
            raise ProviderOptionRejected(
                f"provider option key {key!r}: must be a non-empty string without '=' or spaces"
            )
        if not isinstance(value, str) or not value:
            raise ProviderOptionRejected(f"provider option {key}: the value must be a non-empty string, got {value!r}")
        if any(key == earlier for earlier, _ in checked):
            raise ProviderOptionRejected(f"provider option {key} is given twice")
        flag = OWNED.get(provider, {}).get(key)
        if flag is not None:
            raise ProviderOptionRejected(
                f"provider option {key} is set by ortq from {flag} for --provider {provider}: use {flag} instead"
            )
        checked.append((key, value))
    return tuple(checked)


def merged(own: Mapping[str, str], given: Options) -> dict[str, str]:
    """ortq's own options, then the user's; a user's option that ortq sets too is refused (the plan's
    own options can include some that :data:`OWNED` does not list for every case, such as DirectML's
    preference where adapters could not be enumerated)."""
    for key, _ in given:
        if key in own:
            raise ProviderOptionRejected(
                f"provider option {key} is set by ortq for this adapter ({key}={own[key]}): use --adapter instead"
            )
    return {**own, **dict(given)}


def refused_by_runtime(message: str, given: Options) -> ProviderOptionRejected | None:
    """The error for ONNX Runtime's ``message`` when it refused one of ``given`` while making the
    session; None for any other failure (or when no option was given: then it was ortq's own)."""
    if not given or not any(words in message for words in _RUNTIME_REFUSALS):
        return None
    return ProviderOptionRejected(f"ONNX Runtime refused a --provider-option: {message.strip()}")


def _same(reported: str, given: str) -> bool:
    if reported == given:
        return True
    return _BOOLEANS.get(given.strip().lower(), given) == _BOOLEANS.get(reported.strip().lower(), reported)


def not_taken(given: Options, reported: Mapping[str, Any]) -> list[str]:
    """Each of ``given`` that ``reported`` (the EP's entry of ``session.get_provider_options()``) lacks
    or holds with another value, described for a message; empty when every one was taken."""
    missing = []
    for key, value in given:
        if key not in reported:
            missing.append(f"{key}={value} (not among the options it reports)")
        elif not _same(str(reported[key]), value):
            missing.append(f"{key}={value} (it reports {key}={reported[key]})")
    return missing


def check_taken(session: Any, ep: str, given: Options) -> dict[str, str]:
    """Raise ProviderOptionRejected unless ``session``'s ``ep`` reports every option of ``given``;
    returns them as it reports them (published in the worker's record)."""
    if not given:
        return {}
    reported = session.get_provider_options().get(ep, {})
    missing = not_taken(given, reported)
    if missing:
        known = ", ".join(sorted(reported)) or "none"
        raise ProviderOptionRejected(
            f"{ep} did not take --provider-option {'; '.join(missing)}. ONNX Runtime ignores options a provider "
            f"does not know, so this one would have no effect; the options {ep} reports: {known}"
        )
    return {key: str(reported[key]) for key, _ in given}
