"""Model versions: registered versions per model and the active one (scheduler/model_versions/registry.py).

Revision ID: 0004_model_versions
Revises: 0003_batches
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from scheduler.jobs.models import UTCDateTime

revision = "0004_model_versions"
down_revision = "0003_batches"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "model_versions",
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("registered_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("name", "version", name="pk_model_versions"),
    )
    op.create_table(
        "model_active",
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("version", sa.String(128), nullable=False),
        sa.Column("previous_version", sa.String(128), nullable=True),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("activated_at", UTCDateTime(), nullable=False),
        sa.Column("activated_by", sa.String(255), nullable=True),
        sa.PrimaryKeyConstraint("name", name="pk_model_active"),
        sa.ForeignKeyConstraint(["name", "version"], ["model_versions.name", "model_versions.version"],
                                name="fk_model_active_version_model_versions"),
    )


def downgrade() -> None:
    op.drop_table("model_active")
    op.drop_table("model_versions")
