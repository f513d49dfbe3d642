"""The ``tick_claims`` table: a periodic tick message that ran, so its second delivery is dropped.

``scheduler/infra/tick_claims.py`` says why the claim moved from Redis to SQL (a Sentinel failover
loses a claim written to the old master and hands the tick out again). One row per tick message,
primary key the message id, deleted by the purge tick a minute after the message expires
(``expires_at``, indexed for that delete).

Revision ID: 0017_tick_claims
Revises: 0016_json_keeps_key_order
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from scheduler.jobs.models import UTCDateTime

revision = "0017_tick_claims"
down_revision = "0016_json_keeps_key_order"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tick_claims",
        sa.Column("message_id", sa.String(255), nullable=False),
        sa.Column("task", sa.String(128), nullable=False),
        sa.Column("expires_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("message_id", name="pk_tick_claims"),
    )
    op.create_index("ix_tick_claims_expires_at", "tick_claims", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_tick_claims_expires_at", table_name="tick_claims")
    op.drop_table("tick_claims")
