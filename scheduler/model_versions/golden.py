"""Golden results: whether a model version passed its golden check, the gate a promotion may need.

``cloverq model golden check`` runs the golden set (fixed inputs, expected outputs:
``worker.training.golden``) against a version through the job system and records the outcome
here; ``cloverq model promote --require-golden`` (or ``CLOVERQ_CANARY_REQUIRE_GOLDEN=true``, also
for ``POST /v1/admin/models/{name}/promote``) refuses a canary whose last check did not pass. Only
counts and pass/fail are stored: no case text (contract text never leaves the jobs).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Boolean, Index, Integer, String, select
from sqlalchemy.orm import Mapped, Session, mapped_column

from scheduler.jobs.models import Base, UTCDateTime, utcnow


class GoldenResultRow(Base):
    __tablename__ = "golden_results"
    __table_args__ = (Index("ix_golden_results_version", "name", "version", "checked_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), nullable=False)
    version: Mapped[str] = mapped_column(String(128), nullable=False)
    passed: Mapped[bool] = mapped_column(Boolean, nullable=False)
    cases: Mapped[int] = mapped_column(Integer, nullable=False)
    failures: Mapped[int] = mapped_column(Integer, nullable=False)
    golden_digest: Mapped[str] = mapped_column(String(64), nullable=False)  # sha256 of the golden file
    checked_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)


@dataclass(frozen=True)
class GoldenResult:
    name: str
    version: str
    passed: bool
    cases: int
    failures: int
    golden_digest: str
    checked_at: datetime


def record_golden_result(session: Session, *, name: str, version: str, passed: bool, cases: int,
                         failures: int, golden_digest: str) -> None:  # fmt: skip
    session.add(GoldenResultRow(name=name, version=version, passed=passed, cases=cases, failures=failures,
                                golden_digest=golden_digest, checked_at=utcnow()))  # fmt: skip
    session.commit()


def last_golden_result(session: Session, *, name: str, version: str) -> GoldenResult | None:
    row = session.scalars(
        select(GoldenResultRow)
        .where(GoldenResultRow.name == name, GoldenResultRow.version == version)
        .order_by(GoldenResultRow.checked_at.desc(), GoldenResultRow.id.desc())
        .limit(1)
    ).first()
    if row is None:
        return None
    return GoldenResult(row.name, row.version, row.passed, row.cases, row.failures, row.golden_digest,
                        row.checked_at)  # fmt: skip


def golden_refusal(session: Session, *, name: str, version: str) -> str | None:
    """Why ``version`` of ``name`` may not be promoted for want of a passing golden check (or None)."""
    result = last_golden_result(session, name=name, version=version)
    if result is None:
        return f"version {version} has no golden check (cloverq model golden check --version {version})"
    if not result.passed:
        return f"the last golden check of version {version} failed {result.failures} of {result.cases} cases"
    return None
