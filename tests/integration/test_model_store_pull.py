"""Model store: pull + verify + atomic rename, from a folder, a file:// URL and real HTTP.

The HTTP source is a real server on 127.0.0.1 (``http.server`` in a thread) serving a demo
checkpoint; it can also drop the connection in the middle of a file or trickle bytes slowly so
that a pull can be killed mid-download. The rule under test everywhere: a version is visible
(to ``list_versions``, ``cloverq model list`` and the loader) only when complete and verified.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from worker import model_store
from worker.model.manifest import check_manifest

pytestmark = pytest.mark.integration

WEIGHTS = "model.safetensors"


@dataclass
class ServerControl:
    """How the test server misbehaves (per request path, e.g. ``/model.safetensors``)."""

    drop_after: dict[str, int] = field(default_factory=dict)  # bytes sent before the socket closes
    slow: dict[str, float] = field(default_factory=dict)  # seconds to sleep per 4 KiB chunk
    requests: list[str] = field(default_factory=list)


class _Handler(SimpleHTTPRequestHandler):
    control: ServerControl

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        del format, args

    def do_GET(self) -> None:
        self.control.requests.append(self.path)
        path = self.path.split("?")[0]
        if path not in self.control.drop_after and path not in self.control.slow:
            super().do_GET()
            return
        file = Path(self.translate_path(path))
        body = file.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        limit = self.control.drop_after.get(path, len(body))
        delay = self.control.slow.get(path, 0.0)
        for start in range(0, limit, 4096):
            self.wfile.write(body[start : min(start + 4096, limit)])
            self.wfile.flush()
            if delay:
                time.sleep(delay)
        if limit < len(body):  # drop mid-file: the client sees a truncated body
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """Connections the test drops on purpose (or the client abandons) are not errors."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


@dataclass
class CheckpointServer:
    url: str
    folder: Path
    control: ServerControl


@pytest.fixture
def source(demo_checkpoint: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny demo checkpoint (tests corrupt it)."""
    folder = tmp_path / "source" / "tiny"
    shutil.copytree(demo_checkpoint, folder)
    return folder


@pytest.fixture
def server(source: Path) -> Iterator[CheckpointServer]:
    control = ServerControl()
    handler = type("Handler", (_Handler,), {"control": control})
    httpd = _QuietServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(source.parent)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield CheckpointServer(f"http://127.0.0.1:{httpd.server_address[1]}/tiny/", source, control)
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store"


def _visible(root: Path) -> list[str]:
    """What a reader of the store can see: non-hidden entries, recursively."""
    if not root.exists():
        return []
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if not any(part.startswith(".") for part in p.relative_to(root).parts)
    )


def _flip_byte(path: Path, offset: int = 1000) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _assert_published(root: Path, source: Path, pulled: model_store.ModelVersion) -> None:
    assert pulled.path == root / "demo" / "v1"
    assert check_manifest(pulled.path) == []
    for file in source.iterdir():
        assert (pulled.path / file.name).read_bytes() == file.read_bytes(), file.name
    assert [(v.name, v.version) for v in model_store.list_versions(root)] == [("demo", "v1")]
    assert not [p for p in root.iterdir() if p.name.startswith(model_store.TEMP_PREFIX)]


# --- success --------------------------------------------------------------------------------


def test_pull_from_a_local_folder(source: Path, root: Path) -> None:
    pulled = model_store.pull(source, name="demo", version="v1", root=root)
    _assert_published(root, source, pulled)
    assert pulled.files == len(json.loads((source / "manifest.json").read_text())["files"])


def test_pull_from_a_file_url_then_load(source: Path, root: Path) -> None:
    from worker.model.checkpoint import load_checkpoint

    pulled = model_store.pull(source.as_uri(), name="demo", version="v1", root=root)
    _assert_published(root, source, pulled)
    loaded = load_checkpoint(pulled.path)  # verifies the manifest again, then loads
    assert loaded.config.vocab_size > 0


def test_pull_over_http_streams_every_listed_file(server: CheckpointServer, root: Path) -> None:
    pulled = model_store.pull(server.url, name="demo", version="v1", root=root)
    _assert_published(root, server.folder, pulled)
    assert server.control.requests[0] == "/tiny/manifest.json"  # manifest first, then its files
    assert sorted(server.control.requests[1:]) == sorted(
        f"/tiny/{name}" for name in json.loads((server.folder / "manifest.json").read_text())["files"]
    )


def test_versions_are_immutable_and_sit_side_by_side(source: Path, root: Path) -> None:
    model_store.pull(source, name="demo", version="v1", root=root)
    before = (root / "demo" / "v1" / WEIGHTS).stat().st_mtime_ns
    with pytest.raises(model_store.VersionExistsError):
        model_store.pull(source, name="demo", version="v1", root=root)
    assert (root / "demo" / "v1" / WEIGHTS).stat().st_mtime_ns == before
    model_store.pull(source, name="demo", version="v2", root=root)
    assert [v.version for v in model_store.list_versions(root, name="demo")] == ["v1", "v2"]


# --- refusals leave nothing visible -------------------------------------------------------------


@pytest.mark.parametrize("via", ["folder", "http"])
def test_a_corrupted_file_is_refused_and_nothing_is_visible(
    via: str, source: Path, server: CheckpointServer, root: Path
) -> None:
    _flip_byte(source / WEIGHTS)  # same size, different content: only the sha256 catches it
    src = source if via == "folder" else server.url
    with pytest.raises(model_store.VerificationError) as refused:
        model_store.pull(src, name="demo", version="v1", root=root)
    assert any(WEIGHTS in problem and "sha256" in problem for problem in refused.value.problems)
    assert _visible(root) == []
    assert list(root.iterdir()) == []  # the temporary folder is gone too
    assert model_store.list_versions(root) == []


def test_a_truncated_file_is_refused(source: Path, root: Path) -> None:
    data = (source / "tokenizer.json").read_bytes()
    (source / "tokenizer.json").write_bytes(data[:-10])
    with pytest.raises(model_store.VerificationError, match=r"tokenizer\.json"):
        model_store.pull(source, name="demo", version="v1", root=root)
    assert list(root.iterdir()) == []


def test_a_file_missing_at_the_http_source_is_refused(server: CheckpointServer, root: Path) -> None:
    (server.folder / "generation_config.json").unlink()
    with pytest.raises(model_store.VerificationError, match=r"generation_config\.json"):
        model_store.pull(server.url, name="demo", version="v1", root=root)
    assert list(root.iterdir()) == []


def test_a_manifest_escaping_the_version_folder_is_refused(source: Path, tmp_path: Path, root: Path) -> None:
    manifest = json.loads((source / "manifest.json").read_text())
    manifest["files"]["../../escaped.txt"] = {"sha256": "0" * 64, "size": 1}
    (source / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(model_store.ModelStoreError, match="unsafe path"):
        model_store.pull(source, name="demo", version="v1", root=root)
    assert not (tmp_path / "escaped.txt").exists()
    assert list(root.iterdir()) == []


def test_a_folder_without_manifest_is_hashed_and_gets_one(source: Path, root: Path) -> None:
    (source / "manifest.json").unlink()
    pulled = model_store.pull(source, name="demo", version="v1", root=root)
    assert not pulled.source_manifest and pulled.files == len(list(source.iterdir()))
    assert check_manifest(pulled.path) == []


def test_an_http_source_without_manifest_is_refused(server: CheckpointServer, root: Path) -> None:
    (server.folder / "manifest.json").unlink()
    with pytest.raises(model_store.ModelStoreError, match="needs one"):
        model_store.pull(server.url, name="demo", version="v1", root=root)
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("bad", ["../x", ".hidden", "a/b", ""])
def test_names_and_versions_cannot_escape_the_root(source: Path, root: Path, bad: str) -> None:
    with pytest.raises(model_store.ModelStoreError, match="invalid"):
        model_store.pull(source, name="demo", version=bad, root=root)
    with pytest.raises(model_store.ModelStoreError, match="invalid"):
        model_store.pull(source, name=bad, version="v1", root=root)


# --- interrupted pulls ----------------------------------------------------------------------------


def test_server_dropping_mid_file_leaves_nothing(server: CheckpointServer, root: Path) -> None:
    server.control.drop_after["/tiny/" + WEIGHTS] = 64 * 1024
    with pytest.raises(model_store.ModelStoreError, match="interrupted"):
        model_store.pull(server.url, name="demo", version="v1", root=root, timeout=10)
    assert list(root.iterdir()) == []
    # The same pull succeeds once the server behaves: nothing stale was in the way.
    server.control.drop_after.clear()
    pulled = model_store.pull(server.url, name="demo", version="v1", root=root)
    _assert_published(root, server.folder, pulled)


def test_ctrl_c_mid_file_leaves_nothing(source: Path, root: Path) -> None:
    def interrupt(relpath: str, _nbytes: int) -> None:
        if relpath == WEIGHTS:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        model_store.pull(source, name="demo", version="v1", root=root, on_progress=interrupt)
    assert list(root.iterdir()) == []


def test_a_killed_pull_leaves_only_a_hidden_temporary(server: CheckpointServer, root: Path) -> None:
    """SIGKILL mid-download (no cleanup code runs): readers still see no version."""
    server.control.slow["/tiny/" + WEIGHTS] = 0.05  # ~80 KB/s: the weights take ~20 s
    command = [sys.executable, "-m", "cli", "model", "pull", server.url, "--name", "demo", "--version", "v1"]
    process = subprocess.Popen(
        [*command, "--root", str(root)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60
        while "/tiny/" + WEIGHTS not in server.control.requests:
            assert process.poll() is None, process.stdout.read().decode() if process.stdout else ""
            assert time.monotonic() < deadline, "the pull never reached the weights"
            time.sleep(0.05)
        time.sleep(0.5)  # some bytes of the weights are on disk now
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    temporaries = [p for p in root.iterdir() if p.name.startswith(model_store.TEMP_PREFIX)]
    assert len(temporaries) == 1 and (temporaries[0] / WEIGHTS).exists()
    assert _visible(root) == []
    assert model_store.list_versions(root) == []

    from cli.main import cli

    listed = CliRunner().invoke(cli, ["model", "list", "--root", str(root), "--json"])
    assert listed.exit_code == 0, listed.output
    assert json.loads(listed.output) == []
    # A fresh temporary is never touched; an old one is swept.
    assert model_store.remove_stale_temporaries(root) == []
    assert model_store.remove_stale_temporaries(root, older_than_seconds=0) == temporaries
    assert list(root.iterdir()) == []


# --- CLI ----------------------------------------------------------------------------------------


def test_cli_pull_and_list(server: CheckpointServer, root: Path) -> None:
    from cli.main import cli

    runner = CliRunner()
    pulled = runner.invoke(
        cli, ["model", "pull", server.url, "--name", "demo", "--version", "v1", "--root", str(root)]
    )
    assert pulled.exit_code == 0, pulled.output
    assert "pulled demo/v1" in pulled.output
    listed = runner.invoke(cli, ["model", "list", "--root", str(root), "--json"])
    assert listed.exit_code == 0, listed.output
    (entry,) = json.loads(listed.output)
    assert entry["name"] == "demo" and entry["version"] == "v1" and entry["path"] == str(root / "demo" / "v1")


def test_cli_refuses_a_corrupted_pull_and_names_the_file(source: Path, root: Path) -> None:
    from cli.main import cli

    _flip_byte(source / WEIGHTS)
    result = CliRunner().invoke(
        cli, ["model", "pull", str(source), "--name", "demo", "--version", "v1", "--root", str(root)]
    )
    assert result.exit_code == 1
    assert f"bad: {WEIGHTS}: sha256 mismatch" in result.output
    assert "refused" in result.output
    assert list(root.iterdir()) == []


def test_cli_uses_the_model_root_setting(source: Path, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cli.main import cli
    from scheduler.infra.settings import get_settings

    monkeypatch.setenv("CLOVERQ_MODEL_ROOT", str(root))
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(cli, ["model", "pull", str(source), "--name", "demo", "--version", "v1"])
        assert result.exit_code == 0, result.output
        assert (root / "demo" / "v1" / "manifest.json").is_file()
    finally:
        get_settings.cache_clear()


def test_a_checkpoint_larger_than_the_free_space_is_refused_up_front(
    server: CheckpointServer, root: Path
) -> None:
    manifest = json.loads((server.folder / "manifest.json").read_text())
    manifest["files"][WEIGHTS]["size"] = 10**18  # an exabyte: no disk has that much free
    (server.folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(model_store.ModelStoreError, match="not enough disk space"):
        model_store.pull(server.url, name="demo", version="v1", root=root)
    assert server.control.requests == ["/tiny/manifest.json"]  # nothing else was downloaded
    assert list(root.iterdir()) == []


def test_a_missing_source_folder_leaves_nothing(tmp_path: Path, root: Path) -> None:
    root.mkdir()
    with pytest.raises(model_store.ModelStoreError, match="not found"):
        model_store.pull(tmp_path / "no-such-checkpoint", name="demo", version="v1", root=root)
    assert list(root.iterdir()) == []
