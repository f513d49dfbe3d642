"""Steps per block against the block size: a rule of both job kinds (``api.limits``,
``api.decision_limits``)."""

from __future__ import annotations

from api.errors import ApiError


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
