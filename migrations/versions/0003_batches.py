"""Batches (with submission order) and webhook outbox + per-tenant signing secrets.

Revision ID: 0003_batches
Revises: 0002_api_keys
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from scheduler.jobs.models import UTCDateTime

revision = "0003_batches"
down_revision = "0002_api_keys"
branch_labels = None
depends_on = None

JSON_TYPE = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.Uuid(as_uuid=True), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("webhook_url", sa.Text(), nullable=True),
        sa.Column("metadata", JSON_TYPE, nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("request_id", sa.String(128), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_batches"),
    )
    op.create_index("ix_batches_tenant", "batches", ["tenant"])
    op.create_table(
        "batch_jobs",
        sa.Column("batch_id", sa.Uuid(as_uuid=True), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Uuid(as_uuid=True), nullable=False),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], ondelete="CASCADE",
                                name="fk_batch_jobs_batch_id_batches"),
        sa.PrimaryKeyConstraint("batch_id", "seq", name="pk_batch_jobs"),
    )
    op.create_table(
        "webhook_secrets",
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("secret", sa.String(128), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint("tenant", name="pk_webhook_secrets"),
    )
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.Uuid(as_uuid=True), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("event", sa.String(32), nullable=False),
        sa.Column("job_id", sa.Uuid(as_uuid=True), nullable=True),
        sa.Column("batch_id", sa.Uuid(as_uuid=True), nullable=True),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("payload", JSON_TYPE, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("next_attempt_at", UTCDateTime(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_webhook_deliveries"),
        sa.UniqueConstraint("event", "job_id", name="uq_webhook_deliveries_event_job"),
        sa.UniqueConstraint("event", "batch_id", name="uq_webhook_deliveries_event_batch"),
    )
    op.create_index("ix_webhook_deliveries_status_next", "webhook_deliveries", ["status", "next_attempt_at"])
    # The webhook sweeper's scan: final jobs that asked for a webhook (partial: most jobs do not).
    op.create_index("ix_jobs_webhook_finished", "jobs", ["finished_at"],
                    postgresql_where=sa.text("webhook_url IS NOT NULL"),
                    sqlite_where=sa.text("webhook_url IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("ix_jobs_webhook_finished", table_name="jobs")
    op.drop_table("webhook_deliveries")
    op.drop_table("webhook_secrets")
    op.drop_table("batch_jobs")
    op.drop_index("ix_batches_tenant", table_name="batches")
    op.drop_table("batches")
