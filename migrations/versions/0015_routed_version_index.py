"""An index for the canary gate's tally (issue 32 part 5).

``ix_jobs_routed_version`` on ``jobs (routed_version, status, created_at)``, partial on
``routed_version IS NOT NULL``. The promotion gate (scheduler/model_versions/canary_gate.py
``tally``) counts the jobs pinned to each of two versions, by status, since the canary started:
without an index that is a scan of the whole ``jobs`` table, under the 30 s statement timeout, on
a table that only grows with the retention window. With it, an index (only) range scan of the
pinned rows. Partial because a job is pinned only while a canary runs: unpinned jobs (most) are
not in the index, so submits without a canary pay nothing for it. The queued-pin updates of
scheduler/model_versions/canary_reconcile.py (``routed_version = ...``, ``status = 'queued'``)
use the same index.

Plain ``CREATE INDEX`` like every revision here (it runs in the migration's transaction and
blocks writes to ``jobs`` while it builds): an operator with a very large table can build it
beforehand with ``CREATE INDEX CONCURRENTLY`` under the same name and definition; ``IF NOT
EXISTS`` below then makes the upgrade leave it as it is.

Revision ID: 0015_routed_version_index
Revises: 0014_retention
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015_routed_version_index"
down_revision = "0014_retention"
branch_labels = None
depends_on = None

# The partial index's predicate as this revision creates it (scheduler/jobs/models.py repeats it).
ROUTED_SQL = "routed_version IS NOT NULL"


def upgrade() -> None:
    op.create_index("ix_jobs_routed_version", "jobs", ["routed_version", "status", "created_at"],
                    postgresql_where=sa.text(ROUTED_SQL), sqlite_where=sa.text(ROUTED_SQL),
                    if_not_exists=True)


def downgrade() -> None:
    op.drop_index("ix_jobs_routed_version", table_name="jobs")
