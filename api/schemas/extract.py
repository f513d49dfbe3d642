"""Request models of ``kind: "extract"`` jobs (the union member lives in ``api.schemas.jobs``).

Static shape rules are here; the schema's subset and size and the prompt's token count depend on
the deployment and are checked in :mod:`api.extract_limits`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from api.schemas.common import (
    MAX_BLOCK_SIZE,
    MAX_SEED,
    MAX_STEP_BUDGET_BOUND,
    MAX_STEPS_PER_BLOCK_BOUND,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    Text,
    storable_text,
)
from scheduler.jobs.extract_prompt import extract_messages


def _not_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("the document is blank")
    return text


Document = Annotated[str, StringConstraints(min_length=1), AfterValidator(storable_text),
                     AfterValidator(_not_blank)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExtractInput(_Strict):
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


class ExtractParams(_Strict):
    """Decoding parameters of an extract job (``None`` = default). The output's length is the
    schema's canvas, so there is no ``max_new_tokens``; the JSON is decoded right after the
    prompt, so there is no ``thinking`` either (the template renders it off)."""

    block_size: int | None = Field(None, ge=1, le=MAX_BLOCK_SIZE)
    steps_per_block: int | None = Field(None, ge=1, le=MAX_STEPS_PER_BLOCK_BOUND)
    strategy: Literal["static", "dynamic"] | None = None  # None: the model family's default
    threshold: float | None = Field(None, gt=0.0, le=1.0)
    temperature: float = Field(0.0, ge=0.0, le=MAX_TEMPERATURE, description="0 = greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    step_budget: int | None = Field(None, ge=1, le=MAX_STEP_BUDGET_BOUND,
                                    description="Max denoising passes for the whole job.")
    fault: Text | None = Field(None, description="Test-only fault injection; rejected unless enabled.")
