"""Request models of ``kind: "extract"`` jobs (the union member lives in ``api.schemas.jobs``).

Static shape rules are here; the schema's subset and size and the prompt's token count depend on
the deployment and are checked in :mod:`api.extract_limits`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field, StringConstraints

from api.schemas.common import (
    StrictModel,
    Text,
    storable_text,
)
from api.schemas.decoding import DecodingParams
from scheduler.jobs.extract_prompt import extract_messages


def _not_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("the document is blank")
    return text


Document = Annotated[str, StringConstraints(min_length=1), AfterValidator(storable_text),
                     AfterValidator(_not_blank)]


class ExtractInput(StrictModel):
    """A document and the JSON Schema of what to extract from it. ``schema`` is the field's name on
    the wire (in Python ``schema_``: ``schema`` would shadow a pydantic method)."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True,
                              serialize_by_alias=True)

    context: Document = Field(description="The document. It comes first in the prompt, so jobs over one "
                              "document share its prefill (the engine's prefix cache).")
    schema_: dict[str, Any] = Field(
        alias="schema",
        description="A JSON Schema (the subset in docs/structured.md): the result's data is a value valid "
        "against it by construction, text its JSON. Outside the subset or over "
        "settings.limits.max_schema_bytes / max_schema_depth: 400 invalid_schema, "
        "unsupported_schema_keyword or schema_too_large, nothing stored.",
    )
    instructions: Text | None = Field(
        None, description="What to look for, in words (after the document). Default: extract the fields.")

    def messages(self) -> list[dict[str, str]]:
        """The chat messages the worker renders (``scheduler.jobs.extract_prompt``)."""
        return extract_messages(self.context, self.schema_, self.instructions)

    def text_parts(self) -> list[str]:
        """Every piece of prompt text (for the prompt-size limit): the messages as rendered."""
        return [message["content"] for message in self.messages()]


class ExtractParams(DecodingParams):
    """Decoding parameters of an extract job (``None`` = default). The output's length is the
    schema's canvas, so there is no ``max_new_tokens``; the JSON is decoded right after the
    prompt, so there is no ``thinking`` either (the template renders it off)."""
