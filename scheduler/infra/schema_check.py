"""Whether the database has every migration this release needs, checked when a process starts.

``cloverq up`` migrates before it starts anything; a deployment runs ``cloverq migrate`` (the
compose file's ``migrate`` service, ``deploy/k8s/migrate-job.yaml``) before the new processes. A
process started on a database that missed that step fails in ways far from the cause: requests
that answer 500 on a missing column, or a beat whose every tick is dropped because its claim
table (``tick_claims``) is not there. So the API, the worker and the beat compare the database's
Alembic revision with this release's head before they start, and refuse with one line and exit
78 (EX_CONFIG) when it is **behind**: empty, or at an older revision this release knows.

A database *ahead* of this release (a revision it does not know: a newer release migrated it,
mid-rollout) is fine: every revision is written so the release before it keeps running on it.
A database that cannot be reached is not checked (the process starts, and retries as it would:
the database may come up after it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from sqlalchemy.exc import OperationalError

from scheduler.infra.db import alembic_config, make_engine
from scheduler.infra.settings import CONFIG_ERROR_EXIT_CODE, Settings


@dataclass(frozen=True, slots=True)
class SchemaState:
    """The database's revision (None: never migrated) and this release's head."""

    current: str | None
    head: str
    known: bool  # whether this release's migrations know ``current`` (False: a newer release's)

    @property
    def behind(self) -> bool:
        return self.current is None or (self.known and self.current != self.head)


def schema_state(url: str) -> SchemaState:
    """Read the database's revision; raises ``OperationalError`` when it cannot be reached."""
    from alembic.migration import MigrationContext
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config(url))
    head = script.get_current_head()
    assert head is not None  # the release ships its migrations
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            current = MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
    known = current is not None and current in {rev.revision for rev in script.walk_revisions()}
    return SchemaState(current=current, head=head, known=known)


def schema_problem(settings: Settings) -> str | None:
    """The line a process prints when its database is behind this release, else None."""
    try:
        state = schema_state(settings.resolved_database_url)
    except OperationalError:
        return None  # unreachable now: not this check's concern
    if not state.behind:
        return None
    found = f"at revision {state.current}" if state.current else "not migrated"
    return (f"database {found}, this release needs {state.head}: run `cloverq migrate` "
            "(with the same CLOVERQ_DATABASE_URL) before starting it")


def exit_on_schema_behind(settings: Settings) -> None:
    """Exit with :func:`schema_problem`'s line on stderr and ``CONFIG_ERROR_EXIT_CODE`` when the
    database misses a migration of this release."""
    problem = schema_problem(settings)
    if problem is not None:
        print(problem, file=sys.stderr, flush=True)
        sys.exit(CONFIG_ERROR_EXIT_CODE)
