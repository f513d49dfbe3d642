"""The worker's batched inference engine (``settings.engine``)."""

from __future__ import annotations

from pydantic import Field

from scheduler.infra.settings_groups.base import SettingsGroup


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
        description="Worker: prompt tokens one engine iteration may prefill at a prompt's start; a longer "
        "prompt prefills in whole-block chunks between denoising passes, so running jobs (and short jobs "
        "admitted meanwhile) never wait for a whole long prompt's forward (bench.long). The budget is work: "
        "deeper into a long prompt a chunk carries fewer tokens, so that each costs about the same forward "
        "(engine_token_work_keys). 0: a prompt's whole blocks ride in its first pass.",
    )
    token_work_keys: int = Field(
        0, ge=0, alias="engine_token_work_keys",
        description="Worker: one token's forward work outside attention (projections, experts), counted "
        "as attention keys: a forward of T tokens over S keys costs T x (S + this). It sizes prefill chunks "
        "deep into a long prompt and decides when a pass splits in two. 0: measured by the worker's engine "
        "before its first prefill chunk (about 30 single-row forwards at depth 0 and up to 8,192, logged as "
        "'engine forward cost'; where timing noise hides attention, chunks do not shrink); set it to fix the "
        "schedule.",
    )
    max_len: int | None = Field(
        None, ge=1, alias="engine_max_len",
        description="KV positions per sequence (prompt + generated region). Default: "
        "max_prompt_tokens + max_new_tokens_limit + 64 (chat template) rounded up to 64-token blocks.",
    )
    torch_threads: int | None = Field(
        None, ge=1, description="Worker: torch.set_num_threads at start. Default: `OMP_NUM_THREADS` when "
        "set, else the CPUs the process may run on (its affinity).",
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
