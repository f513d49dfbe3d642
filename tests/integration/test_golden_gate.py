"""Golden checks gate a canary: a version with one expert's weights perturbed fails the shipped
golden set of the trained demo, ``promote --require-golden`` refuses it; the unchanged one passes.

The golden cases run through the job handlers (``worker.execution.run_kind``: the same prompt,
template and result code a worker runs) on a real engine over each checkpoint folder; the gate
reads the results recorded in the real database (``scheduler.model_versions.golden``) as
``cloverq model golden check`` records them.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.model_versions.golden import golden_refusal, record_golden_result
from scheduler.model_versions.registry import ensure_active, register_version
from worker.engine.engine import Engine, EngineConfig
from worker.execution import run_kind
from worker.job_handler import EngineContext, JobSpec
from worker.model.checkpoint import SINGLE_NAME, load_checkpoint
from worker.model.demo_trained import TRAINED_CLOVER_DEMO
from worker.model.hf_defaults import GenerationDefaults
from worker.model.manifest import write_manifest
from worker.training.golden import GOLDEN_FILE, differences, load_golden

pytestmark = pytest.mark.integration


def _failures(folder: Path, cases: list[dict[str, Any]]) -> int:
    lm = load_checkpoint(folder, dtype=torch.float32)
    engine = Engine(lm.model, EngineConfig(max_batch=8, max_len=1024), mask_token_id=lm.config.mask_token_id,  # type: ignore[arg-type]
                    eos_token_ids=lm.tokenizer.eos_token_ids,
                    default_block_size=lm.config.block_size)  # fmt: skip
    engine.start()
    declared = GenerationDefaults.from_dict(lm.generation_config).joint_decode  # as the worker reads it
    failed = 0
    try:
        for case in cases:
            body = case["body"]
            ctx = EngineContext(submit=engine.submit, tokenizer=lm.tokenizer, settings=Settings(),
                                deadline=None,
                                cancel_event=threading.Event(), on_progress=lambda _: None,
                                default_block_size=lm.config.block_size,
                                joint_decode=declared)  # fmt: skip
            outcome = run_kind(
                JobSpec(case["id"], body["kind"], "interactive", 1, body["input"], body["params"]), ctx
            )
            failed += bool(differences(case, outcome.result))
    finally:
        engine.stop()
    return failed


def _broken_copy(tmp_path: Path) -> Path:
    """The trained demo with expert 0's weights of every MoE layer replaced by noise of their scale."""
    folder = tmp_path / "broken"
    shutil.copytree(TRAINED_CLOVER_DEMO, folder)
    tensors = load_file(str(folder / SINGLE_NAME))
    gen = torch.Generator().manual_seed(0)
    hit = [n for n in tensors if ".mlp.experts.0." in n]
    assert hit
    for name in hit:
        t = tensors[name]
        tensors[name] = torch.randn(t.shape, generator=gen) * t.std() * 3
    save_file(tensors, str(folder / SINGLE_NAME), metadata={"format": "pt"})
    write_manifest(folder)
    return folder


def test_a_perturbed_expert_fails_the_golden_check_and_require_golden_refuses_it(
    tmp_path: Path, make_settings: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    torch.set_num_threads(1)
    cases, digest = load_golden(GOLDEN_FILE)
    assert len(cases) >= 10
    assert _failures(TRAINED_CLOVER_DEMO, cases) == 0
    broken = _failures(_broken_copy(tmp_path), cases)
    assert broken > 0

    from click.testing import CliRunner

    from cli.main import cli
    from scheduler.infra.settings import get_settings

    name = f"gg-{os.urandom(3).hex()}"
    settings = make_settings(served_model=name, canary_min_jobs=0)
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    request.addfinalizer(get_settings.cache_clear)
    with get_session_factory(settings.resolved_database_url)() as session:
        ensure_active(session, name=name, version="v1", path=f"/store/{name}/v1")
        for version in ("v2", "v3"):
            register_version(session, name=name, version=version, path=f"/store/{name}/{version}")
        assert golden_refusal(session, name=name, version="v2") is not None  # never checked
        record_golden_result(session, name=name, version="v2", passed=False, cases=len(cases),
                             failures=broken,
                             golden_digest=digest)  # fmt: skip
        record_golden_result(session, name=name, version="v3", passed=True, cases=len(cases), failures=0,
                             golden_digest=digest)  # fmt: skip

    def cloverq(*args: str) -> Any:
        get_settings.cache_clear()
        return CliRunner().invoke(cli, ["model", *args])

    assert cloverq("canary", name, "v2", "--percent", "10").exit_code == 0
    refused = cloverq("promote", name, "--require-golden")
    assert refused.exit_code == 1 and "golden check of version v2 failed" in refused.output, refused.output
    assert cloverq("abort", name).exit_code == 0
    assert cloverq("canary", name, "v3", "--percent", "10").exit_code == 0
    promoted = cloverq("promote", name, "--require-golden")
    assert promoted.exit_code == 0 and "active version v3" in promoted.output, promoted.output


def test_the_admin_promote_route_refuses_without_a_passing_golden_check_when_required(
    make_settings: Any,
) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from scheduler.access.api_keys import create_key
    from scheduler.model_versions.canary import start_canary

    name = f"ga-{os.urandom(3).hex()}"
    settings = make_settings(served_model=name, canary_min_jobs=0, canary_require_golden=True)
    with get_session_factory(settings.resolved_database_url)() as session:
        ensure_active(session, name=name, version="v1", path=f"/store/{name}/v1")
        register_version(session, name=name, version="v2", path=f"/store/{name}/v2")
        start_canary(session, name=name, version="v2", percent=10, actor="test")
        key = create_key(session, tenant="golden", scopes=["admin"]).key
    headers = {"Authorization": f"Bearer {key}"}
    with TestClient(create_app(settings)) as client:
        refused = client.post(f"/v1/admin/models/{name}/promote", headers=headers)
        assert refused.status_code == 409, refused.text
        error = refused.json()["error"]
        assert error["code"] == "canary_gate_refused" and "no golden check" in error["message"]
        with get_session_factory(settings.resolved_database_url)() as session:
            record_golden_result(session, name=name, version="v2", passed=True, cases=3, failures=0,
                                 golden_digest="0" * 64)  # fmt: skip
        promoted = client.post(f"/v1/admin/models/{name}/promote", headers=headers)
        assert promoted.status_code == 200, promoted.text
        assert promoted.json()["active_version"] == "v2"
