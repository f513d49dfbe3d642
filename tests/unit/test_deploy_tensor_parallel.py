"""The tensor-parallel (TP=2) deployments: ``deploy/compose.tp2.yaml`` and ``deploy/k8s-tp2/``.

Checked offline like the base files: each worker gets two GPUs and ``CLOVERQ_TENSOR_PARALLEL=2``,
keeps the base's readiness probe (which requires every rank, see ``cli.probe``), and the patched
Kubernetes Deployments still validate strictly against the Kubernetes schemas.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from cli.probe import all_ranks_ready
from scheduler.fleet.workers import WorkerInfo, WorkerState

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
WORKERS = ("worker", "worker-joint")


def test_compose_override_gives_each_worker_two_gpus_of_its_own() -> None:
    base = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    tp2 = yaml.safe_load((DEPLOY / "compose.tp2.yaml").read_text())["services"]
    assert set(tp2) == set(WORKERS)
    seen: list[str] = []
    for role in WORKERS:
        spec = tp2[role]
        assert spec["environment"]["CLOVERQ_TENSOR_PARALLEL"] == "2"
        assert spec["environment"]["CLOVERQ_DEVICE"] == "cuda"
        assert spec["build"]["dockerfile"] == "deploy/Dockerfile.cuda" and spec["image"].endswith("-cuda")
        (device,) = spec["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and len(device["device_ids"]) == 2
        seen += device["device_ids"]
        assert spec["shm_size"]  # NCCL between the ranks goes through /dev/shm
        assert base[role]["healthcheck"]["test"][-1] == "--ready"  # kept from compose.yaml
    assert len(set(seen)) == len(seen), "two workers on the same GPU"


DOCKER_COMPOSE = shutil.which("docker-compose")
NO_DOCKER_COMPOSE = "docker-compose not installed (apt-get install -y docker-compose; .ci/run does)"


@pytest.mark.skipif(DOCKER_COMPOSE is None, reason=NO_DOCKER_COMPOSE)
def test_docker_compose_merges_the_tp2_override() -> None:
    done = subprocess.run([str(DOCKER_COMPOSE), "-f", "compose.yaml", "-f", "compose.tp2.yaml", "config"],
                          cwd=DEPLOY, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    for role in WORKERS:
        assert services[role]["environment"]["CLOVERQ_TENSOR_PARALLEL"] == "2"
        assert services[role]["healthcheck"]["test"][-1] == "--ready"


def _json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """The two RFC 6902 operations the overlay uses (``add`` to a list end, ``replace``)."""
    out = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].strip("/").split("/")]
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] == "add" and last == "-":
            node.append(op["value"])
        elif op["op"] == "replace":
            assert (int(last) if isinstance(node, list) else last) in (range(len(node)) if isinstance(
                node, list) else node), op["path"]  # replace needs an existing member
            node[int(last) if isinstance(node, list) else last] = op["value"]
        else:
            raise AssertionError(f"unexpected patch operation {op}")
    return out


def _overlay() -> dict[str, dict[str, Any]]:
    """The two worker Deployments as ``kubectl apply -k deploy/k8s-tp2`` would create them."""
    kustomization = yaml.safe_load((DEPLOY / "k8s-tp2" / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../k8s"]
    base = {}
    for name in ("worker.yaml", "worker-joint.yaml"):
        doc = yaml.safe_load((DEPLOY / "k8s" / name).read_text())
        base[doc["metadata"]["name"]] = doc
    patched = {}
    for patch in kustomization["patches"]:
        target = patch["target"]["name"]
        ops = yaml.safe_load((DEPLOY / "k8s-tp2" / patch["path"]).read_text())
        patched[target] = _json_patch(base[target], ops)
    assert set(patched) == {"cloverq-worker", "cloverq-worker-joint"}
    return patched


def test_k8s_overlay_runs_each_worker_pod_on_two_gpus_with_the_ready_probe() -> None:
    assert _overlay()  # the overlay's worker patches parsed
    for name, doc in _overlay().items():
        (container,) = doc["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["CLOVERQ_TENSOR_PARALLEL"] == "2" and env["CLOVERQ_DEVICE"] == "cuda", name
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
        assert "--ready" in container["readinessProbe"]["exec"]["command"]
        assert "--ready" in container["startupProbe"]["exec"]["command"]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/dev/shm" in mounts


def test_k8s_overlay_deployments_match_the_kubernetes_schema() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="a test extra (make test)")
    for doc in _overlay().values():
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


NO_KUBECTL = ("kubectl not on PATH (install its one binary on PATH: "
              "https://kubernetes.io/docs/tasks/tools/install-kubectl-linux/; .ci/run does not, and "
              "the schema test above checks the same overlay without it)")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason=NO_KUBECTL)
def test_kubectl_kustomize_renders_the_overlay_as_the_test_applies_it() -> None:
    done = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s-tp2")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    rendered = {d["metadata"]["name"]: d for d in yaml.safe_load_all(done.stdout)
                if d and d["kind"] == "Deployment"}
    for name, doc in _overlay().items():
        got = rendered[name]["spec"]["template"]["spec"]["containers"][0]
        want = doc["spec"]["template"]["spec"]["containers"][0]
        assert got["env"] == want["env"] and got["resources"] == want["resources"], name


def test_readiness_requires_every_rank_of_a_tensor_parallel_worker() -> None:
    def worker(stats: dict[str, Any]) -> WorkerInfo:
        return WorkerInfo(id="w", hostname="h", pid=1, queues=[], state=WorkerState.READY, stats=stats)

    assert all_ranks_ready(worker({}))  # one device: nothing more to wait for
    assert all_ranks_ready(worker({"tensor_parallel": {"size": 2, "ranks_ready": 2}}))
    assert not all_ranks_ready(worker({"tensor_parallel": {"size": 2, "ranks_ready": 1}}))
