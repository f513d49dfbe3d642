"""The one Settings object of cloverq (env prefix ``CLOVERQ_``).

Every process (api, worker, beat, CLI) reads its configuration here and nowhere else, so a
value means the same thing in every component. Nothing in the code base reads ``os.environ``
for configuration.
"""

from __future__ import annotations

import ipaddress
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from scheduler.queue_names import DEFAULT_WORKER_QUEUES, QueueName

# Positions the chat template adds around a prompt (max_prompt_tokens counts the prompt's text only).
CHAT_TEMPLATE_SLACK_TOKENS = 64


class Settings(BaseSettings):
    """Configuration of one cloverq deployment."""

    model_config = SettingsConfigDict(env_prefix="CLOVERQ_", extra="ignore")

    # --- where state lives -------------------------------------------------------------------
    data_dir: Path = Field(Path(".cloverq"), description="State of the embedded default.")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default SQLite under data_dir.")
    redis_url: str | None = Field(None, description="Redis URL; default the embedded redis-server.")
    embedded_redis_port: int = Field(6390, description="Port of the embedded redis-server.")
    database_connect_timeout_seconds: float = Field(
        5.0, gt=0, description="Seconds to open one database connection (PostgreSQL connect_timeout, "
        "whole seconds, at least 2): a server that accepts and never answers fails fast (503).",
    )
    database_statement_timeout_seconds: float = Field(
        30.0, ge=0, description="PostgreSQL statement_timeout of every session (0: none); migrations run "
        "without it.",
    )
    database_lock_timeout_seconds: float = Field(
        30.0, ge=0, description="How long a statement waits for a lock: PostgreSQL lock_timeout (0: no "
        "bound), SQLite busy timeout (the embedded default's writers queue on one file lock).",
    )
    database_pool_timeout_seconds: float = Field(
        10.0, gt=0, description="PostgreSQL: how long a request waits for a free pooled connection "
        "before it fails (503).",
    )
    readiness_timeout_seconds: float = Field(
        2.0, gt=0, description="/readyz answers within this: a database or Redis check that has not "
        "answered by then counts as failed (503).",
    )

    # --- model -------------------------------------------------------------------------------
    model_dir: Path | None = Field(None, description="Checkpoint folder; default the demo checkpoint.")
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
    model_root: Path | None = Field(
        None, description="Model store: <model_root>/<name>/<version>/; default data_dir/model-store."
    )
    served_model: str | None = Field(
        None, description="Worker: serve this store model and follow its active version (cloverq model "
        "activate); unset: serve model_dir as is. API and beat: route jobs by this model's canary.",
    )
    served_model_initial_version: str | None = Field(
        None, description="Worker: version of served_model to activate when none is active yet.",
    )
    model_watch_interval_seconds: float = Field(
        2.0, gt=0, description="Worker: how often it checks the active version of served_model.",
    )
    # Canary releases (scheduler/canary.py, docs/architecture.md "Canary releases").
    model_track: Literal["stable", "canary"] = Field(
        "stable", description="Worker: canary workers serve the canary version of served_model while "
        "one is in effect (cloverq model canary), stable ones the active version.",
    )
    canary_min_jobs: int = Field(
        50, ge=0, description="Promotion is refused until the canary finished this many jobs "
        "(--force overrides).",
    )
    canary_error_margin: float = Field(
        0.01, ge=0, le=1, description="Promotion is refused when the canary's error rate exceeds the "
        "stable one's by more than this (--force overrides).",
    )
    canary_reroute_seconds: float = Field(
        60.0, gt=0, description="A canary job queued this long while no canary worker is registered "
        "is re-routed to the stable version (reconciler).",
    )

    # --- engine ------------------------------------------------------------------------------
    engine_max_batch: int = Field(16, ge=1, description="Sequences in one batched forward.")
    engine_max_tokens_in_flight: int = Field(65536, ge=1, description="KV positions held at once.")
    prefix_cache_bytes: int = Field(
        512 * 1024 * 1024, ge=0, description="Worker: bytes of shared prompt prefixes (K/V, and GDN "
        "states at the cached block boundary) the engine keeps, evicted least recently used; prompts "
        "that share whole blocks (a decision's questions, jobs over one document) prefill them once. "
        "0 turns prefix sharing off.",
    )
    engine_max_len: int | None = Field(
        None, ge=1, description="KV positions per sequence (prompt + generated region). Default: "
        "max_prompt_tokens + max_new_tokens_limit + 64 (chat template) rounded up to 64-token blocks.",
    )
    torch_threads: int | None = Field(
        None, ge=1, description="Worker: torch.set_num_threads at start. Default: the number of CPU cores.",
    )
    tensor_parallel: int = Field(
        1, ge=1, description="Worker: devices one worker spans (tensor parallel). Ranks 1..N-1 are processes "
        "the worker starts, on cuda:K+1.. after device cuda:K (NCCL; gloo on CPU, torch_threads split "
        "among them); heads and MLP widths must divide by N. A rank that dies takes the worker down "
        "(exit status 75), its jobs come back through lease expiry.",
    )

    # --- request limits and defaults -----------------------------------------------------------
    max_prompt_tokens: int = Field(4096, ge=1)
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
    max_metadata_bytes: int = Field(
        16_384, ge=64,
        description="Bytes of a job's (or batch's) metadata as compact UTF-8 JSON; larger is refused (422).",
    )
    list_max_response_bytes: int = Field(
        4 * 1024 * 1024, ge=65_536,
        description="GET /v1/jobs ends a page before this many bytes (next_cursor goes on from there); "
        "a page always holds at least one job.",
    )

    # --- job system (scheduler + worker) -----------------------------------------------------
    max_attempts: int = Field(3, ge=1, description="Claims a job may take before retries_exhausted.")
    result_ttl_seconds: float = Field(7 * 24 * 3600, gt=0, description="Finished jobs expire after this.")
    lease_seconds: float = Field(60.0, gt=0, description="A running job's lease; renewed while it runs.")
    retry_backoff_base_seconds: float = Field(2.0, ge=0, description="Backoff before retry n: base*2^(n-1).")
    retry_backoff_max_seconds: float = Field(300.0, ge=0, description="Cap of the retry backoff.")
    job_deadline_seconds: float = Field(900.0, gt=0, description="Max run time of one attempt.")
    joint_deadline_seconds: float = Field(1800.0, gt=0, description="Max run time of a joint attempt.")
    interactive_max_cost: int = Field(8192, ge=1, description="Cost (tokens x steps) of the short class.")
    standard_max_cost: int = Field(131072, ge=1, description="Cost bound of the standard class.")
    aging_seconds: float = Field(120.0, gt=0, description="Queued longer than this: promoted to interactive.")
    aging_max_promoted: int = Field(4, ge=1, description="Aged jobs waiting in interactive at once.")
    visibility_timeout_seconds: float | None = Field(
        None, gt=0, description="Redis redelivery timeout; default 2 x the longest deadline + lease."
    )
    reconcile_interval_seconds: float = Field(5.0, gt=0, description="Beat: re-enqueue lost messages.")
    reconcile_grace_seconds: float = Field(2.0, ge=0, description="Age before a queued row counts as lost.")
    reaper_interval_seconds: float = Field(10.0, gt=0, description="Beat: requeue expired leases.")
    expiry_interval_seconds: float = Field(300.0, gt=0, description="Beat: expire old results.")
    progress_sql_interval_seconds: float = Field(5.0, gt=0, description="Progress to SQL every this long.")
    worker_heartbeat_seconds: float = Field(2.0, gt=0, description="Worker registry heartbeat.")
    worker_switch_interval_ms: float = Field(
        0.5, gt=0, le=100,
        description="Worker: Python's thread switch interval (sys.setswitchinterval). The engine thread "
        "holds the GIL between torch calls; at Python's 5 ms a task thread claiming an interactive job "
        "waits up to that long at every hand-over (bench.mix under bulk load: p95 wait 508 ms at 5, "
        "15 ms at 0.5).",
    )
    worker_queues: str = Field(
        ",".join(DEFAULT_WORKER_QUEUES), description="Queues a worker consumes, in order."
    )
    engine_joint_slot_cap: int = Field(4, ge=1, description="Engine slots joint requests may hold.")
    engine_interactive_reserve: int = Field(
        4,  # bench.mix, 4 short jobs/s under a saturating bulk batch: p95 wait 1962 ms with 2, 76 ms with 4
        ge=0,
        description="Task threads and engine slots beyond engine_max_batch that only interactive jobs may "
        "take (on a worker consuming interactive and other queues), so short jobs never wait for bulk work.",
    )
    fault_injection: bool = Field(False, description="TESTS ONLY: honour params.fault in the worker.")
    fault_stall_seconds: float = Field(30.0, ge=0, description="TESTS ONLY: how long a 'stall' fault waits.")

    # --- security and admission control (see scheduler/keys.py, scheduler/admission.py) ------
    auth: Literal["enabled", "disabled"] = Field(
        "enabled", description="API-key authentication; 'disabled' only for local development."
    )
    auth_cache_seconds: float = Field(
        5.0, ge=0, description="How long an API process caches a looked-up key (revocation bound)."
    )
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

    # --- decisions, thinking, batches, webhooks (issue 5) -----------------------------------
    decide_max_questions: int = Field(64, ge=1, description="Questions in one decision job.")
    decide_max_choices: int = Field(16, ge=2, description="Choices of one question.")
    decide_max_context_chars: int = Field(200_000, ge=1, description="Characters of a decision context.")
    decide_rationale_tokens: int = Field(24, ge=1, description="Length of a rationale's free-text slot.")
    decide_rationale_max_chars: int = Field(400, ge=1, description="A longer rationale is invalid.")
    decide_retry_temperature: float = Field(
        0.7, ge=0, description="The one retry after an invalid rationale samples at least this hot."
    )
    joint_default_step_budget: int = Field(4096, ge=1, description="Default step budget of a joint job.")
    default_thinking: bool = Field(False, description="params.thinking when a generate job omits it.")
    thinking_default_max_new_tokens: int = Field(512, ge=1, description="max_new_tokens default, thinking.")
    thinking_default_step_budget: int = Field(4096, ge=1, description="Step budget default, thinking.")
    thinking_deadline_seconds: float = Field(1800.0, gt=0, description="Max run time of a thinking attempt.")
    batch_max_jobs: int = Field(10_000, ge=1, description="Job specs in one batch.")
    batch_max_body_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Body limit of POST /v1/batches (JSON or JSONL upload)."
    )
    webhook_max_attempts: int = Field(5, ge=1, description="Deliveries tried before a webhook is given up.")
    webhook_backoff_base_seconds: float = Field(1.0, ge=0, description="Webhook retry n waits base*2^(n-1).")
    webhook_backoff_max_seconds: float = Field(300.0, ge=0, description="Cap of the webhook backoff.")
    webhook_timeout_seconds: float = Field(5.0, gt=0, description="Timeout of one webhook POST.")
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Webhook URL hosts (names or addresses, comma-separated or a JSON "
        "list) delivered to although they resolve to loopback, private, link-local or other non-public "
        "addresses, which are refused otherwise.",
    )
    webhook_allowed_networks: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="CIDR networks (comma-separated or a JSON list, e.g. 10.8.0.0/16) "
        "webhook targets may resolve into although they are not public.",
    )
    webhook_sweep_interval_seconds: float = Field(
        10.0, gt=0, description="Beat: record missed webhook deliveries and re-publish lost ones."
    )
    light_worker_threads: int = Field(
        4, ge=1, description="Threads of the beat process (maintenance tasks + webhook deliveries)."
    )

    # --- CLI client (cloverq submit / jobs / cancel) -------------------------------------------
    api_url: str = Field("http://127.0.0.1:8000", description="Where the CLI client finds the API.")
    api_key: str | None = Field(None, description="CLI client key; default data_dir/dev_api_key if present.")

    # --- logging -----------------------------------------------------------------------------
    log_level: str = "INFO"
    log_payloads: bool = Field(False, description="Log prompts, contexts and outputs (off by default).")

    # --- metrics (see scheduler/metrics.py) -----------------------------------------------------
    prometheus_multiproc_dir: Path | None = Field(
        None,
        validation_alias="PROMETHEUS_MULTIPROC_DIR",
        description="prometheus-client multiprocess dir; set when one host runs several API processes.",
    )
    worker_metrics_interval: float = Field(
        5.0, gt=0, description="Seconds between a worker's metric snapshots (tokens/s, memory, experts)."
    )

    @field_validator("webhook_allowed_hosts", "webhook_allowed_networks", mode="before")
    @classmethod
    def _split_list(cls, value: Any) -> Any:
        """A JSON list or comma-separated text (environment) -> a list of stripped items."""
        if isinstance(value, str):
            text = value.strip()
            value = json.loads(text) if text.startswith("[") else text.split(",")
        if isinstance(value, (list, tuple)):
            return [str(item).strip() for item in value if str(item).strip()]
        return value

    @field_validator("weight_group_size")
    @classmethod
    def _group_size(cls, value: int) -> int:
        if value not in (32, 64, 128):
            raise ValueError("weight_group_size must be 32, 64 or 128")
        return value

    @field_validator("webhook_allowed_hosts")
    @classmethod
    def _hosts(cls, value: list[str]) -> list[str]:
        return [host.lower().rstrip(".").strip("[]") for host in value]

    @field_validator("webhook_allowed_networks")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        return [str(ipaddress.ip_network(item, strict=False)) for item in value]  # ValueError: refused

    @property
    def resolved_database_url(self) -> str:
        """The database to use: ``database_url`` or SQLite under ``data_dir``."""
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'cloverq.db').resolve()}"

    @property
    def resolved_redis_url(self) -> str:
        """The Redis to use: ``redis_url`` or the embedded server started by ``cloverq up``."""
        if self.redis_url:
            return self.redis_url
        return f"redis://127.0.0.1:{self.embedded_redis_port}/0"

    @property
    def broker_visibility_timeout_seconds(self) -> float:
        """Redis redelivery timeout: above the longest deadline, so no running job is redelivered.

        ``visibility_timeout_seconds`` overrides it (the chaos tests set it below a job's run time
        to show that a redelivered running job is fenced off and runs once).
        """
        if self.visibility_timeout_seconds is not None:
            return self.visibility_timeout_seconds
        longest = max(self.job_deadline_seconds, self.joint_deadline_seconds, self.thinking_deadline_seconds)
        return 2 * longest + self.lease_seconds

    @property
    def resolved_engine_max_len(self) -> int:
        """Per-sequence KV length of the engine: ``engine_max_len``, or room for the largest request
        the API accepts (the chat template's tokens included; whole blocks of any size dividing 64)."""
        if self.engine_max_len is not None:
            return self.engine_max_len
        needed = self.max_prompt_tokens + CHAT_TEMPLATE_SLACK_TOKENS + self.max_new_tokens_limit
        return -(-needed // 64) * 64

    @property
    def resolved_torch_threads(self) -> int:
        """Threads torch uses for one worker's ops: ``torch_threads`` or the CPU cores."""
        return self.torch_threads or os.cpu_count() or 1

    @property
    def resolved_model_dir(self) -> Path:
        """The checkpoint to serve: ``model_dir`` or the demo checkpoint under ``data_dir`` (an
        absolute path, so a process started elsewhere finds the same folder)."""
        return (self.model_dir or (self.data_dir / "models" / "demo")).expanduser().absolute()

    @property
    def resolved_model_root(self) -> Path:
        """The model store root: ``model_root`` or ``data_dir/model-store``."""
        return (self.model_root or (self.data_dir / "model-store")).expanduser().absolute()


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once from the environment."""
    return Settings()
