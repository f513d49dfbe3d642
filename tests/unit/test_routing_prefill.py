"""The routing cost counts the prompt (issue 26): a 3,941-token prompt with 8 new tokens went to
``interactive`` because only the decoding counted. Held against a plain reference: walk the
generated region block by block (``steps`` passes of ``block`` predictions each), cap it by the
step budget, then add every prompt token at ``prefill_token_cost``."""

from __future__ import annotations

import itertools

import pytest

from scheduler.infra.queue_names import QueueName
from scheduler.infra.settings import Settings
from scheduler.jobs.routing import STEPS_ASSUMED, estimate_cost, route_job

SETTINGS = Settings()


def reference_cost(*, new_tokens: int, block: int | None, steps: int, prompt_tokens: int,
                   per_prompt_token: int, budget: int | None = None) -> int:
    """Token-predictions of one generate job, the plain way."""
    width = block or 1  # an unknown block: each generated token is predicted ``steps`` times
    passes = min(steps, block) if block else steps  # a pass commits at least one position of its block
    predictions, generated = 0, 0
    while generated < new_tokens:
        predictions += passes * width
        generated += width
    if budget is not None:
        predictions = min(predictions, budget * (block or 4))
    return predictions + prompt_tokens * per_prompt_token


CASES = list(itertools.product([1, 8, 128, 1000], [None, 4, 32], [1, 4, 32], [0, 12, 3941, 16_000],
                               [None, 50]))


@pytest.mark.parametrize(("new", "block", "steps", "prompt", "budget"), CASES)
def test_cost_matches_the_plain_reference(new: int, block: int | None, steps: int, prompt: int,
                                         budget: int | None) -> None:
    params = {"max_new_tokens": new, "steps_per_block": steps, **({"block_size": block} if block else {}),
              **({"step_budget": budget} if budget is not None else {})}
    got = estimate_cost(kind="generate", input={}, params=params, settings=SETTINGS, prompt_tokens=prompt)
    assert got == reference_cost(new_tokens=new, block=block, steps=steps, prompt_tokens=prompt,
                                 per_prompt_token=SETTINGS.scheduling.prefill_token_cost, budget=budget)


def test_a_long_prompt_with_a_short_output_is_not_interactive() -> None:
    params = {"max_new_tokens": 8}
    decoding = reference_cost(new_tokens=8, block=None, steps=STEPS_ASSUMED, prompt_tokens=0,
                              per_prompt_token=0)
    assert decoding == 32  # the old cost: interactive
    long = route_job(kind="generate", input={}, params=params, priority=None, settings=SETTINGS,
                     prompt_tokens=3941)
    assert long.cost == 32 + 4 * 3941 and long.queue == QueueName.STANDARD
    short = route_job(kind="generate", input={}, params=params, priority=None, settings=SETTINGS,
                      prompt_tokens=40)
    assert short.queue == QueueName.INTERACTIVE
    uncounted = SETTINGS.replaced(prefill_token_cost=0)  # the setting turns it off
    assert route_job(kind="generate", input={}, params=params, priority=None, settings=uncounted,
                     prompt_tokens=3941).queue == QueueName.INTERACTIVE
    huge = route_job(kind="generate", input={}, params=params, priority=None, settings=SETTINGS,
                     prompt_tokens=100_000)
    assert huge.queue == QueueName.BULK


def test_a_decisions_context_counts_once_for_all_its_questions() -> None:
    one = {"questions": [{"id": "a"}]}
    four = {"questions": [{"id": str(i)} for i in range(4)]}
    per_question = estimate_cost(kind="decide", input=one, params={}, settings=SETTINGS)
    # the API counts the context once plus each question's text: the questions share its prefill
    cost = estimate_cost(kind="decide", input=four, params={}, settings=SETTINGS,
                         prompt_tokens=16_000 + 4 * 10)
    assert cost == 4 * per_question + 4 * (16_000 + 40)
    assert route_job(kind="decide", input=four, params={}, priority=None, settings=SETTINGS,
                     prompt_tokens=16_040).queue == QueueName.STANDARD
