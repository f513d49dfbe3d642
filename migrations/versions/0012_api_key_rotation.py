"""API keys: rotation with overlap, per-key networks, last use (scheduler/access/api_keys.py).

``expires_at``: the key is refused from then on (a rotation sets it to the end of the overlap);
``rotated_from``: the key a successor replaced; ``allowed_networks``: space-separated CIDRs the key
may be used from (NULL: any address); ``last_used_at`` / ``last_used_address``: written by the API
processes at most once a minute each, never per request. All NULL for existing keys, which keep
working unchanged.

Revision ID: 0012_api_key_rotation
Revises: 0011_job_trace
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from scheduler.jobs.models import UTCDateTime

revision = "0012_api_key_rotation"
down_revision = "0011_job_trace"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable columns only: an ALTER TABLE ... ADD COLUMN on both backends, no table rewrite.
    op.add_column("api_keys", sa.Column("expires_at", UTCDateTime(), nullable=True))
    op.add_column("api_keys", sa.Column("rotated_from", sa.String(32), nullable=True))
    op.add_column("api_keys", sa.Column("allowed_networks", sa.Text(), nullable=True))
    op.add_column("api_keys", sa.Column("last_used_at", UTCDateTime(), nullable=True))
    op.add_column("api_keys", sa.Column("last_used_address", sa.String(64), nullable=True))


def downgrade() -> None:
    # A plain ALTER TABLE ... DROP COLUMN (SQLite has it since 3.35, and these columns carry no
    # index or constraint), not a batch copy: the batch would reflect the table, which this
    # environment's NullPool connection (migrations/env.py) cannot do on SQLite.
    for column in ("last_used_address", "last_used_at", "allowed_networks", "rotated_from", "expires_at"):
        op.drop_column("api_keys", column)
