"""The engine: one thread owns the model and the device; other threads submit and get futures.

Continuous batching in the style of vLLM v1: between passes the engine admits waiting requests
(their prompt's whole blocks are prefilled inside their first pass, batched with everyone
else's), then runs ONE denoising pass for every active sequence (rows at different blocks and
lengths in one padded forward), retires finished sequences and frees their KV-cache slots. With
chunked prefill a long prompt's blocks prefill in chunks after the pass, and the engine admits
at every boundary between forwards (``prefill_chunks.py``).

Failure contract: an invalid request (bad parameters, too long, bad template) resolves at once
with a ``GenerationResult`` whose ``finish_reason`` is ``ERROR`` and ``error`` says why. A
fault while running the model (e.g. out of memory) is isolated by re-running that pass row by
row; the rows that still fail get the exception set on their future (retryable by the caller),
the others continue.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from worker.engine.admission import Candidate, Occupancy, pick_admissions
from worker.engine.forward_cost import ForwardCost
from worker.engine.prefill_chunks import chunk_sizes, chunk_spans, join_rows, plan_prefill
from worker.engine.prefix_cache import PrefixCache, PrefixEntry, chain_hashes
from worker.engine.runner import ModelRunner, PassTimings, RowOutcome, RowSpec
from worker.engine.stats import EngineStats
from worker.engine.types import FinishReason, GenerationRequest, GenerationResult, SamplingParams
from worker.model.family import DiffusionModel, decoding_defaults
from worker.model.kv_cache import CacheFullError, KVCache
from worker.sampler.layout import RegionLayout, RequestError, build_layout
from worker.sampler.sequence import SequenceState

log = logging.getLogger(__name__)

_RATE_WINDOW = 64  # passes over which tokens/s is measured
# the depth of the forward-cost calibration (Engine.calibrate): deep enough that attention shows
CALIBRATION_DEPTH, CALIBRATION_LEAST_DEPTH = 8192, 1024


@dataclass(frozen=True)
class EngineConfig:
    """Capacity limits of one engine."""

    max_batch: int = 16  # active sequences of the unreserved classes (bulk, standard, joint)
    max_tokens_in_flight: int = 65536  # KV positions reserved by active sequences
    slot_caps: Mapping[str, int] = field(default_factory=dict)  # e.g. {"joint": 4}
    max_len: int = 4096  # per-sequence cache length (prompt + generated region)
    # slots beyond max_batch that only these classes may hold: short work never waits for a slot
    reserved_slots: int = 0
    reserved_classes: frozenset[str] = frozenset({"interactive"})
    # bytes of shared prompt prefixes kept between admission rounds (prefix_cache.py); 0 = no
    # prefix sharing at all, not even between the sequences of one round
    prefix_cache_bytes: int = 0
    # prompt tokens one iteration may prefill at a prompt's start (prefill_chunks.py; deeper into a
    # long prompt, fewer, at the same work): longer prompts prefill in whole-block chunks between
    # passes; 0 = a prompt's whole blocks ride in its first pass
    prefill_chunk_tokens: int = 0
    # one token's work outside attention, in attention keys (forward_cost.py); 0 = measured
    token_work_keys: int = 0

    @property
    def slots(self) -> int:
        """KV-cache slots and most active sequences: the batch plus the reserved slots."""
        return self.max_batch + self.reserved_slots


@dataclass
class _Waiting:
    request: GenerationRequest
    layout: RegionLayout
    block_size: int
    future: concurrent.futures.Future[GenerationResult]
    submitted: float
    prefix_keys: list[bytes] = field(default_factory=list)  # chain keys of the prompt's whole blocks


@dataclass
class _Active:
    state: SequenceState
    slot: int
    future: concurrent.futures.Future[GenerationResult]
    submitted: float
    admitted: float
    prefix_keys: list[bytes] = field(default_factory=list)
    first_pass: float | None = None  # when its first denoising pass began (the end of its wait)


class EngineStopped(RuntimeError):
    """The engine no longer accepts requests."""


class Engine:
    """Continuous-batching block-diffusion engine over one resident model."""

    def __init__(
        self,
        model: DiffusionModel,
        config: EngineConfig,
        *,
        mask_token_id: int,
        eos_token_ids: Sequence[int],
        default_block_size: int | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.mask_token_id = mask_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.defaults = decoding_defaults(model.config)
        self.default_block_size = default_block_size or self.defaults.block_size
        param = next(model.parameters())
        self.cache = model.new_cache(
            max_seqs=config.slots,
            max_len=config.max_len,
            device=param.device,
            dtype=param.dtype,
        )
        self.runner = ModelRunner(model, self.cache, mask_token_id=mask_token_id,
                                  token_work_keys=config.token_work_keys)
        # prefix sharing copies committed state between slots of one local cache (not tensor parallel)
        self.prefix_cache: PrefixCache | None = None
        if config.prefix_cache_bytes > 0 and isinstance(self.cache, KVCache):
            self.prefix_cache = PrefixCache(config.prefix_cache_bytes)
        per_position = self.cache.bytes_per_position(model.config, param.dtype)
        # a hybrid model's fixed per-sequence state, counted in admission as positions of equal bytes
        self.state_positions = -(-self.cache.bytes_per_sequence(model.config) // per_position)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Waiting] = collections.deque()
        self._active: list[_Active] = []
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._abort = False
        # counters (written by the engine thread, read by stats())
        self._steps = 0
        self._passes = 0
        self._forwards = 0
        self._tokens = 0
        self._finished = 0
        self._failed = 0
        self._busy = 0.0
        self._forward_seconds = 0.0
        self._prefill_positions = 0  # prompt positions run through the model (prefixes included)
        self._chunks = 0  # prompt chunks prefilled on their own (prefill_chunks.py)
        self._calibrated = False  # the forward cost model was measured, or needs not be (calibrate)
        self._reused_positions = 0  # prompt positions copied from a shared prefix instead
        self._recent: collections.deque[tuple[float, int]] = collections.deque(maxlen=_RATE_WINDOW)

    # ---- public API --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="cloverq-engine", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> concurrent.futures.Future[GenerationResult]:
        """Queue ``request``; the future resolves with its result (see module doc for failures)."""
        return self.submit_many([request])[0]

    def submit_many(
        self, requests: Sequence[GenerationRequest]
    ) -> list[concurrent.futures.Future[GenerationResult]]:
        """Queue ``requests`` at once (futures in order): the engine sees them all in the same
        admission round, so prompts that share a prefix (the questions of one decision) prefill it
        once instead of racing the engine thread one by one."""
        now = time.monotonic()
        prepared = [self._prepare(request, now) for request in requests]
        entries = [w for w, _ in prepared if w is not None]
        if entries:
            with self._cond:
                if not self._accepting:
                    raise EngineStopped("the engine is stopping and accepts no new requests")
                self._waiting.extend(entries)
                self._cond.notify_all()
        return [future for _, future in prepared]

    def _prepare(
        self, request: GenerationRequest, now: float
    ) -> tuple[_Waiting | None, concurrent.futures.Future[GenerationResult]]:
        """The queue entry of ``request``, or None when it is invalid (its future then resolved)."""
        future: concurrent.futures.Future[GenerationResult] = concurrent.futures.Future()
        request.params = self._with_defaults(request.params)
        block_size = request.params.block_size or self.default_block_size
        try:
            layout = build_layout(request, block_size, self.model.config.vocab_size, self.config.max_len)
            if self._footprint(layout) > self.config.max_tokens_in_flight:
                raise RequestError(
                    f"request needs {self._footprint(layout)} KV positions (incl. its recurrent state); "
                    "the engine holds "
                    f"{self.config.max_tokens_in_flight}"
                )
        except RequestError as exc:
            future.set_result(_error_result(request, str(exc)))
            return None, future
        keys = chain_hashes(request.prompt_ids, block_size) if self.prefix_cache is not None else []
        return _Waiting(request, layout, block_size, future, now, keys), future

    def _footprint(self, layout: RegionLayout) -> int:
        """Memory a sequence holds, in K/V positions: its positions plus, for a hybrid model, its
        fixed recurrent (GDN) state expressed as the positions of the same bytes."""
        return layout.total_len + self.state_positions

    def _with_defaults(self, params: SamplingParams) -> SamplingParams:
        """``params`` with every field the request left unset taken from the family's defaults."""
        block = params.block_size or self.default_block_size
        steps, strategy, threshold = params.steps_per_block, params.strategy, params.threshold
        return dataclasses.replace(
            params,
            steps_per_block=self.defaults.steps_for(block) if steps is None else steps,
            strategy=self.defaults.strategy if strategy is None else strategy,  # type: ignore[arg-type]
            threshold=self.defaults.threshold if threshold is None else threshold,
        )

    def stop(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting; with ``drain`` finish everything queued, else cancel it. Joins."""
        with self._cond:
            self._accepting = False
            if not drain:
                self._abort = True
            self._cond.notify_all()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if not thread.is_alive():
                self._thread = None

    def calibrate(self) -> int | None:
        """Measure ``W`` (``forward_cost.py``) on a free slot, when chunked prefill is on and the
        operator has not fixed it; the depth is up to ``CALIBRATION_DEPTH`` keys, what the cache
        allows besides two budgets. A cache too short to reach ``CALIBRATION_LEAST_DEPTH`` keeps
        the default (the chunks it can hold barely shrink). The engine thread runs it before the
        first iteration that prefills a chunk (``_step``: a worker that never sees a long prompt
        never pays it; measured ~0.8 s on the tiny CPU demo, ~9 s on a loaded machine); call it
        yourself only before the thread starts. Never fatal: a failure keeps the default and is
        logged; with every slot taken it is tried again at a later iteration."""
        self._calibrated = True
        budget, block = self.config.prefill_chunk_tokens, self.default_block_size
        depth = min(CALIBRATION_DEPTH, self.config.max_len - 2 * budget) // block * block
        if budget <= 0 or self.config.token_work_keys > 0 or depth < CALIBRATION_LEAST_DEPTH:
            return None
        began = time.perf_counter()
        try:
            slot = self.cache.allocate()
        except CacheFullError:
            self._calibrated = False  # not now
            return None
        try:
            measured = self.runner.calibrate_forward_cost(slot, block=block, budget=budget, depth=depth)
        except Exception:
            log.exception("forward cost calibration failed; the default W is kept")
            return None
        finally:
            self.cache.free(slot)
        log.info("engine forward cost: W=%s keys per token (%s; forwards at depth 0 and %d, %.2f s)",
                 self.runner.forward_cost.token_keys, "measured" if measured else "the default: not told",
                 depth, time.perf_counter() - began)
        return measured

    def warm_up(self) -> None:
        """Run one small request end to end; raises if it does not complete."""
        prompt = [t for t in range(min(8, self.model.config.vocab_size)) if t != self.mask_token_id][:4]
        params = SamplingParams(max_new_tokens=self.default_block_size, steps_per_block=2, seed=0)
        result = self.submit(GenerationRequest("warm-up", prompt, params)).result()
        if result.finish_reason is FinishReason.ERROR:
            raise RuntimeError(f"engine warm-up failed: {result.error}")

    def stats(self) -> EngineStats:
        with self._cond:
            active = collections.Counter(a.state.request.slot_class for a in self._active)
            waiting = collections.Counter(w.request.slot_class for w in self._waiting)
            positions = sum(self._footprint(a.state.layout) for a in self._active)
            recent = list(self._recent)
        busy = sum(s for s, _ in recent)
        rate = sum(n for _, n in recent) / busy if busy > 0 else 0.0
        return EngineStats(
            running=self._thread is not None and self._thread.is_alive(),
            active=dict(active),
            waiting=dict(waiting),
            max_batch=self.config.slots,
            batch_occupancy=sum(active.values()) / self.config.slots,
            positions_in_flight=positions,
            tokens_per_second=rate,
            steps=self._steps,
            passes=self._passes,
            forwards=self._forwards,
            tokens_committed=self._tokens,
            requests_finished=self._finished,
            requests_failed=self._failed,
            busy_seconds=self._busy,
            forward_seconds=self._forward_seconds,
            router_counts=self.runner.router_counts.cpu().tolist(),
            prefill_positions=self._prefill_positions,
            prefill_chunks=self._chunks,
            prefix_reused_positions=self._reused_positions,
            **self._prefix_stats(),
        )

    def _prefix_stats(self) -> dict[str, int]:
        cache = self.prefix_cache
        if cache is None:
            return {}
        c = cache.counters()
        return {
            "prefix_cache_hits": c.hits,
            "prefix_cache_misses": c.misses,
            "prefix_cache_evictions": c.evictions,
            "prefix_cache_stores": c.stores,
            "prefix_cache_entries": c.entries,
            "prefix_cache_bytes": c.bytes,
            "prefix_cache_budget_bytes": cache.budget_bytes,
        }

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._next_iteration():
                pass
        except BaseException as exc:  # the loop itself broke: fail everyone, never hang callers
            log.exception("engine thread crashed")
            self._fail_all(exc)
            raise

    def _next_iteration(self) -> bool:
        with self._cond:
            while not self._waiting and not self._active and self._accepting:
                self._cond.wait()
            abort = self._abort
            if not abort:
                if not self._waiting and not self._active:
                    return False  # stopping, drained
                self._settle_waiting()
                admitted = self._admit()
                peers = self._prefix_peers(admitted)
        if abort:
            self._cancel_everything()
            return False
        self._start_admitted(admitted, peers)
        self._interrupt_active(time.monotonic())
        if self._active:
            self._step()
        return True

    def _start_admitted(self, admitted: list[_Active], peers: collections.Counter[bytes]) -> None:
        if admitted:
            self._share_prefixes(admitted, peers)
        now = time.monotonic()
        for a in admitted:
            a.admitted = now

    def _admit_at_boundary(self, budget_left: int, cost: ForwardCost) -> tuple[list[_Active], int]:
        """Admit what arrived while the last forward ran, so that a short job's first pass runs
        next instead of after the iteration's chunks; and the budget's work they leave. Those
        whose prompt does not fit what the budget has left are admitted but wait for the next
        iteration's plan."""
        with self._cond:
            if not self._waiting or self._abort:
                return [], budget_left
            self._settle_waiting()
            admitted = self._admit()
            peers = self._prefix_peers(admitted)
        self._start_admitted(admitted, peers)
        joins, left = join_rows([a.state.block_start - a.state.cached_len for a in admitted],
                                [a.state.cached_len for a in admitted],
                                [a.state.block_size for a in admitted], budget_left, cost)
        return [a for a, joined in zip(admitted, joins, strict=True) if joined], left

    def _settle_waiting(self) -> None:
        """Resolve waiting requests that were cancelled or ran out of time before admission."""
        now = time.monotonic()
        keep: collections.deque[_Waiting] = collections.deque()
        for w in self._waiting:
            reason = _interrupt_reason(w.request, now)
            if w.future.cancelled():
                continue
            if reason is not None:
                w.future.set_result(_empty_result(w.request, reason, queue_seconds=now - w.submitted))
                continue
            keep.append(w)
        self._waiting = keep

    def _admit(self) -> list[_Active]:
        per_class = collections.Counter(a.state.request.slot_class for a in self._active)
        occupancy = Occupancy(
            active=len(self._active),
            positions=sum(self._footprint(a.state.layout) for a in self._active),
            per_class=per_class,
        )
        waiting = list(self._waiting)
        chosen = pick_admissions(
            [Candidate(w.request.slot_class, self._footprint(w.layout)) for w in waiting],
            occupancy,
            max_batch=min(self.config.slots, len(self._active) + self.cache.num_free()),
            max_positions=self.config.max_tokens_in_flight,
            slot_caps=self.config.slot_caps,
            reserved=self.config.reserved_slots,
            reserved_classes=self.config.reserved_classes,
        )
        taken = set(chosen)
        self._waiting = collections.deque(w for i, w in enumerate(waiting) if i not in taken)
        admitted = []
        for i in chosen:
            w = waiting[i]
            if not w.future.set_running_or_notify_cancel():
                continue
            try:
                state = SequenceState.start(
                    w.request,
                    w.layout,
                    block_size=w.block_size,
                    mask_token_id=self.mask_token_id,
                    eos_token_ids=self.eos_token_ids,
                )
            except Exception as exc:  # fails alone
                log.exception("could not start request %s", w.request.request_id)
                self._failed += 1
                w.future.set_exception(exc)
                continue
            active = _Active(
                state, self.cache.allocate(), w.future, w.submitted, time.monotonic(), w.prefix_keys
            )
            self._active.append(active)
            admitted.append(active)
        return admitted

    # ---- shared prompt prefixes (prefix_cache.py) ---------------------------------------------
    def _prefix_peers(self, admitted: list[_Active]) -> collections.Counter[bytes]:
        """How many of the just admitted and the still waiting prompts hold each chain key (under
        the lock): a key two of them hold is a prefix worth computing once."""
        peers: collections.Counter[bytes] = collections.Counter()
        if self.prefix_cache is None or not admitted:  # most passes admit nothing: no count per pass
            return peers
        for keys in [a.prefix_keys for a in admitted] + [w.prefix_keys for w in self._waiting]:
            peers.update(keys)
        return peers

    def _share_prefixes(self, admitted: list[_Active], peers: collections.Counter[bytes]) -> None:
        """Start the sequences just admitted from shared prefixes where their prompts allow.

        Per sequence the target is the deepest of (a) the stored prefix it extends and (b) the
        deepest block boundary it shares with another prompt (``PrefixCache.shared_depth``).
        Targets are taken shallowest first, so a deeper one is computed from a shallower one made
        in the same round. A missing target is prefilled once into the first sequence that needs
        it (from the deepest stored prefix below it), stored, and copied into the slots of the
        others. A fault there only costs the sharing: the sequence then prefills as usual.
        """
        cache = self.prefix_cache
        began = time.perf_counter()
        timings = PassTimings()
        if cache is not None:
            plans: list[tuple[int, _Active]] = []
            for a in admitted:
                keys, block = a.prefix_keys, a.state.block_size
                if not keys:
                    continue
                stored = cache.deepest(a.state.request.prompt_ids, keys, block)
                depth = max(cache.shared_depth(keys, peers), 0 if stored is None else stored.length // block)
                if depth == 0:
                    cache.misses += 1
                    continue
                plans.append((depth, a))
            pinned: list[PrefixEntry] = []
            try:
                for depth, a in sorted(plans, key=lambda plan: plan[0]):
                    entry = self._adopt_prefix(a, depth, timings)
                    if entry is not None:
                        cache.pin(entry)  # later sequences of this round may still copy it
                        pinned.append(entry)
                        cache.trim()  # older, unpinned entries make room as the round stores
            finally:
                for entry in pinned:
                    cache.unpin(entry)
                cache.trim()
                for a in admitted:
                    cache.remember(a.prefix_keys)
        for a in admitted:
            whole = len(a.state.request.prompt_ids) // a.state.block_size * a.state.block_size
            self._prefill_positions += max(whole - a.state.cached_len, 0)
        if timings.forwards:
            with self._cond:
                self._busy += time.perf_counter() - began
                self._forwards += timings.forwards
                self._forward_seconds += timings.forward_seconds

    def _adopt_prefix(self, a: _Active, depth: int, timings: PassTimings) -> PrefixEntry | None:
        """Give ``a``'s slot the committed state of its first ``depth`` blocks: copied from the
        stored entry (a hit), else prefilled here and stored (a miss). None if that failed."""
        cache = self.prefix_cache
        assert cache is not None
        block = a.state.block_size
        prompt = a.state.request.prompt_ids
        length = depth * block
        if length > a.state.block_start:  # the first decoded block must stay in the pass
            return None
        key = a.prefix_keys[depth - 1]
        entry = cache.get(key, prompt[:length], block)
        try:
            if entry is not None:
                self.cache.import_prefix(a.slot, entry.state)
                cache.hits += 1
                self._reused_positions += length
            else:
                base = cache.deepest(prompt, a.prefix_keys, block, below=depth)
                start = 0
                if base is not None:
                    self.cache.import_prefix(a.slot, base.state)
                    start = base.length
                self._prefill_prefix(a.slot, prompt, start, length, block, timings)
                entry = cache.put(key, prompt[:length], block, self.cache.export_prefix(a.slot, length))
                cache.misses += 1
                self._prefill_positions += length - start
                self._reused_positions += start
        except Exception:
            log.exception("sharing a prefix of %s failed; it prefills alone", a.state.request.request_id)
            self.cache.free(a.slot)  # back to an empty committed state
            a.slot = self.cache.allocate()
            return None
        a.state.cached_len = length
        return entry

    def _prefill_prefix(self, slot: int, prompt: Sequence[int], start: int, end: int, block: int,
                        timings: PassTimings) -> None:
        """Prefill a shared prefix's ``prompt[start:end]`` into ``slot``: in whole-block chunks of
        the per-iteration budget's tokens when chunking is on (not its work: these spans run back
        to back, so smaller deep spans would only add forwards), so one forward holds memory for a
        chunk, not for the whole context (a 16K-token contract's decision on the
        tiny demo needed GBs in one forward). Exact for the same reason chunked prefill is."""
        spans = chunk_spans(start, end, block, self.config.prefill_chunk_tokens, None)
        for at, to in spans:
            self.runner.run_prefill(slot, list(prompt[at:to]), at, block, timings)
        if len(spans) > 1:
            self._chunks += len(spans)

    def _interrupt_active(self, now: float) -> None:
        for a in self._active:
            reason = _interrupt_reason(a.state.request, now)
            if reason is not None:
                a.state.finish(reason)
        self._retire()

    def _step(self) -> None:
        """One iteration (``prefill_chunks.py``): the denoising pass of every row that joins it,
        then a pass for each round of arrivals admitted at the boundary, then the prompt chunks
        of the plan. Each row's forwards keep their order; only the order between rows changes."""
        began = time.perf_counter()
        timings = PassTimings()
        active = [a for a in self._active if not a.state.finished]
        pending = [a.state.block_start - a.state.cached_len for a in active]
        contexts = [a.state.cached_len for a in active]
        if not self._calibrated and any(p > self.config.prefill_chunk_tokens for p in pending):  # chunks come
            self.calibrate()
        cost = self.runner.forward_cost  # one cost model for the whole iteration
        plan = plan_prefill(pending, contexts, [a.state.block_size for a in active],
                            self.config.prefill_chunk_tokens, cost)
        committed = self._run_pass([a for a, joins in zip(active, plan.joins, strict=True) if joins], timings)
        prompts = [i for i, chunk in enumerate(plan.chunks) if chunk]
        if prompts:  # chunks follow: admit before them, so that no arrival waits a pass and a chunk
            left = plan.left
            while True:  # the arrivals' work comes out of the chunks' (the oldest prompt still moves)
                arrivals, left = self._admit_at_boundary(left, cost)
                if not arrivals:
                    break
                committed += self._run_pass(arrivals, timings)
            rows = [active[i] for i in prompts]
            sizes = chunk_sizes([pending[i] for i in prompts], [contexts[i] for i in prompts],
                                [a.state.block_size for a in rows], left, cost)
            self._prefill_chunks(rows, sizes, timings)
        elapsed = time.perf_counter() - began
        with self._cond:
            self._busy += elapsed
            self._forwards += timings.forwards
            self._forward_seconds += timings.forward_seconds
            self._recent.append((elapsed, committed))
        self._retire()

    def _run_pass(self, joining: list[_Active], timings: PassTimings) -> int:
        """One denoising pass over ``joining`` (a fault is isolated row by row); the positions it
        committed. A row's first pass ends its wait (``first_pass``)."""
        members: list[_Active] = []
        rows: list[RowSpec] = []
        for a in joining:
            if a.state.finished:
                continue
            try:
                rows.append(self._row(a))
                members.append(a)
            except Exception as exc:  # a broken request state fails alone
                self._fail(a, exc)
        if not rows:
            return 0
        now = time.monotonic()
        for a in members:
            if a.first_pass is None:
                a.first_pass = now
        outcomes: list[RowOutcome | BaseException]
        try:
            outcomes = list(self.runner.run_pass(rows, timings))
        except Exception:  # isolate the faulty rows
            log.exception("batched pass failed; retrying row by row")
            outcomes = []
            for row in rows:
                try:
                    outcomes.append(self.runner.run_pass([row], timings)[0])
                except Exception as exc:
                    outcomes.append(exc)
        committed = 0
        for a, outcome in zip(members, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                self._fail(a, outcome)
                continue
            before = a.state.blocks_done
            try:
                block_done = a.state.apply_pass(outcome.chosen, outcome.commit, outcome.group_choices)
            except Exception as exc:
                self._fail(a, exc)
                continue
            committed += sum(outcome.commit)
            if block_done or a.state.blocks_done != before:
                self._report_progress(a)
        with self._cond:
            self._steps += len(members)
            self._passes += 1
            self._tokens += committed
        return committed

    def _prefill_chunks(self, prompts: list[_Active], chunks: list[int], timings: PassTimings) -> None:
        """Prefill ``chunks[i]`` tokens of ``prompts[i]``'s prompt. A chunk that fails is rolled back
        by the runner and fails its sequence alone."""
        for a, chunk in zip(prompts, chunks, strict=True):
            if chunk == 0 or a.state.finished:
                continue
            start, block = a.state.cached_len, a.state.block_size
            try:
                self.runner.run_prefill(a.slot, a.state.tokens[start:start + chunk], start, block, timings)
            except Exception as exc:
                log.exception("a prefill chunk of %s failed", a.state.request.request_id)
                self._fail(a, exc)
                continue
            a.state.cached_len = start + chunk  # (counted in prefill_positions at admission)
            self._chunks += 1

    def _row(self, a: _Active) -> RowSpec:
        p = a.state.request.params
        return RowSpec(
            slot=a.slot,
            block_size=a.state.block_size,
            temperature=p.temperature,
            top_k=p.top_k or 0,
            top_p=p.top_p if p.top_p is not None else 1.0,
            dynamic=p.strategy == "dynamic",
            # resolved at submit for dynamic rows (family defaults); static rows never read it
            threshold=p.threshold if p.threshold is not None else 1.0,
            inp=a.state.pass_input(),
        )

    def _report_progress(self, a: _Active) -> None:
        callback = a.state.request.on_progress
        if callback is None:
            return
        try:
            callback(a.state.progress())
        except Exception:  # a broken progress sink must not fail the request
            log.exception("progress callback of %s failed", a.state.request.request_id)

    def _retire(self) -> None:
        """Resolve finished sequences and free their cache slots."""
        done = [a for a in self._active if a.state.finished]
        if not done:
            return
        now = time.monotonic()
        with self._cond:
            self._active = [a for a in self._active if not a.state.finished]
        for a in done:
            self.cache.free(a.slot)
            if a.future.done():
                continue
            s = a.state
            out = s.output_ids()
            started = a.admitted if a.first_pass is None else a.first_pass
            a.future.set_result(
                GenerationResult(
                    request_id=s.request.request_id,
                    token_ids=out,
                    finish_reason=s.finish_reason or FinishReason.ERROR,
                    steps_used=s.steps_used,
                    blocks=s.blocks_done,
                    tokens=len(out),
                    prompt_tokens=len(s.request.prompt_ids),
                    slot_choices=s.slot_choices(),
                    queue_seconds=started - a.submitted,
                    run_seconds=now - started,
                )
            )
            self._finished += 1

    def _fail(self, a: _Active, exc: BaseException) -> None:
        """Fail one active request with ``exc`` (its slot is freed by the next retire)."""
        a.state.finish(FinishReason.ERROR)
        self._failed += 1
        if not a.future.done():
            a.future.set_exception(exc)

    def _cancel_everything(self) -> None:
        """Abort: resolve every waiting and active request as cancelled."""
        now = time.monotonic()
        with self._cond:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for w in waiting:
            if not w.future.done():
                w.future.set_result(
                    _empty_result(w.request, FinishReason.CANCELLED, queue_seconds=now - w.submitted)
                )
        for a in self._active:
            a.state.finish(FinishReason.CANCELLED)
        self._retire()

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._accepting = False
            pending = [w.future for w in self._waiting] + [a.future for a in self._active]
            self._waiting.clear()
            self._active = []
        for f in pending:
            if not f.done():
                f.set_exception(exc)


def _interrupt_reason(request: GenerationRequest, now: float) -> FinishReason | None:
    if request.cancel_event.is_set():
        return FinishReason.CANCELLED
    if request.deadline is not None and now >= request.deadline:
        return FinishReason.DEADLINE
    return None


def _empty_result(
    request: GenerationRequest, reason: FinishReason, *, queue_seconds: float
) -> GenerationResult:
    return GenerationResult(
        request_id=request.request_id,
        token_ids=[],
        finish_reason=reason,
        steps_used=0,
        blocks=0,
        tokens=0,
        prompt_tokens=len(request.prompt_ids),
        queue_seconds=queue_seconds,
    )


def _error_result(request: GenerationRequest, message: str) -> GenerationResult:
    result = _empty_result(request, FinishReason.ERROR, queue_seconds=0.0)
    result.error = message
    return result


__all__ = ["Engine", "EngineConfig", "EngineStopped"]
