"""Canary releases: a share of jobs runs on a new version, then the fleet is promoted or returned.

The state is three columns of the model's ``model_active`` row (``canary_version``,
``canary_basis_points``, ``canary_started_at``), so SQL stays the system of record and every
process reads one row. The flow:

- ``start_canary``: workers with ``model_track=canary`` switch to the canary version and consume
  the canary lanes (``worker/model_switch_protocol.py``); new jobs are pinned at submit to the canary or
  the stable version by the hash of their id (``scheduler.model_versions.canary_routing``); the claim refuses
  a job pinned to another version than the worker's (``scheduler.jobs.lifecycle.claim_job``).
- ``promote_canary``: the canary becomes the active version (the stable workers roll to it, one
  at a time); queued pinned jobs are unpinned, so any worker of the new fleet takes them.
  Refused by ``scheduler.model_versions.canary_gate`` unless forced.
- ``abort_canary``: the canary ends; queued jobs pinned to it are pinned to the stable version
  instead (so a canary worker that has not switched back yet cannot claim them) and the canary
  workers return to the stable version.

Transitions only write SQL. Messages that now sit on the wrong lane are republished by the
reconciler (``scheduler.model_versions.canary_reconcile``), and a worker handed a job pinned elsewhere leaves
it queued: no job is lost, none runs on a version it was not pinned to.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy.orm import Session

from scheduler.jobs.models import utcnow
from scheduler.model_versions.canary_routing import VersionRoute, basis_points
from scheduler.model_versions.registry import (
    Activation,
    ActiveModel,
    ModelVersionRow,
    UnknownModelVersion,
    activation_of,
    end_canary_rows,
    register_version,
    store_has_version,
    store_path,
)


class CanaryConflict(RuntimeError):
    """A canary transition that does not apply to the model's state (HTTP 409)."""


def current_route(session: Session, name: str | None) -> VersionRoute | None:
    """The canary in effect for model ``name`` (None: none, or no model named); one PK read."""
    if not name:
        return None
    row = session.get(ActiveModel, name, populate_existing=True)
    if row is None or row.canary_version is None or not row.canary_basis_points:
        return None
    return VersionRoute(stable=row.version, canary=row.canary_version, basis_points=row.canary_basis_points)


def _ensure_registered(session: Session, *, name: str, version: str, store_root: Path | None) -> None:
    if session.get(ModelVersionRow, (name, version)) is not None:
        return
    if store_root is None or not store_has_version(store_root, name, version):
        raise UnknownModelVersion(f"model {name!r} has no registered version {version!r}")
    register_version(session, name=name, version=version, path=store_path(store_root, name, version))


def start_canary(session: Session, *, name: str, version: str, percent: float, actor: str | None = None,
                 store_root: Path | None = None) -> Activation:
    """Send ``percent`` % of new jobs of ``name`` to ``version`` (canary workers switch to it).

    Calling it again with the same version changes the share. Raises ``UnknownModelVersion``
    (not registered nor in the store), ``CanaryConflict`` (no active version yet, the version is
    the active one, or another canary is in effect) and ValueError (percent not in (0, 100)).
    """
    points = basis_points(percent)
    _ensure_registered(session, name=name, version=version, store_root=store_root)
    row = session.get(ActiveModel, name, with_for_update=True)
    if row is None:
        session.rollback()
        raise CanaryConflict(f"model {name!r} has no active version to compare a canary with")
    if row.version == version:
        session.rollback()
        raise CanaryConflict(f"{version!r} is already the active version of {name!r}")
    if row.canary_version not in (None, version):
        session.rollback()
        raise CanaryConflict(f"a canary of {name!r} is in effect ({row.canary_version}): promote or abort it")
    if row.canary_version != version:
        row.canary_started_at = utcnow()
        row.generation += 1  # followers see a new decision (and retry a version that failed before)
    row.canary_version, row.canary_basis_points = version, points
    row.activated_by = actor
    session.commit()
    return activation_of(row)


def _locked_canary(session: Session, name: str) -> ActiveModel:
    row = session.get(ActiveModel, name, with_for_update=True)
    if row is None or row.canary_version is None:
        session.rollback()
        raise CanaryConflict(f"model {name!r} has no canary in effect")
    return row


def promote_canary(session: Session, *, name: str, actor: str | None = None) -> Activation:
    """Make the canary the active version; queued pinned jobs are unpinned. The promotion gate
    (``scheduler.model_versions.canary_gate.check_promotion``) is the caller's to apply first."""
    row = _locked_canary(session, name)
    canary = row.canary_version
    assert canary is not None
    row.previous_version, row.version = row.version, canary
    row.activated_at = utcnow()
    row.activated_by = actor
    end_canary_rows(session, row, keep_pinned=None)
    session.commit()
    return activation_of(row)


def abort_canary(session: Session, *, name: str, actor: str | None = None) -> Activation:
    """End the canary: its queued jobs are pinned to the stable version; canary workers return."""
    row = _locked_canary(session, name)
    row.activated_by = actor
    end_canary_rows(session, row, keep_pinned=row.version)
    session.commit()
    return activation_of(row)
