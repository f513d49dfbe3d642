"""Turn a decision spec into engine requests (one per question, or one for all).

``independent``: one sequence per question, all submitted at once so the engine batches them;
none sees another's prompt or answer. ``joint``: one sequence with the context and every
question, whose generated region is the JSON list of all answers, decoded together.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

from worker.decisions.prompts import independent_prompts, joint_prompt
from worker.decisions.spec import DecisionSpec, DecisionTokenizer
from worker.decisions.templates import AnswerTemplate, answer_template
from worker.engine.types import GenerationRequest, Progress, SamplingParams, SlotConstraint


@dataclass(frozen=True)
class DecisionPlan:
    """The engine requests of one decision attempt and the template of each."""

    spec: DecisionSpec
    requests: tuple[GenerationRequest, ...]
    templates: tuple[AnswerTemplate, ...]


class SummedProgress:
    """One job's progress over its several sequences (an independent decision): each sequence's
    latest report, added up, so the job's ``blocks_done`` counts towards the sum of their planned
    blocks. Committed ids are not concatenated (the sequences' texts are separate answers)."""

    def __init__(self, report: Callable[[Progress], None], sequences: int) -> None:
        self._report = report
        self._latest: list[Progress | None] = [None] * sequences
        self._lock = threading.Lock()  # engine callbacks; one engine thread, but cheap insurance

    def callback(self, index: int) -> Callable[[Progress], None]:
        def record(progress: Progress) -> None:
            with self._lock:
                self._latest[index] = progress
                seen = [p for p in self._latest if p is not None]
                budgets = [p.step_budget for p in seen]
                total = Progress(
                    blocks_done=sum(p.blocks_done for p in seen),
                    steps_used=sum(p.steps_used for p in seen),
                    step_budget=None if None in budgets else sum(b for b in budgets if b is not None),
                    tokens_committed=sum(p.tokens_committed for p in seen),
                    committed_token_ids=[],
                )
            self._report(total)

        return record


def _pad_id(tokenizer: DecisionTokenizer) -> int:
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_ids[0]


def with_constraints(template: AnswerTemplate, spec: DecisionSpec) -> AnswerTemplate:
    """``template`` (a joint one) with ``spec``'s constraints as ``SlotConstraint``s over its
    choice slots (a choice's index is its position in the question's ``choices``, as in the
    slot's ``allowed_sequences``)."""
    if not spec.constraints:
        return template
    index = {q.id: i for i, q in enumerate(spec.questions)}
    slot_of = {layout.question_index: layout.choice_slot for layout in template.answers}
    constraints = []
    for constraint in spec.constraints:
        questions = [spec.questions[index[q]] for q in constraint.questions]
        constraints.append(SlotConstraint(
            slots=tuple(slot_of[index[q]] for q in constraint.questions),
            allowed=tuple(tuple(q.choices.index(a) for q, a in zip(questions, combo, strict=True))
                          for combo in constraint.allowed),
        ))  # fmt: skip
    return replace(template, template=replace(template.template, constraints=tuple(constraints)))


def plan_decision(
    spec: DecisionSpec,
    tokenizer: DecisionTokenizer,
    *,
    request_id: str,
    params: SamplingParams,
    rationale_tokens: int,
    slot_class: str,
    deadline: float | None = None,
    cancel_event: threading.Event | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    joint_one_pass: bool = False,
) -> DecisionPlan:
    """Build the requests of one attempt.

    ``params`` applies to every sequence; its ``max_new_tokens`` is replaced by the template
    length. Independent sequences get ``seed + i`` so each question draws on its own stream.
    ``cancel_event`` is shared by every request so one cancel stops them all; ``on_progress``
    gets a joint decision's one sequence's reports, and the sum of an independent decision's
    sequences' latest reports (:class:`SummedProgress`). ``joint_one_pass``: a joint template
    without rationales is decided in one pass (``InfillTemplate.one_pass``); free-text rationales
    need the block-by-block decode, so with them the flag is ignored.
    """
    pad_id = _pad_id(tokenizer)
    rationale = rationale_tokens if spec.rationale else None
    cancel = cancel_event or threading.Event()
    if spec.mode == "joint":
        prompts = [joint_prompt(spec, tokenizer)]
        joint = answer_template(spec.questions, first_index=0, tokenizer=tokenizer, pad_id=pad_id,
                                rationale_tokens=rationale, as_list=True,
                                one_pass=joint_one_pass and rationale is None)  # fmt: skip
        templates = [with_constraints(joint, spec)]
    else:
        prompts = independent_prompts(spec, tokenizer)
        templates = [
            answer_template((q,), first_index=i, tokenizer=tokenizer, pad_id=pad_id,
                            rationale_tokens=rationale, as_list=False)
            for i, q in enumerate(spec.questions)
        ]
    several = on_progress is not None and len(prompts) > 1
    summed = SummedProgress(on_progress, len(prompts)) if several and on_progress is not None else None
    requests = []
    for i, (prompt_ids, template) in enumerate(zip(prompts, templates, strict=True)):
        seed = None if params.seed is None else params.seed + i
        request_params = replace(params, max_new_tokens=len(template.template.token_ids), seed=seed)
        requests.append(
            GenerationRequest(
                request_id=f"{request_id}:{i}",
                prompt_ids=prompt_ids,
                params=request_params,
                template=template.template,
                slot_class=slot_class,
                deadline=deadline,
                cancel_event=cancel,
                on_progress=summed.callback(i) if summed is not None else on_progress,
            )
        )
    return DecisionPlan(spec=spec, requests=tuple(requests), templates=tuple(templates))
