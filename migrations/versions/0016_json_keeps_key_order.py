"""Documents as they were sent: PostgreSQL's ``json`` instead of ``jsonb`` for every JSON column.

``jsonb`` stores an object's keys sorted (shorter keys first, then bytewise), so on PostgreSQL a
job's input came back in another key order than the client sent, while SQLite kept it. The order
is meaning here: a ``response_schema``'s or an extract schema's ``properties`` are the order the
canvas lays fields out and the prompt lists them, and a tool's parameters the order its JSON is
rendered into the prompt, so one request decoded differently on the two backends (and a golden
case recorded on one asked another job on the other); results and metadata came back reordered
too. ``json`` keeps the text as sent. Nothing here queries inside these columns (no ``->``, no
GIN index, no equality), so nothing needed ``jsonb``'s operators.

Rows written before this revision keep the order ``jsonb`` gave them: that order is gone. Unlike
``jsonb``, ``json`` holds a ``\u0000`` escape (a NUL inside a schema, say, as SQLite always held
it); a row holding one makes the downgrade's cast to ``jsonb`` fail, and the downgrade with it.

On PostgreSQL each ``ALTER COLUMN ... TYPE`` rewrites its table under an exclusive lock: on a
large ``jobs`` table, plan the upgrade for a quiet moment (or a short retention window first).
SQLite's columns are JSON text already: nothing to do there.

Revision ID: 0016_json_keeps_key_order
Revises: 0015_routed_version_index
"""

from __future__ import annotations

from alembic import op

revision = "0016_json_keeps_key_order"
down_revision = "0015_routed_version_index"
branch_labels = None
depends_on = None

# (table, column) of every JSON column the models declare (scheduler/jobs/models.py JSONType).
JSON_COLUMNS = (
    ("jobs", "input"), ("jobs", "params"), ("jobs", "metadata"), ("jobs", "progress"), ("jobs", "result"),
    ("batches", "metadata"), ("webhook_deliveries", "payload"),
    ("openai_batches", "metadata"), ("openai_batches", "requests"),
)


def _retype(to: str) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, column in JSON_COLUMNS:
        op.execute(f'ALTER TABLE {table} ALTER COLUMN "{column}" TYPE {to} USING "{column}"::{to}')


def upgrade() -> None:
    _retype("json")


def downgrade() -> None:
    _retype("jsonb")
