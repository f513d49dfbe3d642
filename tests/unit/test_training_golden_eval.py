"""Golden checks and evaluation tallies (pure logic): what passes, what is a difference."""

from __future__ import annotations

import json
from pathlib import Path

from worker.training.corpus import decision_case, generation_case
from worker.training.evaluation import DecisionTally, GenerationTally
from worker.training.golden import differences, golden_inputs, record


def test_a_recorded_case_passes_its_own_result_and_reports_each_change() -> None:
    inputs = golden_inputs(decisions=1, generations=1)
    decide = next(c for c in inputs if c["body"]["kind"] == "decide")
    n = len(decide["body"]["input"]["questions"])
    result = {"answers": [{"id": f"q{i}", "choice": "no"} for i in range(n)]}
    case = record(decide, result)
    assert differences(case, result) == []
    changed = {"answers": [{"id": "q0", "choice": "maybe"}, *result["answers"][1:]]}
    assert len(differences(case, changed)) == 2  # not a choice, and not the recorded answers
    assert differences(case, None) == ["the job did not succeed"]
    generate = next(c for c in inputs if c["body"]["kind"] == "generate")
    gen_case = record(generate, {"token_ids": [5, 6, 7], "text": "Within 30 days."})
    assert differences(gen_case, {"token_ids": [5, 6, 7], "text": "Within 30 days."}) == []
    assert differences(gen_case, {"token_ids": [5, 9, 7], "text": "Within 30 days."}) == [
        "tokens differ from position 1 (3 vs 3)"
    ]


def test_decision_tally_counts_accuracy_groups_and_violations() -> None:
    case = decision_case("eval", 0, 0)
    tally = DecisionTally()
    tally.add(case, list(case.answers))
    assert tally.as_dict()["accuracy"] == 1.0 and tally.violations == 0
    n = len(case.answers)
    assert tally.as_dict()["correct_of_asked_by_slot"] == {f"{n}q/{k}": [1, 1] for k in range(1, n + 1)}
    flipped = [case.answers[0], *("no" if a == "yes" else "yes" for a in case.answers[1:])]
    tally.add(case, flipped)  # the first answer right again, every later one wrong
    assert tally.as_dict()["correct_of_asked_by_slot"] == {f"{n}q/1": [2, 2]} | {
        f"{n}q/{k}": [1, 2] for k in range(2, n + 1)
    }
    wrong = DecisionTally()
    wrong.add(case, None, retries=1)
    assert wrong.as_dict()["accuracy"] == 0.0 and wrong.failed_jobs == 1 and wrong.invalid_output_retries == 1
    assert wrong.as_dict()["correct_of_asked_by_slot"] == {f"{n}q/{k}": [0, 1] for k in range(1, n + 1)}
    gen = generation_case("eval", 0, 0)
    gt = GenerationTally()
    gt.add(gen, gen.answer + "\n", tokens=8, passes=4)
    assert gt.as_dict()["score"] == 1.0 and gt.as_dict()["tokens_per_pass"] == 2.0


def test_the_generation_suite_s_decodings_follow_the_model_s_block() -> None:
    from cli.model_eval import generation_configs

    for block in (4, 8):
        configs = dict(generation_configs(block))
        assert all(p["block_size"] == block for p in configs.values())
        assert configs["static, 1 token/pass"]["steps_per_block"] == block
        assert configs["dynamic 0.9"] == {"block_size": block, "strategy": "dynamic", "threshold": 0.9,
                                          "steps_per_block": block}  # fmt: skip


def test_the_generation_suite_reads_the_block_of_the_checkpoint_it_serves(tmp_path: Path) -> None:
    from cli.model_eval import served_block_size
    from scheduler.infra.settings import Settings
    from worker.model.checkpoint import read_config
    from worker.model.demo_trained import TRAINED_CLOVER_DEMO

    shipped = read_config(TRAINED_CLOVER_DEMO).block_size
    served = tmp_path / "served"
    settings = Settings(model_dir=served, data_dir=tmp_path)
    assert served_block_size(settings) == shipped  # nothing copied there yet: what `cloverq up` will copy
    served.mkdir()
    config = json.loads((TRAINED_CLOVER_DEMO / "config.json").read_text())
    (served / "config.json").write_text(json.dumps({**config, "block_size": 16}))
    assert served_block_size(settings) == 16
    (served / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "block_size"}))
    assert served_block_size(settings) == 32  # none named: Clover's decided default, as a worker serves it
    (served / "config.json").write_text("{not json")
    assert served_block_size(settings) == shipped
