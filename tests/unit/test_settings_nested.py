"""Settings are nested by concern; the flat names (environment, keywords) keep working."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from scheduler.infra.settings import Settings, flat_fields, settings_groups
from scheduler.infra.settings_groups.engine import EngineSettings


def test_every_field_is_in_a_group_or_top_level_under_one_flat_name() -> None:
    table = flat_fields()
    # as many settings as before the grouping, + client.stack_file (issue 33), + the connection and
    # upload bounds (issue 31: six), + canary.require_golden (issue 25),
    # + limits.max_schema_bytes and limits.max_schema_depth (issue 24), + limits.max_tools (issue 24),
    # + the planes group (issue 28: fifteen) and client.admin_api_url / client.ops_api_url (issue 28),
    # + retention default / max and the purge tick's interval and batch (issue 27: four),
    # + the other issue 27 settings (fair share, delayed jobs, webhook progress) and prefill chunks,
    # + scheduling.prefill_token_cost (issue 26) and beat's expiry_batch and lease_seconds (issue 32)
    # + planes.drain_seconds and planes.stop_grace_seconds (issue 32: an API replica's drain)
    # + engine.token_work_keys (issue 26: the prefill budget counted in work)
    # + observability.tracing_step_spans (issue 29: the submit's steps as spans, not events)
    # + decisions.joint_decode (issue 25: a joint decision block by block or in one pass)
    assert len(table) == 151
    grouped = sum(len(group.model_fields) for group in settings_groups().values())
    assert grouped + [entry.group for entry in table.values()].count(None) == len(table)
    assert len({entry.env for entry in table.values()}) == len(table)
    assert table["engine_max_batch"].path == "engine.max_batch"
    assert table["engine_max_batch"].env == "CLOVERQ_ENGINE_MAX_BATCH"
    assert table["data_dir"].path == "data_dir"
    assert table["prometheus_multiproc_dir"].env == "PROMETHEUS_MULTIPROC_DIR"


def test_environment_names_are_the_flat_ones(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CLOVERQ_ENGINE_MAX_BATCH", "4")
    monkeypatch.setenv("CLOVERQ_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("CLOVERQ_AUTH", "disabled")
    monkeypatch.setenv("CLOVERQ_QUEUE_MAX_DEPTH", '{"bulk": 3}')
    monkeypatch.setenv("CLOVERQ_WEBHOOK_ALLOWED_HOSTS", "Hooks.Example., 10.0.0.1")
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prom"))
    settings = Settings()
    assert settings.engine.max_batch == 4
    assert settings.data_dir == tmp_path
    assert settings.security.auth == "disabled"
    assert settings.admission.queue_max_depth == {"bulk": 3}
    assert settings.webhooks.allowed_hosts == ["hooks.example", "10.0.0.1"]
    assert settings.observability.prometheus_multiproc_dir == tmp_path / "prom"
    assert Settings(engine_max_batch=2).engine.max_batch == 2  # a keyword wins over the environment
    with monkeypatch.context() as patch:
        patch.setenv("CLOVERQ_ENGINE", '{"max_batch": 9}')  # the group names are not variables
        assert Settings().engine.max_batch == 4


def test_flat_and_nested_keywords_are_the_same_settings() -> None:
    flat = Settings(engine_max_batch=4, database_url="sqlite://", model_track="canary")
    nested = Settings(engine={"max_batch": 4}, database=dict(url="sqlite://"), canary={"track": "canary"})
    assert flat == nested
    assert Settings(engine=EngineSettings(max_batch=4)) == Settings(engine_max_batch=4)
    merged = Settings(engine={"max_len": 128}, engine_max_batch=3)  # flat joins the nested group
    assert (merged.engine.max_len, merged.engine.max_batch) == (128, 3)


def test_constraints_and_validators_hold_under_both_names() -> None:
    with pytest.raises(ValidationError):
        Settings(engine_max_batch=0)
    with pytest.raises(ValidationError, match="weight_group_size must be 32, 64 or 128"):
        Settings(model={"weight_group_size": 48})
    with pytest.raises(ValidationError):
        Settings(webhook_allowed_networks="not-a-network")
    with pytest.raises(ValidationError):
        Settings(engine={"no_such_setting": 1})


def test_replaced_validates_through_the_flat_names() -> None:
    base = Settings(engine_max_batch=4, visibility_timeout_seconds=5.0)
    changed = base.replaced(engine_max_batch=8, auth="disabled")
    assert (changed.engine.max_batch, changed.security.auth) == (8, "disabled")
    assert changed.jobs.visibility_timeout_seconds == 5.0 and base.engine.max_batch == 4
    with pytest.raises(ValidationError):
        base.replaced(engine_max_batch=0)
    with pytest.raises(TypeError, match="not a setting: engine_max_batchh"):
        base.replaced(engine_max_batchh=8)


def test_to_env_reproduces_the_settings(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, engine_max_batch=3, fault_injection=True,
                        webhook_allowed_networks=["10.8.0.0/16"], queue_max_depth={"bulk": 7})
    env = settings.to_env()
    assert env["CLOVERQ_ENGINE_MAX_BATCH"] == "3" and env["CLOVERQ_FAULT_INJECTION"] == "true"
    assert "CLOVERQ_DATABASE_URL" not in env  # unset values are left out
    for name in list(os.environ):
        if name.startswith("CLOVERQ_") or name == "PROMETHEUS_MULTIPROC_DIR":
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Settings() == settings
