"""Decision templates, result assembly and the retry-once rule, on a character tokenizer and a
fake engine (the real model runs in tests/integration/test_decisions_*.py)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import Future

import pytest

from worker.decisions import DecisionFaults, DecisionSpec, plan_decision, run_decision
from worker.decisions.runner import DecisionOptions
from worker.decisions.validation import rationale_problem
from worker.engine.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    SlotChoice,
)
from worker.thinking import split_thinking, thinking_fields

PAD, EOS, THINK, END_THINK = 1, 2, 3, 4
OFFSET = 10


class CharTokenizer:
    """One token per character; ids below OFFSET are special."""

    pad_token_id = PAD
    eos_token_ids = (EOS,)
    vocab_size = 140

    def encode(self, text: str) -> list[int]:
        return [ord(c) + OFFSET for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i - OFFSET) for i in ids if i >= OFFSET)

    def render_chat(self, messages, *, enable_thinking: bool, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class FakeEngine:
    """Fills each template: choice = the allowed sequence picked by ``pick``; free slots get
    ``rationale`` text (padded)."""

    def __init__(self, *, rationale: str = "clause 4 says so", pick=lambda request, slot: 0) -> None:
        self.rationale = rationale
        self.pick = pick
        self.requests: list[GenerationRequest] = []

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        self.requests.append(request)
        template = request.template
        assert template is not None
        ids = list(template.token_ids)
        choices = []
        for i, slot in enumerate(template.slots):
            if slot.allowed_sequences is None:
                text = CharTokenizer().encode(self.rationale)[: slot.length]
                fill = text + [PAD] * (slot.length - len(text))
                choices.append(SlotChoice(index=-1, token_ids=fill, confidence=1.0))
            else:
                index = self.pick(request, i)
                fill = list(slot.allowed_sequences[index])
                choices.append(SlotChoice(index=index, token_ids=fill, confidence=0.75))
            ids[slot.start : slot.start + slot.length] = fill
        future: Future[GenerationResult] = Future()
        future.set_result(
            GenerationResult(
                request_id=request.request_id, token_ids=ids, finish_reason=FinishReason.LENGTH,
                steps_used=3, blocks=2, tokens=len(ids), prompt_tokens=len(request.prompt_ids),
                slot_choices=choices,
            )
        )
        return future


def _spec(mode: str, rationale: bool = False) -> DecisionSpec:
    return DecisionSpec.from_input(
        {
            "context": "The supplier may terminate with 30 days notice.",
            "questions": [
                {"id": "q1", "text": "Can the supplier terminate?"},
                {"id": "risk", "text": "Risk level?", "choices": ["low", "medium", "high"]},
                {"id": "q3", "text": "Is notice required?", "choices": ["yes", "no"]},
            ],
            "mode": mode,
            "rationale": rationale,
        }
    )


def _run(spec: DecisionSpec, engine: FakeEngine, **kwargs):
    return run_decision(
        spec, tokenizer=CharTokenizer(), submit=engine.submit, request_id="job",
        params=SamplingParams(seed=7), slot_class="standard", **kwargs,
    )


@pytest.mark.parametrize("mode", ["independent", "joint"])
@pytest.mark.parametrize("rationale", [False, True])
def test_filled_template_decodes_to_valid_json_with_allowed_choices(mode: str, rationale: bool) -> None:
    spec = _spec(mode, rationale)
    tokenizer = CharTokenizer()
    plan = plan_decision(spec, tokenizer, request_id="j", params=SamplingParams(), rationale_tokens=20,
                         slot_class="joint" if mode == "joint" else "standard")
    assert len(plan.requests) == (1 if mode == "joint" else 3)
    engine = FakeEngine(pick=lambda request, slot: len(engine.requests) % 2)
    for request in plan.requests:
        text = tokenizer.decode(engine.submit(request).result().token_ids, skip_special_tokens=True)
        parsed = json.loads(text)  # the region is valid JSON whatever the choices are
        objects = parsed if mode == "joint" else [parsed]
        for obj in objects:
            question = next(q for q in spec.questions if q.id == obj["id"])
            assert obj["choice"] in question.choices
            assert ("rationale" in obj) == rationale


@pytest.mark.parametrize(("mode", "rationale", "expected"),
                         [("joint", False, True), ("joint", True, False), ("independent", False, False)])
def test_joint_one_pass_marks_a_joint_template_without_rationales(mode: str, rationale: bool,
                                                                  expected: bool) -> None:
    """``CLOVERQ_DECIDE_JOINT_DECODE=one_pass``: only a joint template with every slot a choice
    is decided in one pass (free-text rationales need the block-by-block decode)."""
    plan = plan_decision(_spec(mode, rationale), CharTokenizer(), request_id="j", params=SamplingParams(),
                         rationale_tokens=8, slot_class="standard", joint_one_pass=True)  # fmt: skip
    assert {r.template.one_pass for r in plan.requests if r.template is not None} == {expected}


def test_independent_prompts_never_see_other_questions() -> None:
    spec = _spec("independent")
    plan = plan_decision(spec, CharTokenizer(), request_id="j", params=SamplingParams(seed=3),
                         rationale_tokens=8, slot_class="standard")
    for i, request in enumerate(plan.requests):
        prompt = CharTokenizer().decode(request.prompt_ids)
        others = [q.text for j, q in enumerate(spec.questions) if j != i]
        assert spec.questions[i].text in prompt
        assert not any(text in prompt for text in others)
        assert request.params.seed == 3 + i
        assert request.params.max_new_tokens == len(request.template.token_ids)
    assert len({id(r.cancel_event) for r in plan.requests}) == 1  # one cancel stops all


@pytest.mark.parametrize("mode", ["independent", "joint"])
def test_result_in_question_order_with_choices_and_confidence(mode: str) -> None:
    picks = {"q1": 1, "risk": 2, "q3": 0}

    def pick(request: GenerationRequest, slot: int) -> int:
        prompt = CharTokenizer().decode(request.template.token_ids)
        ids = [qid for qid in picks if f'"{qid}"' in prompt]
        return picks[ids[slot]] if mode == "joint" else picks[ids[0]]

    outcome = _run(_spec(mode), FakeEngine(pick=pick))
    assert outcome.error_code is None
    assert outcome.result["mode"] == mode
    assert [(a["id"], a["choice"]) for a in outcome.result["answers"]] == [
        ("q1", "no"), ("risk", "high"), ("q3", "yes")
    ]
    assert all(a["confidence"] == 0.75 for a in outcome.result["answers"])
    assert all("rationale" not in a for a in outcome.result["answers"])


def test_invalid_rationale_retried_once_with_new_seed_then_succeeds() -> None:
    engine = FakeEngine()
    alerts: list[tuple[int, str]] = []
    outcome = _run(
        _spec("joint", rationale=True), engine, faults=DecisionFaults(invalid_rationale_attempts=1),
        on_invalid_output=lambda attempt, reason: alerts.append((attempt, reason)),
    )
    assert outcome.error_code is None and outcome.attempts == 2
    assert [a[0] for a in alerts] == [1]
    assert all(a["rationale"] == "clause 4 says so" for a in outcome.result["answers"])
    first, retry = engine.requests
    assert retry.params.seed != first.params.seed
    assert retry.params.temperature >= DecisionOptions().retry_temperature


def test_second_invalid_rationale_fails_with_invalid_model_output() -> None:
    engine = FakeEngine(rationale='he said "no"')
    alerts: list[int] = []
    outcome = _run(_spec("independent", rationale=True), engine,
                   on_invalid_output=lambda attempt, reason: alerts.append(attempt))
    assert outcome.result is None
    assert outcome.error_code == "invalid_model_output"
    assert alerts == [1, 2] and outcome.attempts == 2
    assert len(engine.requests) == 6  # 3 questions x 2 attempts, never a third


def test_rationale_slot_restricted_to_json_safe_tokens() -> None:
    plan = plan_decision(_spec("joint", rationale=True), CharTokenizer(), request_id="j",
                         params=SamplingParams(), rationale_tokens=8, slot_class="joint")
    free = [slot for slot in plan.requests[0].template.slots if slot.allowed_sequences is None]
    assert len(free) == 3
    allowed = {chr(i - OFFSET) for i in free[0].allowed_token_ids}
    assert {"a", "Z", " ", "."} <= allowed
    assert not allowed & {'"', "\\", "\n", "\t"}
    assert all(i >= OFFSET for i in free[0].allowed_token_ids)  # no special tokens


@pytest.mark.parametrize(
    ("text", "ok"),
    [("fine text", True), ("  ", False), ('a "quote', False), ("back\\slash", False),
     ("line\nbreak", False), ("bad \ufffd byte", False), ("x" * 401, False)],
)
def test_rationale_validation(text: str, ok: bool) -> None:
    assert (rationale_problem(text, max_chars=400) is None) == ok


def test_stopped_sequence_ends_decision_with_its_reason() -> None:
    class Cancelling(FakeEngine):
        def submit(self, request):
            future = super().submit(request)
            result = future.result()
            result.finish_reason = FinishReason.CANCELLED
            return future

    outcome = _run(_spec("independent"), Cancelling())
    assert outcome.finish_reason is FinishReason.CANCELLED and outcome.result is None


A, B, C, D = (ord(c) + OFFSET for c in "abcd")


@pytest.mark.parametrize(
    ("ids", "reasoning", "text"),
    [
        ([THINK, A, B, END_THINK, C, D], "ab", "cd"),  # both markers generated
        ([A, END_THINK, C], "a", "c"),  # <think> was in the prompt
        ([THINK, A, B], "ab", ""),  # thinking never closed: no answer yet
        ([C, D], "cd", ""),
    ],
)
def test_split_thinking(ids: list[int], reasoning: str, text: str) -> None:
    split = split_thinking(ids, think_start_id=THINK, think_end_id=END_THINK,
                           decode=lambda xs: CharTokenizer().decode(xs, skip_special_tokens=True))
    assert (split.reasoning, split.text) == (reasoning, text)


def test_thinking_fields_replace_text_with_the_answer() -> None:
    class Thinking(CharTokenizer):
        think_start_id, think_end_id = THINK, END_THINK

    fields = thinking_fields([THINK, A, B, END_THINK, C], Thinking())
    assert fields == {"reasoning": "ab", "text": "c"}


def test_independent_sequences_report_their_progress_summed() -> None:
    from worker.decisions.planner import SummedProgress
    from worker.engine.types import Progress

    seen: list[Progress] = []
    summed = SummedProgress(seen.append, 3)
    summed.callback(0)(Progress(blocks_done=1, steps_used=4, step_budget=None, tokens_committed=3,
                                committed_token_ids=[5, 6, 7]))
    summed.callback(2)(Progress(blocks_done=2, steps_used=6, step_budget=None, tokens_committed=5,
                                committed_token_ids=[8]))
    # The latest report of a sequence replaces its earlier one.
    summed.callback(0)(Progress(blocks_done=2, steps_used=7, step_budget=None, tokens_committed=6,
                                committed_token_ids=[5, 6, 7, 9]))
    sums = [(p.blocks_done, p.steps_used, p.tokens_committed) for p in seen]
    assert sums == [(1, 4, 3), (3, 10, 8), (4, 13, 11)]
    assert seen[-1].committed_token_ids == []  # separate answers: no concatenated partial text


@pytest.mark.parametrize(("mode", "allowed", "says"), [
    ("independent", [["yes", "no"]], 'need mode "joint"'),
    ("joint", [["yes", "maybe"]], "'maybe' is not a choice"),
])  # fmt: skip
def test_a_stored_input_s_constraints_follow_the_api_s_rules(mode: str, allowed: list, says: str) -> None:
    """The worker refuses what the API refuses, in its words (``scheduler.jobs.decision_constraints``)."""
    data = {"context": "c", "mode": mode, "questions": [{"id": "a", "text": "A?"}, {"id": "b", "text": "B?"}],
            "constraints": [{"questions": ["a", "b"], "allowed": allowed}]}
    with pytest.raises(ValueError, match=says):
        DecisionSpec.from_input(data)
