"""OpenAI Batch API: uploaded files and OpenAI batches over cloverq batches
(scheduler/batches/openai_batches.py).

Revision ID: 0005_openai_batches
Revises: 0004_model_versions
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from scheduler.jobs.models import UTCDateTime

revision = "0005_openai_batches"
down_revision = "0004_model_versions"
branch_labels = None
depends_on = None

JSON_TYPE = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "openai_files",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_openai_files"),
    )
    op.create_index("ix_openai_files_tenant", "openai_files", ["tenant"])
    op.create_table(
        "openai_batches",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("batch_id", sa.Uuid(as_uuid=True), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("metadata", JSON_TYPE, nullable=True),
        sa.Column("requests", JSON_TYPE, nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("cancelling_at", UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_openai_batches"),
    )
    op.create_index("ix_openai_batches_tenant", "openai_batches", ["tenant"])


def downgrade() -> None:
    op.drop_index("ix_openai_batches_tenant", table_name="openai_batches")
    op.drop_table("openai_batches")
    op.drop_index("ix_openai_files_tenant", table_name="openai_files")
    op.drop_table("openai_files")
