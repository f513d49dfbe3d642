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
A database that cannot be reached or read is not checked (the process starts, and retries as it
would: the database may come up after it). Costs one connection and Alembic's import (~0.1 s) per
start.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from sqlalchemy.exc import SQLAlchemyError

from scheduler.infra.db import DatabaseTimeouts, alembic_config, make_engine, redact_url
from scheduler.infra.settings import CONFIG_ERROR_EXIT_CODE, Settings


@dataclass(frozen=True, slots=True)
class SchemaState:
    """The database's revisions (none: never migrated) and this release's heads."""

    current: frozenset[str]
    heads: frozenset[str]
    known: bool  # whether this release's migrations know every current revision (False: a newer release's)

    @property
    def behind(self) -> bool:
        return not self.current or (self.known and self.current != self.heads)


def schema_state(url: str, *, timeouts: DatabaseTimeouts | None = None) -> SchemaState:
    """Read the database's revisions (a branched history has several heads, and so may the table)."""
    from alembic.migration import MigrationContext
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config(url))
    engine = make_engine(url, pool_size=1, timeouts=timeouts)
    try:
        with engine.connect() as conn:
            current = frozenset(MigrationContext.configure(conn).get_current_heads())
    finally:
        engine.dispose()
    revisions = {rev.revision for rev in script.walk_revisions()}
    return SchemaState(current=current, heads=frozenset(script.get_heads()), known=current <= revisions)


def schema_problem(settings: Settings) -> str | None:
    """The line a process prints when its database is behind this release, else None. Refused only
    on evidence: a database that cannot be reached or read (down, a role that may not read
    ``alembic_version``, a file that is no database) is left to fail, or work, as it would."""
    from alembic.util import CommandError

    url = settings.resolved_database_url
    try:
        state = schema_state(url, timeouts=DatabaseTimeouts.from_settings(settings))
    except (SQLAlchemyError, OSError, CommandError):
        return None
    if not state.behind:
        return None
    shown = redact_url(url)
    found = f"at revision {', '.join(sorted(state.current))}" if state.current else "not migrated"
    return (f"cloverq: the database {shown} is {found}; this release needs {', '.join(sorted(state.heads))}: "
            "run `cloverq migrate` (with the same settings) before starting it")


def exit_on_schema_behind(settings: Settings) -> None:
    """Exit with :func:`schema_problem`'s line on stderr and ``CONFIG_ERROR_EXIT_CODE`` when the
    database misses a migration of this release."""
    problem = schema_problem(settings)
    if problem is not None:
        print(problem, file=sys.stderr, flush=True)
        sys.exit(CONFIG_ERROR_EXIT_CODE)
