"""Long prompts against what the worker can hold, checked at submit so nothing is stored for a
job the worker would refuse (issue 26).

The numbers come from ``scheduler.fleet.context_limits`` (the checkpoint's context capped by the
operator, the engine's positions per sequence and its K/V budget); the prompt cap itself is
checked by each kind (``prompt_too_long``, ``api/limit_messages.py``). Two refusals live here,
both 422 with the figures in ``details``:

- ``request_too_long``: prompt + generated region (whole blocks) is longer than one engine slot
  (``CLOVERQ_ENGINE_MAX_LEN``, or the checkpoint's context when that is smaller);
- ``context_exceeds_memory``: the sequence's footprint (K/V of every position in the attention
  layers plus the fixed Gated DeltaNet state) is more than the engine's whole K/V budget
  (``CLOVERQ_ENGINE_MAX_TOKENS_IN_FLIGHT`` positions), in positions and bytes.
"""

from __future__ import annotations

from api.errors import ApiError
from api.limit_messages import instead, setting_env
from api.prompt_tokens import PromptTokenCounter
from scheduler.fleet.context_limits import ContextLimits
from scheduler.infra.settings import Settings


def context_limits(settings: Settings, counter: PromptTokenCounter) -> ContextLimits:
    """The limits a request is judged by: ``settings`` on the checkpoint the counter counts for."""
    return ContextLimits.resolve(settings, counter.checkpoint)


def check_sequence_room(prompt_tokens: int, max_new_tokens: int, block: int, limits: ContextLimits) -> int:
    """422 ``request_too_long`` when prompt + ``max_new_tokens`` in whole blocks of ``block`` exceed
    one engine slot; returns the positions otherwise (the engine holds them rounded up so)."""
    positions = -(-(prompt_tokens + max_new_tokens) // block) * block
    room = limits.sequence_positions
    if positions <= room:
        return positions
    env = setting_env("engine_max_len")
    fits = (room // block) * block - prompt_tokens
    alternative = f"lower max_new_tokens to at most {fits}" if fits > 0 else "shorten the prompt"
    if limits.sequence_limited_by_checkpoint:
        holds, raise_it = f"the checkpoint reads {room} (max_position_embeddings)", ""
    else:
        holds, raise_it = f"the engine holds {room} ({env})", f"; or ask the operator to raise {env}"
    raise ApiError(
        422, "request_too_long",
        f"Prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) in blocks of {block} needs "
        f"{positions} positions; {holds}. Instead: {alternative}{raise_it}.",
        {"positions": positions, "engine_max_len": room, "setting": env},
    )


def check_context_memory(positions: int, limits: ContextLimits, *, subject: str) -> None:
    """422 ``context_exceeds_memory`` when one sequence of ``positions`` positions holds more than
    the engine's whole K/V budget: the worker could never admit it (``Engine._footprint``)."""
    if limits.fits_memory(positions):
        return
    env = setting_env("engine_max_tokens_in_flight")
    footprint, budget = limits.footprint_positions(positions), limits.budget_positions
    details: dict[str, object] = {"positions": positions, "footprint_positions": footprint,
                                  "max_tokens_in_flight": budget, "setting": env}
    needed, available = limits.needed_bytes(positions), limits.budget_bytes()
    if limits.memory is not None and needed is not None and available is not None:
        memory = limits.memory
        per_position = int(memory.bytes_per_position())
        bytes_text = (f" ({_size(needed)}: {per_position:,} bytes of K/V per position over "
                      f"{memory.attention_layers} attention layers + {memory.state_bytes:,} bytes of fixed "
                      f"recurrent state)")
        holds_text = f" ({_size(available)})"
        details |= {"bytes_needed": needed, "bytes_available": available, "bytes_per_position": per_position,
                    "state_bytes": memory.state_bytes}
    else:
        bytes_text = holds_text = ""
    fits = limits.max_fitting_positions()
    shorter = (f"shorten it to at most {fits} positions (prompt and output), or split the document into "
               "parts, one job each")
    message = (f"{subject} needs {positions} positions, {footprint} with its recurrent state{bytes_text}; "
               f"the worker's engine holds {budget} positions{holds_text} in all ({env}). "
               + instead([shorter], env))
    raise ApiError(422, "context_exceeds_memory", message, details)


def _size(n: int) -> str:
    return f"{n:,} bytes = {n / 2**20:,.1f} MiB"
