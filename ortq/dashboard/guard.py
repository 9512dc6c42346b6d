"""Who may use the dashboard, and how a state-changing request must look.

Checked on every request, before any view runs, in this order:

1. **Host.** When the dashboard listens on a loopback address, or ``--allowed-host`` names the
   hosts it is reached by, a request whose ``Host`` header names another host is refused (400).
   That stops DNS rebinding: a web page whose own name is made to resolve to the dashboard's
   address would otherwise be same-origin with it, and pass every check below.
2. **Authentication** (``--auth user:password`` or ``$ORTQ_DASHBOARD_AUTH``): HTTP Basic, both
   parts compared in constant time; anything else is a 401. A client address that keeps sending
   wrong logins is locked out for a while (429; ortq.dashboard.throttle).
3. **State changes** are every route that accepts POST (rq-dashboard's delete, requeue, empty,
   compact). They must be a POST (405 otherwise: ``GET /rq/requeue/<queue>`` used to fire from an
   ``<img>``), come from the dashboard's own origin (``Origin``, else ``Referer``, must name the
   request's host; a browser's ``Sec-Fetch-Site`` must be same-origin) and carry the CSRF token
   (the ``X-CSRFToken`` header rq-dashboard's script sends, or a ``csrf_token`` form field): 403
   otherwise. The token is random per process; pages get it from :func:`page_values`.

Every answer gets a Content-Security-Policy (scripts only from the dashboard itself, plus the one
inline script that carries the response's nonce; no framing), ``nosniff`` and no caching.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from flask import Flask, Response, g, request

from ortq.dashboard.throttle import LoginThrottle
from ortq.errors import ConfigurationError

log = logging.getLogger(__name__)

#: Names of this machine that DNS rebinding cannot take: always allowed in the Host header.
LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
#: Environment variable read when ``--auth`` is not given.
AUTH_ENV = "ORTQ_DASHBOARD_AUTH"
CSRF_HEADER = "X-CSRFToken"
CSRF_FIELD = "csrf_token"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# rq-dashboard renders its pages with underscore templates, which compile with Function():
# 'unsafe-eval'. Bootstrap's selects use data: images; its markup has style attributes.
_CSP = (
    "default-src 'self'; script-src 'self' 'nonce-{nonce}' 'unsafe-eval'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)


@dataclass(frozen=True)
class Access:
    """Who may use the dashboard: ``credentials`` (user, password) or None for anyone who can
    reach it; ``hosts``: the Host header names it answers to, or None for any."""

    credentials: tuple[str, str] | None = None
    hosts: frozenset[str] | None = None

    @classmethod
    def for_listener(cls, listen_host: str, auth: str | None, allowed_hosts: Iterable[str] = ()) -> Access:
        """What ``ortq dashboard --host listen_host --auth auth --allowed-host ...`` allows. The Host
        header is checked when listening on loopback only, or when ``allowed_hosts`` are given."""
        named = {_host_name(h) for h in allowed_hosts}
        checked = bool(named) or is_loopback(listen_host)
        listening = set() if _is_wildcard(listen_host) else {_host_name(listen_host)}
        hosts = frozenset(LOOPBACK_HOSTS | named | listening)
        return cls(parse_credentials(auth) if auth else None, hosts if checked else None)


def parse_credentials(value: str) -> tuple[str, str]:
    """``user:password`` (the password may hold colons) as (user, password)."""
    user, colon, password = value.partition(":")
    if not colon or not user or not password:
        raise ConfigurationError(f"--auth / ${AUTH_ENV} must be USER:PASSWORD, both non-empty")
    return user, password


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_wildcard(host: str) -> bool:
    return host.strip("[]") in ("", "0.0.0.0", "::")


def _host_name(host_header: str) -> str:
    """The host of a ``Host`` header or URL netloc, without port or IPv6 brackets, lower case."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _refuse(status: int, message: str, **headers: str) -> Response:
    log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote_addr, message)
    return Response(message + "\n", status, mimetype="text/plain", headers=headers)


def _same_origin() -> str | None:
    """Why this request does not come from the dashboard's own pages, or None when it does (or
    comes from no browser: one sends Origin with every POST)."""
    fetch_site = request.headers.get("Sec-Fetch-Site")
    if fetch_site not in (None, "same-origin"):
        return f"Sec-Fetch-Site is {fetch_site}"
    source = request.headers.get("Origin") or request.headers.get("Referer")
    if source is None:
        return None
    try:
        netloc = urlsplit(source).netloc if source != "null" else ""
    except ValueError:  # e.g. "http://[": not a URL
        netloc = ""
    if netloc.lower() != request.host.lower():
        return f"it comes from {source!r}, not from this dashboard ({request.host})"
    return None


def install(app: Flask, access: Access, throttle: LoginThrottle | None = None) -> None:
    """Check every request of ``app`` as this module says, and add the headers to every answer."""
    csrf_token = secrets.token_urlsafe(32)
    expected = None if access.credentials is None else tuple(part.encode() for part in access.credentials)
    throttle = throttle or LoginThrottle()

    @app.before_request
    def check_request() -> Response | None:
        g.csp_nonce = secrets.token_urlsafe(16)
        refusal = _wrong_host(access.hosts)
        if refusal is None and expected is not None:
            refusal = _failed_login(expected, throttle)
        if refusal is None:
            refusal = _refused_state_change(csrf_token)
        return refusal

    @app.context_processor
    def page_values() -> dict[str, Any]:
        """What every page's template may use: the CSRF token and the response's CSP nonce."""
        return {"csrf_token": csrf_token, "csp_nonce": g.get("csp_nonce", "")}

    app.after_request(_with_headers)


def _wrong_host(hosts: frozenset[str] | None) -> Response | None:
    """Check 1: the 400 for a ``Host`` header that names none of ``hosts`` (None: any host
    passes); None when the request passes."""
    if hosts is not None and _host_name(request.host) not in hosts:
        return _refuse(400, f"this dashboard does not answer to the host {request.host!r}; start it with "
                            f"--allowed-host {_host_name(request.host)} if that name is yours")  # fmt: skip
    return None


def _failed_login(expected: tuple[bytes, ...], throttle: LoginThrottle) -> Response | None:
    """Check 2: the 429 for a client locked out by ``throttle``, the 401 for a request without the
    ``expected`` (user, password), counted as a wrong login when it tried one; None when it logs in."""
    client = request.remote_addr
    if wait := throttle.retry_after(client):
        return _refuse(429, f"too many wrong logins from {client}: try again in {wait} s",
                       **{"Retry-After": str(wait)})  # fmt: skip
    given = request.authorization
    basic = given is not None and given.type == "basic"
    user, password = (given.username, given.password) if given is not None and basic else ("", "")
    user_ok = hmac.compare_digest((user or "").encode(), expected[0])
    password_ok = hmac.compare_digest((password or "").encode(), expected[1])
    if not (user_ok and password_ok):
        if basic:  # a login that was tried, not a browser's first request (it sends none)
            throttle.failed(client)
        return _refuse(401, "log in (HTTP Basic) with the --auth user and password",
                       **{"WWW-Authenticate": 'Basic realm="ortq dashboard", charset="UTF-8"'})  # fmt: skip
    throttle.succeeded(client)
    return None


def _refused_state_change(csrf_token: str) -> Response | None:
    """Check 3: the 405 or 403 for a request to a state-changing route that is no POST from the
    dashboard's own origin carrying ``csrf_token``; None for every other request."""
    rule = request.url_rule
    if rule is None or "POST" not in (rule.methods or ()):
        return None
    if request.method != "POST":
        return _refuse(405, "this changes state: POST only, from the dashboard's own pages", Allow="POST")
    wrong_origin = _same_origin()
    if wrong_origin is not None:
        return _refuse(403, f"cross-origin request refused: {wrong_origin}")
    token = request.headers.get(CSRF_HEADER) or request.form.get(CSRF_FIELD) or ""
    if not hmac.compare_digest(token.encode(), csrf_token.encode()):
        return _refuse(403, f"missing or wrong CSRF token ({CSRF_HEADER} header): reload the page")
    return None


def _with_headers(response: Response) -> Response:
    nonce = g.get("csp_nonce") or secrets.token_urlsafe(16)
    response.headers["Content-Security-Policy"] = _CSP.format(nonce=nonce)
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["Referrer-Policy"] = "same-origin"
    if request.endpoint not in ("static", "rq_dashboard.static"):  # rq-dashboard's scripts may be cached
        response.headers["Cache-Control"] = "no-store"
    return response
