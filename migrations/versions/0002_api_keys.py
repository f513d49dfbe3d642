"""API keys (only a sha256 digest of each key is stored; see scheduler/access/api_keys.py).

Revision ID: 0002_api_keys
Revises: 0001_jobs
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from scheduler.jobs.models import UTCDateTime

revision = "0002_api_keys"
down_revision = "0001_jobs"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("scopes", sa.Text(), nullable=False),
        sa.Column("label", sa.String(200), nullable=True),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("revoked", sa.Boolean(), nullable=False),
        sa.Column("revoked_at", UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint("key_id", name="pk_api_keys"),
    )
    op.create_index("ix_api_keys_tenant_created", "api_keys", ["tenant", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_api_keys_tenant_created", table_name="api_keys")
    op.drop_table("api_keys")
