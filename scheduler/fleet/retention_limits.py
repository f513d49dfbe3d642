"""A tenant's retention policy as the operator set it, read from SQL on the submit path.

The overrides are operator state (``scheduler/fleet/operator_state.py``: SQL first, then the
Redis hash ``LIMITS_KEY``). Submits read them here from SQL, the system of record: a Redis that
restarted empty (before beat restores it) must not let a job ask for a retention above its
tenant's maximum. One primary-key lookup of at most two rows.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from scheduler.access.retention import RETENTION_FIELDS, RetentionPolicy, override_field, policy_for
from scheduler.fleet.operator_state import KIND_LIMIT, OperatorSetting
from scheduler.infra.settings import Settings


def tenant_retention_policy(session: Session, *, tenant: str, settings: Settings) -> RetentionPolicy:
    """``tenant``'s default and maximum retention (overrides from ``operator_state``, else settings)."""
    names = [override_field(field, tenant) for field in RETENTION_FIELDS]
    rows = session.execute(
        select(OperatorSetting.name, OperatorSetting.value)
        .where(OperatorSetting.kind == KIND_LIMIT, OperatorSetting.name.in_(names))
    ).all()
    overrides = {row.name: float(row.value) for row in rows if row.value is not None}
    return policy_for(tenant, overrides, settings)
