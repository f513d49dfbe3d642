"""Operator state: drained queues and limit overrides, the SQL record of what Redis mirrors
(scheduler/fleet/operator_state.py).

Revision ID: 0008_operator_state
Revises: 0007_canary
"""

from __future__ import annotations

from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

from scheduler.jobs.models import UTCDateTime

revision = "0008_operator_state"
down_revision = "0007_canary"
branch_labels = None
depends_on = None


def upgrade() -> None:
    table = op.create_table(
        "operator_state",
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("kind", "name", name="pk_operator_state"),
    )
    # Until the first restore: import what Redis holds (state set before this revision) instead
    # of overwriting it with this empty table (scheduler.fleet.operator_state._adopt).
    op.bulk_insert(table, [{"kind": "meta", "name": "adopt_redis", "value": None,
                            "updated_at": datetime.now(UTC)}])


def downgrade() -> None:
    op.drop_table("operator_state")
