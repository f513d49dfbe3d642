"""Model versions in SQL: which versions of a model are registered, and which one is active.

Why SQL: the active version is a fleet-wide decision that must survive restarts of Redis and of
every process, exactly like a job row. Workers that serve a store model (``served_model``)
poll ``active_version`` every few seconds and switch when it changes (``worker/model_switch_protocol.py``).

A version is a folder of the model store (``<model_root>/<name>/<version>/``, written once by
``cloverq model pull``). Activating or rolling back changes one row here and never touches the
folders: rollback is activating the previous version again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import ForeignKeyConstraint, Integer, String, Text, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, Session, mapped_column

from scheduler.infra.db import lift_statement_timeout, rowcount
from scheduler.jobs.models import Base, Job, JobStatus, UTCDateTime, utcnow

MANIFEST_NAME = "manifest.json"  # a store version is a folder holding its manifest


class UnknownModelVersion(LookupError):
    """Activation of a version that is neither registered nor present in the store."""


class ModelVersionRow(Base):
    """One registered version of a model (its folder in the store)."""

    __tablename__ = "model_versions"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[str] = mapped_column(String(128), primary_key=True)
    path: Mapped[str] = mapped_column(Text, nullable=False)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)


class ActiveModel(Base):
    """The version every worker serving ``name`` should run; ``generation`` counts activations."""

    __tablename__ = "model_active"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    version: Mapped[str] = mapped_column(String(128), nullable=False)
    previous_version: Mapped[str | None] = mapped_column(String(128), nullable=True)
    generation: Mapped[int] = mapped_column(Integer, nullable=False, default=1)
    activated_at: Mapped[datetime] = mapped_column(UTCDateTime, nullable=False, default=utcnow)
    activated_by: Mapped[str | None] = mapped_column(String(255), nullable=True)
    # A canary in effect (scheduler/model_versions/canary.py): its version and share of jobs in basis points.
    canary_version: Mapped[str | None] = mapped_column(String(128), nullable=True)
    canary_basis_points: Mapped[int | None] = mapped_column(Integer, nullable=True)
    canary_started_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)

    __table_args__ = (
        ForeignKeyConstraint(["name", "version"], ["model_versions.name", "model_versions.version"],
                             name="fk_model_active_version_model_versions"),
    )


@dataclass(frozen=True)
class Activation:
    """The active version of one model, as read or just written."""

    name: str
    version: str
    previous_version: str | None
    generation: int
    activated_at: datetime
    activated_by: str | None
    canary_version: str | None = None
    canary_basis_points: int = 0  # share of jobs routed to the canary, 1/100 of a percent
    canary_started_at: datetime | None = None


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: str
    path: str
    registered_at: datetime
    active: bool


def activation_of(row: ActiveModel) -> Activation:
    """The immutable view of a ``model_active`` row (what callers and workers read)."""
    return Activation(name=row.name, version=row.version, previous_version=row.previous_version,
                      generation=row.generation, activated_at=row.activated_at, activated_by=row.activated_by,
                      canary_version=row.canary_version, canary_basis_points=row.canary_basis_points or 0,
                      canary_started_at=row.canary_started_at)


def store_path(root: Path, name: str, version: str) -> Path:
    """Where the store keeps ``name``/``version`` (same layout as ``worker.model_store``)."""
    return Path(root) / name / version


def store_has_version(root: Path, name: str, version: str) -> bool:
    """Whether the store under ``root`` holds a published (manifest-bearing) ``name``/``version``."""
    if not name or not version or "/" in name + version or name.startswith(".") or version.startswith("."):
        return False
    return (store_path(root, name, version) / MANIFEST_NAME).is_file()


def register_version(session: Session, *, name: str, version: str, path: Path | str) -> bool:
    """Record ``name``/``version`` (idempotent); returns True when it was new."""
    if session.get(ModelVersionRow, (name, version)) is not None:
        return False
    session.add(ModelVersionRow(name=name, version=version, path=str(path), registered_at=utcnow()))
    try:
        session.commit()
    except IntegrityError:  # registered concurrently: same outcome
        session.rollback()
        return False
    return True


def active_version(session: Session, *, name: str) -> Activation | None:
    """The active version of ``name`` (None before the first activation)."""
    row = session.get(ActiveModel, name, populate_existing=True)
    return activation_of(row) if row is not None else None


def activate(session: Session, *, name: str, version: str, actor: str | None = None,
             store_root: Path | None = None) -> Activation:
    """Make ``version`` the active one of ``name``; workers follow within their poll interval.

    The version must be registered, or present in the store under ``store_root`` (then it is
    registered on the way). Activating the version already active changes nothing, except that
    any activation ends a canary in effect (its queued jobs are unpinned:
    ``end_canary_rows``).
    Raises ``UnknownModelVersion`` otherwise.
    """
    if session.get(ModelVersionRow, (name, version)) is None:
        if store_root is None or not store_has_version(store_root, name, version):
            raise UnknownModelVersion(f"model {name!r} has no registered version {version!r}")
        register_version(session, name=name, version=version, path=store_path(store_root, name, version))
    row = session.get(ActiveModel, name, with_for_update=True)
    if row is None:
        row = ActiveModel(name=name, version=version, previous_version=None, generation=1,
                          activated_at=utcnow(), activated_by=actor)
        session.add(row)
    elif row.version != version:
        row.previous_version, row.version = row.version, version
        row.generation += 1
        row.activated_at = utcnow()
        row.activated_by = actor
    if row.canary_version is not None:
        end_canary_rows(session, row, keep_pinned=None)
    session.commit()
    return activation_of(row)


def ensure_active(session: Session, *, name: str, version: str, path: Path | str) -> Activation:
    """Register ``version`` and make it active only if ``name`` has no active version yet.

    A worker's first start on a fresh database uses this with its initial version; concurrent
    starts agree on one row (the loser reads the winner's).
    """
    register_version(session, name=name, version=version, path=path)
    current = active_version(session, name=name)
    if current is not None:
        return current
    session.add(ActiveModel(name=name, version=version, previous_version=None, generation=1,
                            activated_at=utcnow(), activated_by="initial"))
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
    found = active_version(session, name=name)
    assert found is not None
    return found


def list_registered(session: Session, *, name: str | None = None) -> list[RegisteredVersion]:
    """Registered versions (optionally of one model), oldest first, with the active one marked."""
    query = select(ModelVersionRow, ActiveModel.version).outerjoin(
        ActiveModel, ActiveModel.name == ModelVersionRow.name
    )
    if name is not None:
        query = query.where(ModelVersionRow.name == name)
    query = query.order_by(ModelVersionRow.name, ModelVersionRow.registered_at, ModelVersionRow.version)
    return [
        RegisteredVersion(name=row.name, version=row.version, path=row.path, registered_at=row.registered_at,
                          active=row.version == active)
        for row, active in session.execute(query)
    ]


def list_active(session: Session) -> dict[str, Activation]:
    """The active version of every model that has one."""
    return {row.name: activation_of(row) for row in session.scalars(select(ActiveModel))}


def end_canary_rows(session: Session, row: ActiveModel, *, keep_pinned: str | None) -> int:
    """Clear the canary of ``row`` (not committed) and move the queued jobs pinned to it.

    Here, beside the row it changes, because an activation ends a canary too; ``canary.py``
    (start / promote / abort) builds on this module and this module imports nothing of it.

    ``keep_pinned=None``: every queued pinned job is unpinned (promote, activate: the whole fleet
    converges on one version). A version: jobs pinned to the canary are pinned to it instead
    (abort: the withdrawn version must not take them). Returns how many jobs moved.
    """
    canary = row.canary_version
    row.canary_version = row.canary_basis_points = row.canary_started_at = None
    row.generation += 1
    queued = (Job.status == JobStatus.QUEUED.value)
    lift_statement_timeout(session)  # every queued pinned job: a backlog must not fail the move
    if keep_pinned is None:
        moved = session.execute(update(Job).where(queued, Job.routed_version.is_not(None))
                                .values(routed_version=None, updated_at=utcnow()))
    else:
        moved = session.execute(update(Job).where(queued, Job.routed_version == canary)
                                .values(routed_version=keep_pinned, updated_at=utcnow()))
    return rowcount(moved)
