"""Which rows of a pass share a forward (worker/engine/pass_groups.py): heavy rows (a prompt's
last piece, a row over a long context) run apart and after the light ones when padding them
together would waste more than half of the work; otherwise one forward."""

from __future__ import annotations

import random

import pytest

from worker.engine.pass_groups import forward_work, split_pass


@pytest.mark.parametrize(("tokens", "contexts", "groups"), [
    ([8], [20], [[0]]),  # one row
    ([8, 8, 16, 8], [20, 24, 0, 28], [[0, 1, 2, 3]]),  # a short job's first pass: not worth a forward
    ([8] * 9 + [16, 416], [20] * 9 + [0, 15972], [list(range(10)), [10]]),  # a prompt's last piece
    ([8] * 11 + [8], [30] * 11 + [16384], [list(range(11)), [11]]),  # decoding after a 16K prompt
    ([8, 8, 8], [16384, 16380, 16388], [[0, 1, 2]]),  # every row over the same long context
    ([416, 8, 8], [15972, 20, 20], [[1, 2], [0]]),  # the light rows run first, whatever the order
])
def test_split_pass(tokens: list[int], contexts: list[int], groups: list[list[int]]) -> None:
    assert split_pass(tokens, contexts) == groups


def test_a_split_at_least_halves_the_estimated_work() -> None:
    tokens, contexts = [8] * 9 + [16, 416], [20] * 9 + [0, 15972]
    light, heavy = split_pass(tokens, contexts)
    everyone = list(range(len(tokens)))
    apart = forward_work(tokens, contexts, light) + forward_work(tokens, contexts, heavy)
    assert 2 * apart < forward_work(tokens, contexts, everyone)
    assert sorted(light + heavy) == everyone


def reference_split(tokens: list[int], contexts: list[int]) -> list[list[int]]:
    """The rule written the plain way: every threshold over either size, the least work wins."""
    everyone = list(range(len(tokens)))
    together = forward_work(tokens, contexts, everyone)
    best, best_work = [everyone], together
    for size in (tokens, contexts):
        for threshold in sorted(set(size))[:-1]:
            light = [i for i in everyone if size[i] <= threshold]
            heavy = [i for i in everyone if size[i] > threshold]
            work = forward_work(tokens, contexts, light) + forward_work(tokens, contexts, heavy)
            if work < best_work:
                best, best_work = [light, heavy], work
    return best if 2 * best_work < together else [everyone]


def test_split_pass_matches_the_plain_rule() -> None:
    rng = random.Random(26)
    for _ in range(500):
        r = rng.randint(1, 12)
        tokens = [rng.choice([4, 8, 8, 8, 16, 40, 416]) for _ in range(r)]
        contexts = [rng.choice([0, 12, 20, 30, 900, 8000, 16384]) for _ in range(r)]
        assert split_pass(tokens, contexts) == reference_split(tokens, contexts), (tokens, contexts)
