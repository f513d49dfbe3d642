"""Step planning: how many masks each denoising pass commits, and how many passes a block gets.

Both are pure integer arithmetic so that the engine, the tests and the bench agree exactly on
the schedule the decoding contract prescribes (docs/architecture.md §3.7).
"""

from __future__ import annotations


def step_quotas(masked: int, steps: int) -> list[int]:
    """Per-pass commit quotas for a block that starts with ``masked`` masks and ``steps`` passes.

    Step ``i`` commits ``masked // steps`` masks plus one for the first ``masked % steps`` steps;
    zero-quota steps are skipped, so a block never takes more than ``min(steps, masked)`` passes
    and the quotas always sum to ``masked``.
    """
    if masked < 0 or steps < 1:
        raise ValueError(f"need masked >= 0 and steps >= 1, got masked={masked}, steps={steps}")
    base, extra = divmod(masked, steps)
    quotas = [base + (1 if i < extra else 0) for i in range(steps)]
    return [q for q in quotas if q > 0]


def plan_block_steps(steps_per_block: int, blocks_left: int, budget_left: int | None) -> int:
    """Passes the next block may use so the blocks left fit the passes left.

    ``blocks_left`` counts the block about to start. With no budget (``None``) or enough of it
    every block gets ``steps_per_block``; otherwise the passes left are spread evenly over the
    blocks left (the remainder goes to later blocks as this is re-planned at each block start),
    never below one pass. Returns 0 only when no pass is left at all.
    """
    if steps_per_block < 1 or blocks_left < 1:
        raise ValueError(
            f"need steps_per_block >= 1 and blocks_left >= 1, got {steps_per_block}, {blocks_left}"
        )
    if budget_left is None or budget_left >= steps_per_block * blocks_left:
        return steps_per_block
    if budget_left <= 0:
        return 0
    return max(1, budget_left // blocks_left)
