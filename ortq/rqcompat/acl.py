"""Which command Redis's ACL refused inside one of ortq's scripts: a worker whose user lacks one
stops (exit 2) and says which, so that the operator can fix its rule (docs/security.md)."""

from __future__ import annotations

import hashlib
import re
from functools import cache

from ortq.rqcompat.book import SCRIPTS, script_source


@cache
def _script_lines() -> dict[str, list[str]]:
    """Each script's lines by its SHA1 (the id Redis's errors give it)."""
    sources = [script_source(name) for name in SCRIPTS]
    return {hashlib.sha1(source.encode()).hexdigest(): source.splitlines() for source in sources}


_NAMED = re.compile(r"no permissions to run the '([\w|]+)' command")  # Redis >= 7.2
_TAGGED = re.compile(r"can't run this command or subcommand \((\w+)\)")  # common.lua's unless_acl
_LOCATED = re.compile(r"script: ([0-9a-f]{40}), on @user_script:(\d+)")  # Redis 7.0, a redis.call
_CALL = re.compile(r"(?:call|write|remove)\(\s*'(\w+)'")


def refused_command(message: str) -> str | None:
    """The command an ACL refusal inside one of ortq's scripts was for, from Redis's error
    ``message``: Redis 7.2+ names it, common.lua's ``unless_acl`` names it for Redis 7.0, and a
    ``redis.call`` refused on 7.0 gives the script's line, where the call names it (None: not found)."""
    if found := _NAMED.search(message) or _TAGGED.search(message):
        return found.group(1).upper()
    located = _LOCATED.search(message)
    lines = _script_lines().get(located.group(1)) if located else None
    if located is None or lines is None:
        return None
    at = int(located.group(2)) - 1
    for line in reversed(lines[max(0, at - 3) : at + 1]):  # a call over several lines: from its first
        if called := _CALL.search(line):
            return called.group(1).upper()
    return None
