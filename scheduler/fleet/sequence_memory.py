"""What one sequence holds in a worker's memory: the one formula the planner (``cloverq model
plan``), the engine's caches and the API's submit check share (issue 26).

A sequence keeps the K and V of every committed position in each *attention* layer (every layer
of SDAR and LLaDA2; one in four of Clover's) and, for a hybrid model, a fixed Gated DeltaNet state
whatever its length: per GDN layer the float32 recurrent state ``S`` ``[Hv, dk, dv]`` and the conv
ring (the last ``K-1`` raw ``in_proj_qkv`` rows, ``[K-1, C]``), held twice because
``HybridCache`` double-buffers them (a failed pass keeps the committed copy). So memory grows
linearly with the context only through the attention layers.

A leaf: it imports nothing but the standard library, so plain-torch ``worker.model`` may name it
(the import-linter contract in pyproject.toml lists it beside ``scheduler.jobs.error_codes``) and
the API, which never imports the worker, computes with the same arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

GDN_STATE_COPIES = 2  # HybridCache: the committed copy and the one a commit writes
FLOAT32_BYTES = 4  # GDN state and ring are float32 whatever the model's dtype


def gdn_state_bytes(
    *, layers: int, value_heads: int, key_head_dim: int, value_head_dim: int, conv_channels: int,
    conv_kernel: int,
) -> int:
    """ONE copy of a sequence's committed GDN state over ``layers`` layers: ``S`` plus the conv ring."""
    state = FLOAT32_BYTES * value_heads * key_head_dim * value_head_dim
    ring = FLOAT32_BYTES * (conv_kernel - 1) * conv_channels
    return layers * (state + ring)


@dataclass(frozen=True)
class SequenceMemory:
    """Bytes one sequence of a checkpoint holds: K/V per position plus a fixed state."""

    attention_layers: int  # layers that keep K/V per position
    kv_heads: int
    head_dim: int
    kv_element_bytes: float  # bytes of one K or V element (the cache's dtype)
    state_bytes: int = 0  # held per sequence whatever its length, every copy (0: no GDN layers)

    def bytes_per_position(self, tp: int = 1) -> float:
        """K and V of one position over every attention layer. Over ``tp`` tensor-parallel ranks
        the K/V heads shard, but a rank holds at least one: beyond ``kv_heads`` ranks the heads are
        replicated, so the group holds ``max(kv_heads, tp)`` heads' worth."""
        return 2 * self.attention_layers * max(self.kv_heads, tp) * self.head_dim * self.kv_element_bytes

    def sequence_bytes(self, positions: int, tp: int = 1) -> float:
        """What a sequence of ``positions`` committed positions holds (K/V + fixed state)."""
        return positions * self.bytes_per_position(tp) + self.state_bytes

    def state_positions(self) -> int:
        """The fixed state as K/V positions of the same bytes, rounded up: the engine's admission
        counts a sequence's footprint in positions (``Engine._footprint``)."""
        per_position = self.bytes_per_position()
        return int(-(-self.state_bytes // per_position)) if per_position > 0 else 0
