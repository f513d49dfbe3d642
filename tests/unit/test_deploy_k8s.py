"""The Kubernetes manifests in deploy/k8s are valid and wired together, checked offline.

Standard kinds are validated strictly (unknown fields rejected) against the Kubernetes JSON
schemas that the ``kubernetes-validate`` wheel ships; the KEDA ScaledObject, which has no schema
there, against a small schema of the fields we use. Then the cross-references a cluster would
only reveal at run time: selectors, ports, ConfigMap/Secret/PVC names, scale targets, queues.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler.infra.settings import Settings
from scheduler.jobs.models import QueueName

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"

try:  # the schemas come with the `kubernetes-validate` test extra; the other checks need only YAML
    import kubernetes_validate
except ImportError:  # pragma: no cover - the test extra installs it
    kubernetes_validate = None
needs_schemas = pytest.mark.skipif(
    kubernetes_validate is None, reason="kubernetes-validate (a test extra: make test) ships the schemas"
)


def _docs() -> list[tuple[str, dict[str, Any]]]:
    return [
        (path.name, doc)
        for path in sorted(K8S.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in _docs() if doc["kind"] == kind]


def _deployment(name: str) -> dict[str, Any]:
    (found,) = [d for d in _of_kind("Deployment") if d["metadata"]["name"] == name]
    return found


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    (container,) = _pod_spec(doc)["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


STANDARD_KINDS = {
    "NetworkPolicy",
    "Namespace",
    "ConfigMap",
    "Secret",
    "PersistentVolumeClaim",
    "Deployment",
    "Service",
    "Job",
    "PodDisruptionBudget",
}


@needs_schemas
@pytest.mark.parametrize(
    ("file_name", "doc"),
    [(f, d) for f, d in _docs() if d["kind"] in STANDARD_KINDS],
    ids=lambda v: v if isinstance(v, str) else v["metadata"]["name"],
)
def test_standard_manifests_match_the_kubernetes_schema(file_name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_every_manifest_kind_is_validated_somewhere() -> None:
    kinds = {doc["kind"] for _, doc in _docs()}
    assert kinds <= STANDARD_KINDS | {"ScaledObject", "Kustomization"}, kinds


@needs_schemas
def test_strict_validation_rejects_a_typo() -> None:
    """Guard the guard: a misspelt field must fail, or the test above proves nothing."""
    doc = _deployment("cloverq-api")
    broken = yaml.safe_load(yaml.safe_dump(doc))
    _container(broken)["livenessprobe"] = _container(broken).pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


SCALED_OBJECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {"name": {"type": "string"}, "kind": {"type": "string"}},
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "advanced": {"type": "object"},
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": {"const": "redis"},
                            "authenticationRef": {"type": "object"},
                            "metadata": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["address", "listName", "listLength"],
                                "properties": {
                                    "address": {"type": "string", "pattern": "^[a-z0-9.-]+:[0-9]+$"},
                                    "listName": {"type": "string"},
                                    "listLength": {"type": "string", "pattern": "^[0-9]+$"},
                                    "databaseIndex": {"type": "string", "pattern": "^[0-9]+$"},
                                    "activationListLength": {"type": "string", "pattern": "^[0-9]+$"},
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def test_keda_scaled_objects_scale_the_workers_on_their_own_queues() -> None:
    import jsonschema

    scaled = _of_kind("ScaledObject")
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == {"cloverq-worker", "cloverq-worker-joint"}
    for obj in scaled:
        jsonschema.validate(obj, SCALED_OBJECT_SCHEMA)
        spec = obj["spec"]
        target = _deployment(spec["scaleTargetRef"]["name"])
        consumed = _env(_container(target))["CLOVERQ_WORKER_QUEUES"].split(",")
        # With Celery's Redis transport (no priority steps) queue Q is the Redis list Q.
        assert sorted(t["metadata"]["listName"] for t in spec["triggers"]) == sorted(consumed)
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"], "no scale-to-zero: loads take minutes"


def test_workers_consume_every_job_queue_exactly_once() -> None:
    consumed: list[str] = []
    for name in ("cloverq-worker", "cloverq-worker-joint"):
        consumed += _env(_container(_deployment(name)))["CLOVERQ_WORKER_QUEUES"].split(",")
    assert sorted(consumed) == sorted(q.value for q in QueueName)
    assert _env(_container(_deployment("cloverq-worker-joint")))["CLOVERQ_WORKER_QUEUES"] == "joint"
    # Interactive work comes first in the shared worker's (priority-ordered) queue list.
    assert consumed[0] == QueueName.INTERACTIVE.value


@pytest.mark.parametrize("name", ["cloverq-worker", "cloverq-worker-joint"])
def test_gpu_workers_have_a_gpu_probes_and_a_grace_period(name: str) -> None:
    worker = _deployment(name)
    pod = _pod_spec(worker)
    container = _container(worker)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"].endswith("-cuda")
    # Torch's host threads match the CPU request (a pod's affinity is every core of the node).
    assert _env(container)["CLOVERQ_TORCH_THREADS"] == str(container["resources"]["requests"]["cpu"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in container, f"{name} lacks a {probe}"
    assert "--ready" in container["readinessProbe"]["exec"]["command"]
    assert "--ready" not in container["livenessProbe"]["exec"]["command"]
    # A long start budget: liveness only begins once the model is loaded and warm.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    # Running jobs finish on SIGTERM: the grace period covers the longest deadline of the queue.
    settings = Settings()
    queue_deadline = (
        settings.jobs.joint_deadline_seconds if name.endswith("joint") else settings.jobs.deadline_seconds
    )
    deadline = max(queue_deadline, settings.thinking.deadline_seconds)  # thinking jobs run on any queue
    assert pod["terminationGracePeriodSeconds"] >= deadline
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/models"].get("readOnly") is True, "workers never write the model store"
    assert worker["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_configured_deadlines_fit_the_worker_grace_periods() -> None:
    (config,) = [d for d in _of_kind("ConfigMap") if d["metadata"]["name"] == "cloverq-config"]
    data = config["data"]
    for name, key in (
        ("cloverq-worker", "CLOVERQ_JOB_DEADLINE_SECONDS"),
        ("cloverq-worker", "CLOVERQ_THINKING_DEADLINE_SECONDS"),
        ("cloverq-worker-joint", "CLOVERQ_JOINT_DEADLINE_SECONDS"),
        ("cloverq-worker-joint", "CLOVERQ_THINKING_DEADLINE_SECONDS"),
    ):
        grace = _pod_spec(_deployment(name))["terminationGracePeriodSeconds"]
        assert grace >= float(data[key]), (name, key)


def test_beat_runs_a_leader_and_a_standby_replaced_one_at_a_time() -> None:
    """Two beats (one leads by the lease, the other stands by); a rollout never stops both."""
    beat = _deployment("cloverq-beat")
    assert beat["spec"]["replicas"] == 2
    assert beat["spec"]["strategy"]["type"] == "RollingUpdate"
    assert beat["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 1, "maxSurge": 0}
    assert _container(beat)["command"] == ["cloverq", "beat"]
    assert not any(s["spec"]["scaleTargetRef"]["name"] == "cloverq-beat" for s in _of_kind("ScaledObject"))


def test_migrations_job_runs_cloverq_migrate() -> None:
    jobs = {j["metadata"]["name"]: j for j in _of_kind("Job")}
    migrate = jobs["cloverq-migrate"]
    assert _container(migrate)["command"] == ["cloverq", "migrate"]
    assert _pod_spec(migrate)["restartPolicy"] in {"OnFailure", "Never"}


def test_api_service_routes_to_the_api_pods() -> None:
    """One Service per plane, each to its named port of the API pods; probes on the ops port; the
    NetworkPolicy restricts the admin and ops ports and leaves the public one open."""
    services = {s["metadata"]["name"]: s for s in _of_kind("Service")
                if s["metadata"]["name"] != "otel-collector"}
    assert set(services) == {"cloverq-api", "cloverq-api-admin", "cloverq-api-ops"}
    api = _deployment("cloverq-api")
    labels = api["spec"]["template"]["metadata"]["labels"]
    assert api["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port_names = {p["name"] for p in _container(api)["ports"]}
    assert port_names == {"http", "admin", "ops"}
    for name, plane in (("cloverq-api", "http"), ("cloverq-api-admin", "admin"), ("cloverq-api-ops", "ops")):
        service = services[name]
        assert service["spec"]["selector"].items() <= labels.items()
        assert service["spec"]["type"] == "ClusterIP"
        assert [port["targetPort"] for port in service["spec"]["ports"]] == [plane]
    container = _container(api)
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] == "ops"
    (policy,) = _of_kind("NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    rules = {rule["ports"][0]["port"]: rule for rule in policy["spec"]["ingress"]}
    assert "from" not in rules[8000] and rules[8001]["from"] and rules[8002]["from"]


def test_references_resolve_and_pods_run_as_non_root() -> None:
    config_maps = {d["metadata"]["name"] for d in _of_kind("ConfigMap")}
    secrets = {d["metadata"]["name"] for d in _of_kind("Secret")}
    claims = {d["metadata"]["name"] for d in _of_kind("PersistentVolumeClaim")}
    namespaces = {d["metadata"]["name"] for d in _of_kind("Namespace")}
    assert namespaces and any(doc["kind"] in {"Deployment", "Job"} for _, doc in _docs())  # parsed
    for file_name, doc in _docs():
        if doc["kind"] in {"Namespace", "Kustomization"}:
            continue
        assert doc["metadata"]["namespace"] in namespaces, file_name
        if doc["kind"] not in {"Deployment", "Job"}:
            continue
        pod = _pod_spec(doc)
        assert pod["securityContext"]["runAsNonRoot"] is True, file_name
        assert pod["securityContext"]["runAsUser"] != 0, file_name
        for volume in pod.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, file_name
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, file_name
            assert ":" in container["image"] and not container["image"].endswith(":latest"), file_name
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in config_maps, file_name
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in secrets, file_name


def test_kustomization_lists_every_manifest_but_examples() -> None:
    (kustomization,) = [d for _, d in _docs() if d["kind"] == "Kustomization"]
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    examples = {"secret.example.yaml", "model-pull-job.yaml"}
    assert set(kustomization["resources"]) == files - examples


def test_the_collector_configmap_is_the_compose_collector_config() -> None:
    """deploy/k8s/otel-collector.yaml inlines deploy/otel/collector.yaml (kustomize cannot load a
    file outside its folder): the two must not drift."""
    (config_map,) = [d for _, d in _docs() if d["kind"] == "ConfigMap"
                     and d["metadata"]["name"] == "otel-collector-config"]
    shared = yaml.safe_load((K8S.parent / "otel" / "collector.yaml").read_text())
    assert yaml.safe_load(config_map["data"]["config.yaml"]) == shared
    (service,) = [d for _, d in _docs()
                  if d["kind"] == "Service" and d["metadata"]["name"] == "otel-collector"]
    assert service["spec"]["ports"][0]["port"] == 4318
