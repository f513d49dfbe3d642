"""Prefix cache: the committed state of shared prompt blocks, computed once and copied (plain torch).

Sequences whose prompts agree token for token up to a block boundary have the same committed
state there: a block's K/V depend only on the blocks up to it (block-causal attention; Clover's
commit rows are token-causal), and a Gated DeltaNet layer's conv ring and recurrent state after
position ``P`` depend only on the tokens before ``P``. So the engine prefills such a prefix once
and starts every sequence that shares it from a copy (``KVCache.import_prefix``): the sequence's
first pass then feeds only its own tokens after the prefix. Outputs are those of a sequence that
prefilled the prefix itself: the same math, rounded differently only because the prefix ran in a
forward of another length (~3e-6 on logits of ~7 with the demo models), so only a near tie at
that level (a seeded draw on a CDF step) could decide otherwise.

Keys are chain hashes over whole blocks from position 0 (``chain_hashes``: block ``i``'s key
hashes block ``i``'s token ids with block ``i - 1``'s key and the block size), so one key names a
whole prefix. Every hit also compares the entry's token ids, so a hash collision can never change
an output.

**Which boundaries are kept.** A GDN state exists only at the boundary it was taken at and is
large (two float32 copies are held per slot; one snapshot of Clover-35B's 30 GDN layers is
63 MiB, against 20 KiB of K/V per position), so the cache does not snapshot every block. It
keeps one entry per *divergence point*: the deepest block boundary a prompt shares with another
prompt, either one being admitted or waiting now (the questions of one decision, a burst of jobs
over one contract) or one seen recently (``remember``: a bounded set of the chain keys of recent
prompts, 16 bytes each, no state). A prompt that shares nothing known stores nothing; the second
prompt over a context stores the context's last whole block, and every later one hits it. A
deeper divergence point (two questions that share their first words too) is computed from the
deepest entry below it, so only the new blocks are prefilled. Attention-only models use the same
rule (one policy for both families; their entries are K/V only).

**Budget, references, eviction.** Entries are evicted least recently used until their bytes fit
``budget_bytes`` (after each store and at the end of an admission round). An entry used in a
round is pinned (``refs``) until the round ends, so later sequences of the round can still copy
it even when it alone exceeds the budget (it is evicted right after). The copies themselves live
in the sequences' own slots, so an entry can go while sequences made from it run on.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from worker.model.kv_cache import PrefixState

KEY_BYTES = 16  # blake2b digest size of a chain key


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Chain keys of the whole blocks of ``tokens``: key ``i`` names blocks ``0..i`` (with the
    block size, so the same ids cut into other blocks never match)."""
    key = hashlib.blake2b(f"cloverq-prefix/{block_size}".encode(), digest_size=KEY_BYTES).digest()
    keys: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hashlib.blake2b(key, digest_size=KEY_BYTES)
        h.update(array("q", tokens[start : start + block_size]).tobytes())
        key = h.digest()
        keys.append(key)
    return keys


@dataclass
class PrefixEntry:
    """The committed state after one shared prefix of whole blocks."""

    key: bytes
    tokens: tuple[int, ...]  # the prefix's ids, compared on every hit
    block_size: int
    state: PrefixState
    refs: int = 0  # pins of the admission round copying it

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return self.state.nbytes


@dataclass(frozen=True)
class PrefixCounters:
    """What the cache did since start (plain values for ``EngineStats``)."""

    hits: int
    misses: int
    evictions: int
    stores: int
    entries: int
    bytes: int


class PrefixCache:
    """Entries keyed by chain key, LRU by a byte budget; plus the recent keys that find sharing."""

    def __init__(self, budget_bytes: int, *, seen_limit: int = 32768) -> None:
        if budget_bytes <= 0:
            raise ValueError("a prefix cache needs a positive byte budget (0 turns sharing off)")
        self.budget_bytes = budget_bytes
        self.seen_limit = seen_limit
        self._entries: collections.OrderedDict[bytes, PrefixEntry] = collections.OrderedDict()  # LRU first
        self._seen: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.stores = 0

    # ---- lookups ------------------------------------------------------------------------------
    def get(self, key: bytes, tokens: Sequence[int], block_size: int) -> PrefixEntry | None:
        """The entry for ``key`` if it holds exactly ``tokens`` (made most recently used)."""
        entry = self._entries.get(key)
        if entry is None or entry.block_size != block_size or entry.tokens != tuple(tokens):
            return None
        self._entries.move_to_end(key)
        return entry

    def deepest(
        self, tokens: Sequence[int], keys: Sequence[bytes], block_size: int, *, below: int | None = None
    ) -> PrefixEntry | None:
        """The longest stored prefix of ``tokens`` (at most ``below - 1`` blocks when given)."""
        top = len(keys) if below is None else min(below - 1, len(keys))
        for depth in range(top, 0, -1):
            if keys[depth - 1] in self._entries:
                entry = self.get(keys[depth - 1], tokens[: depth * block_size], block_size)
                if entry is not None:
                    return entry
        return None

    def shared_depth(self, keys: Sequence[bytes], peers: collections.Counter[bytes]) -> int:
        """Blocks ``keys`` share with another prompt: one counted in ``peers`` (which counts this
        prompt once too) or one seen recently. Chain keys make a shared key share all before it."""
        for depth in range(len(keys), 0, -1):
            key = keys[depth - 1]
            if peers[key] >= 2 or key in self._seen:
                return depth
        return 0

    def remember(self, keys: Sequence[bytes]) -> None:
        """Record a prompt's chain keys so a later prompt finds where it diverges from this one."""
        for key in keys:
            self._seen[key] = None
            self._seen.move_to_end(key)
        while len(self._seen) > self.seen_limit:
            self._seen.popitem(last=False)

    # ---- entries ------------------------------------------------------------------------------
    def put(self, key: bytes, tokens: Sequence[int], block_size: int, state: PrefixState) -> PrefixEntry:
        """Store a new entry (most recently used; call ``trim`` once the round is done)."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        entry = PrefixEntry(key, tuple(tokens), block_size, state)
        self._entries[key] = entry
        self.bytes += entry.nbytes
        self.stores += 1
        return entry

    def pin(self, entry: PrefixEntry) -> None:
        entry.refs += 1

    def unpin(self, entry: PrefixEntry) -> None:
        if entry.refs <= 0:
            raise ValueError("prefix entry is not pinned")
        entry.refs -= 1

    def trim(self) -> int:
        """Evict unpinned entries, least recently used first, until the bytes fit the budget."""
        evicted = 0
        for key in list(self._entries):
            if self.bytes <= self.budget_bytes:
                break
            entry = self._entries[key]
            if entry.refs > 0:
                continue
            del self._entries[key]
            self.bytes -= entry.nbytes
            evicted += 1
        self.evictions += evicted
        return evicted

    def counters(self) -> PrefixCounters:
        return PrefixCounters(
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
            stores=self.stores,
            entries=len(self._entries),
            bytes=self.bytes,
        )

    def __len__(self) -> int:
        return len(self._entries)
