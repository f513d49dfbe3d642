"""The promotion gate: a canary is promoted only after enough jobs and no worse an error rate.

Why SQL and not the metrics: promotion is a rare operator action that must be decided on the
record that cannot be lost (the jobs table), not on counters a Redis flush resets. The tally
counts jobs pinned to each version since the canary started that reached a final status
(``failed`` is an error; ``cancelled`` and ``expired`` are neither success nor error). The
query scans the canary's window of the table: fine for an operator command, never on a hot path.
Where asked for (``canary.require_golden``, ``promote --require-golden``), the canary's last golden
check must have passed too: one gate, so the CLI, the admin API and its dry run
(``GET /v1/admin/models/{name}/canary``) give the same reasons.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job, JobStatus
from scheduler.model_versions.golden import golden_refusal
from scheduler.model_versions.registry import Activation

COUNTED = (JobStatus.SUCCEEDED.value, JobStatus.FAILED.value)


@dataclass(frozen=True)
class VersionTally:
    """Finished jobs of one version during the canary."""

    version: str
    finished: int = 0
    failed: int = 0

    @property
    def error_rate(self) -> float:
        return self.failed / self.finished if self.finished else 0.0


@dataclass(frozen=True)
class GateReport:
    """The promotion decision and why (``reasons`` empty: promotable)."""

    canary: VersionTally
    stable: VersionTally
    min_jobs: int
    error_margin: float
    reasons: list[str] = field(default_factory=list)
    golden: str | None = None  # why the golden gate refuses, where it was asked for (among ``reasons``)

    @property
    def ok(self) -> bool:
        return not self.reasons

    def as_dict(self) -> dict[str, object]:
        def one(t: VersionTally) -> dict[str, object]:
            return {"version": t.version, "finished": t.finished, "failed": t.failed,
                    "error_rate": round(t.error_rate, 4)}

        return {"ok": self.ok, "reasons": list(self.reasons), "min_jobs": self.min_jobs,
                "error_margin": self.error_margin, "canary": one(self.canary), "stable": one(self.stable),
                "golden": self.golden}


def tally(session: Session, *, versions: list[str], since: datetime | None) -> dict[str, VersionTally]:
    """Succeeded and failed jobs pinned to each of ``versions`` created at or after ``since``."""
    query = (select(Job.routed_version, Job.status, func.count())
             .where(Job.routed_version.in_(versions), Job.status.in_(COUNTED))
             .group_by(Job.routed_version, Job.status))
    if since is not None:
        query = query.where(Job.created_at >= since)
    counts: dict[str, dict[str, int]] = {v: {} for v in versions}
    for version, status, n in session.execute(query):
        counts[str(version)][str(status)] = int(n)
    session.commit()
    return {v: VersionTally(version=v, finished=sum(c.values()), failed=c.get(JobStatus.FAILED.value, 0))
            for v, c in counts.items()}


def check_promotion(session: Session, *, activation: Activation, settings: Settings,
                    require_golden: bool | None = None) -> GateReport:
    """Whether the canary of ``activation`` may be promoted (see the module doc), with every reason
    it may not at once. ``require_golden`` (None: ``canary.require_golden``): the canary's last
    golden check must have passed (``scheduler.model_versions.golden``), the first reason."""
    assert activation.canary_version is not None
    tallies = tally(session, versions=[activation.canary_version, activation.version],
                    since=activation.canary_started_at)
    canary, stable = tallies[activation.canary_version], tallies[activation.version]
    needs_golden = settings.canary.require_golden if require_golden is None else require_golden
    golden = golden_refusal(session, name=activation.name, version=activation.canary_version) \
        if needs_golden else None
    reasons: list[str] = [golden] if golden is not None else []
    if canary.finished < settings.canary.min_jobs:
        reasons.append(f"the canary finished {canary.finished} jobs, fewer than {settings.canary.min_jobs}")
    if canary.error_rate > stable.error_rate + settings.canary.error_margin:
        reasons.append(f"the canary's error rate {canary.error_rate:.2%} exceeds the stable one's "
                       f"{stable.error_rate:.2%} by more than {settings.canary.error_margin:.2%}")
    return GateReport(canary=canary, stable=stable, min_jobs=settings.canary.min_jobs,
                      error_margin=settings.canary.error_margin, reasons=reasons, golden=golden)
