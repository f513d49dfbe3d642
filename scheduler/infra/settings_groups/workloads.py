"""Decision, thinking and batch jobs (``settings.decisions``, ``settings.thinking``,
``settings.batches``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from scheduler.infra.settings_groups.base import SettingsGroup


class DecisionSettings(SettingsGroup):
    """Decision jobs (one or more questions over a context) and joint jobs."""

    max_questions: int = Field(
        64, ge=1, alias="decide_max_questions", description="Questions in one decision job."
    )
    max_choices: int = Field(16, ge=2, alias="decide_max_choices", description="Choices of one question.")
    max_context_chars: int = Field(
        200_000, ge=1, alias="decide_max_context_chars", description="Characters of a decision context."
    )
    rationale_tokens: int = Field(
        24, ge=1, alias="decide_rationale_tokens", description="Length of a rationale's free-text slot."
    )
    rationale_max_chars: int = Field(
        400, ge=1, alias="decide_rationale_max_chars", description="A longer rationale is invalid."
    )
    retry_temperature: float = Field(
        0.7, ge=0, alias="decide_retry_temperature",
        description="The one retry after an invalid rationale samples at least this hot.",
    )
    joint_default_step_budget: int = Field(4096, ge=1, description="Default step budget of a joint job.")
    joint_decode: Literal["auto", "blockwise", "one_pass"] = Field(
        "auto", alias="decide_joint_decode",
        description="How a joint decision without rationales is decoded: block by block (each answer"
        " sees the earlier ones) or one_pass (every answer in one pass; for checkpoints trained with"
        " --parallel-slots 1.0); auto: the checkpoint's generation_config.json joint_decode, else"
        " blockwise.",
    )


class ThinkingSettings(SettingsGroup):
    """Generate jobs with thinking on: whether it is the default, and their defaults and deadline."""

    default: bool = Field(
        False, alias="default_thinking", description="params.thinking when a generate job omits it."
    )
    default_max_new_tokens: int = Field(
        512, ge=1, alias="thinking_default_max_new_tokens", description="max_new_tokens default, thinking."
    )
    default_step_budget: int = Field(
        4096, ge=1, alias="thinking_default_step_budget", description="Step budget default, thinking."
    )
    deadline_seconds: float = Field(
        1800.0, gt=0, alias="thinking_deadline_seconds", description="Max run time of a thinking attempt."
    )


class BatchSettings(SettingsGroup):
    """Batches (POST /v1/batches, OpenAI batch files)."""

    max_jobs: int = Field(10_000, ge=1, alias="batch_max_jobs", description="Job specs in one batch.")
    max_body_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, alias="batch_max_body_bytes",
        description="Body limit of POST /v1/batches (JSON or JSONL upload).",
    )
    max_concurrent_uploads: int = Field(
        2, ge=1, alias="batch_max_concurrent_uploads",
        description="POST /v1/batches bodies one API process reads and parses at once (each costs a few "
        "times its size in memory while parsed); a request that finds none free within "
        "batch_upload_wait_seconds gets 503 uploads_busy with Retry-After.",
    )
    upload_wait_seconds: float = Field(
        10.0, ge=0, alias="batch_upload_wait_seconds",
        description="How long POST /v1/batches waits for a free upload slot.",
    )
