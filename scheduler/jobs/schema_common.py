"""What every schema module shares: the annotation keywords, the error and its stable codes.

Its own module so that the subset's parser (``schema_subset.py``) and the reference inliner it runs
first (``schema_refs.py``) raise the same errors without importing each other.
"""

from __future__ import annotations

import enum

from scheduler.infra.settings import flat_fields

# Keywords that describe a schema without constraining its values: accepted and ignored.
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)


class SchemaErrorCode(enum.StrEnum):
    """Stable codes (the API's ``error.code``)."""

    INVALID_SCHEMA = "invalid_schema"  # not a JSON Schema, or one no value satisfies
    UNSUPPORTED_KEYWORD = "unsupported_schema_keyword"  # a keyword outside the supported subset
    SCHEMA_TOO_LARGE = "schema_too_large"  # bytes, nesting or canvas tokens over the limits


class SchemaError(ValueError):
    """A schema outside the supported subset; ``keyword`` and ``path`` say where, ``setting``
    (a limit's refusal) the environment variable of the deployment setting that raises it."""

    def __init__(
        self, code: SchemaErrorCode, message: str, *, keyword: str | None = None, path: str = "",
        setting: str | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.keyword = keyword
        self.path = path or "#"
        self.setting = setting

    def details(self) -> dict[str, str | None]:
        where: dict[str, str | None] = {"keyword": self.keyword, "path": self.path}
        return where if self.setting is None else {**where, "setting": self.setting}


def over_limit(what: str, flat_name: str, smaller: str, path: str = "") -> SchemaError:
    """``schema_too_large`` over ``settings.limits.<flat_name>``: the setting's environment
    variable, and what to send instead (issue 33: every limit error names its setting)."""
    env = flat_fields()[flat_name].env
    return SchemaError(SchemaErrorCode.SCHEMA_TOO_LARGE,
                       f"{what} ({env}). Instead: {smaller}; or ask the operator to raise {env}",
                       path=path, setting=env)
