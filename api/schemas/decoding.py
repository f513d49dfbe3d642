"""The decoding parameters every job kind takes (generate, decide, extract): one declaration,
so a bound or a description is changed in one place. Each kind's model adds what is its own
(``max_new_tokens`` and ``thinking`` for generate) or narrows a field (a decision's seed range,
its per-sequence step budget); ``None`` means the default named in the description."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from api.schemas.common import (
    MAX_BLOCK_SIZE,
    MAX_SEED,
    MAX_STEP_BUDGET_BOUND,
    MAX_STEPS_PER_BLOCK_BOUND,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    StrictModel,
    Text,
)


class DecodingParams(StrictModel):
    """Decoding parameters (see the decoding contract, docs/architecture.md §3.7); ``None`` = default."""

    block_size: int | None = Field(None, ge=1, le=MAX_BLOCK_SIZE,
                                   description="Default: the checkpoint's block size.")
    steps_per_block: int | None = Field(
        None, ge=1, le=MAX_STEPS_PER_BLOCK_BOUND,
        description="Default: settings.limits.default_steps_per_block, else the model family's "
        "(Clover, LLaDA2: the block size; SDAR: 4).",
    )
    strategy: Literal["static", "dynamic"] | None = Field(
        None, description="Default: the model family's (Clover, LLaDA2: dynamic; SDAR: static)."
    )
    threshold: float | None = Field(
        None, gt=0.0, le=1.0,
        description="Confidence threshold (dynamic strategy). Default: the family's (0.95; SDAR 0.9).",
    )
    temperature: float = Field(0.0, ge=0.0, le=MAX_TEMPERATURE, description="0 = greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    step_budget: int | None = Field(None, ge=1, le=MAX_STEP_BUDGET_BOUND,
                                    description="Max denoising passes for the whole job.")
    fault: Text | None = Field(None, description="Test-only fault injection; rejected unless enabled.")
