"""Chat prompts for the two decision modes.

The prompt only sets the scene; the answer's structure is enforced by the infill template,
so the wording here never has to be trusted for validity.
"""

from __future__ import annotations

from worker.decisions.spec import DecisionQuestion, DecisionSpec, DecisionTokenizer

SYSTEM_PROMPT = (
    "You review documents. For each question, pick exactly one of the listed choices. "
    "Answer in JSON."
)


def _question_line(question: DecisionQuestion) -> str:
    choices = ", ".join(question.choices)
    return f"- id {question.id}: {question.text} (choices: {choices})"


def _render(tokenizer: DecisionTokenizer, context: str, questions: tuple[DecisionQuestion, ...],
            rationale: bool) -> list[int]:
    lines = "\n".join(_question_line(q) for q in questions)
    ask = "Give each answer with a short rationale." if rationale else "Give each answer."
    user = f"Document:\n{context}\n\nQuestions:\n{lines}\n\n{ask}"
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    text = tokenizer.render_chat(messages, enable_thinking=False, add_generation_prompt=True)
    return tokenizer.encode(text)


def independent_prompts(spec: DecisionSpec, tokenizer: DecisionTokenizer) -> list[list[int]]:
    """One prompt per question: no question sees another (nor its answer)."""
    return [_render(tokenizer, spec.context, (q,), spec.rationale) for q in spec.questions]


def joint_prompt(spec: DecisionSpec, tokenizer: DecisionTokenizer) -> list[int]:
    """One prompt holding the context and every question, answered together."""
    return _render(tokenizer, spec.context, spec.questions, spec.rationale)
