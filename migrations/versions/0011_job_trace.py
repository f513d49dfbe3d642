"""Job trace context: the OpenTelemetry trace of a job's submit (scheduler/observability/tracing.py).

``trace_id`` (32 hex) is returned in the job's JSON; ``trace_span_id`` (16 hex) is the submit span a
message republished by the reconciler, or a retry, is parented to, so that every attempt of a job
is in its one trace. Both NULL when the job was not traced (tracing off, or not sampled).

Revision ID: 0011_job_trace
Revises: 0010_golden_results
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011_job_trace"
down_revision = "0010_golden_results"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable columns only: an ALTER TABLE ... ADD COLUMN on both backends, no table rewrite.
    op.add_column("jobs", sa.Column("trace_id", sa.String(32), nullable=True))
    op.add_column("jobs", sa.Column("trace_span_id", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("trace_span_id")
        batch.drop_column("trace_id")
