"""Flat setting names and the environment that sets them.

Every setting of ``Settings`` (scheduler/infra/settings.py) keeps a **flat name**: its pydantic
``alias`` where the nested name differs, else the nested name. ``flat_table`` derives the one
table of flat names from the declarations, ``nest`` moves flat keywords into their groups, and
``FlatEnvSource`` reads the environment under ``CLOVERQ_`` + the flat name in capitals (or the
file a ``*_FILE`` variable names).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import EnvSettingsSource, SettingsError

from scheduler.infra.settings_groups.base import SettingsGroup

ENV_PREFIX = "CLOVERQ_"


class FlatField(NamedTuple):
    """One setting under its flat name: where it lives in ``Settings`` and its environment variable."""

    flat: str  # keyword and environment suffix: engine_max_batch
    group: str | None  # engine (None: a top-level field such as data_dir)
    name: str  # max_batch
    field: FieldInfo
    env: str  # CLOVERQ_ENGINE_MAX_BATCH

    @property
    def path(self) -> str:
        """The nested attribute path: ``engine.max_batch``."""
        return self.name if self.group is None else f"{self.group}.{self.name}"


def _entry(flat: str, group: str | None, name: str, field: FieldInfo) -> FlatField:
    extra = field.json_schema_extra
    own_env = extra.get("env") if isinstance(extra, dict) else None
    env = own_env if isinstance(own_env, str) else f"{ENV_PREFIX}{flat.upper()}"
    return FlatField(flat, group, name, field, env)


@cache
def flat_table(settings_cls: type[BaseModel]) -> dict[str, FlatField]:
    """Every setting of ``settings_cls`` by flat name, in declaration order (derived from the field
    declarations): a field whose type is a ``SettingsGroup`` contributes its members, any other
    field itself."""
    table: dict[str, FlatField] = {}
    for group, group_field in settings_cls.model_fields.items():
        model = group_field.annotation
        if isinstance(model, type) and issubclass(model, SettingsGroup):
            entries = [_entry(field.alias or name, group, name, field)
                       for name, field in model.model_fields.items()]
        else:
            entries = [_entry(group, None, group, group_field)]
        for entry in entries:
            if entry.flat in table or (entry.group is not None and entry.flat in settings_cls.model_fields):
                raise TypeError(f"flat setting name {entry.flat!r} is not unique")
            table[entry.flat] = entry
    return table


def nest(values: Mapping[str, Any], table: Mapping[str, FlatField]) -> dict[str, Any]:
    """``values`` with every flat group member moved into its group (``engine_max_batch`` ->
    ``engine: {max_batch: ...}``); a flat value wins over the same setting given nested."""
    nested: dict[str, Any] = {}
    flat: list[tuple[FlatField, Any]] = []
    for key, value in values.items():
        entry = table.get(key)
        if entry is None or entry.group is None:
            nested[key] = value
        else:
            flat.append((entry, value))
    for entry, value in flat:
        assert entry.group is not None
        group = nested.get(entry.group)
        if isinstance(group, BaseModel):
            group = group.model_dump()
        group = dict(group) if isinstance(group, Mapping) else {}
        group[entry.name] = value
        nested[entry.group] = group
    return nested


FILE_SUFFIX = "_FILE"  # CLOVERQ_DATABASE_URL_FILE=/path: the setting's value is that file's content


def read_setting_file(variable: str, path: str) -> str:
    """The value a ``*_FILE`` variable points at: the file's content without its trailing newline
    (``echo secret > file`` and Kubernetes secret mounts both end with one). Errors name the
    variable and the path, never the content."""
    if not path:
        raise SettingsError(f"{variable} is empty: give the path of the file holding the value")
    try:
        return Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise SettingsError(f"{variable}={path}: cannot read the file ({reason})") from None


class FlatEnvSource(EnvSettingsSource):
    """The environment, read under each setting's flat name (``CLOVERQ_ENGINE_MAX_BATCH``).

    Any setting can come from a file instead (secrets mounted by Kubernetes or Docker): its
    variable plus ``_FILE`` (``CLOVERQ_DATABASE_URL_FILE=/run/secrets/db-url``) names a file whose
    content, trailing newline stripped, is the value, parsed as the variable's would be. Giving
    both the variable and its ``_FILE`` form is an error (neither silently wins). A ``*_FILE``
    name that is itself a setting's variable (``CLOVERQ_STACK_FILE``) stays that setting.
    """

    def _raw(self, entry: FlatField, settings_env: frozenset[str]) -> str | None:
        """The value of ``entry`` from its variable or its ``_FILE`` variable (None: neither)."""
        def get(name: str) -> str | None:
            return self.env_vars.get(name if self.case_sensitive else name.lower())

        raw = get(entry.env)
        file_variable = entry.env + FILE_SUFFIX
        if file_variable.lower() in settings_env:
            return raw
        path = get(file_variable)
        if path is None:
            return raw
        if raw is not None:
            raise SettingsError(f"both {entry.env} and {file_variable} are set: give the value one way")
        return read_setting_file(file_variable, path)

    def __call__(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        table = flat_table(self.settings_cls)
        settings_env = frozenset(entry.env.lower() for entry in table.values())
        for entry in table.values():
            raw = self._raw(entry, settings_env)
            if raw is None:
                continue
            value: Any = raw
            if self.field_is_complex(entry.field):
                try:
                    value = self.decode_complex_value(entry.flat, entry.field, raw)
                except ValueError as exc:
                    raise SettingsError(f"{entry.env}: not valid JSON (maps and lists are given "
                                        "as JSON)") from exc
            target = data if entry.group is None else data.setdefault(entry.group, {})
            target[entry.name] = value
        return data


# ``CLOVERQ_`` variables that are no setting and are not mistakes either: deploy/compose.yaml's own
# interpolation variables (an operator's shell exports them for docker-compose, and ``cloverq`` run
# from that shell must not call them typos), and the test suite's (``tests/``; any ``CLOVERQ_TEST_``).
NOT_SETTINGS = frozenset({
    "CLOVERQ_MODEL_NAME", "CLOVERQ_MODEL_VERSION", "CLOVERQ_MODEL_SRC", "CLOVERQ_MODEL_IMPORT_DIR",
    "CLOVERQ_CHAOS_KEEP_LOGS", "CLOVERQ_DASHBOARD_SCREENSHOT", "CLOVERQ_DASHBOARD_BATCH_SCREENSHOT",
    "CLOVERQ_DASHBOARD_LINK_SCREENSHOT",
})
NOT_SETTINGS_PREFIX = "CLOVERQ_TEST_"


def unknown_variables(environ: Mapping[str, str], settings_cls: type[BaseModel]) -> dict[str, str | None]:
    """The ``CLOVERQ_`` variables of ``environ`` that no setting reads, each with the setting
    variable it most resembles (a likely typo: ``CLOVERQ_ENGINE_MAX_BACTH``) or None.

    Why: pydantic-settings ignores what it does not know, so a misspelt variable leaves its setting
    at the default without a word; every process logs these at start (``configure_logging``).
    Names compare without case, as the settings read them."""
    known = {entry.env.upper() for entry in flat_table(settings_cls).values()}
    known_files = {name + FILE_SUFFIX for name in known}
    stems = sorted(name.removeprefix(ENV_PREFIX) for name in known)
    unknown: dict[str, str | None] = {}
    for name in environ:
        upper = name.upper()
        if (not upper.startswith(ENV_PREFIX) or upper in known or upper in known_files
                or upper in NOT_SETTINGS or upper.startswith(NOT_SETTINGS_PREFIX)):
            continue
        # compared without the prefix, which every name shares and would make any two look alike
        stem = upper.removeprefix(ENV_PREFIX).removesuffix(FILE_SUFFIX)
        close = difflib.get_close_matches(stem, stems, n=1, cutoff=0.75)
        unknown[name] = ENV_PREFIX + close[0] if close else None
    return dict(sorted(unknown.items()))
