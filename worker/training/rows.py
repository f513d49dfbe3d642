"""Cases -> token rows as the engine serves them, with the positions the model must predict.

A decision row is what ``worker.decisions.planner.plan_decision`` submits (the same prompts and
the same infill template) with the true choices written into the choice slots; only slot
positions are predicted (the template's JSON is fixed in the engine, never decoded). A
generation row is the chat template's prompt (``enable_thinking`` as the case says) then the
target and ``<|im_end|>``; every position after the prompt is predicted. An extraction row is an
``extract`` job's prompt and its schema's canvas, the true values in the choice slots (predicted).
A tool-call row is a generation row whose prompt carries the tools and whose target is the
assistant turn as the chat template renders it: the call in the checkpoint's format, or the text;
it lists the tokens that decide it (``keys``: the first, the function's name, the argument's
value), which the trainer's ``tool_keys`` option weighs.
Rows are padded with EOS to a whole block, so a final partial block trains the model to stop.

A decision row also lists its choice slots (``units``: absolute start and length): the engine
masks a slot whole and commits it as one unit (``worker.sampler.sequence``), and while a slot that
crosses a block boundary is undecided its positions in the earlier blocks stay *mask tokens* in
the committed prefix (they are only scored there). The trainer's ``served_slots`` option noises
decision rows that way (``worker.training.trainer._noisy_batch``); its EOS padding after the
template is then not predicted either (a template region never decodes past its end).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import get_args

from scheduler.jobs.schema_subset import parse_schema
from worker.decisions.planner import plan_decision
from worker.decisions.spec import DecisionMode
from worker.decisions.templates import choice_sequences
from worker.engine.types import InfillTemplate, SamplingParams
from worker.execution import prompt_ids
from worker.extract_job import render_extract_prompt
from worker.model.tokenizer import Tokenizer
from worker.structured.canvas import compile_canvas
from worker.training.corpus import DecisionCase, GenerationCase
from worker.training.extraction import ExtractionCase
from worker.training.tool_calls import ToolCallCase

MODES: tuple[DecisionMode, ...] = get_args(DecisionMode)


@dataclass(frozen=True)
class Row:
    ids: tuple[int, ...]
    predicted: tuple[bool, ...]  # per position: a target of the denoising loss
    units: tuple[tuple[int, int], ...] = ()  # decision rows: (start, length) of each choice slot
    # tool-call rows: the positions that decide the answer (its first token: a call or text; the
    # function's name; the argument's value), the rest of a call being fixed by the format
    keys: tuple[int, ...] = ()
    # a self-distillation row (``worker.training.self_distill``): its block is masked whole, the
    # state of a block's first pass, where a ``dynamic`` decode commits what it is sure of
    whole: bool = False


def _padded(ids: list[int], predicted: list[bool], block: int, eos: int) -> Row:
    extra = -len(ids) % block
    return Row(tuple(ids + [eos] * extra), tuple(predicted + [True] * extra))


def _template_row(
    prompt: list[int],
    template: InfillTemplate,
    fills: list[tuple[int, tuple[int, ...]]],
    block: int,
    eos: int,
) -> Row:
    """``prompt`` then ``template`` with each ``(slot index, tokens)`` of ``fills`` written into its
    slot: only those positions predicted, each slot a unit."""
    region = list(template.token_ids)
    predicted = [False] * len(region)
    units = []
    for index, chosen in fills:
        slot = template.slots[index]
        region[slot.start : slot.start + slot.length] = chosen
        predicted[slot.start : slot.start + slot.length] = [True] * slot.length
        units.append((len(prompt) + slot.start, slot.length))
    row = _padded(prompt + region, [False] * len(prompt) + predicted, block, eos)
    return Row(row.ids, row.predicted, tuple(units))


def decision_rows(case: DecisionCase, mode: DecisionMode, tokenizer: Tokenizer, block: int) -> list[Row]:
    """The rows of ``case`` asked in ``mode`` (one per question when independent)."""
    spec = case.spec(mode)
    plan = plan_decision(spec, tokenizer, request_id="train", params=SamplingParams(),  # type: ignore[arg-type]
                         rationale_tokens=0, slot_class="train")  # fmt: skip
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_ids[0]
    rows = []
    for request, layout in zip(plan.requests, plan.templates, strict=True):
        fills = []
        for answer in layout.answers:
            question = spec.questions[answer.question_index]
            sequences = choice_sequences(question, tokenizer, pad)  # type: ignore[arg-type]
            fills.append(
                (answer.choice_slot, sequences[question.choices.index(case.answers[answer.question_index])])
            )
        rows.append(
            _template_row(list(request.prompt_ids), layout.template, fills, block, tokenizer.eos_token_ids[0])
        )
    return rows


def extraction_row(case: ExtractionCase, tokenizer: Tokenizer, block: int) -> Row:
    """The row of an ``extract`` job asking ``case``: its prompt (``worker.extract_job``) and the
    schema's canvas (``worker.structured``) with the true value of each field in its choice slot."""
    prompt = render_extract_prompt(tokenizer, case.context, case.schema)
    canvas = compile_canvas(parse_schema(case.schema), tokenizer)
    fills = canvas.choice_fills(case.answer)
    return _template_row(prompt, canvas.template, fills, block, tokenizer.eos_token_ids[0])


def answer_row(prompt: list[int], answer: list[int], tokenizer: Tokenizer, block: int) -> Row:
    """``prompt`` then the ``answer`` ids and EOS, every position after the prompt predicted."""
    eos = tokenizer.eos_token_ids[0]
    target = [*answer, eos]
    return _padded(prompt + target, [False] * len(prompt) + [True] * len(target), block, eos)


def generation_prompt(case: GenerationCase, tokenizer: Tokenizer) -> list[int]:
    """The prompt a ``generate`` job with ``messages`` and ``thinking`` builds (the worker's own)."""
    return prompt_ids({"messages": list(case.messages)}, {"thinking": case.thinking}, tokenizer)


def generation_row(case: GenerationCase, tokenizer: Tokenizer, block: int) -> Row:
    return answer_row(generation_prompt(case, tokenizer), tokenizer.encode(case.target), tokenizer, block)


def tool_call_target(case: ToolCallCase, tokenizer: Tokenizer) -> str:
    """The assistant turn of ``case`` as the chat template renders it in a conversation (the call
    in the template's own format), without its end marker: what the model writes after the prompt."""
    history = tokenizer.render_chat([*case.messages, case.assistant_turn()], enable_thinking=False,
                                    add_generation_prompt=False, tools=case.tools)  # fmt: skip
    opening = "<|im_start|>assistant\n"
    turn = history[history.rindex(opening) + len(opening):]
    return turn[: turn.rindex("<|im_end|>")]


def tool_call_prompt(case: ToolCallCase, tokenizer: Tokenizer) -> list[int]:
    """The prompt a ``generate`` job of ``case.job_input()`` builds (thinking off; the worker's own)."""
    return prompt_ids(case.job_input(), {}, tokenizer)


def deciding_spans(case: ToolCallCase, target: str) -> list[tuple[int, int]]:
    """The character spans of ``target`` (``tool_call_target``) that decide it: its first character
    (a call or a text answer) and, for a call, the function's name and the argument's value as the
    template writes them (``<function=NAME>`` ... ``<parameter=ARG>`` newline VALUE newline)."""
    spans = [(0, 1)]
    if case.call is not None:
        name, arguments = case.call
        start = target.index("<function=") + len("<function=")
        spans.append((start, start + len(name)))
        for argument in arguments:
            opening = f"<parameter={argument}>\n"
            begin = target.index(opening) + len(opening)
            spans.append((begin, target.index("\n</parameter>", begin)))
    return spans


def tool_call_row(case: ToolCallCase, tokenizer: Tokenizer, block: int) -> Row:
    """A generation row of ``case``'s prompt and target, its deciding tokens listed as ``keys``."""
    prompt = tool_call_prompt(case, tokenizer)
    target = tool_call_target(case, tokenizer)
    ids, offsets = tokenizer.encode_spans(target)
    spans = deciding_spans(case, target)
    keys = tuple(len(prompt) + i for i, (a, b) in enumerate(offsets)
                 if any(a < end and start < b for start, end in spans))  # fmt: skip
    return replace(answer_row(prompt, ids, tokenizer, block), keys=keys)
