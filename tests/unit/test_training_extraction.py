"""Extraction targets of the demo corpus: the cases, their training rows, their scoring and their
golden checks (pure logic, the shipped demo's tokenizer)."""

from __future__ import annotations

import random
from pathlib import Path

import jsonschema
import pytest

from worker.engine.types import SlotChoice
from worker.model.demo_trained import TRAINED_CLOVER_DEMO
from worker.model.tokenizer import Tokenizer
from worker.training.contracts import ContractFacts, draw_facts, money, years
from worker.training.corpus import extraction_case, extraction_cases, in_split
from worker.training.evaluation import ExtractionTally
from worker.training.extraction import FIELDS, extraction_schema, field_value
from worker.training.golden import differences, golden_inputs, load_golden, record, write_golden
from worker.training.rows import extraction_row

FACTS = ContractFacts(roles=("Supplier", "Buyer"), names=("Acme Ltd", "Birch plc"), term_years=3,
                      renewal_years=None, notice_days=45, cap=None, law="Spain", payment_days=30,
                      survival_years=2, assignment="affiliates")  # fmt: skip


def test_each_field_reads_its_fact_and_null_stands_for_a_missing_right_or_term() -> None:
    values = {FIELDS[k].name: field_value(k, FACTS) for k in FIELDS}
    assert values == {"liability_cap": None, "notice_days": 45, "renewal_years": None, "term_years": 3,
                      "confidentiality_years": 2, "governing_law": "Spain", "payment_days": 30,
                      "assign_without_consent": "affiliates"}  # fmt: skip
    for _ in range(200):  # every value the corpus draws is one of its field's enum
        facts = draw_facts(random.Random(_))
        for kind, spec in FIELDS.items():
            assert field_value(kind, facts) in spec.values


@pytest.mark.parametrize("split", ["train", "eval", "heldout"])
def test_cases_are_deterministic_valid_and_stated_by_their_contract(split: str) -> None:
    cases = extraction_cases(split, 3, 40)  # type: ignore[arg-type]
    assert cases == extraction_cases(split, 3, 40)  # type: ignore[arg-type]
    for case in cases:
        assert 2 <= len(case.kinds) <= 3 and list(case.answer) == [FIELDS[k].name for k in case.kinds]
        jsonschema.validate(case.answer, case.schema)
        for name, value in case.answer.items():  # the contract writes each value it asks for
            assert _written(name, value) in case.context, (name, value, case.context)


def _written(name: str, value: object) -> str:
    """A fragment of the contract that states ``value`` (empty: nothing to find)."""
    if value is None or name == "assign_without_consent":  # absence, or a paraphrase of the clause
        return ""
    if name == "liability_cap":
        return money(value)  # type: ignore[arg-type]
    if name.endswith("_years"):
        return years(value)  # type: ignore[arg-type]
    return str(value)


def test_evaluation_extractions_use_evaluation_facts_only() -> None:
    train = {c.context for c in extraction_cases("train", 0, 200)}
    assert not train & {c.context for c in extraction_cases("eval", 0, 200)}
    for i in range(50):  # the facts of case i are the first draw of its stream that fits the split
        for split in ("train", "eval"):
            rng = random.Random(f"{split}/0/extract/{i}")
            facts = draw_facts(rng)
            while not in_split(facts, split):  # type: ignore[arg-type]
                facts = draw_facts(rng)
            assert in_split(facts, split) and not in_split(facts, "eval" if split == "train" else "train")  # type: ignore[arg-type]
            case = extraction_case(split, 0, i)  # type: ignore[arg-type]
            assert case.answer == {FIELDS[k].name: field_value(k, facts) for k in case.kinds}


def test_a_training_row_holds_the_canvas_with_the_true_value_in_each_choice_slot() -> None:
    from scheduler.jobs.schema_subset import parse_schema
    from worker.structured.canvas import compile_canvas

    tokenizer = Tokenizer.from_dir(TRAINED_CLOVER_DEMO)
    for case in extraction_cases("train", 0, 20):
        row = extraction_row(case, tokenizer, block=4)
        canvas = compile_canvas(parse_schema(case.schema), tokenizer)
        assert len(row.units) == len(case.kinds) == len(canvas.template.slots)
        in_slots = {p for start, length in row.units for p in range(start, start + length)}
        padding = [p for p, on in enumerate(row.predicted) if on and p not in in_slots]
        assert len(row.ids) % 4 == 0 and len(padding) < 4  # only the EOS that fills the last block
        assert all(row.ids[p] == tokenizer.eos_token_ids[0] and p > max(in_slots) for p in padding)
        choices = []
        for (start, length), slot in zip(row.units, canvas.template.slots, strict=True):
            tokens = row.ids[start : start + length]
            assert slot.allowed_sequences is not None and all(row.predicted[start : start + length])
            choices.append(SlotChoice(slot.allowed_sequences.index(tokens), list(tokens), 1.0))
        assert canvas.read(choices, tokenizer).value == case.answer
        text = tokenizer.decode(list(row.ids), skip_special_tokens=True)
        assert "Answer with JSON holding:" in text and case.context in text


def test_the_tally_scores_fields_cases_and_schema_validity() -> None:
    case = extraction_case("eval", 0, 0)
    tally = ExtractionTally()
    tally.add(case, dict(case.answer))
    first = next(iter(case.answer))
    spec = next(f for f in FIELDS.values() if f.name == first)
    wrong = next(v for v in spec.values if v != case.answer[first])
    tally.add(case, {**case.answer, first: wrong}, retries=1)
    tally.add(case, None)
    tally.add(case, {**case.answer, first: "not a value"})  # outside the enum: wrong and invalid
    d = tally.as_dict()
    fields = len(case.answer)
    assert d["jobs"] == 4 and d["failed_jobs"] == 1 and d["invalid_output_retries"] == 1
    assert d["field_accuracy"] == round((fields + (fields - 1) + 0 + (fields - 1)) / (4 * fields), 4)
    assert d["all_fields_correct"] == 0.25 and d["schema_valid"] == round(2 / 3, 4)
    typed = ExtractionTally()
    typed.add(extraction_case("eval", 0, 0), {k: (True if v == 1 else v) for k, v in case.answer.items()})
    assert typed.correct == sum(v != 1 or isinstance(v, bool) for v in case.answer.values())


def test_a_golden_extraction_checks_the_schema_and_the_recorded_value() -> None:
    extract = next(c for c in golden_inputs(decisions=0, generations=0, extractions=1, tools=0))
    assert extract["body"]["kind"] == "extract"
    schema = extract["body"]["input"]["schema"]
    data = {name: prop["enum"][0] for name, prop in schema["properties"].items()}
    case = record(extract, {"data": data})
    assert differences(case, {"data": data}) == []
    other = {name: prop["enum"][1] for name, prop in schema["properties"].items()}
    assert differences(case, {"data": other}) == [f"data: {other!r} != {data!r}"]
    broken = {**data, "extra": 1}
    assert differences(case, {"data": broken}) == [
        "data is not valid against the schema", f"data: {broken!r} != {data!r}"
    ]


def test_the_schema_lists_every_field_required_with_its_enum() -> None:
    schema = extraction_schema(("law", "liability"))
    assert schema["required"] == ["governing_law", "liability_cap"] and not schema["additionalProperties"]
    assert schema["properties"]["liability_cap"]["enum"][-1] is None


def test_a_golden_file_keeps_each_schema_s_property_order(tmp_path: Path) -> None:
    """The canvas lays fields out in the schema's order: a file with sorted keys would ask
    another job than the one recorded."""
    inputs = golden_inputs(decisions=0, generations=0, extractions=6, tools=0)
    cases = [record(c, {"data": None}) for c in inputs]
    write_golden(tmp_path / "g.json", cases)
    loaded, _ = load_golden(tmp_path / "g.json")
    for before, after in zip(cases, loaded, strict=True):
        props = before["body"]["input"]["schema"]["properties"]
        assert list(after["body"]["input"]["schema"]["properties"]) == list(props)
    orders = [list(c["body"]["input"]["schema"]["properties"]) for c in cases]
    assert any(order != sorted(order) for order in orders)  # the check can fail
