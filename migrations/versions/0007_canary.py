"""Canary releases: the canary of a model (model_active) and the version a job is pinned to (jobs).

Revision ID: 0007_canary
Revises: 0005_openai_batches
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from scheduler.jobs.models import UTCDateTime

revision = "0007_canary"
down_revision = "0005_openai_batches"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable columns only: an ALTER TABLE ... ADD COLUMN on both backends, no table rewrite.
    op.add_column("model_active", sa.Column("canary_version", sa.String(128), nullable=True))
    op.add_column("model_active", sa.Column("canary_basis_points", sa.Integer(), nullable=True))
    op.add_column("model_active", sa.Column("canary_started_at", UTCDateTime(), nullable=True))
    op.add_column("jobs", sa.Column("routed_version", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("routed_version")
    with op.batch_alter_table("model_active") as batch:
        batch.drop_column("canary_started_at")
        batch.drop_column("canary_basis_points")
        batch.drop_column("canary_version")
