"""Committed keys/values of a batch of sequences ("slots") of different lengths.

Block diffusion only ever appends whole committed blocks, so the cache is a preallocated
``[max_seqs, kv_heads, max_len, head_dim]`` pair per layer plus a length per slot. A forward reads
the first ``lengths[slot]`` positions of each row's slot and may append new positions at the end.
Preallocation keeps the hot path free of allocation and lets slots be reused without fragmentation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.model.config import ModelConfig


class CacheFullError(RuntimeError):
    """No free slot (or no room left in a slot)."""


@dataclass
class PrefixState:
    """The committed state of one sequence after its first ``length`` positions, detached from any
    slot: what the engine's prefix cache keeps and copies into the slots of sequences that start
    with the same blocks (``KVCache.export_prefix`` / ``import_prefix``).

    ``k``/``v`` hold the K/V of positions ``0..length-1`` of every attention layer. ``ring`` and
    ``state`` hold, for a hybrid model, each GDN layer's conv ring and recurrent state *at*
    ``length`` (a recurrent state exists only at the boundary it was taken at); both empty for an
    all-attention model.
    """

    length: int
    k: list[torch.Tensor]  # per attention layer [KVH, length, D]
    v: list[torch.Tensor]  # per attention layer [KVH, length, D]
    ring: list[torch.Tensor] = field(default_factory=list)  # per GDN layer [K-1, C] float32
    state: list[torch.Tensor] = field(default_factory=list)  # per GDN layer [Hv, dk, dv] float32

    @property
    def nbytes(self) -> int:
        """Device memory the copy holds."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *self.ring, *self.state))


class KVCache:
    """Committed K/V of up to ``max_seqs`` sequences ("slots"), each up to ``max_len`` positions."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_seqs: int,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.max_seqs = max_seqs
        self.max_len = max_len
        self.device = torch.device(device)
        self.dtype = dtype
        shape = (max_seqs, config.num_key_value_heads, max_len, config.head_dim)
        layers = len(config.attention_layers)  # every layer for SDAR; Clover's full-attention ones
        self.k: list[torch.Tensor] = [  # per attention layer [S, KVH, L, D]
            torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(layers)
        ]
        self.v: list[torch.Tensor] = [  # per attention layer [S, KVH, L, D]
            torch.zeros(shape, device=self.device, dtype=dtype) for _ in range(layers)
        ]
        self.lengths: torch.Tensor = torch.zeros(max_seqs, dtype=torch.long, device=self.device)  # [S]
        self._free: list[int] = list(range(max_seqs - 1, -1, -1))  # pop() hands out slot 0 first
        self._in_use: set[int] = set()

    @staticmethod
    def bytes_per_position(config: ModelConfig, dtype: torch.dtype) -> int:
        """Memory of one cached position across all layers (K and V)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return int(config.sequence_memory(elem).bytes_per_position())

    @staticmethod
    def bytes_per_sequence(config: ModelConfig) -> int:
        """Memory held per sequence whatever its length (none for an all-attention model)."""
        return 0

    def snapshot(self, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What a failed pass must put back for ``slots`` (``[R]``): here their lengths."""
        return (self.lengths[slots],)  # advanced indexing copies

    def restore(self, slots: torch.Tensor, snapshot: tuple[torch.Tensor, ...]) -> None:
        """Undo every commit made to ``slots`` since ``snapshot`` (K/V past the lengths are dead)."""
        self.lengths[slots] = snapshot[0]

    def allocate(self) -> int:
        """A free slot with length 0; raises ``CacheFullError`` when none is free."""
        if not self._free:
            raise CacheFullError(f"all {self.max_seqs} KV-cache slots are in use")
        slot = self._free.pop()
        self._in_use.add(slot)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot`` to the pool (its contents become garbage)."""
        if slot not in self._in_use:
            raise ValueError(f"slot {slot} is not allocated")
        self._in_use.remove(slot)
        self.lengths[slot] = 0
        self._free.append(slot)

    def num_free(self) -> int:
        return len(self._free)

    def truncate(self, slot: int, length: int) -> None:
        """Forget the positions of ``slot`` from ``length`` on (e.g. to re-run a block)."""
        if slot not in self._in_use:
            raise ValueError(f"slot {slot} is not allocated")
        self.lengths[slot] = torch.clamp(self.lengths[slot], max=length)

    def export_prefix(self, slot: int, length: int) -> PrefixState:
        """A copy of the committed state of ``slot``'s first ``length`` positions (K/V only here)."""
        self._check_prefix(slot, length)
        return PrefixState(
            length=length,
            k=[k[slot, :, :length].clone() for k in self.k],  # [KVH, length, D] each
            v=[v[slot, :, :length].clone() for v in self.v],
        )

    def import_prefix(self, slot: int, prefix: PrefixState) -> None:
        """Make ``prefix`` the committed state of the freshly allocated ``slot`` (a copy: the slot
        then appends its own blocks after it, exactly as if it had committed the prefix itself)."""
        if slot not in self._in_use:
            raise ValueError(f"slot {slot} is not allocated")
        if prefix.length > self.max_len:
            raise CacheFullError(f"prefix of {prefix.length} positions exceeds max_len {self.max_len}")
        for dst, src in zip(self.k, prefix.k, strict=True):
            dst[slot, :, : prefix.length] = src
        for dst, src in zip(self.v, prefix.v, strict=True):
            dst[slot, :, : prefix.length] = src
        self.lengths[slot] = prefix.length

    def _check_prefix(self, slot: int, length: int) -> None:
        if slot not in self._in_use:
            raise ValueError(f"slot {slot} is not allocated")
        if length > self.length(slot):
            raise ValueError(f"slot {slot} has not committed {length} positions")

    def length(self, slot: int) -> int:
        """Committed positions of one slot (a host sync; not for hot loops)."""
        return int(self.lengths[slot].item())
