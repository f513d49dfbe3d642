"""The README documents what exists: its configuration table is the generated one."""

from __future__ import annotations

from pathlib import Path

from cli.settings_doc import BEGIN_MARKER, END_MARKER, env_var, settings_block
from scheduler.settings import Settings

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_configuration_table_matches_settings() -> None:
    text = README.read_text()
    start, end = text.index(BEGIN_MARKER), text.index(END_MARKER) + len(END_MARKER)
    assert text[start:end] == settings_block(), (
        "README.md configuration table is out of date: run `cloverq settings-table --write README.md`"
    )


def test_every_setting_is_in_the_readme() -> None:
    text = README.read_text()
    fields = Settings.model_fields.items()
    missing = [name for name, field in fields if f"`{env_var(name, field)}`" not in text]
    assert missing == []


def test_readme_keeps_the_two_commands() -> None:
    text = README.read_text()
    assert "make up" in text and "make test" in text
