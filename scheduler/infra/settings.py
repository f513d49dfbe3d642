"""The one Settings object of cloverq (env prefix ``CLOVERQ_``).

Every process (api, worker, beat, CLI) reads its configuration here and nowhere else, so a
value means the same thing in every component. Nothing in the code base reads ``os.environ``
for configuration.

Settings are grouped by concern into nested models, and code reads them nested
(``settings.engine.max_batch``, ``settings.database.url``)::

    data_dir        the root folder every embedded default lives under (the one top-level field)
    database        SQL: URL and timeouts            redis           URL, embedded server port
    model           checkpoint, dtype, store         canary          canary releases
    engine          the batched inference engine     limits          request limits and defaults
    jobs            retries, leases, deadlines       scheduling      cost classes and aging
    worker          worker process                   beat            maintenance process
    security        API-key authentication           admission       rate limits and caps
    decisions       decision jobs                    thinking        thinking generate jobs
    batches         batch jobs                       webhooks        webhook deliveries
    planes          API listeners, allow-lists, TLS
    client          the CLI client                   observability   logs, metrics, readiness

Every field keeps its **flat name**, the name it had before the grouping: the field's pydantic
``alias`` where the nested name differs (``engine.max_batch`` has alias ``engine_max_batch``),
else the nested name itself (``limits.max_prompt_tokens``). The flat name is

* its environment variable: ``CLOVERQ_`` + flat name in capitals (``CLOVERQ_ENGINE_MAX_BATCH``),
  unless the field names another one (``json_schema_extra={"env": ...}``: only
  ``PROMETHEUS_MULTIPROC_DIR``, which prometheus-client itself reads);
* its keyword: ``Settings(engine_max_batch=4)`` is the alias of ``Settings(engine={"max_batch": 4})``,
  and ``settings.replaced(engine_max_batch=4)`` a validated copy with that change;
* what ``settings.to_env()`` writes for a subprocess.

``flat_fields()`` derives that one table from the declarations below; there is no second list.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from functools import cache, lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from scheduler.access.networks import normalised_networks
from scheduler.infra.queue_names import DEFAULT_WORKER_QUEUES, QueueName

# Positions the chat template adds around a prompt (max_prompt_tokens counts the prompt's text only).
CHAT_TEMPLATE_SLACK_TOKENS = 64

ENV_PREFIX = "CLOVERQ_"


class SettingsGroup(BaseModel):
    """One concern's settings; its fields validate by nested name and by flat name (alias)."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)


# --- where state lives -----------------------------------------------------------------------


class DatabaseSettings(SettingsGroup):
    """SQL database: where it is and how long its operations may take."""

    url: str | None = Field(
        None, alias="database_url", description="SQLAlchemy URL; default SQLite under data_dir."
    )
    connect_timeout_seconds: float = Field(
        5.0, gt=0, alias="database_connect_timeout_seconds",
        description="Seconds to open one database connection (PostgreSQL connect_timeout, "
        "whole seconds, at least 2): a server that accepts and never answers fails fast (503).",
    )
    statement_timeout_seconds: float = Field(
        30.0, ge=0, alias="database_statement_timeout_seconds",
        description="PostgreSQL statement_timeout of every session (0: none); migrations run "
        "without it.",
    )
    lock_timeout_seconds: float = Field(
        30.0, ge=0, alias="database_lock_timeout_seconds",
        description="How long a statement waits for a lock: PostgreSQL lock_timeout (0: no "
        "bound), SQLite busy timeout (the embedded default's writers queue on one file lock).",
    )
    pool_timeout_seconds: float = Field(
        10.0, gt=0, alias="database_pool_timeout_seconds",
        description="PostgreSQL: how long a request waits for a free pooled connection "
        "before it fails (503).",
    )


class RedisSettings(SettingsGroup):
    """Redis (broker, caches, streams): where it is."""

    url: str | None = Field(
        None, alias="redis_url", description="Redis URL (redis://, rediss://, unix://, or "
        "redis+sentinel://HOST:26379,HOST:26379/SERVICE/DB to follow a Sentinel-managed master: "
        "deploy/README.md); default the embedded redis-server."
    )
    embedded_port: int = Field(
        6390, alias="embedded_redis_port", description="Port of the embedded redis-server."
    )


# --- model -------------------------------------------------------------------------------------


class ModelSettings(SettingsGroup):
    """The checkpoint a worker serves: where it is, how it is loaded, which store model it follows."""

    dir: Path | None = Field(
        None, alias="model_dir", description="Checkpoint folder; default the demo checkpoint."
    )
    device: str = Field("cpu", description="torch device for the model: cpu, cuda, cuda:N.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Weights and compute dtype; default the checkpoint's (config.json dtype or "
        "torch_dtype), float32 when it names none.",
    )
    weight_dtype: Literal["int8", "int4"] | None = Field(
        None, description="Worker: weight-only quantization at load (expert and projection matrices; "
        "embeddings, LM head, norms, routers and GDN gates keep dtype): int8 per output channel or int4 "
        "in groups of weight_group_size. Default: none, the weights stay in dtype.",
    )
    weight_group_size: int = Field(
        64, description="Worker: int4 group along the input dim (weight_dtype=int4): 32, 64 or 128.",
    )
    skip_verify: bool = Field(False, description="Load a checkpoint even if its manifest fails.")
    verify_on_load: Literal["quick", "full"] = Field(
        "quick", description="Manifest check when a worker loads a checkpoint: quick (sizes and sampled "
        "chunks of every file, the hashes recorded at pull trusted) or full (every byte re-hashed).",
    )
    root: Path | None = Field(
        None, alias="model_root",
        description="Model store: <model_root>/<name>/<version>/; default data_dir/model-store.",
    )
    served: str | None = Field(
        None, alias="served_model",
        description="Worker: serve this store model and follow its active version (cloverq model "
        "activate); unset: serve model_dir as is. API and beat: route jobs by this model's canary.",
    )
    served_initial_version: str | None = Field(
        None, alias="served_model_initial_version",
        description="Worker: version of served_model to activate when none is active yet.",
    )
    watch_interval_seconds: float = Field(
        2.0, gt=0, alias="model_watch_interval_seconds",
        description="Worker: how often it checks the active version of served_model.",
    )

    @field_validator("weight_group_size")
    @classmethod
    def _group_size(cls, value: int) -> int:
        if value not in (32, 64, 128):
            raise ValueError("weight_group_size must be 32, 64 or 128")
        return value


class CanarySettings(SettingsGroup):
    """Canary releases (scheduler/model_versions/canary.py, docs/architecture.md "Canary releases")."""

    track: Literal["stable", "canary"] = Field(
        "stable", alias="model_track",
        description="Worker: canary workers serve the canary version of served_model while "
        "one is in effect (cloverq model canary), stable ones the active version.",
    )
    min_jobs: int = Field(
        50, ge=0, alias="canary_min_jobs",
        description="Promotion is refused until the canary finished this many jobs (--force overrides).",
    )
    error_margin: float = Field(
        0.01, ge=0, le=1, alias="canary_error_margin",
        description="Promotion is refused when the canary's error rate exceeds the "
        "stable one's by more than this (--force overrides).",
    )
    require_golden: bool = Field(
        False, alias="canary_require_golden",
        description="Promotion is refused unless the canary version's last golden check passed "
        "(cloverq model golden check; --force overrides).",
    )
    reroute_seconds: float = Field(
        60.0, gt=0, alias="canary_reroute_seconds",
        description="A canary job queued this long while no canary worker is registered "
        "is re-routed to the stable version (reconciler).",
    )


# --- engine ------------------------------------------------------------------------------------


class EngineSettings(SettingsGroup):
    """The worker's batched inference engine: batch, KV room, prefix cache, threads, devices."""

    max_batch: int = Field(
        16, ge=1, alias="engine_max_batch", description="Sequences in one batched forward."
    )
    max_tokens_in_flight: int = Field(
        65536, ge=1, alias="engine_max_tokens_in_flight", description="KV positions held at once."
    )
    prefix_cache_bytes: int = Field(
        512 * 1024 * 1024, ge=0, description="Worker: bytes of shared prompt prefixes (K/V, and GDN "
        "states at the cached block boundary) the engine keeps, evicted least recently used; prompts "
        "that share whole blocks (a decision's questions, jobs over one document) prefill them once. "
        "0 turns prefix sharing off.",
    )
    prefill_chunk_tokens: int = Field(
        512, ge=0, alias="engine_prefill_chunk_tokens",
        description="Worker: prompt tokens one engine iteration may prefill; a longer prompt prefills in "
        "whole-block chunks between denoising passes, so running jobs (and short jobs admitted meanwhile) "
        "never wait for a whole long prompt's forward (bench.long). 0: a prompt's whole blocks ride in its "
        "first pass.",
    )
    max_len: int | None = Field(
        None, ge=1, alias="engine_max_len",
        description="KV positions per sequence (prompt + generated region). Default: "
        "max_prompt_tokens + max_new_tokens_limit + 64 (chat template) rounded up to 64-token blocks.",
    )
    torch_threads: int | None = Field(
        None, ge=1, description="Worker: torch.set_num_threads at start. Default: the number of CPU cores.",
    )
    tensor_parallel: int = Field(
        1, ge=1, description="Worker: devices one worker spans (tensor parallel). Ranks 1..N-1 are processes "
        "the worker starts, on cuda:K+1.. after device cuda:K (NCCL; gloo on CPU, torch_threads split "
        "among them); heads and MLP widths must divide by N. `CLOVERQ_WEIGHT_DTYPE` applies per rank (each "
        "quantizes its shard on the host with the one-device rules: the same int8 codes and scales; an int4 "
        "group that does not divide a row-parallel shard's input width falls back to a smaller group or "
        "int8, logged) and FP8 block-scaled checkpoints are dequantized slice by slice. A rank that dies "
        "takes the worker down (exit status 75), its jobs come back through lease expiry.",
    )
    joint_slot_cap: int = Field(
        4, ge=1, alias="engine_joint_slot_cap", description="Engine slots joint requests may hold."
    )
    interactive_reserve: int = Field(
        4,  # bench.mix, 4 short jobs/s under a saturating bulk batch: p95 wait 1962 ms with 2, 76 ms with 4
        ge=0, alias="engine_interactive_reserve",
        description="Task threads and engine slots beyond engine_max_batch that only interactive jobs may "
        "take (on a worker consuming interactive and other queues), so short jobs never wait for bulk work.",
    )


# --- request limits and defaults ---------------------------------------------------------------


class LimitSettings(SettingsGroup):
    """What one request may ask for, the defaults it gets, and the HTTP size limits of the API."""

    max_prompt_tokens: int = Field(
        16_384, ge=1, description="Prompt tokens a job may send; the checkpoint's context "
        "(max_position_embeddings) caps it further (scheduler/fleet/context_limits.py). The default lets a "
        "16K-token contract through; engine memory per sequence grows with it (engine_max_len).",
    )
    max_new_tokens_limit: int = Field(2048, ge=1)
    default_max_new_tokens: int = Field(128, ge=1)
    default_steps_per_block: int | None = Field(
        None,
        ge=1,
        description="Steps per block when a request names none; unset: the model family's default "
        "(Clover and LLaDA2: the block size; SDAR: 4).",
    )
    max_steps_per_block: int = Field(64, ge=1)
    max_step_budget: int = Field(8192, ge=1)
    max_body_bytes: int = Field(1_048_576, ge=1024)
    max_header_bytes: int = Field(
        32_768, ge=1024, description="cloverq api: bytes of a request's head (request line and headers); "
        "a larger one is refused with 431 as it arrives.",
    )
    max_header_count: int = Field(
        100, ge=8, description="cloverq api: header lines of one request; more are refused with 431.",
    )
    header_timeout_seconds: float = Field(
        10.0, gt=0, description="cloverq api: from a request head's first byte to its end; a slower head "
        "(slowloris) is answered 408 and the connection closed.",
    )
    idle_timeout_seconds: float = Field(
        15.0, gt=0, description="cloverq api: how long a new connection may stay silent before its first "
        "request; then it is closed. Between requests the keep-alive timeout (cloverq api --keep-alive) "
        "applies.",
    )
    max_connections: int = Field(
        900, ge=1, description="cloverq api: open connections one process serves; beyond it (and the health "
        "reserve) a new one is answered 503 too_many_connections and closed at once. Lowered to fit the "
        "process's file-descriptor limit (raised to its hard limit at start).",
    )
    health_connections: int = Field(
        32, ge=1, description="cloverq api: connections beyond max_connections that may still ask "
        "/healthz, /readyz and /metrics, so probes answer while the API is full.",
    )
    max_metadata_bytes: int = Field(
        16_384, ge=64,
        description="Bytes of a job's (or batch's) metadata as compact UTF-8 JSON; larger is refused (422).",
    )
    max_schema_bytes: int = Field(
        16_384, ge=64,
        description="Bytes of a response_schema (OpenAI response_format json_schema) as JSON; larger is "
        "refused with 400 schema_too_large.",
    )
    max_schema_depth: int = Field(
        6, ge=1, le=32,
        description="Nesting of objects, arrays and anyOf in a response_schema; deeper is refused with 400 "
        "schema_too_large.",
    )
    max_tools: int = Field(
        128, ge=1, le=4096,
        description="Functions in one request's tools (OpenAI tools); more are refused with 400 "
        "too_many_tools. Each tool's parameters count against max_schema_bytes / max_schema_depth.",
    )
    list_max_response_bytes: int = Field(
        4 * 1024 * 1024, ge=65_536,
        description="GET /v1/jobs ends a page before this many bytes (next_cursor goes on from there); "
        "a page always holds at least one job.",
    )


# --- job system (scheduler + worker + beat) ----------------------------------------------------


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


class WorkerSettings(SettingsGroup):
    """The worker process: the queues it consumes, its heartbeat, its threads; test-only faults."""

    heartbeat_seconds: float = Field(
        2.0, gt=0, alias="worker_heartbeat_seconds", description="Worker registry heartbeat."
    )
    switch_interval_ms: float = Field(
        0.5, gt=0, le=100, alias="worker_switch_interval_ms",
        description="Worker: Python's thread switch interval (sys.setswitchinterval). The engine thread "
        "holds the GIL between torch calls; at Python's 5 ms a task thread claiming an interactive job "
        "waits up to that long at every hand-over (bench.mix under bulk load, back to back on a loaded host: "
        "p95 wait 508 ms at 5, 15 ms at 0.5).",
    )
    queues: str = Field(
        ",".join(DEFAULT_WORKER_QUEUES), alias="worker_queues",
        description="Queues a worker consumes, in order.",
    )
    fault_injection: bool = Field(False, description="TESTS ONLY: honour params.fault in the worker.")
    fault_stall_seconds: float = Field(30.0, ge=0, description="TESTS ONLY: how long a 'stall' fault waits.")


class BeatSettings(SettingsGroup):
    """The beat process: its maintenance tasks and their intervals (webhooks has its own sweep)."""

    reconcile_interval_seconds: float = Field(5.0, gt=0, description="Beat: re-enqueue lost messages.")
    reconcile_grace_seconds: float = Field(2.0, ge=0, description="Age before a queued row counts as lost.")
    reaper_interval_seconds: float = Field(10.0, gt=0, description="Beat: requeue expired leases.")
    expiry_interval_seconds: float = Field(300.0, gt=0, description="Beat: expire old results.")
    expiry_batch: int = Field(
        1000, ge=1, description="Jobs one expiry statement expires at most; a tick repeats it, each batch "
        "its own short transaction under the statement timeout, until none is due.",
    )
    delayed_interval_seconds: float = Field(
        1.0, gt=0, description="Beat: publish delayed jobs that came due (an index range scan per tick).",
    )
    purge_interval_seconds: float = Field(
        10.0, gt=0, description="Beat: purge the data of jobs whose retention passed (or that expired).",
    )
    purge_batch: int = Field(500, ge=1, description="Jobs one purge tick schedules and purges at most.")
    lease_seconds: float = Field(
        10.0, gt=0, alias="beat_lease_seconds",
        description="Beat leader lease (Redis): any number of beat processes run, the holder dispatches the "
        "periodic tasks and renews every third of it; a dead or hung leader is replaced within 4/3 of it.",
    )
    threads: int = Field(
        4, ge=1, alias="light_worker_threads",
        description="Threads of the beat process (maintenance tasks + webhook deliveries).",
    )


# --- security and admission control (scheduler/access/api_keys.py, scheduler/access/admission.py) ---


class SecuritySettings(SettingsGroup):
    """API-key authentication (scheduler/access/api_keys.py)."""

    auth: Literal["enabled", "disabled"] = Field(
        "enabled", description="API-key authentication; 'disabled' only for local development."
    )
    auth_cache_seconds: float = Field(
        5.0, ge=0, description="How long an API process caches a looked-up key (revocation bound)."
    )


class AdmissionSettings(SettingsGroup):
    """Admission control (scheduler/access/admission.py): per-key rate, per-tenant and per-queue caps."""

    rate_limit_per_second: float = Field(
        50.0, ge=0, description="Per-key token-bucket refill rate (requests/s); 0 disables the limit."
    )
    rate_limit_burst: int = Field(100, ge=1, description="Per-key token-bucket size (requests).")
    tenant_max_active_jobs: int = Field(
        1000, ge=1, description="Per-tenant cap on queued + running jobs; more submits get 429."
    )
    tenant_count_cache_seconds: float = Field(
        1.0, ge=0, description="How long an API process trusts its tenant active-job count while far "
        "below the cap (near the cap it always counts in SQL); 0 counts every submit.",
    )
    queue_max_depth: dict[str, int] = Field(
        default_factory=lambda: {QueueName.INTERACTIVE.value: 1000, QueueName.STANDARD.value: 5000,
                                 QueueName.BULK.value: 20000, QueueName.JOINT.value: 500},
        description="Per-queue cap on waiting messages; a submit routed to a full queue gets 429.",
    )


# --- decisions, thinking, batches, webhooks (issue 5) ------------------------------------------


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


class WebhookSettings(SettingsGroup):
    """Webhook deliveries: retries, timeout, which non-public targets are allowed, the beat's sweep."""

    max_attempts: int = Field(
        5, ge=1, alias="webhook_max_attempts", description="Deliveries tried before a webhook is given up."
    )
    backoff_base_seconds: float = Field(
        1.0, ge=0, alias="webhook_backoff_base_seconds", description="Webhook retry n waits base*2^(n-1)."
    )
    backoff_max_seconds: float = Field(
        300.0, ge=0, alias="webhook_backoff_max_seconds", description="Cap of the webhook backoff."
    )
    timeout_seconds: float = Field(
        5.0, gt=0, alias="webhook_timeout_seconds", description="Timeout of one webhook POST."
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, alias="webhook_allowed_hosts",
        description="Webhook URL hosts (names or addresses, comma-separated or a JSON "
        "list) delivered to although they resolve to loopback, private, link-local or other non-public "
        "addresses, which are refused otherwise.",
    )
    allowed_networks: Annotated[list[str], NoDecode] = Field(
        default_factory=list, alias="webhook_allowed_networks",
        description="CIDR networks (comma-separated or a JSON list, e.g. 10.8.0.0/16) "
        "webhook targets may resolve into although they are not public.",
    )
    sweep_interval_seconds: float = Field(
        10.0, gt=0, alias="webhook_sweep_interval_seconds",
        description="Beat: record missed webhook deliveries and re-publish lost ones.",
    )
    progress_interval_seconds: float = Field(
        10.0, ge=0.1, alias="webhook_progress_interval_seconds",
        description="At most one job.progress webhook per job per this long (webhook_events: progress).",
    )

    @field_validator("allowed_hosts", "allowed_networks", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        return split_list(value)

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        return [host.lower().rstrip(".").strip("[]") for host in value]

    @field_validator("allowed_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        return normalised_networks(value)  # a ValueError refuses the setting


def split_list(value: Any) -> Any:
    """A JSON list or comma-separated text (environment) -> a list of stripped items."""
    if isinstance(value, str):
        text = value.strip()
        value = json.loads(text) if text.startswith("[") else text.split(",")
    if isinstance(value, (list, tuple)):
        return [str(item).strip() for item in value if str(item).strip()]
    return value


# --- the API's listeners: planes, allow-lists, TLS ----------------------------------------------


NetworkList = Annotated[list[str], NoDecode]


class PlaneSettings(SettingsGroup):
    """Where the API's three planes listen, who may reach each, and their TLS (docs/security.md).

    Public plane: jobs, batches, decisions, the OpenAI routes, events. Admin plane: ``/v1/admin``
    and the dashboard. Ops plane: ``/metrics``, ``/livez``, ``/healthz``, ``/readyz``. With
    neither ``admin_port`` nor ``ops_port`` set, one listener serves all three (one-port mode, for
    development); with them set, each plane has its own listener and the others answer 404 for
    its paths.
    """

    admin_port: int | None = Field(
        None, ge=0, le=65535, description="Port of the admin plane's own listener (unset: the admin "
        "plane is served on the public port).")
    admin_host: str = Field("127.0.0.1", description="Interface the admin listener binds (loopback: "
                            "reachable only from this host or through a proxy of yours).")
    ops_port: int | None = Field(
        None, ge=0, le=65535, description="Port of the ops plane's own listener (unset: the ops plane is "
        "served on the admin port when there is one, else on the public port).")
    ops_host: str = Field("127.0.0.1", description="Interface the ops listener binds.")
    public_allowed_networks: NetworkList = Field(
        default_factory=list, description="CIDR networks (comma-separated or a JSON list) allowed to "
        "call the public plane; empty: any address.")
    admin_allowed_networks: NetworkList = Field(
        default_factory=list, description="CIDR networks allowed to call the admin plane; empty: any.")
    ops_allowed_networks: NetworkList = Field(
        default_factory=list, description="CIDR networks allowed to call the ops plane; empty: any.")
    trusted_proxies: NetworkList = Field(
        default_factory=list, description="CIDR networks of proxies whose X-Forwarded-For / Forwarded "
        "headers are believed (the right-most hop that is not a trusted proxy is the client); empty: "
        "the socket's peer is always the client.")
    tls_cert_file: Path | None = Field(
        None, description="PEM certificate (chain) of the public listener; with tls_key_file the API "
        "serves HTTPS. Also the admin and ops listeners' unless they have their own.")
    tls_key_file: Path | None = Field(None, description="PEM private key of tls_cert_file.")
    admin_tls_cert_file: Path | None = Field(None, description="PEM certificate of the admin listener.")
    admin_tls_key_file: Path | None = Field(None, description="PEM private key of admin_tls_cert_file.")
    admin_tls_client_ca_file: Path | None = Field(
        None, description="PEM CA bundle: the admin listener then requires a client certificate it "
        "signed (mutual TLS); a client without one is refused in the TLS handshake.")
    ops_tls_cert_file: Path | None = Field(None, description="PEM certificate of the ops listener.")
    ops_tls_key_file: Path | None = Field(None, description="PEM private key of ops_tls_cert_file.")
    drain_seconds: float = Field(
        0.0, ge=0, le=300, alias="api_drain_seconds", description="cloverq api: after SIGTERM the replica "
        "keeps serving this long while /readyz and /readyz/replica answer 503, so a load balancer takes it "
        "out before its listeners close; long polls answer and event streams end by then (api/drain.py). "
        "Behind a load balancer set it above the time it takes to mark a server down (HAProxy: inter x "
        "fall); 0: close at once.")
    stop_grace_seconds: float = Field(
        10.0, gt=0, alias="api_stop_grace_seconds", description="cloverq api: after the listeners close, "
        "how long requests still running (OpenAI streams and blocking answers) may go on before they are "
        "cut; a cut OpenAI stream cancels its job.")

    @field_validator("public_allowed_networks", "admin_allowed_networks", "ops_allowed_networks",
                     "trusted_proxies", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        return split_list(value)

    @field_validator("public_allowed_networks", "admin_allowed_networks", "ops_allowed_networks",
                     "trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        return normalised_networks(value)  # a ValueError refuses the setting

    @model_validator(mode="after")
    def _pairs(self) -> PlaneSettings:
        pairs = (("tls_cert_file", "tls_key_file"), ("admin_tls_cert_file", "admin_tls_key_file"),
                 ("ops_tls_cert_file", "ops_tls_key_file"))
        for cert, key in pairs:
            if (getattr(self, cert) is None) != (getattr(self, key) is None):
                raise ValueError(f"{cert} and {key} go together: set both or neither")
        if self.admin_tls_client_ca_file is not None and self.admin_tls_cert_file is None \
                and self.tls_cert_file is None:
            raise ValueError("admin_tls_client_ca_file needs the admin listener to serve TLS "
                             "(admin_tls_cert_file or tls_cert_file)")
        return self

    @property
    def split(self) -> bool:
        """Whether the admin or ops plane has a listener of its own."""
        return self.admin_port is not None or self.ops_port is not None


# --- CLI client, logging, metrics --------------------------------------------------------------


class ClientSettings(SettingsGroup):
    """The CLI client (cloverq submit / jobs / cancel)."""

    api_url: str = Field(
        "http://127.0.0.1:8000",
        description="Where the CLI client finds the API; unset: the stack `cloverq up` recorded.",
    )
    admin_api_url: str | None = Field(
        None, description="Where the CLI client finds the admin plane (`cloverq top`) when the API serves it "
        "on a port of its own; unset: the recorded stack's, else api_url.")
    ops_api_url: str | None = Field(
        None, description="Where the CLI client finds the ops plane (/readyz); unset: the recorded stack's, "
        "else api_url.")
    api_key: str | None = Field(
        None, description="CLI client key; unset: data_dir/dev_api_key, else the recorded stack's dev key.")
    stack_file: Path | None = Field(
        None, description="Where `cloverq up` records its URL and data dir so the CLI finds them from any "
        "folder; default $XDG_STATE_HOME/cloverq/stack.json (~/.local/state/cloverq/stack.json).",
    )


class ObservabilitySettings(SettingsGroup):
    """Logs, metrics (scheduler/observability/metric_families.py), traces (tracing.py), readiness."""

    log_level: str = "INFO"
    log_payloads: bool = Field(False, description="Log prompts, contexts and outputs (off by default).")
    prometheus_multiproc_dir: Path | None = Field(
        None,
        json_schema_extra={"env": "PROMETHEUS_MULTIPROC_DIR"},
        description="prometheus-client multiprocess dir; set when one host runs several API processes.",
    )
    worker_metrics_interval: float = Field(
        5.0, gt=0, description="Seconds between a worker's metric snapshots (tokens/s, memory, experts)."
    )
    readiness_timeout_seconds: float = Field(
        2.0, gt=0, description="/readyz answers within this: a database or Redis check that has not "
        "answered by then counts as failed (503).",
    )
    tracing_enabled: bool = Field(
        False, description="OpenTelemetry traces (docs/observability.md): one trace per job across the API, "
        "worker and beat, exported over OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT (default "
        "http://localhost:4318); OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES apply. Off: no exporter.",
    )
    tracing_sample_ratio: float | None = Field(
        None, ge=0, le=1, description="Share of new traces recorded (parent-based: a client's sampled "
        "traceparent is followed). Unset: OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG, default all.",
    )
    tracing_queue_size: int = Field(
        2048, ge=1, description="Finished spans a process buffers for export; beyond it (a collector "
        "down or slow) spans are dropped and counted (cloverq_trace_spans_dropped_total), never waited on.",
    )
    tracing_ui_url: str | None = Field(
        None, description="Dashboard: a job's trace links to this http(s) URL with {trace_id} replaced "
        "(a Grafana Explore, Jaeger or vendor trace page); unset: the trace id is shown without a link.",
    )

    @field_validator("tracing_ui_url")
    @classmethod
    def _trace_ui_template(cls, value: str | None) -> str | None:
        """Only an http(s) URL with the placeholder: the dashboard renders it as a link (never a
        ``javascript:`` one)."""
        if value is not None and (not value.startswith(("http://", "https://")) or "{trace_id}" not in value):
            raise ValueError("tracing_ui_url must be an http(s) URL containing {trace_id}")
        return value


# --- the settings ------------------------------------------------------------------------------


class Settings(BaseSettings):
    """Configuration of one cloverq deployment."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    data_dir: Path = Field(Path(".cloverq"), description="State of the embedded default.")
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    redis: RedisSettings = Field(default_factory=RedisSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    canary: CanarySettings = Field(default_factory=CanarySettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    jobs: JobSettings = Field(default_factory=JobSettings)
    scheduling: SchedulingSettings = Field(default_factory=SchedulingSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
    beat: BeatSettings = Field(default_factory=BeatSettings)
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    decisions: DecisionSettings = Field(default_factory=DecisionSettings)
    thinking: ThinkingSettings = Field(default_factory=ThinkingSettings)
    batches: BatchSettings = Field(default_factory=BatchSettings)
    webhooks: WebhookSettings = Field(default_factory=WebhookSettings)
    planes: PlaneSettings = Field(default_factory=PlaneSettings)
    client: ClientSettings = Field(default_factory=ClientSettings)
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Keywords first, then the environment under the flat names (no .env file, no secrets dir)."""
        return init_settings, FlatEnvSource(settings_cls)

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_names(cls, data: Any) -> Any:
        """Flat names (keywords, ``model_validate``) -> their groups; a flat value wins over a nested one."""
        return nest(data) if isinstance(data, Mapping) else data

    def replaced(self, **changes: Any) -> Settings:
        """A validated copy with ``changes`` (flat names, or whole groups by group name)."""
        unknown = set(changes) - set(flat_fields()) - set(type(self).model_fields)
        if unknown:
            raise TypeError(f"not a setting: {', '.join(sorted(unknown))}")
        return type(self).model_validate({**self.model_dump(), **changes})

    def flat_value(self, flat_name: str) -> Any:
        """The value of the setting with this flat name (``engine_max_batch`` -> ``engine.max_batch``)."""
        entry = flat_fields()[flat_name]
        owner = self if entry.group is None else getattr(self, entry.group)
        return getattr(owner, entry.name)

    def to_env(self) -> dict[str, str]:
        """Environment variables that reproduce these settings in a subprocess (unset values left out)."""
        env: dict[str, str] = {}
        for entry in flat_fields().values():
            value = self.flat_value(entry.flat)
            if value is None:
                continue
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, (dict, list, tuple)):
                text = json.dumps(value)
            else:
                text = str(value)
            env[entry.env] = text
        return env

    @property
    def resolved_database_url(self) -> str:
        """The database to use: ``database.url`` or SQLite under ``data_dir``."""
        if self.database.url:
            return self.database.url
        return f"sqlite:///{(self.data_dir / 'cloverq.db').resolve()}"

    @property
    def resolved_redis_url(self) -> str:
        """The Redis to use: ``redis.url`` or the embedded server started by ``cloverq up``."""
        if self.redis.url:
            return self.redis.url
        return f"redis://127.0.0.1:{self.redis.embedded_port}/0"

    @property
    def broker_visibility_timeout_seconds(self) -> float:
        """Redis redelivery timeout: above the longest deadline, so no running job is redelivered.

        ``jobs.visibility_timeout_seconds`` overrides it (the chaos tests set it below a job's run
        time to show that a redelivered running job is fenced off and runs once).
        """
        if self.jobs.visibility_timeout_seconds is not None:
            return self.jobs.visibility_timeout_seconds
        longest = max(self.jobs.deadline_seconds, self.jobs.joint_deadline_seconds,
                      self.thinking.deadline_seconds)
        return 2 * longest + self.jobs.lease_seconds

    @property
    def resolved_engine_max_len(self) -> int:
        """Per-sequence KV length of the engine: ``engine.max_len``, or room for the largest request
        the API accepts (the chat template's tokens included; whole blocks of any size dividing 64)."""
        if self.engine.max_len is not None:
            return self.engine.max_len
        needed = self.limits.max_prompt_tokens + CHAT_TEMPLATE_SLACK_TOKENS + self.limits.max_new_tokens_limit
        return -(-needed // 64) * 64

    @property
    def resolved_torch_threads(self) -> int:
        """Threads torch uses for one worker's ops: ``engine.torch_threads`` or the CPU cores."""
        return self.engine.torch_threads or os.cpu_count() or 1

    @property
    def resolved_model_dir(self) -> Path:
        """The checkpoint to serve: ``model.dir`` or the demo checkpoint under ``data_dir`` (an
        absolute path, so a process started elsewhere finds the same folder)."""
        return (self.model.dir or (self.data_dir / "models" / "demo")).expanduser().absolute()

    @property
    def resolved_model_root(self) -> Path:
        """The model store root: ``model.root`` or ``data_dir/model-store``."""
        return (self.model.root or (self.data_dir / "model-store")).expanduser().absolute()


# --- flat names --------------------------------------------------------------------------------


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
def flat_fields() -> dict[str, FlatField]:
    """Every setting by flat name, in declaration order (derived from the field declarations)."""
    table: dict[str, FlatField] = {}
    for group, group_field in Settings.model_fields.items():
        model = group_field.annotation
        if isinstance(model, type) and issubclass(model, SettingsGroup):
            entries = [_entry(field.alias or name, group, name, field)
                       for name, field in model.model_fields.items()]
        else:
            entries = [_entry(group, None, group, group_field)]
        for entry in entries:
            if entry.flat in table or (entry.group is not None and entry.flat in Settings.model_fields):
                raise TypeError(f"flat setting name {entry.flat!r} is not unique")
            table[entry.flat] = entry
    return table


def settings_groups() -> dict[str, type[SettingsGroup]]:
    """The nested groups of ``Settings`` by attribute name, in declaration order."""
    return {name: field.annotation for name, field in Settings.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, SettingsGroup)}


def nest(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with every flat group member moved into its group (``engine_max_batch`` ->
    ``engine: {max_batch: ...}``); a flat value wins over the same setting given nested."""
    table = flat_fields()
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
        table = flat_fields()
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
                    raise SettingsError(f'error parsing value for field "{entry.flat}" from source '
                                        f'"{type(self).__name__}"') from exc
            target = data if entry.group is None else data.setdefault(entry.group, {})
            target[entry.name] = value
        return data


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
