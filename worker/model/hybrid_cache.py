"""Committed state of a hybrid (Clover) model: K/V for attention layers, GDN state per sequence.

Attention layers keep the K/V of every committed position exactly as ``KVCache`` does. Each Gated
DeltaNet layer keeps, per sequence, its conv ring (the last ``K-1`` raw ``in_proj_qkv`` rows) and
its recurrent state ``S`` (float32). Those are overwritten by a commit rather than appended to,
so each slot holds two copies and a ``current`` index: a commit writes the other copy and flips
the index at the end of a successful forward. A failed pass restores the index with the lengths
(``snapshot``/``restore``), and a preview, which only reads, can never disturb either copy.
"""

from __future__ import annotations

import torch

from scheduler.fleet.sequence_memory import GDN_STATE_COPIES
from worker.model.config import ModelConfig
from worker.model.kv_cache import KVCache, PrefixState


class HybridCache(KVCache):
    """K/V of the attention layers plus double-buffered GDN rings and states per slot."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_seqs: int,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(config, max_seqs=max_seqs, max_len=max_len, device=device, dtype=dtype)
        taps = config.linear_conv_kernel_dim - 1
        ring_shape = (2 * max_seqs, taps, config.linear_conv_dim)
        state_shape = (
            2 * max_seqs,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
        )
        layers = len(config.linear_layers)
        self.ring: list[torch.Tensor] = [  # per GDN layer [2S, K-1, C] raw pre-conv rows (float32)
            torch.zeros(ring_shape, device=self.device, dtype=torch.float32) for _ in range(layers)
        ]
        self.state: list[torch.Tensor] = [  # per GDN layer [2S, Hv, dk, dv] float32
            torch.zeros(state_shape, device=self.device, dtype=torch.float32) for _ in range(layers)
        ]
        self.current = torch.zeros(max_seqs, dtype=torch.long, device=self.device)  # [S] copy in use

    @staticmethod
    def bytes_per_sequence(config: ModelConfig) -> int:
        """Both copies of every GDN layer's ring and state (held whatever the length)."""
        return GDN_STATE_COPIES * config.gdn_state_bytes()

    def allocate(self) -> int:
        slot = super().allocate()
        self.current[slot] = 0
        for ring, state in zip(self.ring, self.state, strict=True):  # nothing committed: zeros [D]
            ring[2 * slot].zero_()
            state[2 * slot].zero_()
        return slot

    def read_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows of ``ring``/``state`` holding the committed copy of ``slots`` ``[R]``."""
        return 2 * slots + self.current[slots]

    def write_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows a commit of ``slots`` writes (the copy not in use)."""
        return 2 * slots + 1 - self.current[slots]

    def flip(self, slots: torch.Tensor) -> None:
        """Make the copies a commit just wrote the committed ones."""
        self.current[slots] = 1 - self.current[slots]

    def snapshot(self, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.lengths[slots], self.current[slots])

    def restore(self, slots: torch.Tensor, snapshot: tuple[torch.Tensor, ...]) -> None:
        self.lengths[slots] = snapshot[0]
        self.current[slots] = snapshot[1]

    def export_prefix(self, slot: int, length: int) -> PrefixState:
        """K/V of the first ``length`` positions plus the committed GDN rings and states, which are
        the state *at* ``length``: so ``length`` must be the slot's committed length exactly."""
        if length != self.length(slot):
            raise ValueError(f"a GDN state exists only at the committed length {self.length(slot)}, "
                             f"not {length}")
        prefix = super().export_prefix(slot, length)
        row = 2 * slot + int(self.current[slot].item())
        prefix.ring = [ring[row].clone() for ring in self.ring]  # [K-1, C] each
        prefix.state = [state[row].clone() for state in self.state]  # [Hv, dk, dv] each
        return prefix

    def import_prefix(self, slot: int, prefix: PrefixState) -> None:
        """K/V as ``KVCache`` does, and the rings/states into the slot's committed copy."""
        if len(prefix.ring) != len(self.ring) or len(prefix.state) != len(self.state):
            raise ValueError("the prefix carries no GDN state for this hybrid cache")
        super().import_prefix(slot, prefix)
        row = 2 * slot + int(self.current[slot].item())
        for dst, src in zip(self.ring, prefix.ring, strict=True):
            dst[row] = src
        for dst, src in zip(self.state, prefix.state, strict=True):
            dst[row] = src

    def truncate(self, slot: int, length: int) -> None:
        """A recurrent state cannot be rewound: only a no-op truncation is allowed."""
        if length < self.length(slot):
            raise ValueError("a hybrid cache cannot forget committed positions (GDN state is recurrent)")
