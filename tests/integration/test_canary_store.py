"""Canary state, pins and the claim fence in SQL (SQLite and PostgreSQL), without workers.

- ``start_canary`` refuses what does not apply (the active version, an unknown version, a
  second canary); jobs submitted during it are pinned by the hash of their id;
- the claim refuses a pinned job to a worker of another version (or of no version);
- ``abort`` pins the canary's queued jobs to the stable version, ``promote`` unpins them all;
- the promotion gate refuses too few canary jobs and a worse error rate;
- the reconciler's rules: a pin to a retired version is dropped; canary jobs waiting with no
  canary worker registered go to the stable version.
"""

from __future__ import annotations

import os
import uuid
from datetime import timedelta
from typing import Any

import pytest
import redis as redis_lib
from sqlalchemy import update
from sqlalchemy.orm import Session

from scheduler.infra.db import get_session_factory
from scheduler.infra.settings import Settings
from scheduler.jobs.lifecycle import claim_job, finish_job
from scheduler.jobs.models import Job, JobStatus, utcnow
from scheduler.jobs.service import submit_job
from scheduler.model_versions.canary import (
    CanaryConflict,
    abort_canary,
    current_route,
    promote_canary,
    start_canary,
)
from scheduler.model_versions.canary_gate import check_promotion
from scheduler.model_versions.canary_reconcile import heal_pins
from scheduler.model_versions.canary_routing import route_version
from scheduler.model_versions.registry import (
    UnknownModelVersion,
    activate,
    active_version,
    ensure_active,
    register_version,
)

pytestmark = pytest.mark.integration


def _submit(session: Session, settings: Settings, n: int) -> list[Job]:
    return [submit_job(session, tenant="canary-store", kind="generate", input={"prompt": "x"},
                       params={"max_new_tokens": 2}, settings=settings, publish=False)[0] for _ in range(n)]


def _pins(session: Session, jobs: list[Job]) -> dict[uuid.UUID, str | None]:
    session.expire_all()
    return {job.id: session.get(Job, job.id).routed_version for job in jobs}  # type: ignore[union-attr]


def test_canary_pins_fence_transitions_gate_and_reconciler(
    db_backend_url: str, make_settings: Any, redis_client: redis_lib.Redis
) -> None:
    name = f"cm-{os.urandom(3).hex()}"
    settings = make_settings(database_url=db_backend_url, served_model=name, canary_min_jobs=2,
                             canary_error_margin=0.0, canary_reroute_seconds=5)
    sessions = get_session_factory(db_backend_url)
    with sessions() as session:
        ensure_active(session, name=name, version="v1", path=f"/store/{name}/v1")
        for version in ("v2", "v3"):
            register_version(session, name=name, version=version, path=f"/store/{name}/{version}")
        with pytest.raises(CanaryConflict):
            start_canary(session, name=name, version="v1", percent=10)  # already active
        with pytest.raises(UnknownModelVersion):
            start_canary(session, name=name, version="v9", percent=10)
        with pytest.raises(ValueError):
            start_canary(session, name=name, version="v2", percent=100)
        with pytest.raises(CanaryConflict):
            abort_canary(session, name=name)
        started = start_canary(session, name=name, version="v2", percent=50, actor="test")
        assert (started.canary_version, started.canary_basis_points) == ("v2", 5000)
        with pytest.raises(CanaryConflict):
            start_canary(session, name=name, version="v3", percent=10)  # one canary at a time
        route = current_route(session, name)
        assert route is not None and (route.stable, route.canary) == ("v1", "v2")

        jobs = _submit(session, settings, 40)
        pins = _pins(session, jobs)
        assert pins == {job.id: route_version(job.id, route) for job in jobs}
        canary_jobs = [job for job in jobs if pins[job.id] == "v2"]
        stable_jobs = [job for job in jobs if pins[job.id] == "v1"]
        assert len(canary_jobs) >= 4 and len(stable_jobs) >= 4

        # The claim fence: only the pinned version's workers (never a worker of no version).
        first = canary_jobs[0].id
        for served in ("v1", None):
            assert claim_job(session, job_id=first, worker_id="w", model_version=f"{served}@x",
                             settings=settings, served_version=served) is None
        claimed = claim_job(session, job_id=first, worker_id="w2", model_version="v2@x", settings=settings,
                            served_version="v2")
        assert claimed is not None and claimed.routed_version == "v2"

        # The gate: one canary job finished (failed) against one stable success.
        from scheduler.jobs.lifecycle import Lease

        assert finish_job(session, lease=Lease(first, 1), status=JobStatus.FAILED, settings=settings)
        stable_claim = claim_job(session, job_id=stable_jobs[0].id, worker_id="w1", model_version="v1@x",
                                 settings=settings, served_version="v1")
        assert stable_claim is not None
        assert finish_job(session, lease=Lease(stable_jobs[0].id, 1), status=JobStatus.SUCCEEDED,
                          settings=settings, result={"text": "ok"})
        current = active_version(session, name=name)
        assert current is not None
        report = check_promotion(session, activation=current, settings=settings)
        assert not report.ok and len(report.reasons) == 2, report  # too few, and worse than stable
        assert (report.canary.finished, report.canary.failed, report.stable.finished) == (1, 1, 1)

        # Abort: queued canary jobs go to the stable version; stable pins stay.
        aborted = abort_canary(session, name=name, actor="test")
        assert aborted.canary_version is None and current_route(session, name) is None
        after_abort = _pins(session, jobs)
        assert all(after_abort[j.id] == "v1" for j in canary_jobs[1:] + stable_jobs[1:])
        assert _submit(session, settings, 1)[0].routed_version is None  # no canary: not pinned

        # Promote: every queued pinned job is unpinned; v2 becomes active.
        start_canary(session, name=name, version="v2", percent=50)
        more = _submit(session, settings, 10)
        promoted = promote_canary(session, name=name, actor="test")
        assert (promoted.version, promoted.previous_version, promoted.canary_version) == ("v2", "v1", None)
        queued = [j for j in jobs if j.id not in (first, stable_jobs[0].id)] + more
        assert set(_pins(session, queued).values()) == {None}

        # Reconciler rule 1: a pin to a retired version (here v1 after the promotion) is dropped.
        stale = _submit(session, settings, 1)[0]
        session.execute(update(Job).where(Job.id == stale.id).values(routed_version="v1"))
        session.commit()
        assert heal_pins(session, redis_client=redis_client, settings=settings) >= 1
        assert _pins(session, [stale])[stale.id] is None

        # Rule 2: a canary with no canary worker registered: jobs waiting long enough go to stable.
        start_canary(session, name=name, version="v3", percent=99.99)
        waiting = _submit(session, settings, 3)
        assert set(_pins(session, waiting).values()) == {"v3"}
        assert heal_pins(session, redis_client=redis_client, settings=settings) == 0  # not waited yet
        old = utcnow() - timedelta(seconds=10)
        session.execute(update(Job).where(Job.id.in_([j.id for j in waiting])).values(created_at=old))
        session.commit()
        assert heal_pins(session, redis_client=redis_client, settings=settings) == 3
        assert set(_pins(session, waiting).values()) == {"v2"}

        # An activation ends a canary too: its queued jobs are unpinned.
        pinned = _submit(session, settings, 2)
        assert set(_pins(session, pinned).values()) == {"v3"}
        ended = activate(session, name=name, version="v2")
        assert ended.canary_version is None and set(_pins(session, pinned + waiting).values()) == {None}


def test_cli_canary_promote_refused_then_forced_and_abort(
    make_settings: Any, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    from click.testing import CliRunner

    from cli.main import cli
    from scheduler.infra.settings import get_settings

    name = f"cc-{os.urandom(3).hex()}"
    settings = make_settings(served_model=name, canary_min_jobs=5)
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    request.addfinalizer(get_settings.cache_clear)  # later tests must not see these settings
    with get_session_factory(settings.resolved_database_url)() as session:
        ensure_active(session, name=name, version="v1", path=f"/store/{name}/v1")
        register_version(session, name=name, version="v2", path=f"/store/{name}/v2")

    def cloverq(*args: str) -> Any:
        get_settings.cache_clear()
        return CliRunner().invoke(cli, ["model", *args])

    started = cloverq("canary", name, "v2", "--percent", "12.5")
    assert started.exit_code == 0 and "canary v2 at 12.5% of new jobs" in started.output, started.output
    # no worker of this model runs here: recorded, and the operator is told it moves no job yet
    assert f"no ready worker serves model '{name}' now" in started.stderr, started.output
    refused = cloverq("promote", name)
    assert refused.exit_code == 1 and "promotion refused" in refused.output, refused.output
    both = cloverq("promote", name, "--require-golden")  # every reason at once, not the golden one alone
    assert both.exit_code == 1 and "has no golden check" in both.output, both.output
    assert "tallies" in both.output, both.output
    forced = cloverq("promote", name, "--force")
    assert forced.exit_code == 0, forced.output
    assert "active version v2 (previous: v1), no canary" in forced.output
    assert cloverq("abort", name).exit_code == 1  # nothing to abort any more
    assert cloverq("canary", name, "v1", "--percent", "5").exit_code == 0
    aborted = cloverq("abort", name)
    assert aborted.exit_code == 0 and "active version v2" in aborted.output, aborted.output
