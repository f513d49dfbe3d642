"""Field types shared by every request model: storable text, UTC timestamps, metadata, bounds.

Each rule lives here once and every model uses it, so a field added later cannot forget it:

- :data:`Text` (with length bounds: ``Annotated[str, StringConstraints(...),
  AfterValidator(storable_text)]``): text that can be encoded, stored and echoed — no
  NUL (a PostgreSQL text column cannot hold U+0000) and no lone surrogate (``"\\ud800"`` is legal
  in a JSON string but is not Unicode text: UTF-8 encoding, the tokenizer and the JSON
  renderer all fail on it).
- :data:`UtcDateTime`: a timestamp with an offset that is still a valid datetime in UTC.
- :data:`Metadata`: the client's labels on a job or batch (bounded keys, storable values; the
  total serialized size is a deployment limit, checked in :mod:`api.limits`).
- ``*_BOUND``: static upper bounds of the sampling parameters, far above any deployment
  limit, so no value ever overflows the worker's integer types (``top_k=10**30`` did).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import AfterValidator, AllowInfNan, BaseModel, BeforeValidator, ConfigDict, Field

from scheduler.jobs.models import as_utc

MAX_METADATA_KEYS = 32

# Static bounds of the sampling parameters (deployment limits, e.g. max_new_tokens_limit, are
# lower and checked per request in api.limits / api.decision_limits).
MAX_NEW_TOKENS_BOUND = 1 << 20
MAX_BLOCK_SIZE = 1024
MAX_STEPS_PER_BLOCK_BOUND = 1024
MAX_STEP_BUDGET_BOUND = 1 << 24
MAX_TOP_K = 1 << 20  # above every vocabulary: a larger top_k would mean "no top-k" anyway
MAX_TEMPERATURE = 10.0
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds
# A static bound of retention_seconds (the tenant's maximum, at most the result TTL, is lower and
# checked at submit: scheduler/access/retention.py); keeps every purge time a valid datetime.
MAX_RETENTION_SECONDS = 10 * 365 * 24 * 3600



class StrictModel(BaseModel):
    """A request model that refuses fields it does not know (a typo is a 422, not ignored)."""

    model_config = ConfigDict(extra="forbid")


def storable_text(text: str) -> str:
    """``text`` unchanged, or ValueError when it holds NUL or a lone surrogate."""
    if "\x00" in text:
        raise ValueError("text must not contain NUL (U+0000) characters")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"text must be valid Unicode: a lone surrogate (U+{ord(text[exc.start]):04X}) at "
                f"position {exc.start}"
            ) from None
    return text


Text = Annotated[str, AfterValidator(storable_text)]


def _utc(value: datetime) -> datetime:
    return as_utc(value)  # ValueError (-> 422) for a naive or out-of-range timestamp


UtcDateTime = Annotated[datetime, AfterValidator(_utc)]

FiniteFloat = Annotated[float, AllowInfNan(False)]


def _flat(value: object) -> object:
    """A nested value is refused with one error that says what a value may be (the union alone
    answered with one error per member, under names such as ``function-after[storable_text(), str]``)."""
    if isinstance(value, dict | list):
        raise ValueError(f"a metadata value is a string, number, boolean or null, not {type(value).__name__}"
                         " (metadata is flat: one level of keys)")  # fmt: skip
    return value


MetadataValue = Annotated[Text | int | FiniteFloat | bool | None, BeforeValidator(_flat)]
Metadata = Annotated[dict[Text, MetadataValue], Field(max_length=MAX_METADATA_KEYS)]
