"""The README documents what exists: its configuration table is the generated one."""

from __future__ import annotations

from pathlib import Path

from cli.settings_doc import BEGIN_MARKER, END_MARKER, settings_block
from scheduler.infra.settings import flat_fields, settings_groups

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_configuration_table_matches_settings() -> None:
    text = README.read_text()
    start, end = text.index(BEGIN_MARKER), text.index(END_MARKER) + len(END_MARKER)
    assert text[start:end] == settings_block(), (
        "README.md configuration table is out of date: run `cloverq settings-table --write README.md`"
    )


def test_every_setting_is_in_the_readme() -> None:
    text = README.read_text()
    missing = [entry.flat for entry in flat_fields().values() if f"`{entry.env}`" not in text]
    assert missing == []


def test_every_group_has_its_section() -> None:
    block = settings_block()
    assert [group for group in settings_groups() if f"**`settings.{group}`: " not in block] == []


def test_readme_keeps_the_two_commands() -> None:
    text = README.read_text()
    assert "make up" in text and "make test" in text
