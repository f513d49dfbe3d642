"""Data retention (issue 27 part 3): the arithmetic of a job's retention and its tenant's limits,
and what a purge keeps of a job's result, progress and webhook bodies (pure functions, no I/O)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from pydantic import TypeAdapter, ValidationError

from api.routes.admin import _limit_changes
from api.schemas.admin import LimitsUpdate
from api.schemas.jobs import JobCreate
from scheduler.access.limit_overrides import validate_limit_field
from scheduler.access.retention import (
    RetentionPolicy,
    RetentionTooLongError,
    deployment_policy,
    override_field,
    policy_for,
    purge_due_at,
)
from scheduler.infra.settings import Settings
from scheduler.maintenance.data_purge import (
    is_tombstone,
    tombstone_payload,
    tombstone_progress,
    tombstone_result,
)

DAY = 24 * 3600
SECRET = "CONFIDENTIAL-CLAUSE-7"


def test_without_settings_or_overrides_data_lives_until_the_result_ttl() -> None:
    policy = deployment_policy(Settings(result_ttl_seconds=7 * DAY))
    assert policy == RetentionPolicy(default_seconds=None, max_seconds=7 * DAY)
    assert policy.resolve(None) is None  # no retention: the result TTL (expiry) purges it
    assert policy.resolve(0) == 0  # as soon as it finished (the tick waits SETTLE_SECONDS)
    assert policy.resolve(7 * DAY) == 7 * DAY
    with pytest.raises(RetentionTooLongError) as refused:
        policy.resolve(7 * DAY + 1)  # longer than the result TTL: a promise expiry would break
    assert (refused.value.requested, refused.value.maximum) == (7 * DAY + 1, 7 * DAY)


def test_tenant_overrides_win_over_the_settings_and_stay_below_the_ttl() -> None:
    settings = Settings(result_ttl_seconds=10 * DAY, retention_default_seconds=DAY,
                        retention_max_seconds=2 * DAY)
    assert deployment_policy(settings) == RetentionPolicy(default_seconds=DAY, max_seconds=2 * DAY)
    overrides = {override_field("retention_default", "acme"): 3600.0,
                 override_field("retention_max", "acme"): 30 * DAY,  # above the TTL: cut to it
                 override_field("retention_max", "other"): 60.0}
    assert policy_for("acme", overrides, settings) == RetentionPolicy(3600, 10 * DAY)
    # another tenant's override does not apply; its default above its maximum is cut to it
    assert policy_for("other", overrides, settings) == RetentionPolicy(60, 60)
    assert policy_for("nobody", overrides, settings) == RetentionPolicy(DAY, 2 * DAY)


def test_the_purge_is_due_retention_after_the_finish_but_never_before_the_settle_time() -> None:
    finished = datetime(2025, 1, 1, tzinfo=UTC)
    assert purge_due_at(finished, 3600, settle_seconds=5) == finished + timedelta(seconds=3600)
    assert purge_due_at(finished, 0, settle_seconds=5) == finished + timedelta(seconds=5)


def test_requests_take_retention_seconds_within_static_bounds() -> None:
    create = TypeAdapter(JobCreate)
    body = {"kind": "generate", "input": {"prompt": "x"}}
    assert create.validate_python({**body, "retention_seconds": 60}).retention_seconds == 60
    assert create.validate_python(body).retention_seconds is None
    for bad in (-1, 10**12, "soon", 1.5):
        with pytest.raises(ValidationError):
            create.validate_python({**body, "retention_seconds": bad})


def test_admin_limits_set_and_clear_per_tenant_retention_overrides() -> None:
    update = LimitsUpdate.model_validate(
        {"tenants": {"acme": {"retention_max_seconds": 86400, "retention_default_seconds": None}}})
    assert _limit_changes(update) == {"retention_max:acme": 86400, "retention_default:acme": None}
    validate_limit_field("retention_max:acme")
    validate_limit_field("retention_default:acme")
    with pytest.raises(ValueError):
        validate_limit_field("retention_max")  # per tenant only (the deployment's: settings)
    with pytest.raises(ValidationError):
        LimitsUpdate.model_validate({"tenants": {"acme": {"retention_max_seconds": -1}}})


def test_a_tombstone_keeps_figures_and_never_text() -> None:
    result = {"text": SECRET, "token_ids": [1, 2], "reasoning": SECRET, "data": {"v": SECRET},
              "tool_calls": [{"function": {"arguments": SECRET}}], "finish_reason": "eos", "mode": "joint",
              "answers": [{"choice": SECRET}], "timings": {"engine_run_seconds": 0.5},
              "usage": {"completion_tokens": 2, "steps_used": 4, "note": SECRET}}
    kept = tombstone_result(result)
    assert kept == {"usage": {"completion_tokens": 2, "steps_used": 4},
                    "timings": {"engine_run_seconds": 0.5}, "finish_reason": "eos", "mode": "joint"}
    assert tombstone_result({"text": SECRET}) is None and tombstone_result(None) is None
    assert tombstone_progress({"blocks_done": 3, "partial_text": SECRET}) == {"blocks_done": 3}
    assert tombstone_progress({"partial_text": SECRET}) is None


def test_a_webhook_body_keeps_the_job_id_status_and_labels_only() -> None:
    purged_at = datetime(2025, 1, 2, tzinfo=UTC)
    payload = {"event": "job.finished", "extra": SECRET,
               "job": {"id": "j1", "kind": "generate", "status": "failed", "batch_id": None,
                       "metadata": {"doc": "42"}, "result": {"text": SECRET},
                       "error": {"code": "invalid_input", "message": SECRET},
                       "progress": {"blocks_done": 2, "partial_text": SECRET}, "future_field": SECRET,
                       "finished_at": "2025-01-01T00:00:00+00:00"}}
    tombstone = tombstone_payload(payload, purged_at)
    assert SECRET not in json.dumps(tombstone)
    assert tombstone["event"] == "job.finished"
    assert tombstone["job"]["error"] == {"code": "invalid_input", "message": None}
    assert tombstone["job"]["progress"] == {"blocks_done": 2}
    assert tombstone["job"]["result"] is None and tombstone["job"]["metadata"] == {"doc": "42"}
    assert is_tombstone(tombstone) and not is_tombstone(payload)
    assert tombstone_payload(tombstone, purged_at + timedelta(days=1))["job"]["purged_at"] != \
        tombstone["job"]["purged_at"]  # (callers skip tombstones: the first purge time stays)
