"""Images, compose and the systemd unit follow the deployment rules, checked offline.

Rules (issue 8): non-root user, pinned versions, weights mounted and never baked into an image,
Redis with AOF, one service per role (api, worker, worker-joint, beat, PostgreSQL, Redis,
Prometheus, Grafana), graceful stop longer than a job's deadline.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from scheduler.infra.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
PINNED_IMAGE = re.compile(r"^[a-z0-9./-]+:[0-9v][A-Za-z0-9._-]*[0-9][A-Za-z0-9._-]*$")  # a version tag


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (DEPLOY / name).read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _final_stage(name: str) -> list[tuple[str, str]]:
    instructions = _instructions(name)
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    return instructions[last_from:]


def _base_images(name: str) -> list[str]:
    instructions = _instructions(name)
    args = dict(rest.split("=", 1) for keyword, rest in instructions if keyword == "ARG" and "=" in rest)
    images = []
    for keyword, rest in instructions:
        if keyword == "FROM":
            image = rest.split()[0]
            images.append(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image))
    return images


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_base_images_are_pinned(name: str) -> None:
    assert _base_images(name), f"{name}: no FROM line parsed"
    for image in _base_images(name):
        assert PINNED_IMAGE.match(image), f"{name}: base image {image!r} is not pinned to a version"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_runs_as_a_non_root_user(name: str) -> None:
    users = [rest for keyword, rest in _final_stage(name) if keyword == "USER"]
    assert users, f"{name}: the final stage never switches user"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}, name


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_never_bakes_weights(name: str) -> None:
    instructions = _instructions(name)
    for keyword, rest in instructions:
        if keyword in {"COPY", "ADD"}:
            sources = [s for s in rest.split()[:-1] if not s.startswith("--")]
            for source in sources:
                assert not re.search(r"safetensors|\.bin$|models?(/|$)|\.cloverq", source), (name, source)
                if keyword == "COPY" and not rest.startswith("--from"):
                    assert (ROOT / source).exists(), f"{name}: COPY source {source} does not exist"
        if keyword == "RUN":
            assert "init-demo" not in rest and "model pull" not in rest, f"{name}: weights in a layer"
    final = _final_stage(name)
    volumes = " ".join(rest for keyword, rest in final if keyword == "VOLUME")
    assert "/models" in volumes, f"{name}: the model store must be a mount point"
    env = " ".join(rest for keyword, rest in final if keyword == "ENV")
    assert "CLOVERQ_MODEL_ROOT=/models" in env


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_pins_python_packages(name: str) -> None:
    runs = [rest for keyword, rest in _instructions(name) if keyword == "RUN" and "pip install" in rest]
    assert any("torch==2.13.0" in run for run in runs), f"{name}: torch must be pinned to 2.13.0"
    for run in runs:
        if "/src" in run:
            assert "--constraint /tmp/constraints.txt" in run, f"{name}: project installed unpinned"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerignore_keeps_weights_and_state_out_of_the_context(name: str) -> None:
    text = (DEPLOY / f"{name}.dockerignore").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert lines[0] == "**", "exclude everything, then allow the sources"
    for pattern in ("**/*.safetensors", "**/.cloverq"):
        assert pattern in lines
    for keyword, rest in _instructions(name):
        if keyword == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                assert f"!{source}" in lines or f"!{source}/**" in lines, f"{source} excluded from context"


def _project_dependencies() -> list[Requirement]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [Requirement(dep) for dep in pyproject["project"]["dependencies"]]


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (DEPLOY / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraint {line!r} is not an exact pin"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def test_constraints_pin_every_runtime_dependency_within_its_range() -> None:
    pins = _constraints()
    for requirement in _project_dependencies():
        key = re.sub(r"[-_.]+", "-", requirement.name).lower()
        assert key in pins, f"{requirement.name} is not pinned in deploy/constraints.txt"
        assert requirement.specifier.contains(pins[key], prereleases=True), (requirement, pins[key])
    assert pins["torch"] == "2.13.0"


# --- compose ----------------------------------------------------------------------------------


def _compose(name: str = "compose.yaml") -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_compose_has_every_role() -> None:
    services = _compose()["services"]
    for role in (
        "api",
        "worker",
        "worker-joint",
        "beat",
        "migrate",
        "redis",
        "postgres",
        "prometheus",
        "grafana",
    ):
        assert role in services, role


def test_compose_images_are_pinned() -> None:
    assert len(_compose()["services"]) >= 9  # every role (test_compose_has_every_role)
    for name, spec in _compose()["services"].items():
        assert PINNED_IMAGE.match(spec["image"]), f"{name}: image {spec['image']!r} is not pinned"


def test_compose_redis_uses_aof_and_a_volume() -> None:
    redis = _compose()["services"]["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command
    assert any(str(v).endswith(":/data") for v in redis["volumes"])


def test_compose_orders_startup_and_mounts_models_read_only() -> None:
    services = _compose()["services"]
    for role in ("api", "worker", "worker-joint", "beat"):
        assert services[role]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for role in ("worker", "worker-joint"):
        assert "models:/models:ro" in services[role]["volumes"], role
        assert services[role]["healthcheck"]["test"][-1] == "--ready"
    assert services["worker-joint"]["environment"]["CLOVERQ_WORKER_QUEUES"] == "joint"


def _seconds(duration: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smh])", duration))


def test_compose_stop_grace_covers_job_deadlines() -> None:
    services = _compose()["services"]
    settings = Settings()
    thinking = settings.thinking.deadline_seconds  # thinking jobs may run on any queue
    assert _seconds(services["worker"]["stop_grace_period"]) >= max(settings.jobs.deadline_seconds, thinking)
    assert _seconds(services["worker-joint"]["stop_grace_period"]) >= max(
        settings.jobs.joint_deadline_seconds, thinking
    )


def test_compose_bind_mounts_exist() -> None:
    binds = [v for spec in _compose()["services"].values() for v in spec.get("volumes", [])
             if str(v).startswith("./")]
    assert binds  # compose bind-mounts files from deploy/ (prometheus, grafana): there are some to check
    for name, spec in _compose()["services"].items():
        for volume in spec.get("volumes", []):
            source = str(volume).split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"


def test_compose_gpu_override_gives_each_worker_a_gpu() -> None:
    services = _compose("compose.gpu.yaml")["services"]
    for role in ("worker", "worker-joint"):
        (device,) = services[role]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        assert services[role]["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
        assert PINNED_IMAGE.match(services[role]["image"])


# --- systemd --------------------------------------------------------------------------------


def _unit() -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for line in (DEPLOY / "systemd" / "cloverq-worker.service").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key, []).append(value)
    return sections


def test_systemd_unit_runs_the_worker_safely() -> None:
    unit = _unit()
    assert set(unit) == {"Unit", "Service", "Install"}
    service = unit["Service"]
    (exec_start,) = service["ExecStart"]
    assert exec_start.split()[0].endswith("/cloverq") and exec_start.split()[1:] == ["worker"]
    assert service["User"] != ["root"]
    assert service["KillSignal"] == ["SIGTERM"]
    settings = Settings()
    assert int(service["TimeoutStopSec"][0]) >= max(
        settings.jobs.deadline_seconds, settings.thinking.deadline_seconds
    )
    assert service["Restart"] == ["always"]
    env_names = {value.split("=", 1)[0] for value in service["Environment"]}
    assert "CLOVERQ_WORKER_QUEUES" in env_names and "CLOVERQ_DEVICE" in env_names
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


# --- compose, validated by docker-compose itself (Debian's `docker-compose`, no daemon needed) --

DOCKER_COMPOSE = shutil.which("docker-compose")
NO_DOCKER_COMPOSE = "docker-compose not installed (apt-get install -y docker-compose; .ci/run does)"
needs_docker_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None, reason=NO_DOCKER_COMPOSE
)


def _compose_config(*files: str, cwd: Path = DEPLOY) -> subprocess.CompletedProcess[str]:
    assert DOCKER_COMPOSE is not None
    argv = [DOCKER_COMPOSE]
    for name in files:
        argv += ["-f", name]
    return subprocess.run([*argv, "config"], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_docker_compose
def test_docker_compose_accepts_the_files_and_merges_the_gpu_override() -> None:
    plain = _compose_config("compose.yaml")
    assert plain.returncode == 0, plain.stderr
    merged = _compose_config("compose.yaml", "compose.gpu.yaml")
    assert merged.returncode == 0, merged.stderr
    services = yaml.safe_load(merged.stdout)["services"]
    for role, queues in (("worker", "interactive,standard,bulk"), ("worker-joint", "joint")):
        env = services[role]["environment"]
        assert env["CLOVERQ_WORKER_QUEUES"] == queues  # the override keeps the shared settings
        assert env["CLOVERQ_DEVICE"] == "cuda" and env["CLOVERQ_DATABASE_URL"].startswith("postgresql")


@needs_docker_compose
def test_docker_compose_rejects_an_invalid_file(tmp_path: Path) -> None:
    """Guard the guard: a misspelt key must fail validation."""
    broken = (DEPLOY / "compose.yaml").read_text().replace("stop_grace_period:", "stop_grace_periode:")
    (tmp_path / "compose.yaml").write_text(broken)
    for relative in ("prometheus", "grafana"):
        shutil.copytree(DEPLOY / relative, tmp_path / relative)
    assert _compose_config("compose.yaml", cwd=tmp_path).returncode != 0


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
NO_SYSTEMD_ANALYZE = "systemd-analyze not installed (apt-get install -y systemd)"


def _verify_unit(text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze verify`` on the unit installed as a template, ExecStart on this venv."""
    cloverq = Path(sys.executable).with_name("cloverq")
    unit = tmp_path / "cloverq-worker@.service"
    unit.write_text(text.replace("/opt/cloverq/.venv/bin/cloverq", str(cloverq)))
    assert SYSTEMD_ANALYZE is not None
    return subprocess.run([SYSTEMD_ANALYZE, "verify", str(unit)], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason=NO_SYSTEMD_ANALYZE)
def test_systemd_analyze_accepts_the_unit(tmp_path: Path) -> None:
    text = (DEPLOY / "systemd" / "cloverq-worker.service").read_text()
    result = _verify_unit(text, tmp_path)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    # Guard the guard: a misspelt directive is reported.
    broken = _verify_unit(text.replace("KillMode=", "KillMod="), tmp_path)
    assert "Unknown key" in broken.stderr


# --- HAProxy in front of the API replicas, validated by haproxy itself (Debian's `haproxy`) -----

HAPROXY = shutil.which("haproxy")
NO_HAPROXY = "haproxy not installed (apt-get install -y haproxy; .ci/run does)"


@pytest.mark.skipif(HAPROXY is None, reason=NO_HAPROXY)
def test_haproxy_accepts_its_config_and_a_misspelt_one_fails(tmp_path: Path) -> None:
    assert HAPROXY is not None
    config = DEPLOY / "haproxy" / "haproxy.cfg"
    done = subprocess.run([HAPROXY, "-c", "-f", str(config)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    broken = tmp_path / "haproxy.cfg"
    broken.write_text(config.read_text().replace("http-check expect", "http-check expekt"))
    assert subprocess.run([HAPROXY, "-c", "-f", str(broken)], capture_output=True, timeout=30).returncode != 0


def test_haproxy_checks_each_replicas_own_readiness() -> None:
    """The health check is /readyz/replica (503 while the replica drains), never /readyz: that one
    also needs a ready worker and would take every replica out while workers restart."""
    text = (DEPLOY / "haproxy" / "haproxy.cfg").read_text()
    assert re.search(r"^\s*http-check send meth GET uri /readyz/replica\s*$", text, re.M)
    assert re.search(r"^\s*http-check expect status 200\s*$", text, re.M)
    assert len(re.findall(r"^\s*server api\d ", text, re.M)) == 3
