"""Every command line and HTTP path in deploy/ must exist in the real cloverq CLI and API.

Deployment files rot silently: a renamed flag or route only shows up when a pod crash-loops.
These tests collect every ``cloverq ...`` invocation (compose, Dockerfiles, Kubernetes
containers and exec probes, the systemd unit) and parse it with the real click group, and
check every probe / scrape path against the routes of the real FastAPI app.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from scheduler.infra.settings import Settings, flat_fields
from scheduler.infra.settings_env import FILE_SUFFIX

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
COMPOSE_FILES = ("compose.yaml", "compose.gpu.yaml")


def _k8s_docs() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path.name, doc


def _pod_containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {})
    pod = spec.get("template", {}).get("spec") or spec.get("jobTemplate", {}).get("spec", {}).get(
        "template", {}
    ).get("spec")
    if not pod:
        return []
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def _dockerfile_arrays(text: str, instruction: str) -> list[list[str]]:
    """JSON-array forms of ``instruction`` (ENTRYPOINT, CMD, HEALTHCHECK ... CMD) in a Dockerfile."""
    joined = re.sub(r"\\\n", " ", text)
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if instruction == "HEALTHCHECK" and line.startswith("HEALTHCHECK"):
            match = re.search(r"\bCMD\s+(\[.*\])\s*$", line)
        elif line.startswith(instruction + " "):
            match = re.match(rf"{instruction}\s+(\[.*\])\s*$", line)
        else:
            continue
        assert match, f"{instruction} must use the JSON (exec) form: {line}"
        found.append(json.loads(match.group(1)))
    return found


def collect_command_lines() -> list[tuple[str, list[str]]]:
    """(where, argv) of every process command in deploy/ (argv[0] as written)."""
    lines: list[tuple[str, list[str]]] = []
    for name in DOCKERFILES:
        text = (DEPLOY / name).read_text()
        (entrypoint,) = _dockerfile_arrays(text, "ENTRYPOINT")
        for cmd in _dockerfile_arrays(text, "CMD"):
            lines.append((f"{name} ENTRYPOINT+CMD", [*entrypoint, *cmd]))
        for check in _dockerfile_arrays(text, "HEALTHCHECK"):
            lines.append((f"{name} HEALTHCHECK", check))
    for name in COMPOSE_FILES:
        services = yaml.safe_load((DEPLOY / name).read_text())["services"]
        for service, spec in services.items():
            image = str(spec.get("image", ""))
            command = spec.get("command")
            if image.startswith("cloverq") and command is not None:
                argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
                lines.append((f"{name} {service}", ["cloverq", *argv]))  # image ENTRYPOINT is cloverq
            test = spec.get("healthcheck", {}).get("test")
            if isinstance(test, list) and test and test[0] == "CMD":
                lines.append((f"{name} {service} healthcheck", [str(a) for a in test[1:]]))
    for file_name, doc in _k8s_docs():
        for container in _pod_containers(doc):
            where = f"k8s/{file_name} {doc['metadata']['name']}/{container['name']}"
            argv = [*container.get("command", []), *container.get("args", [])]
            if argv:
                lines.append((where, [str(a) for a in argv]))
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                exec_cmd = container.get(probe, {}).get("exec", {}).get("command")
                if exec_cmd:
                    lines.append((f"{where} {probe}", [str(a) for a in exec_cmd]))
    for line in (DEPLOY / "README.md").read_text().splitlines():
        if line.startswith("cloverq "):  # commands an operator copies from the deploy guide
            lines.append(("deploy/README.md", shlex.split(line.split("#")[0])))
    for line in (DEPLOY / "systemd" / "cloverq-worker.service").read_text().splitlines():
        if line.startswith("ExecStart="):
            argv = shlex.split(line.removeprefix("ExecStart="))
            lines.append(("systemd ExecStart", argv))
    return lines


def _resolve(group: click.Group, prog: str, argv: list[str]) -> str:
    """Parse ``argv`` with the real click tree (raises on unknown commands/options); return the path."""
    ctx = group.make_context(prog, list(argv))
    command: click.Command = group
    path = [prog]
    while isinstance(command, click.Group):
        protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
        rest = [*protected, *ctx.args]
        assert rest, f"{' '.join(path)} needs a subcommand"
        name, sub, rest = command.resolve_command(ctx, rest)
        assert sub is not None and name is not None
        ctx = sub.make_context(name, list(rest), parent=ctx)
        command = sub
        path.append(name)
    return " ".join(path)


def _cloverq_lines() -> list[tuple[str, list[str]]]:
    return [
        (where, argv)
        for where, argv in collect_command_lines()
        if Path(argv[0]).name == "cloverq" or argv[:3] == ["python", "-m", "cli.probe"]
    ]


def test_deploy_files_run_cloverq_commands() -> None:
    """The collection itself is meaningful: every role appears somewhere."""
    joined = {" ".join(argv[1:3]) for _, argv in _cloverq_lines()}
    for role in ("api --host", "migrate", "beat", "worker", "model pull", "-m cli.probe"):
        assert any(j.startswith(role) for j in joined), f"no deploy file runs `cloverq {role}`"


@pytest.mark.parametrize(("where", "argv"), _cloverq_lines(), ids=lambda v: v if isinstance(v, str) else None)
def test_command_lines_parse_with_the_real_cli(where: str, argv: list[str]) -> None:
    from cli.main import cli

    if argv[:3] == ["python", "-m", "cli.probe"]:
        from cli.probe import probe_group

        resolved = _resolve(probe_group, "cloverq probe", argv[3:])
        # The module entry point and the registered subcommand are the same command.
        assert cli.commands["probe"] is probe_group
    else:
        resolved = _resolve(cli, "cloverq", argv[1:])
    assert resolved.startswith("cloverq"), where


def test_unknown_flags_are_caught() -> None:
    """Guard the guard: the resolver really rejects a misspelt option or command."""
    from cli.main import cli

    with pytest.raises(click.UsageError):
        _resolve(cli, "cloverq", ["api", "--hots", "0.0.0.0"])
    with pytest.raises(click.UsageError):
        _resolve(cli, "cloverq", ["modle", "pull"])


# --- environment variables -------------------------------------------------------------------


def _env_names_in_deploy() -> set[str]:
    names: set[str] = set()
    for path in DEPLOY.rglob("*"):
        if path.is_file() and path.suffix in {"", ".yaml", ".yml", ".service", ".cuda"}:
            names.update(re.findall(r"\b(CLOVERQ_[A-Z0-9_]+)", path.read_text()))
    return names


def _settings_env_names() -> set[str]:
    """Every setting's variable, and its ``_FILE`` form (the value read from a file)."""
    names = {entry.env for entry in flat_fields().values()}
    return names | {name + FILE_SUFFIX for name in names}


# Variables that compose reads for interpolation only (never reach a cloverq process).
COMPOSE_ONLY = {
    "CLOVERQ_MODEL_NAME",
    "CLOVERQ_MODEL_VERSION",
    "CLOVERQ_MODEL_SRC",
    "CLOVERQ_MODEL_IMPORT_DIR",
}


def test_every_cloverq_env_var_is_a_setting() -> None:
    unknown = _env_names_in_deploy() - _settings_env_names() - COMPOSE_ONLY
    assert not unknown, f"deploy/ sets variables that Settings does not read: {sorted(unknown)}"


def test_compose_only_variables_are_only_interpolated() -> None:
    compose = (DEPLOY / "compose.yaml").read_text()
    for name in COMPOSE_ONLY:
        assert re.search(rf"\$\{{{name}[:}}]", compose), name
        assert not re.search(rf"^\s+{name}:", compose, re.M), f"{name} must not be passed as a setting"


def test_other_env_keys_are_real_settings() -> None:
    """Non-CLOVERQ_ keys given to cloverq containers (e.g. PROMETHEUS_MULTIPROC_DIR) are aliases."""
    aliases = {entry.env for entry in flat_fields().values() if not entry.env.startswith("CLOVERQ_")}
    passthrough = {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "CUDA_VISIBLE_DEVICES"}
    envs = [env for _, doc in _k8s_docs() for c in _pod_containers(doc) for env in c.get("env", [])]
    assert envs  # the k8s containers do carry env entries (else the loop checks nothing)
    for file_name, doc in _k8s_docs():
        for container in _pod_containers(doc):
            for env in container.get("env", []):
                name = env["name"]
                assert name.startswith("CLOVERQ_") or name in aliases | passthrough, (file_name, name)


# --- HTTP paths ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api_app(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The real app (nothing connects until a request needs it)."""
    from api.app import create_app

    data_dir = tmp_path_factory.mktemp("deploy-api")
    return create_app(Settings(data_dir=data_dir, redis_url="redis://127.0.0.1:1/0"))


def _is_get_route(app: Any, path: str) -> bool:
    """True if a GET of ``path`` reaches a route (matched the way Starlette dispatches)."""
    from starlette.routing import Match

    scope = {"type": "http", "path": path, "method": "GET", "root_path": "", "headers": [], "app": app}
    return any(route.matches(scope)[0] == Match.FULL for route in app.router.routes)


def _http_paths_in_deploy() -> list[tuple[str, str]]:
    paths: list[tuple[str, str]] = []
    for file_name, doc in _k8s_docs():
        for container in _pod_containers(doc):
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                http = container.get(probe, {}).get("httpGet")
                if http:
                    paths.append((f"k8s/{file_name} {probe}", http["path"]))
        annotations = doc.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations", {})
        if "prometheus.io/path" in annotations:
            paths.append((f"k8s/{file_name} scrape", annotations["prometheus.io/path"]))
    for where, argv in collect_command_lines():
        for url_path in re.findall(r"http://127\.0\.0\.1:8000(/[A-Za-z0-9_/-]*)", " ".join(argv)):
            paths.append((where, url_path))
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    for job in prometheus["scrape_configs"]:
        if job["job_name"].startswith("cloverq"):
            paths.append((f"prometheus {job['job_name']}", job.get("metrics_path", "/metrics")))
    return paths


def test_probe_and_scrape_paths_are_real_api_routes(api_app: Any) -> None:
    paths = _http_paths_in_deploy()
    assert {p for _, p in paths} >= {"/livez", "/metrics"}
    for where, path in paths:
        assert _is_get_route(api_app, path), f"{where}: GET {path} is not a route of the API"


def test_route_check_rejects_unknown_paths(api_app: Any) -> None:
    assert not _is_get_route(api_app, "/healthzz")


def test_api_container_port_matches_the_cli_port() -> None:
    """The ports the API binds (cloverq api --port/--admin-port/--ops-port) are the container's, in
    that order (public, admin, ops), the ones probes and the Services target."""
    api_containers = [c for _, doc in _k8s_docs() if doc["kind"] == "Deployment"
                      for c in _pod_containers(doc) if c.get("command", [])[:2] == ["cloverq", "api"]]
    assert api_containers  # an API Deployment was parsed
    for file_name, doc in _k8s_docs():
        if doc["kind"] != "Deployment":
            continue
        for container in _pod_containers(doc):
            argv = container.get("command", [])
            if argv[:2] != ["cloverq", "api"]:
                continue
            ports = [int(argv[argv.index(flag) + 1]) for flag in ("--port", "--admin-port", "--ops-port")]
            assert [p["containerPort"] for p in container["ports"]] == ports, file_name
            assert argv[argv.index("--host") + 1] == "0.0.0.0", "a pod must listen beyond loopback"
            env = {item["name"]: item.get("value") for item in container.get("env", [])}
            assert env["CLOVERQ_ADMIN_HOST"] == env["CLOVERQ_OPS_HOST"] == "0.0.0.0", file_name
