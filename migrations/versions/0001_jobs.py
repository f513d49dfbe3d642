"""The jobs table.

Revision ID: 0001_jobs
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from scheduler.jobs.models import UTCDateTime

revision = "0001_jobs"
down_revision = None
branch_labels = None
depends_on = None

JSON_TYPE = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Uuid(as_uuid=True), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("priority", sa.String(16), nullable=False),
        sa.Column("queue", sa.String(16), nullable=False),
        sa.Column("cost", sa.Integer(), nullable=False),
        sa.Column("input", JSON_TYPE, nullable=True),
        sa.Column("params", JSON_TYPE, nullable=False),
        sa.Column("metadata", JSON_TYPE, nullable=True),
        sa.Column("step_budget", sa.Integer(), nullable=True),
        sa.Column("steps_used", sa.Integer(), nullable=False),
        sa.Column("progress", JSON_TYPE, nullable=True),
        sa.Column("result", JSON_TYPE, nullable=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("lease_deadline", UTCDateTime(), nullable=True),
        sa.Column("worker_id", sa.String(255), nullable=True),
        sa.Column("model_version", sa.String(255), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=True),
        sa.Column("request_fingerprint", sa.String(64), nullable=True),
        sa.Column("request_id", sa.String(128), nullable=True),
        sa.Column("webhook_url", sa.Text(), nullable=True),
        sa.Column("batch_id", sa.Uuid(as_uuid=True), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("available_at", UTCDateTime(), nullable=False),
        sa.Column("started_at", UTCDateTime(), nullable=True),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.Column("expires_at", UTCDateTime(), nullable=True),
        sa.Column("updated_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_jobs"),
        sa.UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
    )
    op.create_index("ix_jobs_tenant_created", "jobs", ["tenant", "created_at", "id"])
    op.create_index("ix_jobs_tenant_status_created", "jobs", ["tenant", "status", "created_at"])
    op.create_index("ix_jobs_status_available", "jobs", ["status", "available_at"])
    op.create_index("ix_jobs_status_lease", "jobs", ["status", "lease_deadline"])
    op.create_index("ix_jobs_status_expires", "jobs", ["status", "expires_at"])
    op.create_index("ix_jobs_batch", "jobs", ["batch_id"])


def downgrade() -> None:
    op.drop_table("jobs")
