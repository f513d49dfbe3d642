"""Data retention and purge (issue 27 part 3; scheduler/access/retention.py, docs/security.md#retention).

``jobs.retention_seconds``: how long after it finishes a job's input and output are kept (NULL:
until the result TTL). ``jobs.purge_at``: when the beat's purge tick (re)purges the job's data
(scheduler/maintenance/retention_tick.py; NULL: nothing scheduled). ``jobs.purged_at``: when it was
purged (the tombstone keeps id, tenant, status, timings and usage). ``batches.retention_seconds`` /
``batches.purged_at``: the same for a batch as a whole.

Two partial indexes keep each tick an index range scan however many jobs are kept or already
purged: ``ix_jobs_purge_due`` holds only scheduled purges, ``ix_jobs_purge_pending`` only jobs that
will need one and have none scheduled yet (a retention, or expired before their data was purged).
``ix_openai_batches_batch_id``: a purge finds the OpenAI batch (its input file holds the prompts)
of a purged job's batch.

Revision ID: 0014_retention
Revises: 0013_schedule_and_webhook_events
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from scheduler.jobs.models import UTCDateTime

revision = "0014_retention"
down_revision = "0013_schedule_and_webhook_events"
branch_labels = None
depends_on = None

# The partial indexes' predicates as this revision creates them (scheduler/jobs/models.py repeats them).
PURGE_DUE_SQL = "purge_at IS NOT NULL"
PURGE_PENDING_SQL = ("purged_at IS NULL AND purge_at IS NULL"
                     " AND (retention_seconds IS NOT NULL OR status = 'expired')")


def upgrade() -> None:
    # Nullable columns only: an ALTER TABLE ... ADD COLUMN on both backends, no table rewrite.
    op.add_column("jobs", sa.Column("retention_seconds", sa.Integer(), nullable=True))
    op.add_column("jobs", sa.Column("purge_at", UTCDateTime(), nullable=True))
    op.add_column("jobs", sa.Column("purged_at", UTCDateTime(), nullable=True))
    op.create_index("ix_jobs_purge_due", "jobs", ["purge_at"], postgresql_where=sa.text(PURGE_DUE_SQL),
                    sqlite_where=sa.text(PURGE_DUE_SQL))
    op.create_index("ix_jobs_purge_pending", "jobs", ["finished_at"],
                    postgresql_where=sa.text(PURGE_PENDING_SQL), sqlite_where=sa.text(PURGE_PENDING_SQL))
    op.add_column("batches", sa.Column("retention_seconds", sa.Integer(), nullable=True))
    op.add_column("batches", sa.Column("purged_at", UTCDateTime(), nullable=True))
    op.create_index("ix_openai_batches_batch_id", "openai_batches", ["batch_id"])


def downgrade() -> None:
    op.drop_index("ix_openai_batches_batch_id", table_name="openai_batches")
    op.drop_index("ix_jobs_purge_pending", table_name="jobs")
    op.drop_index("ix_jobs_purge_due", table_name="jobs")
    # Plain DROP COLUMN (SQLite has it since 3.35; no index or constraint left on them), not a
    # batch copy, which would have to reflect the table (see 0012_api_key_rotation).
    for column in ("purged_at", "retention_seconds"):
        op.drop_column("batches", column)
    for column in ("purged_at", "purge_at", "retention_seconds"):
        op.drop_column("jobs", column)
