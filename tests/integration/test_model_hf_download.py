"""A Hugging Face download served as it is: ``cloverq model pull`` -> a real worker -> a chat job.

Per family (``tests/hf_checkpoints.BUILDERS``; a third family is one more entry), a checkpoint
written by transformers' ``save_pretrained``: no ``manifest.json``, no ``block_size``, the chat
template in ``chat_template.jinja`` only. It is pulled with the CLI (hashed once, manifest written,
progress on stderr), a real worker process serves it from the store (quick manifest check, the
family's default block size through warm-up), and a chat job through the API succeeds. No manual
step in between. The worker's own count of the bytes its manifest check read is printed and must
be a small part of the shard bytes (a full check reads all of them).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis as redis_lib
from click.testing import CliRunner
from fastapi.testclient import TestClient

from api.app import create_app
from cli.main import cli
from scheduler.access.api_keys import create_key
from scheduler.fleet.workers import list_workers
from scheduler.infra.db import make_engine, session_factory
from tests.conftest import ProcessLauncher, wait_for
from worker.model.manifest import check

pytestmark = pytest.mark.integration
pytest.importorskip("transformers", reason="transformers: a test extra (make test)")

from tests import hf_checkpoints  # noqa: E402  (imports torch; after the importorskip)


@pytest.fixture(params=sorted(hf_checkpoints.BUILDERS))
def download(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Path]:
    family = str(request.param)
    return family, hf_checkpoints.BUILDERS[family](tmp_path / "download" / f"tiny-{family}")


def _as_downloaded(folder: Path) -> None:
    assert not (folder / "manifest.json").exists()
    assert "block_size" not in json.loads((folder / "config.json").read_text())
    assert "block_size" not in json.loads((folder / "generation_config.json").read_text())
    assert (folder / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1


def test_pull_then_serve_a_chat_job(
    download: tuple[str, Path], tmp_path: Path, make_settings: Any, launcher: ProcessLauncher,
    redis_url: str,
) -> None:
    family, src = download
    _as_downloaded(src)
    root, name = tmp_path / "store", f"hf-{family}"

    pulled = CliRunner().invoke(cli, ["model", "pull", str(src), "--name", name, "--version", "v1",
                                      "--root", str(root)])
    assert pulled.exit_code == 0, pulled.output
    assert "MB/s" in pulled.stderr and "manifest written" in pulled.stdout, pulled.output
    version = root / name / "v1"
    shard_bytes = sum(p.stat().st_size for p in version.glob("*.safetensors"))
    full = check(version, mode="full")
    assert full.ok and full.bytes_read == full.bytes_total

    settings = make_settings(served_model=name, served_model_initial_version="v1", model_root=root,
                             model_dir=version)  # the API's tokenizer (prompt-length checks)
    began = time.monotonic()
    worker = launcher.start_worker(settings, concurrency=2)
    ready_seconds = time.monotonic() - began
    [info] = [w for w in list_workers(redis_lib.Redis.from_url(redis_url, decode_responses=True))
              if w.pid == worker.pid]
    verify = info.stats["model_verify"]
    read, total = verify["bytes_read"], verify["bytes_total"]
    print(f"\n[{family}] worker start from the store: ready in {ready_seconds:.1f}s (load + warm-up "
          f"{info.stats['model_load_seconds']:.2f}s); quick manifest check read {read:,} of {total:,} "
          f"bytes ({100 * read / total:.1f}%; shards {shard_bytes:,} bytes) in "
          f"{verify['seconds'] * 1000:.1f} ms; a full check reads {full.bytes_read:,} in "
          f"{full.seconds * 1000:.1f} ms")
    assert verify["mode"] == "quick" and verify["bytes_total"] == full.bytes_total
    assert verify["bytes_read"] < 0.1 * shard_bytes

    with session_factory(make_engine(settings.resolved_database_url))() as session:
        key = create_key(session, tenant=f"hf-{family}", scopes=["submit", "read"]).key
    headers = {"Authorization": f"Bearer {key}"}
    body = {"kind": "generate", "input": {"messages": [{"role": "user", "content": "What is a clover?"}]},
            "params": {"max_new_tokens": 8}}
    with TestClient(create_app(settings)) as client:
        response = client.post("/v1/jobs", json=body, headers=headers)
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]

        def finished() -> dict[str, Any] | None:
            job = client.get(f"/v1/jobs/{job_id}", headers=headers).json()
            return job if job["status"] in {"succeeded", "failed", "cancelled", "expired"} else None

        job = wait_for(finished, timeout=120, interval=0.1, message="the chat job")
    assert job["status"] == "succeeded", job
    assert job["model_version"].startswith("v1@")
    assert job["result"]["usage"]["completion_tokens"] > 0 and job["result"]["text"].strip()
