"""A process refuses to start on a database that missed this release's migrations
(``scheduler/infra/schema_check.py``): behind (never migrated, or at an older revision) is refused
with one line and exit 78; at the head, ahead (a newer release's revision) or unreachable is not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import text

from scheduler.infra.db import alembic_config, make_engine, migrate, redact_url
from scheduler.infra.schema_check import schema_problem, schema_state
from scheduler.infra.settings import CONFIG_ERROR_EXIT_CODE, Settings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _head_and_previous() -> tuple[str, str]:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    head = script.get_current_head()
    assert head is not None
    previous = script.get_revision(head).down_revision
    assert isinstance(previous, str)
    return head, previous


def _problem(url: str) -> str | None:
    return schema_problem(Settings(database_url=url))


def test_behind_is_refused_and_head_or_ahead_is_not(empty_db_url: str) -> None:
    head, previous = _head_and_previous()
    shown = redact_url(empty_db_url)
    assert _problem(empty_db_url) == (f"cloverq: the database {shown} is not migrated; this release "
                                      f"needs {head}: run `cloverq migrate` (with the same settings) "
                                      "before starting it")
    migrate(empty_db_url, revision=previous)
    problem = _problem(empty_db_url)
    assert problem is not None and f"is at revision {previous}; this release needs {head}:" in problem
    migrate(empty_db_url)
    assert _problem(empty_db_url) is None
    engine = make_engine(empty_db_url)
    try:
        with engine.begin() as conn:  # a newer release migrated it (mid-rollout): this one runs on
            conn.execute(text("UPDATE alembic_version SET version_num = '9999_a_newer_release'"))
    finally:
        engine.dispose()
    state = schema_state(empty_db_url)
    assert (set(state.current), state.known, state.behind) == ({"9999_a_newer_release"}, False, False)
    assert _problem(empty_db_url) is None


def test_a_database_that_cannot_be_reached_or_read_is_not_checked(tmp_path: Path) -> None:
    assert _problem("postgresql+psycopg://postgres@127.0.0.1:1/none") is None  # nothing listens
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database file " * 100)
    assert _problem(f"sqlite:///{junk}") is None  # left to fail as it would


@pytest.mark.parametrize("process", ["api", "worker", "beat"])
def test_a_process_refuses_a_database_behind_with_one_line(
    tmp_path: Path, redis_url: str, process: str
) -> None:
    _head, previous = _head_and_previous()
    url = f"sqlite:///{tmp_path / 'behind.db'}"
    migrate(url, revision=previous)
    env = {name: value for name, value in os.environ.items() if not name.startswith("CLOVERQ_")}
    env |= {"CLOVERQ_DATABASE_URL": url, "CLOVERQ_REDIS_URL": redis_url,
            "CLOVERQ_DATA_DIR": str(tmp_path / "data"), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "cli", process], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == CONFIG_ERROR_EXIT_CODE
    assert done.stderr.strip().splitlines() == [_problem(url)]
