"""deploy/k8s/keda-*.yaml and the scaler's Redis user (docs/security.md, section 6).

The KEDA objects are checked against models generated from KEDA's CRDs (the cloudcoil-models-keda
package, KEDA 2.16), strictly: a field the CRD does not have fails, as a misspelt one must. The
Kubernetes Job inside the ScaledJob is checked by kubernetes-validate like tests/test_deploy.py's
manifests. The ACL rule is read from docs/security.md and tried on a real redis-server, with a Lua
script written here from what KEDA's redis scaler documents it evaluates at each poll.

No Kubernetes cluster or KEDA operator runs here: what KEDA does with these objects is not tested.
"""

from __future__ import annotations

import copy
import hashlib
import re
import secrets
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis

from ortq import keys
from ortq.errors import EXIT_CONFIGURATION, EXIT_DEVICE_LOST
from ortq.exporter import DEFAULT_PORT, exporter
from ortq.localredis import LocalRedis
from ortq.producer import Producer
from ortq.rqcompat import layout
from ortq.settings import Settings
from tests.conftest import REPO
from tests.test_deploy import KUBERNETES_VERSION, load_yaml_documents, ortq_variables

K8S = REPO / "deploy" / "k8s"
SECURITY = REPO / "docs" / "security.md"
MODEL = "digits"  # the model the example objects scale

#: What KEDA's redis scaler EVALs at each poll (its documentation and pkg/scalers/redis_scaler.go
#: describe it; written here from that description): the watched key's TYPE picks the command that
#: counts it, LLEN for a list or no key.
KEDA_SCRIPT = """
local kind = redis.call('TYPE', KEYS[1])['ok']
local counter = {list = 'LLEN', none = 'LLEN', zset = 'ZCARD', set = 'SCARD', hash = 'HLEN'}
return redis.call(counter[kind], KEYS[1])
"""


#: Redis's words for an ACL refusal: of a command, of a key, or of either inside a script.
REFUSED = re.compile(r"no permissions|NOPERM|can't run this command|no permissions to access", re.I)


def keda_documents() -> dict[str, dict[str, Any]]:
    """Every KEDA object of deploy/k8s by kind (one of each)."""
    found = [d for p in sorted(K8S.glob("keda-*.yaml")) for d in load_yaml_documents(p)]
    objects = [d for d in found if d["apiVersion"].startswith("keda.sh/")]
    kinds = [d["kind"] for d in objects]
    assert sorted(kinds) == ["ScaledJob", "ScaledObject", "TriggerAuthentication"]
    return {d["kind"]: d for d in objects}


def keda_model(kind: str) -> Any:
    models = pytest.importorskip("cloudcoil.models.keda.v1alpha1", reason="cloudcoil-models-keda: the test extra")
    return getattr(models, kind)


def strictly_valid(document: dict[str, Any]) -> None:
    """``document`` validated by the model of its kind, and nothing in it dropped: the models ignore
    unknown fields, so a round trip that loses one is a field KEDA's CRD does not have.

    Containers' ``resources`` are left to kubernetes-validate (below): the generated models refuse
    every whole-number quantity (``cpu: 1``, ``"1"``, ``nvidia.com/gpu: 1``), a pattern applied to
    an int."""
    document = copy.deepcopy(document)
    for container in _containers(document):
        container.pop("resources", None)
    model = keda_model(document["kind"]).model_validate(document)
    dumped = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert dumped == document, f"not in KEDA's CRD: {_differences(document, dumped)}"


def _containers(document: dict[str, Any]) -> list[dict[str, Any]]:
    template = document.get("spec", {}).get("jobTargetRef", {}).get("template", {})
    containers: list[dict[str, Any]] = template.get("spec", {}).get("containers", [])
    return containers


def _differences(wanted: Any, got: Any, where: str = "") -> list[str]:
    if isinstance(wanted, dict) and isinstance(got, dict):
        return [d for k in wanted for d in _differences(wanted[k], got.get(k), f"{where}.{k}")]
    if isinstance(wanted, list) and isinstance(got, list) and len(wanted) == len(got):
        return [
            d for i, (w, g) in enumerate(zip(wanted, got, strict=True)) for d in _differences(w, g, f"{where}[{i}]")
        ]
    return [] if wanted == got else [where or "."]


def test_the_keda_objects_fit_kedas_crds() -> None:
    documents = keda_documents()
    scaled_object = documents["ScaledObject"]
    misspelt = copy.deepcopy(scaled_object)
    misspelt["spec"]["pollingIntervall"] = 5
    with pytest.raises(AssertionError, match="pollingIntervall"):
        strictly_valid(misspelt)
    numeric = copy.deepcopy(scaled_object)
    numeric["spec"]["triggers"][0]["metadata"]["listLength"] = 4  # KEDA's metadata values are strings
    with pytest.raises(ValueError, match="listLength"):
        strictly_valid(numeric)
    no_target = copy.deepcopy(documents["ScaledJob"])
    del no_target["spec"]["jobTargetRef"]
    with pytest.raises(ValueError, match="jobTargetRef"):
        strictly_valid(no_target)
    for document in documents.values():
        strictly_valid(document)


def test_the_scaled_jobs_job_passes_kubernetes_validate() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="in the dev extras")
    spec = keda_documents()["ScaledJob"]["spec"]["jobTargetRef"]
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "ortq-digits-burst-x"}, "spec": spec}
    broken = copy.deepcopy(job)
    broken["spec"]["podFailurePolicy"]["rules"][0]["onExitCode"] = broken["spec"]["podFailurePolicy"]["rules"][0].pop(
        "onExitCodes"
    )
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)


def test_the_keda_objects_fit_ortq_and_each_other() -> None:
    documents = keda_documents()
    [deployment] = [d for d in load_yaml_documents(K8S / "digits.yaml") if d["kind"] == "Deployment"]
    [secret] = [d for d in load_yaml_documents(K8S / "keda-auth.example.yaml") if d["kind"] == "Secret"]
    workers_env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert workers_env["ORTQ_MODEL_NAME"] == MODEL
    queue = layout.QueueKeys.of(keys.queue_name(MODEL))
    # The jobs parked for the Deployment's version: the list its workers take before the queue.
    parked = keys.parked_key(MODEL, str(workers_env["ORTQ_MODEL_VERSION"]))

    scaled = documents["ScaledObject"]["spec"]
    assert scaled["scaleTargetRef"]["kind"] == deployment["kind"]
    assert scaled["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert scaled["minReplicaCount"] == 0  # scale to zero
    lists = {t["name"]: t["metadata"]["listName"] for t in scaled["triggers"]}
    assert lists == {"pending": keys.queue_key(MODEL), "running": queue.started, "parked": parked}

    job = documents["ScaledJob"]["spec"]
    pod = job["jobTargetRef"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["args"] == ["worker", "--burst"]
    env = {e["name"]: e for e in container["env"]}
    assert set(env) <= ortq_variables() and env["ORTQ_MODEL_NAME"]["value"] == MODEL
    burst_parked = keys.parked_key(MODEL, env["ORTQ_MODEL_VERSION"]["value"])
    assert [t["metadata"]["listName"] for t in job["triggers"]] == [keys.queue_key(MODEL), burst_parked]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    policy = job["jobTargetRef"]["podFailurePolicy"]["rules"]
    rules = {(r["action"], tuple(r["onExitCodes"]["values"])): r for r in policy if "onExitCodes" in r}
    assert set(rules) == {("FailJob", (EXIT_CONFIGURATION,)), ("Ignore", (EXIT_DEVICE_LOST,))}
    assert all(r["onExitCodes"]["containerName"] == container["name"] for r in rules.values())

    auth = documents["TriggerAuthentication"]
    references = {t["authenticationRef"]["name"] for t in [*scaled["triggers"], *job["triggers"]]}
    assert references == {auth["metadata"]["name"]}
    for target in auth["spec"]["secretTargetRef"]:
        assert target["name"] == secret["metadata"]["name"] and target["key"] in secret["stringData"]
    assert {t["parameter"] for t in auth["spec"]["secretTargetRef"]} == {"address", "username", "password"}
    assert secret["stringData"]["username"] == "ortq-keda"  # the user of docs/security.md


def test_the_exporter_manifest_and_scrape_config_fit_the_command() -> None:
    [deployment, service] = load_yaml_documents(K8S / "exporter.yaml")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    context = exporter.make_context("exporter", list(container["args"][1:]))  # the real command parses them
    assert container["args"][0] == "exporter" and context.params["host"] == "0.0.0.0"
    port = context.params["port"]
    assert port == DEFAULT_PORT == container["ports"][0]["containerPort"] == service["spec"]["ports"][0]["port"]
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(port)
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    [prometheus] = load_yaml_documents(REPO / "deploy" / "prometheus" / "prometheus.yml")
    [job] = [j for j in prometheus["scrape_configs"] if j["job_name"] == "ortq-exporter"]
    assert [t for c in job["static_configs"] for t in c["targets"]] == [f"exporter:{port}"]
    [compose] = load_yaml_documents(REPO / "deploy" / "docker" / "docker-compose.yml")
    assert compose["services"]["exporter"]["command"] == container["args"]


# --- the scaler's Redis user, on a real Redis -----------------------------------------------------


def documented_rules(user: str) -> str:
    """The rules docs/security.md gives ``user``, exactly as written there."""
    [rules] = re.findall(rf"^user {re.escape(user)} on #<sha256 of its password> (.+)$", SECURITY.read_text(), re.M)
    return str(rules)


class Scaler:
    """A Redis with the documented scaler users, an admin connection, and queued jobs of MODEL."""

    def __init__(self, server: LocalRedis) -> None:
        self.server = server
        self.admin = redis.Redis.from_url(server.url)
        self.passwords: dict[str, str] = {}

    def add_user(self, user: str, rules: str) -> None:
        password = secrets.token_hex(8)
        digest = hashlib.sha256(password.encode()).hexdigest()  # as the aclfile holds it
        self.admin.execute_command("ACL", "SETUSER", user, "reset", "on", f"#{digest}", *rules.split())
        self.passwords[user] = password

    def client(self, user: str, **options: Any) -> redis.Redis:
        return redis.Redis(port=self.server.port, username=user, password=self.passwords[user], **options)

    def refusals(self, user: str) -> list[dict[str, Any]]:
        return [e for e in self.admin.acl_log(count=1000) if e["username"] == user]


@pytest.fixture(scope="module")
def scaler() -> Iterator[Scaler]:
    with LocalRedis() as server:
        ours = Scaler(server)
        ours.add_user("ortq-keda", documented_rules("ortq-keda"))
        ours.add_user("keda-digits", documented_rules("keda-digits"))
        try:
            yield ours
        finally:
            ours.admin.close()


def queued_jobs(scaler: Scaler, model: str, count: int) -> list[str]:
    """``count`` real jobs of ``model`` enqueued by ortq's producer (no worker: allow_unknown_models)."""
    with Producer(settings=Settings.from_url(scaler.server.url), allow_unknown_models=True) as producer:
        jobs = producer.submit_many(model, [{"x": np.ones((1, 4), np.float32)}] * count)
    return [job.id for job in jobs]


def test_the_scaler_user_reads_the_depths_kedas_script_reads(scaler: Scaler) -> None:
    queued_jobs(scaler, MODEL, 3)
    started = layout.QueueKeys.of(keys.queue_name(MODEL)).started
    scaler.admin.zadd(started, {"job-a:exec-1": 1e12, "job-b:exec-2": 1e12})  # as start.lua writes them
    parked = keys.parked_key(MODEL, "v1")
    scaler.admin.rpush(parked, "job-c", "job-d", "job-e", "job-f")  # as start.lua parks pinned jobs
    scaler.admin.acl_log_reset()
    for user in ("ortq-keda", "keda-digits"):
        # go-redis (KEDA's client) says HELLO 3 with the user's credentials, PINGs, SELECTs its db.
        with scaler.client(user, protocol=3, db=0) as client:
            assert client.ping()
            assert client.eval(KEDA_SCRIPT, 1, keys.queue_key(MODEL)) == 3
            assert client.eval(KEDA_SCRIPT, 1, started) == 2
            assert client.eval(KEDA_SCRIPT, 1, parked) == 4
            if user == "ortq-keda":  # a model with no queue yet: no key, LLEN says 0
                assert client.eval(KEDA_SCRIPT, 1, keys.queue_key("never-used")) == 0
    assert scaler.refusals("ortq-keda") == [] and scaler.refusals("keda-digits") == []


def test_eval_needs_read_write_key_patterns(scaler: Scaler) -> None:
    """Why the rule says ``~`` and not ``%R~``: Redis checks EVAL's declared keys for writing too."""
    read_only = documented_rules("ortq-keda").replace(" ~rq:", " %R~rq:")
    scaler.add_user("keda-read-only", read_only)
    with scaler.client("keda-read-only") as client, pytest.raises(redis.exceptions.NoPermissionError):
        client.eval(KEDA_SCRIPT, 1, keys.queue_key(MODEL))


def test_the_scaler_user_is_refused_writes_frames_and_other_keys(scaler: Scaler) -> None:
    [job_id] = queued_jobs(scaler, MODEL, 1)
    queue, request = keys.queue_key(MODEL), keys.request_key(MODEL, job_id)
    started = layout.QueueKeys.of(keys.queue_name(MODEL)).started
    depth = scaler.admin.llen(queue)
    scaler.admin.acl_log_reset()
    refused: dict[str, tuple[Any, ...]] = {
        "push onto the queue": ("RPUSH", queue, "forged"),
        "delete the queue": ("DEL", queue),
        "pop a job": ("LPOP", queue),
        "list the queued ids": ("LRANGE", queue, 0, -1),
        "read the head id": ("LINDEX", queue, 0),
        "list the running ids": ("ZRANGE", started, 0, -1),
        "list the parked ids": ("LRANGE", keys.parked_key(MODEL, "v1"), 0, -1),
        "take a parked id": ("LPOP", keys.parked_key(MODEL, "v1")),
        "write the started registry": ("ZADD", started, 1, "forged"),
        "read a request frame": ("GET", request),
        "read a job hash": ("HGETALL", keys.job_key(job_id)),
        "read a reply": ("XREAD", "STREAMS", keys.reply_key(MODEL, job_id), "0-0"),
        "list key names": ("SCAN", 0),
        "list keys": ("KEYS", "*"),
        "write a key": ("SET", "rq:queue:ortq:x", "y"),
        "run ortq's function": ("FCALL", "ortq_enqueue_high_v2", 1, queue),
        "publish a command": ("PUBLISH", "rq:pubsub:w", "{}"),
        "flush": ("FLUSHALL",),
        "a script naming a request frame": ("EVAL", KEDA_SCRIPT, 1, request),
        "a script reading a frame": ("EVAL", f"return redis.call('GET', '{request}')", 0),
        "a script writing the queue": ("EVAL", "return redis.call('RPUSH', KEYS[1], 'x')", 1, queue),
        "a script deleting the queue": ("EVAL", "return redis.call('DEL', KEYS[1])", 1, queue),
        "a script listing the ids": ("EVAL", "return redis.call('LRANGE', KEYS[1], 0, -1)", 1, queue),
    }
    with scaler.client("ortq-keda") as client:
        for what, command in refused.items():
            with pytest.raises(redis.exceptions.ResponseError) as caught:
                client.execute_command(*command)
            assert REFUSED.search(str(caught.value)), (what, caught.value)
    assert scaler.admin.llen(queue) == depth and scaler.admin.exists(request) == 1  # nothing changed
    # Every refusal logged (the log merges repeats of one command into one entry with a count).
    assert sum(entry["count"] for entry in scaler.refusals("ortq-keda")) >= len(refused)
    with scaler.client("keda-digits") as client:  # the per-model rule: its model only
        for key in (keys.queue_key("another-model"), keys.parked_key("another-model", "v1")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.eval(KEDA_SCRIPT, 1, key)


def test_a_watched_key_of_the_wrong_type_is_an_error_not_a_count(scaler: Scaler) -> None:
    queue = keys.queue_key("wrong-typed")
    scaler.admin.hset(queue, "not", "a list")  # KEDA's script would count it with HLEN
    with scaler.client("ortq-keda") as client, pytest.raises(redis.exceptions.ResponseError):
        client.eval(KEDA_SCRIPT, 1, queue)
