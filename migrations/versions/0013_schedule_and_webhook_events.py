"""Delayed jobs and webhook event filters (issue 27 parts 2 and 4).

``jobs.scheduled_for`` / ``batches.scheduled_for``: the time a delayed job (or every job of a
batch) is due; NULL: not delayed. A delayed job's ``available_at`` starts at the same time, so the
reconciler leaves it alone until then; the beat's schedule tick (scheduler/jobs/schedule.py)
publishes it within a second of it. ``ix_jobs_status_scheduled`` keeps that tick an index range
scan however large the backlog of ordinary queued jobs.

``jobs.webhook_events`` / ``batches.webhook_events``: the events the webhook wants (space-separated,
scheduler/webhooks/events.py); NULL: today's default (``job.finished`` / ``batch.finished``).

``webhook_deliveries.sequence``: several ``job.progress`` deliveries per job (one per throttle
interval), so the outbox's uniqueness becomes (event, job_id, sequence); every other event keeps
sequence 0 and with it "one delivery per event and job".

Revision ID: 0013_schedule_and_webhook_events
Revises: 0012_api_key_rotation
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

from scheduler.jobs.models import UTCDateTime

revision = "0013_schedule_and_webhook_events"
down_revision = "0012_api_key_rotation"
branch_labels = None
depends_on = None

JSON_TYPE = sa.JSON().with_variant(JSONB(), "postgresql")
OLD_UNIQUE = "uq_webhook_deliveries_event_job"
NEW_UNIQUE = "uq_webhook_deliveries_event_job_sequence"


def _deliveries(*, unique: tuple[str, ...], name: str) -> sa.Table:
    """``webhook_deliveries`` with ``sequence`` and the given job uniqueness: SQLite changes a
    constraint by copying the table, and this environment's NullPool connection cannot reflect it
    (migrations/env.py), so the copy is described here instead (the shape 0003_batches created)."""
    return sa.Table(
        "webhook_deliveries", sa.MetaData(),
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
        sa.Column("sequence", sa.Integer(), nullable=False, server_default=sa.text("0")),
        sa.PrimaryKeyConstraint("id", name="pk_webhook_deliveries"),
        sa.UniqueConstraint(*unique, name=name),
        sa.UniqueConstraint("event", "batch_id", name="uq_webhook_deliveries_event_batch"),
        sa.Index("ix_webhook_deliveries_status_next", "status", "next_attempt_at"),
    )


def upgrade() -> None:
    # Nullable columns (and one with a server default): ALTER TABLE ... ADD COLUMN, no rewrite.
    op.add_column("jobs", sa.Column("scheduled_for", UTCDateTime(), nullable=True))
    op.add_column("jobs", sa.Column("webhook_events", sa.String(128), nullable=True))
    op.create_index("ix_jobs_status_scheduled", "jobs", ["status", "scheduled_for"])
    op.add_column("batches", sa.Column("scheduled_for", UTCDateTime(), nullable=True))
    op.add_column("batches", sa.Column("webhook_events", sa.String(128), nullable=True))
    op.add_column(
        "webhook_deliveries",
        sa.Column("sequence", sa.Integer(), nullable=False, server_default=sa.text("0")),
    )
    copy = _deliveries(unique=("event", "job_id"), name=OLD_UNIQUE)
    with op.batch_alter_table("webhook_deliveries", copy_from=copy) as batch:
        batch.drop_constraint(OLD_UNIQUE, type_="unique")
        batch.create_unique_constraint(NEW_UNIQUE, ["event", "job_id", "sequence"])


def downgrade() -> None:
    # Progress deliveries beyond the first of each job would break the old uniqueness.
    op.execute("DELETE FROM webhook_deliveries WHERE sequence <> 0")
    copy = _deliveries(unique=("event", "job_id", "sequence"), name=NEW_UNIQUE)
    with op.batch_alter_table("webhook_deliveries", copy_from=copy) as batch:
        batch.drop_constraint(NEW_UNIQUE, type_="unique")
        batch.create_unique_constraint(OLD_UNIQUE, ["event", "job_id"])
        batch.drop_column("sequence")
    op.drop_index("ix_jobs_status_scheduled", table_name="jobs")
    # Plain DROP COLUMN (SQLite has it since 3.35; no index or constraint left on them), not a
    # batch copy, which would have to reflect the table (see _deliveries).
    for table in ("batches", "jobs"):
        op.drop_column(table, "webhook_events")
        op.drop_column(table, "scheduled_for")
