"""Redis with Sentinel in deploy/: ``compose.sentinel.yaml`` and the ``k8s-sentinel/`` overlay.

Checked offline like the base files: a master, a replica and three sentinels (quorum 2) watching
them under the service name every cloverq process's ``redis+sentinel://`` URL names (parsed by the
real parser, ``scheduler/infra/redis_sentinel.py``); every cloverq service of the compose file is
pointed at the sentinels; the Kubernetes objects validate strictly against the Kubernetes schemas,
the URL documented for the Secret names the sentinel pods the StatefulSet makes, and KEDA reads the
same lists through the sentinels.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler.infra.redis_sentinel import parse_sentinel_url

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAY = DEPLOY / "k8s-sentinel"
PINNED = re.compile(r"^[a-z0-9./-]+:[0-9v][A-Za-z0-9._-]*[0-9][A-Za-z0-9._-]*$")


def _compose(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((DEPLOY / name).read_text())
    return loaded


def _cloverq_services() -> list[str]:
    """The base file's cloverq services that run with the stack (the setup profile's pull aside)."""
    services = _compose("compose.yaml")["services"]
    return [name for name, spec in services.items()
            if str(spec.get("image", "")).startswith("cloverq") and not spec.get("profiles")]


def test_compose_override_runs_a_master_a_replica_and_three_sentinels() -> None:
    services = _compose("compose.sentinel.yaml")["services"]
    sentinels = [name for name in services if name.startswith("sentinel-")]
    assert len(sentinels) == 3
    replica = services["redis-replica"]
    assert replica["command"][replica["command"].index("--replicaof") + 1:][:2] == ["redis", "6379"]
    assert "--appendonly" in replica["command"] and replica["volumes"]
    for name in ["redis-replica", *sentinels]:
        assert PINNED.match(services[name]["image"]), name
    for name in sentinels:
        script = " ".join(services[name]["command"])
        assert "sentinel monitor mymaster redis 6379 2" in script, name
        assert "--sentinel" in script and "announce-hostnames yes" in script


def test_every_cloverq_service_follows_the_sentinels() -> None:
    override = _compose("compose.sentinel.yaml")["services"]
    sentinels = {(name, 26379) for name in override if name.startswith("sentinel-")}
    for name in _cloverq_services():
        url = override[name]["environment"]["CLOVERQ_REDIS_URL"]
        parsed = parse_sentinel_url(url)
        assert set(parsed.sentinels) == sentinels and parsed.service == "mymaster", name


NO_COMPOSE = "docker-compose not installed (apt-get install -y docker-compose; .ci/run does)"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason=NO_COMPOSE)
def test_docker_compose_merges_the_sentinel_override() -> None:
    done = subprocess.run(["docker-compose", "-f", "compose.yaml", "-f", "compose.sentinel.yaml", "config"],
                          cwd=DEPLOY, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    merged = yaml.safe_load(done.stdout)["services"]
    for name in _cloverq_services():
        assert merged[name]["environment"]["CLOVERQ_REDIS_URL"].startswith("redis+sentinel://"), name
        assert merged[name]["environment"]["CLOVERQ_DATABASE_URL"].startswith("postgresql")  # kept


# --- Kubernetes -----------------------------------------------------------------------------------


def _overlay_docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((OVERLAY / "redis-sentinel.yaml").read_text()) if d]


def _named(kind: str, name: str) -> dict[str, Any]:
    return next(d for d in _overlay_docs() if d["kind"] == kind and d["metadata"]["name"] == name)


def test_overlay_objects_match_the_kubernetes_schema() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="a test extra (make test)")
    for doc in _overlay_docs():
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_overlay_runs_two_redis_pods_and_three_sentinels_with_quorum_two() -> None:
    redis = _named("StatefulSet", "cloverq-redis")
    sentinel = _named("StatefulSet", "cloverq-sentinel")
    assert redis["spec"]["replicas"] == 2 and sentinel["spec"]["replicas"] == 3
    for doc in (redis, sentinel):
        service = _named("Service", doc["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None"  # stable per-pod names
        assert service["spec"]["selector"] == doc["spec"]["selector"]["matchLabels"]
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        assert PINNED.match(container["image"])
        assert doc["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    scripts = _named("ConfigMap", "cloverq-redis-scripts")["data"]
    monitor = "sentinel monitor mymaster cloverq-redis-0.cloverq-redis.cloverq.svc 6379 2"
    assert monitor in scripts["sentinel.sh"]
    assert "--replicaof" in scripts["redis.sh"] and "get-master-addr-by-name mymaster" in scripts["redis.sh"]


def test_the_documented_url_names_the_sentinel_pods() -> None:
    text = (OVERLAY / "kustomization.yaml").read_text()
    (url,) = re.findall(r"CLOVERQ_REDIS_URL=(redis\+sentinel://\S+)", text)
    parsed = parse_sentinel_url(url)
    sentinel = _named("StatefulSet", "cloverq-sentinel")
    pods = {(f"cloverq-sentinel-{i}.cloverq-sentinel", 26379) for i in range(sentinel["spec"]["replicas"])}
    assert set(parsed.sentinels) == pods and parsed.service == "mymaster"


def _json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] == "replace"
        *parents, last = [part for part in op["path"].split("/") if part]
        target = out
        for part in parents:
            target = target[part]
        target[last] = op["value"]
    return out


def test_keda_reads_the_same_lists_through_the_sentinels() -> None:
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert kustomization["resources"][0] == "../k8s"
    keda = yaml.safe_load_all((DEPLOY / "k8s" / "keda.yaml").read_text())
    base = {d["metadata"]["name"]: d for d in keda if d}
    patched = set()
    for patch in kustomization["patches"]:
        name = patch["target"]["name"]
        doc = _json_patch(base[name], yaml.safe_load((OVERLAY / patch["path"]).read_text()))
        lists = [t["metadata"]["listName"] for t in doc["spec"]["triggers"]]
        assert lists == [t["metadata"]["listName"] for t in base[name]["spec"]["triggers"]]
        for trigger in doc["spec"]["triggers"]:
            assert trigger["type"] == "redis-sentinel" and trigger["metadata"]["sentinelMaster"] == "mymaster"
            assert trigger["metadata"]["addresses"].count(":26379") == 3
        patched.add(name)
    assert patched == set(base)


@pytest.mark.skipif(shutil.which("kubectl") is None,
                    reason="kubectl not on PATH (the checks above need only YAML)")
def test_kubectl_kustomize_renders_the_overlay() -> None:
    done = subprocess.run(["kubectl", "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    kinds = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(done.stdout) if d}
    assert {("StatefulSet", "cloverq-redis"), ("StatefulSet", "cloverq-sentinel"),
            ("Deployment", "cloverq-api"), ("Deployment", "cloverq-beat")} <= kinds
