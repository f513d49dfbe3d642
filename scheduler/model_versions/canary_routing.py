"""Which version a job is routed to during a canary, and which Celery queue carries it (pure).

Why pure: the API at submit, the reconciler at republish and the tests must agree on a job's
version and lane without any shared state, so both are functions of the job id and the one SQL
row of the model (``model_active``, read by ``scheduler.model_versions.canary.current_route``).

- **Version.** While a canary is in effect, a job goes to the canary version when the hash of its
  id falls below the canary's share: ``sha256(id) mod 10000 < basis points``. Deterministic and
  stateless (any process, any retry, the same answer), uniform over ids, independent of tenant.
  Without a canary a job is routed to no version (``None``): any worker may claim it, exactly
  as before canaries existed (an activation rolls the fleet and jobs follow it).
- **Lane.** Jobs routed to the canary travel on ``canary.<queue>`` (e.g. ``canary.interactive``),
  consumed only by workers serving the canary version; every other job on the plain class
  queue. The lane is only delivery: the claim in ``scheduler.jobs.lifecycle.claim_job`` refuses a
  job pinned to another version than the claiming worker's, whatever queue it came from.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from scheduler.infra.queue_names import CANARY_LANE_PREFIX

BASIS_POINTS = 10_000  # a canary's share is stored in 1/100 of a percent


@dataclass(frozen=True)
class VersionRoute:
    """A canary in effect for one model: the stable (active) version, the canary, its share."""

    stable: str
    canary: str
    basis_points: int

    @property
    def percent(self) -> float:
        return self.basis_points * 100 / BASIS_POINTS


def basis_points(percent: float) -> int:
    """``percent`` (0 < p < 100, two decimals kept) as basis points; ValueError outside."""
    points = round(float(percent) * BASIS_POINTS / 100)
    if not 0 < points < BASIS_POINTS:
        raise ValueError(f"a canary's percent must be above 0 and below 100, not {percent}")
    return points


def job_bucket(job_id: uuid.UUID) -> int:
    """The job's bucket in ``[0, 10000)``: hashed so that ids chosen by callers (uuid7, ...) spread too."""
    return int.from_bytes(hashlib.sha256(job_id.bytes).digest()[:8], "big") % BASIS_POINTS


def route_version(job_id: uuid.UUID, route: VersionRoute | None) -> str | None:
    """The version a new job is pinned to (None: no canary, any version)."""
    if route is None:
        return None
    return route.canary if job_bucket(job_id) < route.basis_points else route.stable


def lane(queue: str, routed_version: str | None, route: VersionRoute | None) -> str:
    """The Celery queue a job's message goes to: the canary lane of ``queue`` for canary jobs."""
    if route is not None and routed_version == route.canary:
        return CANARY_LANE_PREFIX + queue
    return queue


def is_canary_lane(name: str) -> bool:
    return name.startswith(CANARY_LANE_PREFIX)


def queue_of_lane(name: str) -> str:
    """The class queue a delivery belongs to (``canary.joint`` -> ``joint``)."""
    return name.removeprefix(CANARY_LANE_PREFIX)


def lane_names(queues: Iterable[str], *, canary: bool) -> list[str]:
    """The Celery queues a worker consumes for its class ``queues`` on the canary lane or not."""
    return [CANARY_LANE_PREFIX + q if canary else q for q in queues]


def served_target(*, stable: str, canary: str | None, track: str) -> tuple[str, bool]:
    """``(version, on the canary lane)`` a worker of ``track`` should serve.

    A ``canary`` worker serves the canary version while one is in effect, else the stable one;
    a ``stable`` worker always serves the stable (active) version.
    """
    if track == "canary" and canary is not None:
        return canary, True
    return stable, False
