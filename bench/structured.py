"""Constrained vs unconstrained decoding on a demo checkpoint (``python -m bench.structured``).

Issue 24. The engine runs in process (``worker.engine.Engine`` over a fresh random-weight demo
checkpoint, as ``bench.sampler`` does; no API, no queue). In one run, against a baseline measured
in the same run:

  1. **constrained vs unconstrained, same prompts, same output length.** Every row is a chat
     prompt asking for a document's fields as JSON (rendered by the checkpoint's template). The
     constrained request lays one of three realistic schemas (``SCHEMAS``: an enum, integers, a
     date, strings, an array, a boolean, optional keys) out as its canvas
     (``worker.structured``: given structure tokens + constrained slots); its unconstrained twin
     decodes freely exactly as many positions (``max_new_tokens`` = the canvas length, the prompt
     padded so both end on a block boundary, no EOS stop), greedy, the family's decoding
     defaults. At batch 1 and 16 (``--batches``; at least one row per schema, so batch 1 decodes
     the three one after another): tokens/s (output positions per wall second), passes per
     generated token (denoising passes of a row over its output positions: the given structure
     tokens and choice slots committed as one unit should make the constrained rows need
     *fewer*), the engine time per row-pass and per output position, and
     **the constraint's share of engine time**: the time inside the constraint code paths
     (per-position vocabulary masks on the logits, the pad-tail rule's mask and commit sides,
     choice-slot grouping, scoring and whole-slot commits) over the engine's busy time. It is
     measured by wrapping those functions with ``time.perf_counter`` for the bench's run only
     (``ConstraintClock``; the engine code is unchanged). Goal (issue 24): <= 15% at batch 16.
     Constrained outputs are checked with ``jsonschema`` (draft 2020-12, format checks).
  2. **the share of well-formed ``auto`` tool calls** on the random Clover demo and on the shipped
     trained Clover demo (``worker/model/demo_trained/clover``): tool requests through the
     worker's own generate path (``worker.execution.run_generate``: the tools rendered by the
     chat template, free decoding, the Qwen3 XML parser, the retry-once rule), counting per first
     decode the answers that attempt a call (``<tool_call>``), the well-formed ones (a known
     function, arguments that validate) and those with none, and per job the calls returned
     after the retry. Random weights write no calls (expected ~0); the trained demo was trained
     on contract text without tool calls, so ~0 is expected there too.

Timings are wall clock on whatever shares the machine; the passes and the constraint's share
(a ratio of two times measured in the same passes) are the steadier figures. Torch runs
``--threads`` intra-op threads (default 1). On a CUDA device the clock synchronises around each
wrapped call (otherwise it would time kernel launches only).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import torch

import worker.engine.runner as runner_module
from scheduler.infra.settings import Settings
from scheduler.jobs.schema_subset import parse_schema
from worker import tool_job
from worker.engine.engine import Engine, EngineConfig
from worker.engine.runner import ModelRunner
from worker.engine.types import GenerationRequest, GenerationResult, SamplingParams
from worker.execution import run_generate
from worker.job_handler import EngineContext, JobSpec
from worker.model.checkpoint import LoadedModel, load_checkpoint
from worker.model.demo import write_demo_checkpoint
from worker.model.demo_trained import TRAINED_CLOVER_DEMO
from worker.sampler.sequence import SequenceState
from worker.structured.canvas import Canvas, compile_canvas
from worker.structured.tool_parsers import call_format, parse_calls

# ---- workload ------------------------------------------------------------------------------

SCHEMAS: dict[str, dict[str, Any]] = {
    "contract": {
        "type": "object",
        "properties": {
            "kind": {"enum": ["supply", "service", "lease", "licence"]},
            "supplier": {"type": "string", "maxLength": 24},
            "signed": {"type": "string", "format": "date"},
            "notice_days": {"type": "integer", "minimum": 0, "maximum": 365},
            "amount": {"type": "integer", "minimum": 1},
            "parties": {"type": "array", "items": {"type": "string", "maxLength": 16},
                        "minItems": 1, "maxItems": 3},
            "auto_renew": {"type": "boolean"},
        },
        "required": ["kind", "supplier", "signed", "notice_days", "amount", "parties"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 32},
            "date": {"type": "string", "format": "date"},
            "room": {"enum": ["A1", "B2", "C3"]},
            "seats": {"type": "integer", "minimum": 1, "maximum": 40},
            "attendees": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
        "required": ["title", "date", "seats", "attendees"],
    },
    "invoice": {
        "type": "object",
        "properties": {
            "number": {"type": "integer", "minimum": 1000, "maximum": 99999},
            "currency": {"enum": ["EUR", "USD", "GBP"]},
            "due": {"type": "string", "format": "date"},
            "total": {"type": "number", "minimum": 0},
            "paid": {"type": "boolean"},
            "lines": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
                "type": "object",
                "properties": {"item": {"type": "string", "maxLength": 20},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["item", "qty"]}},
        },
        "required": ["number", "currency", "due", "total", "lines"],
    },
}

DOCUMENTS: dict[str, str] = {
    "contract": ("Supply agreement signed on 2024-03-18 between Northwind Ltd (the supplier) and Acme "
                 "GmbH (the buyer). The supplier delivers 400 units for 18,500 EUR. Either party may "
                 "terminate with 90 days' notice; the agreement renews each year unless terminated."),
    "event": ("Quarterly review on 2025-06-02 in room B2, 14 seats. Attending: Ana, Bo and Chen. "
              "Agenda: the supply figures, the new carrier and the audit plan."),
    "invoice": ("Invoice 20417, due 2025-01-31, in GBP. Lines: 12 pallets of paper, 3 printer drums. "
                "Total 1,240.50. Not paid yet."),
}


def _prompt_ids(lm: LoadedModel, name: str) -> list[int]:
    user = f"Extract the fields of this {name} as JSON.\n\n{DOCUMENTS[name]}"
    text = lm.tokenizer.render_chat([{"role": "user", "content": user}], enable_thinking=False)
    return lm.tokenizer.encode(text)


@dataclass(frozen=True)
class Row:
    """One row of the workload: the same prompt for both modes, the constrained one's canvas."""

    name: str  # schema name
    prompt: list[int]  # padded so prompt + canvas ends on a block boundary
    canvas: Canvas

    @property
    def length(self) -> int:
        """Output positions of both modes (the canvas's tokens)."""
        return len(self.canvas.template.token_ids)


def build_rows(lm: LoadedModel, batch: int) -> list[Row]:
    """``batch`` rows cycling over ``SCHEMAS``.

    Why the padding: a plain request decodes whole blocks (its region is rounded up), a canvas
    exactly its tokens; leading filler tokens make prompt + canvas a whole number of blocks, so
    both modes decode the same positions."""
    block = lm.config.block_size or 8
    filler = lm.tokenizer.encode("\n")[:1]
    names = list(SCHEMAS)
    rows = []
    for i in range(batch):
        name = names[i % len(names)]
        canvas = compile_canvas(parse_schema(SCHEMAS[name]), lm.tokenizer)
        prompt = _prompt_ids(lm, name)
        pad = -(len(prompt) + len(canvas.template.token_ids)) % block
        rows.append(Row(name, filler * pad + prompt, canvas))
    return rows


def canvas_shares(canvas: Canvas) -> dict[str, float]:
    """Shares of a canvas's positions: given structure, choice slots (committed as one unit),
    token slots (per-position masks: strings, digits, with the pad-tail rule)."""
    template = canvas.template
    total = len(template.token_ids)
    choice = sum(s.length for s in template.slots if s.allowed_sequences is not None)
    token = sum(s.length for s in template.slots if s.allowed_sequences is None)
    return {"positions": float(total), "given": (total - choice - token) / total,
            "choice": choice / total, "token": token / total}


# ---- the constraint's clock ----------------------------------------------------------------

# The engine's constraint code paths. None of them runs for a plain request except the two
# early-outs (``_restrict_ids``/``_choose_sequences`` with nothing restricted) and the empty loop
# of ``_carry_deferred_scores``, so a plain run measures their fixed cost too.
_CONSTRAINT_PATHS: tuple[tuple[Any, str], ...] = (
    (ModelRunner, "_restrict_ids"),  # allowed-id masks on the logits
    (ModelRunner, "_choose_sequences"),  # choice slots: candidates scored, one picked
    (runner_module, "expand_to_groups"),  # a choice slot commits as one unit
    (SequenceState, "_slot_groups"),  # which choice slots lie in the pass's block
    (SequenceState, "_record_groups"),  # the picks recorded
    (SequenceState, "_carry_deferred_scores"),  # scores of slots crossing blocks
    (SequenceState, "_restrict_pad_tails"),  # pad-tail rule, mask side
    (SequenceState, "_enforce_pad_tails"),  # pad-tail rule, commit side
)


class ConstraintClock:
    """Wall time inside the constraint code paths (``_CONSTRAINT_PATHS``) while installed.

    A monkeypatch for the bench's runs only: each path is wrapped with ``time.perf_counter``
    (two calls, well under a microsecond, per wrapped call). Only the engine thread calls them.
    """

    def __init__(self, *, sync: bool = False) -> None:
        self.seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()
        self.sync = sync  # CUDA: wait for the kernels, or only their launches would be timed

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.sync:
                torch.cuda.synchronize()
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.sync:
                    torch.cuda.synchronize()
                self.seconds[name] += time.perf_counter() - began
                self.calls[name] += 1

        return timed

    @contextlib.contextmanager
    def installed(self) -> Iterator[ConstraintClock]:
        saved = [(owner, name, vars(owner)[name]) for owner, name in _CONSTRAINT_PATHS]
        try:
            for owner, name, original in saved:
                setattr(owner, name, self._wrap(name, original))
            yield self
        finally:
            for owner, name, original in saved:
                setattr(owner, name, original)


# ---- constrained vs unconstrained ----------------------------------------------------------


@dataclass
class ModeFigures:
    """One mode at one batch size, summed over the repeats."""

    mode: str  # "unconstrained" | "constrained"
    batch: int
    wall_s: float = 0.0
    tokens: int = 0  # output positions
    row_passes: int = 0  # denoising passes summed over rows (what budgets count)
    passes: int = 0  # engine passes (one per batched step)
    busy_s: float = 0.0  # engine time inside passes
    forward_s: float = 0.0  # of which model forwards
    constraint_s: float = 0.0  # of which constraint code paths
    valid: int = 0  # outputs that parse as JSON and validate (unconstrained: parse and validate)
    outputs: int = 0
    walls: list[float] = field(default_factory=list)  # per repeat
    texts: list[str] = field(default_factory=list)  # the last repeat's outputs (constrained: JSON)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def passes_per_token(self) -> float:
        return self.row_passes / self.tokens if self.tokens else 0.0

    @property
    def ms_per_row_pass(self) -> float:
        """Engine time per row and pass: what one row costs one pass, batched."""
        return 1000 * self.busy_s / self.row_passes if self.row_passes else 0.0

    @property
    def constraint_share(self) -> float:
        return self.constraint_s / self.busy_s if self.busy_s > 0 else 0.0


def _validates(schema: dict[str, Any], text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    return validator.is_valid(value)


def _mask_id(lm: LoadedModel) -> int:
    assert lm.config.mask_token_id is not None, "a diffusion checkpoint names its mask token"
    return lm.config.mask_token_id


def _engine(lm: LoadedModel, rows: Sequence[Row], batch: int) -> Engine:
    block = lm.config.block_size or 8
    max_len = max(len(r.prompt) + r.length for r in rows) + block
    engine = Engine(
        lm.model,
        EngineConfig(max_batch=batch, max_len=max_len, max_tokens_in_flight=1 << 24),  # batch-bound
        mask_token_id=_mask_id(lm),
        eos_token_ids=(),  # plain rows never stop early: both modes decode every position
        default_block_size=lm.config.block_size,
    )
    engine.start()
    engine.warm_up()
    return engine


def _run_mode(engine: Engine, lm: LoadedModel, rows: Sequence[Row], figures: ModeFigures,
              clock: ConstraintClock, params: SamplingParams) -> None:
    """One repeat of ``figures.mode``: every row submitted at once, timed until all are back."""
    constrained = figures.mode == "constrained"
    requests = [
        GenerationRequest(f"{figures.mode[0]}{i}", list(r.prompt),
                          dataclasses.replace(params, max_new_tokens=r.length, seed=i),
                          template=r.canvas.template if constrained else None)
        for i, r in enumerate(rows)
    ]
    before, in_constraints = engine.stats(), clock.total
    began = time.perf_counter()
    results: list[GenerationResult] = [f.result() for f in engine.submit_many(requests)]
    wall = time.perf_counter() - began
    after = engine.stats()
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{figures.mode} request failed: {errors[0]}")
    figures.walls.append(wall)
    figures.wall_s += wall
    figures.tokens += sum(r.tokens for r in results)
    figures.row_passes += sum(r.steps_used for r in results)
    figures.passes += after.passes - before.passes
    figures.busy_s += after.busy_seconds - before.busy_seconds
    figures.forward_s += after.forward_seconds - before.forward_seconds
    figures.constraint_s += clock.total - in_constraints
    texts = [
        r.canvas.read(res.slot_choices, lm.tokenizer).text if constrained
        else lm.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        for r, res in zip(rows, results, strict=True)
    ]
    figures.valid += sum(_validates(SCHEMAS[r.name], t) for r, t in zip(rows, texts, strict=True))
    figures.outputs += len(rows)
    figures.texts = texts


def family_params(lm: LoadedModel) -> tuple[SamplingParams, str]:
    """The family's decoding defaults (as ``bench.sampler`` uses them), greedy."""
    if lm.config.family == "clover":
        return SamplingParams(), f"dynamic 0.95, S={lm.config.block_size}"
    return SamplingParams(steps_per_block=4, strategy="static"), "static S=4"


def compare(lm: LoadedModel, batch: int, repeats: int, *, params: SamplingParams | None = None,
            clock: ConstraintClock | None = None) -> tuple[ModeFigures, ModeFigures]:
    """Unconstrained and constrained decoding of the same rows, ``batch`` at a time, ``repeats``
    times each, alternating which mode goes first (so slow phases of a shared machine hit both
    alike). At least one row per schema: below that the engine queues them (batch 1 decodes the
    three schemas one after another)."""
    params = params or family_params(lm)[0]
    clock = clock or ConstraintClock()
    rows = build_rows(lm, max(batch, len(SCHEMAS)))
    plain, shaped = ModeFigures("unconstrained", batch), ModeFigures("constrained", batch)
    engine = _engine(lm, rows, batch)
    try:
        # untimed: the full batch width once (prefill and two blocks per row), so neither mode
        # pays for the first wide pass
        short = dataclasses.replace(params, max_new_tokens=2 * (lm.config.block_size or 8))
        warm = [GenerationRequest(f"w{i}", list(r.prompt), short) for i, r in enumerate(rows)]
        for future in engine.submit_many(warm):
            future.result()
        with clock.installed():
            for rep in range(repeats):
                for figures in (plain, shaped) if rep % 2 == 0 else (shaped, plain):
                    _run_mode(engine, lm, rows, figures, clock, params)
    finally:
        engine.stop()
    return plain, shaped


def compile_ms(lm: LoadedModel, reps: int = 20) -> dict[str, float]:
    """Median ms of laying out each schema (per request, in the submitting thread: not engine time)."""
    out = {}
    for name, schema in SCHEMAS.items():
        times = []
        for _ in range(reps):
            began = time.perf_counter()
            compile_canvas(parse_schema(schema), lm.tokenizer)
            times.append(time.perf_counter() - began)
        out[name] = 1000 * statistics.median(times)
    return out


# ---- auto tool calls -----------------------------------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 32},
            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "create_event", "description": "Put a meeting in the calendar.",
        "parameters": {"type": "object", "properties": {
            "title": {"type": "string", "maxLength": 40},
            "date": {"type": "string", "format": "date"},
            "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
            "required": ["title", "date"]}}},
    {"type": "function", "function": {
        "name": "find_clause", "description": "Look a clause of the contract up by its number.",
        "parameters": {"type": "object", "properties": {
            "number": {"type": "integer", "minimum": 1, "maximum": 50}}, "required": ["number"]}}},
]
ASKS = (
    "What is the weather in Oslo right now, in celsius?",
    "Book a meeting called Supply review on 2025-06-02 with Ana and Bo.",
    "Show me clause 12 of the contract.",
    "Is it raining in Lyon?",
    "Schedule the audit kickoff for 2025-09-15.",
    "What does clause 3 say about notice?",
    "Weather in Boston in fahrenheit, please.",
    "Find clause 27.",
)


@dataclass
class AutoFigures:
    """``auto`` tool requests on one checkpoint."""

    checkpoint: str
    requests: int = 0
    attempted: int = 0  # first decodes that open a <tool_call>
    well_formed: int = 0  # ... whose calls all name a tool and validate (at least one call)
    none: int = 0  # first decodes without any <tool_call>
    retries: int = 0  # malformed first decodes decoded again (the retry-once rule)
    calls_returned: int = 0  # jobs that end with tool_calls (after the retry)
    samples: list[str] = field(default_factory=list)  # a few first-decode texts


@contextlib.contextmanager
def _counting_retries() -> Iterator[list[int]]:
    """The tool job's retry metric, counted here instead of in Redis (the bench needs no Redis)."""
    counted: list[int] = []
    original = tool_job._count_retry

    def count(ctx: EngineContext) -> None:
        counted.append(1)

    tool_job._count_retry = count
    try:
        yield counted
    finally:
        tool_job._count_retry = original


def auto_calls(lm: LoadedModel, label: str, *, requests: int, max_new_tokens: int, temperature: float,
               batch: int = 16, settings: Settings | None = None) -> AutoFigures:
    """``requests`` generate jobs with ``TOOLS`` and ``tool_choice: auto`` run by the worker's own
    ``run_generate`` (``batch`` at a time, batched by the engine), each over one of ``ASKS``."""
    settings = settings or Settings()
    fmt = call_format(lm.tokenizer.chat_template)
    if fmt is None:
        raise RuntimeError(f"{label}: the chat template renders no tool calls")
    engine = Engine(
        lm.model,
        EngineConfig(max_batch=batch, max_len=2048, max_tokens_in_flight=1 << 24),
        mask_token_id=_mask_id(lm),
        eos_token_ids=lm.config.eos_token_ids,  # an answer ends where the model ends it
        default_block_size=lm.config.block_size,
    )
    engine.start()
    first: dict[str, Future[GenerationResult]] = {}
    lock = threading.Lock()

    def submit(request: GenerationRequest) -> Future[GenerationResult]:
        future = engine.submit(request)
        with lock:
            first.setdefault(request.request_id, future)  # a retry keeps the job's request id
        return future

    ctx = EngineContext(submit=submit, tokenizer=lm.tokenizer, settings=settings, deadline=None,
                        cancel_event=threading.Event(), on_progress=lambda _p: None,
                        default_block_size=lm.config.block_size)
    jobs = [JobSpec(job_id=f"auto{i}", kind="generate", queue="standard", attempt=1,
                    params={"seed": i, "temperature": temperature, "max_new_tokens": max_new_tokens},
                    input={"messages": [{"role": "user", "content": ASKS[i % len(ASKS)]}],
                           "tools": TOOLS, "tool_choice": "auto"})
            for i in range(requests)]
    out = AutoFigures(label, requests=requests)
    try:
        with _counting_retries() as retries, ThreadPoolExecutor(max_workers=batch) as pool:
            outcomes = list(pool.map(lambda job: run_generate(job, ctx), jobs))
        out.retries = len(retries)
    finally:
        engine.stop()
    spec = tool_job.job_tool_spec(jobs[0], ctx)
    assert spec is not None
    for job, outcome in zip(jobs, outcomes, strict=True):
        text = lm.tokenizer.decode(first[job.job_id].result().token_ids, skip_special_tokens=True)
        parsed = parse_calls(text, spec, fmt)
        if "<tool_call>" not in text:
            out.none += 1
        else:
            out.attempted += 1
            out.well_formed += parsed.malformed is None and bool(parsed.calls)
        out.calls_returned += bool((outcome.result or {}).get("tool_calls"))
        if len(out.samples) < 2:
            out.samples.append(text)
    return out


# ---- report ----------------------------------------------------------------------------------


def _load(folder: Path, device: str, dtype: str) -> LoadedModel:
    return load_checkpoint(folder, device=device, dtype=getattr(torch, dtype))


def _print_compare(results: list[tuple[ModeFigures, ModeFigures]]) -> None:
    """The per-mode table, then constrained / unconstrained ratios. ms/row-pass splits into the
    model forward, the constraint paths and the rest of the engine (input building, sampling,
    commits, bookkeeping): it tells whether a dearer pass comes from the constraint or from
    the forward (the same prompts' prefill spread over fewer passes)."""
    print(f"{'batch':>5} {'mode':<14} {'tokens/s':>9} {'passes/token':>12} {'engine passes':>13} "
          f"{'ms/row-pass':>11} {'(forward':>8} {'constraint':>10} {'rest)':>6} {'constraint':>10} "
          f"{'share':>6} {'schema-valid':>12}")
    for plain, shaped in results:
        for f in (plain, shaped):
            per = 1000 / f.row_passes if f.row_passes else 0.0
            rest = f.busy_s - f.forward_s - f.constraint_s
            print(f"{f.batch:>5} {f.mode:<14} {f.tokens_per_s:>9.1f} {f.passes_per_token:>12.3f} "
                  f"{f.passes:>13d} {f.ms_per_row_pass:>11.2f} {per * f.forward_s:>8.2f} "
                  f"{per * f.constraint_s:>10.2f} {per * rest:>6.2f} {1000 * f.constraint_s:>8.0f}ms "
                  f"{100 * f.constraint_share:>5.1f}% {f.valid:>7d}/{f.outputs:<4d}")
    print("\nconstrained / unconstrained, same run:")
    print(f"{'batch':>5} {'tokens/s':>9} {'passes/token':>12} {'ms/row-pass':>11} {'forward/row-pass':>16} "
          f"{'engine s/token':>14}")
    for plain, shaped in results:
        engine_per_token = (shaped.busy_s / shaped.tokens) / (plain.busy_s / plain.tokens)
        forward = (shaped.forward_s / shaped.row_passes) / (plain.forward_s / plain.row_passes)
        print(f"{plain.batch:>5} {shaped.tokens_per_s / plain.tokens_per_s:>8.2f}x "
              f"{shaped.passes_per_token / plain.passes_per_token:>11.2f}x "
              f"{shaped.ms_per_row_pass / plain.ms_per_row_pass:>10.2f}x {forward:>15.2f}x "
              f"{engine_per_token:>13.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", choices=["clover", "sdar"], default="clover",
                        help="Random demo of the throughput runs (part 2 always uses Clover demos).")
    parser.add_argument("--size", choices=["tiny", "small"], default="small")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--repeats", type=int, default=3, help="Runs of each mode per batch size.")
    parser.add_argument("--auto-requests", type=int, default=32, help="auto tool jobs per checkpoint.")
    parser.add_argument("--auto-tokens", type=int, default=96, help="max_new_tokens of an auto job.")
    parser.add_argument("--auto-temperature", type=float, default=0.7)
    parser.add_argument("--no-auto", action="store_true", help="Skip part 2.")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke run: tiny demo, one repeat, 4 auto jobs of 32 tokens.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's).")
    args = parser.parse_args()
    if args.quick:
        args.size, args.repeats, args.auto_requests, args.auto_tokens = "tiny", 1, 4, 32
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        lm = _load(write_demo_checkpoint(Path(tmp) / "demo", seed=0, size=args.size, arch=args.family),
                   args.device, args.dtype)
        clover = lm if args.family == "clover" else _load(
            write_demo_checkpoint(Path(tmp) / "clover", seed=0, size=args.size, arch="clover"),
            args.device, args.dtype)
    c = lm.config
    total, active = c.param_counts()
    params, decoding = family_params(lm)
    print(f"checkpoint: random {args.family} demo, {args.size} ({total / 1e6:.1f} M params, "
          f"{active / 1e6:.1f} M active), block {c.block_size}, {decoding}, greedy; device {args.device}, "
          f"{args.dtype}, torch threads {torch.get_num_threads()}, repeats {args.repeats}")

    print("\n[1] constrained (schema canvas) vs unconstrained, same prompts, same output positions")
    compiled = compile_ms(lm)
    for name in SCHEMAS:
        row = build_rows(lm, len(SCHEMAS))[list(SCHEMAS).index(name)]
        s = canvas_shares(row.canvas)
        print(f"  {name:<9} {s['positions']:>4.0f} positions: given {100 * s['given']:.0f}%, "
              f"choice slots {100 * s['choice']:.0f}%, token slots {100 * s['token']:.0f}%; "
              f"prompt {len(row.prompt)} tokens; canvas compiled in {compiled[name]:.1f} ms")
    results = []
    for batch in batches:
        clock = ConstraintClock(sync=args.device.startswith("cuda"))
        results.append(compare(lm, batch, args.repeats, params=params, clock=clock))
    _print_compare(results)
    print(f"constraint time by path at batch {batches[-1]} (both modes; plain rows reach only early-outs): "
          + ", ".join(f"{name} {1000 * sec:.0f} ms" for name, sec in
                      sorted(clock.seconds.items(), key=lambda item: -item[1])))
    plain, shaped = results[-1]
    share = shaped.constraint_share
    print(f"\nconstraint share of engine time at batch {shaped.batch}: {100 * share:.1f}% "
          f"(goal <= 15%: {'met' if share <= 0.15 else 'NOT met'}); passes per token "
          f"{shaped.passes_per_token:.3f} constrained vs {plain.passes_per_token:.3f} unconstrained "
          f"({'fewer' if shaped.passes_per_token < plain.passes_per_token else 'NOT fewer'})")
    print("sample constrained output:", shaped.texts[0])

    if args.no_auto:
        return
    print(f"\n[2] auto tool calls ({len(TOOLS)} tools, tool_choice auto, "
          f"temperature {args.auto_temperature}, up to {args.auto_tokens} tokens, "
          "the worker's run_generate + Qwen3 XML parser)")
    figures = [
        auto_calls(clover, f"random Clover demo ({args.size})", requests=args.auto_requests,
                   max_new_tokens=args.auto_tokens, temperature=args.auto_temperature),
        auto_calls(_load(TRAINED_CLOVER_DEMO, args.device, args.dtype),
                   "trained Clover demo (tiny)", requests=args.auto_requests,
                   max_new_tokens=args.auto_tokens, temperature=args.auto_temperature),
    ]
    print(f"{'checkpoint':<28} {'jobs':>5} {'attempted':>9} {'well formed':>11} {'none':>5} "
          f"{'retried':>7} {'calls returned':>14}")
    for f in figures:
        print(f"{f.checkpoint:<28} {f.requests:>5} {f.attempted:>9} {f.well_formed:>11} {f.none:>5} "
              f"{f.retries:>7} {f.calls_returned:>14}")
        for text in f.samples:
            print(f"    e.g. {text[:100]!r}")
    print("well-formed share of first decodes: " + ", ".join(
        f"{f.checkpoint} {f.well_formed}/{f.requests}" for f in figures))


if __name__ == "__main__":
    main()
