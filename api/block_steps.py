"""Steps per block against the block size, and the step limits: rules of every job kind
(``api.limits``, ``api.decision_limits``, ``api.extract_limits``)."""

from __future__ import annotations

from api.errors import ApiError
from api.limit_messages import over_limit
from scheduler.infra.settings import Settings


def check_steps_fit_block(
    steps_per_block: int | None, block_size: int | None, default: int | None
) -> int | None:
    """The steps per block a job runs with: ``steps_per_block`` or ``default`` (``None``: neither
    names one, and the worker applies the model family's default).

    A pass commits at least one position of its block, so a block never takes more passes than
    it has positions: an explicit ``steps_per_block`` above an explicit ``block_size`` is refused
    (422, never quietly lowered); the deployment's default is capped at the block size.
    """
    if steps_per_block is None:
        return min(default, block_size) if block_size is not None and default is not None else default
    if block_size is not None and steps_per_block > block_size:
        message = (f"params.steps_per_block ({steps_per_block}) must not exceed params.block_size "
                   f"({block_size}): every pass commits at least one of the block's positions.")
        raise ApiError(422, "invalid_request", message, [
            {"loc": ["body", "params", "steps_per_block"], "message": f"at most block_size ({block_size})",
             "type": "limit", "value": steps_per_block},
        ])
    return steps_per_block


def check_step_limits(steps_per_block: int | None, block_size: int | None, step_budget: int | None, *,
                      settings: Settings) -> int | None:
    """The steps per block a decide or extract job runs with (``check_steps_fit_block``), within
    ``max_steps_per_block``, and its ``step_budget`` within ``max_step_budget`` (422 naming the
    setting otherwise)."""
    limits = settings.limits
    steps = check_steps_fit_block(steps_per_block, block_size, limits.default_steps_per_block)
    if steps is not None and steps > limits.max_steps_per_block:
        raise over_limit(["params", "steps_per_block"], f"at most {limits.max_steps_per_block}",
                         steps, "max_steps_per_block")
    if step_budget is not None and step_budget > limits.max_step_budget:
        raise over_limit(["params", "step_budget"], f"at most {limits.max_step_budget}",
                         step_budget, "max_step_budget")
    return steps
