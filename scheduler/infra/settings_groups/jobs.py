"""A job's life and its routing by cost (``settings.jobs``, ``settings.scheduling``)."""

from __future__ import annotations

from pydantic import Field

from scheduler.infra.settings_groups.base import SettingsGroup


class JobSettings(SettingsGroup):
    """A job's life: attempts, leases, retries, deadlines, redelivery, progress, expiry."""

    max_attempts: int = Field(3, ge=1, description="Claims a job may take before retries_exhausted.")
    result_ttl_seconds: float = Field(7 * 24 * 3600, gt=0, description="Finished jobs expire after this.")
    lease_seconds: float = Field(60.0, gt=0, description="A running job's lease; renewed while it runs.")
    retry_backoff_base_seconds: float = Field(2.0, ge=0, description="Backoff before retry n: base*2^(n-1).")
    retry_backoff_max_seconds: float = Field(300.0, ge=0, description="Cap of the retry backoff.")
    deadline_seconds: float = Field(
        900.0, gt=0, alias="job_deadline_seconds", description="Max run time of one attempt."
    )
    joint_deadline_seconds: float = Field(1800.0, gt=0, description="Max run time of a joint attempt.")
    visibility_timeout_seconds: float | None = Field(
        None, gt=0, description="Redis redelivery timeout; default 2 x the longest deadline + lease."
    )
    progress_sql_interval_seconds: float = Field(5.0, gt=0, description="Progress to SQL every this long.")
    delay_past_tolerance_seconds: float = Field(
        60.0, ge=0, description="A job's not_before may lie this far in the past (clock skew); older: 422.",
    )
    delay_max_seconds: float = Field(
        30 * 24 * 3600, gt=0, le=10 * 365 * 24 * 3600,
        description="Latest start a job may ask for (not_before, delay_seconds).",
    )
    retention_default_seconds: int | None = Field(
        None, ge=0, le=10 * 365 * 24 * 3600,
        description="Data retention of a job that sets none (seconds after it finishes; its tenant's "
        "override wins): then its input, output and stream events are purged (docs/security.md#retention). "
        "None: kept until the result TTL.",
    )
    retention_max_seconds: int | None = Field(
        None, ge=0, le=10 * 365 * 24 * 3600,
        description="Longest retention_seconds a job may ask for (422 above; its tenant's override wins). "
        "None: the result TTL, which bounds it anyway.",
    )


class SchedulingSettings(SettingsGroup):
    """Which class (queue) a job goes to by cost, and how waiting jobs are promoted."""

    interactive_max_cost: int = Field(8192, ge=1, description="Cost (tokens x steps) of the short class.")
    prefill_token_cost: int = Field(
        4, ge=0, description="Routing cost of one prompt token, in the cost's unit (token-predictions): a "
        "long prompt holds its engine slot through prefill iterations and its K/V through every pass. 4: "
        "prompts up to 2,048 tokens can be interactive (interactive_max_cost / 4), up to 32,768 standard; "
        "a 3,941-token prompt with 8 new tokens is standard (issue 26). 0: prompts do not count.",
    )
    standard_max_cost: int = Field(131072, ge=1, description="Cost bound of the standard class.")
    aging_seconds: float = Field(120.0, gt=0, description="Queued longer than this: promoted to interactive.")
    aging_max_promoted: int = Field(4, ge=1, description="Aged jobs waiting in interactive at once.")
    fair_share: bool = Field(
        True, description="Weighted fair share between tenants (and a tenant's batches) inside each class "
        "(scheduler/fairness/): a class's broker list holds at most fair_share_window messages while jobs "
        "wait; the rest stay queued in SQL and are released by deficit round robin. false: FIFO per class.",
    )
    fair_share_window: int = Field(
        16, ge=1, description="Messages a class's broker list may hold while the class has held jobs: a "
        "newly backlogged tenant waits behind at most this many (bench.fair). Each message a worker takes "
        "releases the next held job within milliseconds, so this only has to cover that moment.",
    )
    fair_share_tick_seconds: float = Field(
        1.0, gt=0, description="Beat: release held jobs into free window room (the backstop of the release "
        "at submit and at each message a worker takes).",
    )
