"""rq-dashboard's templates as ortq serves them: every value escaped, a CSRF token, a CSP nonce.

rq-dashboard 0.9 fills its pages in the browser: its scripts fetch JSON and render it with
underscore templates, whose ``<%= value %>`` inserts ``value`` as raw HTML (``<%- value %>``
escapes it). Queue names, a job's id, description, origin, status, result, meta and exception
text, and worker names and versions all went in raw: a queue name or a job field written to
Redis ran as script in the operator's browser, with the dashboard's rights. Its Jinja includes
named ``*.js`` were rendered without autoescaping, and one puts the queue name from the URL into
a JavaScript string.

:class:`PatchedTemplates` serves rq-dashboard's own templates with these changes, made when the
app is created (not copies of them: what it patches is what the installed rq-dashboard ships):

* every ``<%=`` becomes ``<%-`` (two places escaped by hand, with jQuery, lose that step);
* the one JavaScript string built from a Jinja value uses ``|tojson``;
* the inline script carries the response's CSP nonce (ortq.dashboard.guard), and the CSRF
  token is written into the page instead of being read from a cookie (rq-dashboard's script
  sends it with every jQuery request as ``X-CSRFToken``);
* a banner shows why a request failed (a refused requeue, a record that cannot be read), and job
  and worker rows show their ``unreadable`` notes (ortq.dashboard.rqviews);
* ortq jobs (``requeue_refused`` in their JSON) and ortq queues show no Requeue / Requeue All
  button: ortq refuses every such requeue (an ended job's request tensors are gone).

It refuses to start if a change no longer applies or if, once patched, any template still has a
raw ``<%=``, a Jinja value in a script that is not ``|tojson``, or a ``|safe`` that does not
follow ``tojson`` (:func:`check`). The app renders every template with autoescaping on.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import rq_dashboard
from jinja2 import BaseLoader, Environment, TemplateNotFound
from rq_dashboard.version import VERSION as RQ_DASHBOARD_VERSION

from ortq import keys
from ortq.errors import ConfigurationError

TEMPLATE_DIR = Path(rq_dashboard.__file__).parent / "templates"
NAMESPACE = "rq_dashboard"

#: ``<%= $('<div/>').text(VALUE).html() %>``: escaped by hand; ``<%- VALUE %>`` says the same.
_HAND_ESCAPED = re.compile(r"<%=\s*\$\('<div/>'\)\.text\((.+?)\)\.html\(\)\s*%>")
_JINJA_VALUE = re.compile(r"\{\{(.*?)\}\}", re.S)
#: Jinja values allowed in a script without ``|tojson``: numbers from the app's own config.
_SCRIPT_NUMBERS = {"poll_interval"}

_PROBLEM_BANNER = '<div id="ortq-problem" class="alert alert-danger" role="alert" style="display: none"></div>\n'
_PROBLEM_SCRIPT = """
// ortq: say why an action or a data request failed (a refused requeue, a record that cannot be read).
$(document).ajaxError(function(event, xhr, settings) {
    if (settings.type !== 'POST' && xhr.status < 400) { return; }
    var body = xhr.responseJSON || {};
    var why = body.message || (xhr.status ? xhr.status + ' ' + xhr.statusText : 'no answer');
    $('#ortq-problem').text(settings.type + ' ' + settings.url + ': ' + why).attr('data-method', settings.type).show();
});
$(document).ajaxSuccess(function(event, xhr, settings) {
    if ($('#ortq-problem').attr('data-method') === settings.type) { $('#ortq-problem').hide(); }
});
"""
_UNREADABLE_ROW = (
    '<% if (d.unreadable) { %><div class="text-danger" data-role="unreadable">not readable: <%- d.unreadable %></div>'
    "<% } %>"
)


@dataclass(frozen=True)
class Patch:
    """Replace ``old`` (exactly once) in rq-dashboard's template ``template``."""

    template: str
    old: str
    new: str


PATCHES = (
    Patch(
        "base.html", '<script type="text/javascript">\n', '<script type="text/javascript" nonce="{{ csp_nonce }}">\n'
    ),
    Patch("base.html", '<div class="container">', _PROBLEM_BANNER + '        <div class="container">'),
    Patch(
        "inline_js.html",
        '{% include "rq_dashboard/scripts/dashboard.js" with context %}',
        '{% include "rq_dashboard/scripts/dashboard.js" with context %}' + _PROBLEM_SCRIPT,
    ),
    Patch("scripts/dashboard.js", 'var CSRF = getCookie("_csrf_token");', "var CSRF = {{ csrf_token|tojson }};"),
    Patch("scripts/jobs.js", "$(this).val('{{ queue.name }}');", "$(this).val({{ queue.name|tojson }});"),
    Patch("jobs.html", '<div class="job_id">', _UNREADABLE_ROW + '\n                <div class="job_id">'),
    Patch(
        "job.html",
        '<script name="job-info" type="text/template">\n        <span class="col-6">\n',
        '<script name="job-info" type="text/template">\n        <span class="col-6">\n'
        '            <% if (d.unreadable) { %><p class="text-danger" data-role="unreadable">'
        "<strong>Not readable</strong>:<br><%- d.unreadable %></p><% } %>\n",
    ),
    Patch("workers.html", "<%= d.name %>\n", "<%= d.name %>\n" + _UNREADABLE_ROW + "\n"),
    # No Requeue buttons where ortq refuses every requeue (rqviews.requeue_refusal): an ortq job's row
    # and page (``requeue_refused`` in its JSON), and an ortq queue's "Requeue All".
    Patch(
        "jobs.html",
        '<% if (d.exc_info) { %>\n                <a href="#" data-role="requeue-job-btn"',
        '<% if (d.exc_info && !d.requeue_refused) { %>\n                <a href="#" data-role="requeue-job-btn"',
    ),
    Patch(
        "jobs.html",
        "{% if registry_name == 'failed' %}\n        <a href=\"{{ url_for('rq_dashboard.requeue_all'",
        f"{{% if registry_name == 'failed' and not queue.name.startswith({keys.PREFIX!r}) %}}\n"
        "        <a href=\"{{ url_for('rq_dashboard.requeue_all'",
    ),
    Patch("scripts/job.js", 'if (job.status === "failed") {', 'if (job.status === "failed" && !job.requeue_refused) {'),
)


def escape_all(source: str) -> str:
    """Every underscore interpolation of ``source`` escaped."""
    return _HAND_ESCAPED.sub(r"<%- \1 %>", source).replace("<%=", "<%-")


def check(name: str, source: str) -> None:
    """Refuse a patched template that could still put a value into a page unescaped."""
    problems = []
    if "<%=" in source:
        problems.append("an unescaped underscore interpolation (<%=)")
    if re.search(r"autoescape\s+false", source):
        problems.append("autoescape turned off")
    for match in _JINJA_VALUE.finditer(source):
        value = match.group(1).strip()
        if re.search(r"\|\s*safe", value) and not re.search(r"\|\s*tojson\s*\|\s*safe$", value):
            problems.append(f"{{{{ {value} }}}} marked safe")
        in_script = name.endswith(".js") or name == "inline_js.html"
        if in_script and "tojson" not in value and value not in _SCRIPT_NUMBERS:
            problems.append(f"{{{{ {value} }}}} in a script without |tojson")
    if problems:
        raise ConfigurationError(
            f"rq-dashboard {RQ_DASHBOARD_VERSION}: template {name} has {'; '.join(problems)}: ortq would serve it "
            "unsafe (it was checked on rq-dashboard 0.9)"
        )


def apply(sources: dict[str, str], patches: tuple[Patch, ...] = PATCHES) -> dict[str, str]:
    """``sources`` (templates by name under rq_dashboard/) with ``patches`` applied, every
    interpolation escaped, and :func:`check` passed; ConfigurationError when a patch does not apply."""
    patched = dict(sources)
    for patch in patches:
        found = patched.get(patch.template, "").count(patch.old)
        if found != 1:
            raise ConfigurationError(
                f"rq-dashboard {RQ_DASHBOARD_VERSION}: template {patch.template} has {found} copies of what ortq "
                f"patches ({patch.old.strip()[:60]!r}), not one (it was checked on rq-dashboard 0.9)"
            )
        patched[patch.template] = patched[patch.template].replace(patch.old, patch.new)
    for name, source in patched.items():
        patched[name] = escape_all(source)
        check(name, patched[name])
    return patched


def shipped_sources() -> dict[str, str]:
    """The installed rq-dashboard's templates, by name under rq_dashboard/."""
    folder = TEMPLATE_DIR / NAMESPACE
    return {str(path.relative_to(folder)): path.read_text() for path in sorted(folder.rglob("*")) if path.is_file()}


@cache
def patched_sources() -> dict[str, str]:
    """rq-dashboard's templates by their Jinja name (``rq_dashboard/...``), patched and checked."""
    return {f"{NAMESPACE}/{name}": source for name, source in apply(shipped_sources()).items()}


class PatchedTemplates(BaseLoader):
    """A Jinja loader of rq-dashboard's templates as :func:`patched_sources` makes them."""

    def __init__(self) -> None:
        self.sources = patched_sources()

    def get_source(self, environment: Environment, template: str) -> tuple[str, str | None, Callable[[], bool]]:
        if template not in self.sources:
            raise TemplateNotFound(template)
        return self.sources[template], None, lambda: True
