"""Golden results: the last golden checks of each model version (scheduler/model_versions/golden.py).

Revision ID: 0010_golden_results
Revises: 0008_operator_state
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from scheduler.jobs.models import UTCDateTime

revision = "0010_golden_results"
down_revision = "0008_operator_state"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "golden_results",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("passed", sa.Boolean(), nullable=False),
        sa.Column("cases", sa.Integer(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("golden_digest", sa.String(64), nullable=False),
        sa.Column("checked_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_golden_results"),
    )
    op.create_index("ix_golden_results_version", "golden_results", ["name", "version", "checked_at"])


def downgrade() -> None:
    op.drop_index("ix_golden_results_version", table_name="golden_results")
    op.drop_table("golden_results")
