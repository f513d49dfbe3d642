"""Tool-call examples of the demo corpus: the cases, their training rows (the call in the chat
template's own format, read back by the worker's parser), their scoring and the trainer option
(pure logic, the shipped demo's tokenizer)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from scheduler.jobs.tool_spec import parse_tools
from worker.model.demo_trained import TRAINED_CLOVER_DEMO
from worker.model.tokenizer import Tokenizer
from worker.structured.tool_parsers import ParsedCall, call_format, parse_calls
from worker.structured.tool_render import openai_calls
from worker.training.contracts import draw_facts
from worker.training.corpus import in_split, tool_call_case, tool_call_cases
from worker.training.evaluation import ToolCallTally
from worker.training.rows import tool_call_prompt, tool_call_row, tool_call_target
from worker.training.tool_calls import TOOLS, ToolCallCase, calls_seen
from worker.training.trainer import TrainConfig, _batch


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(TRAINED_CLOVER_DEMO)


@pytest.mark.parametrize("split", ["train", "eval", "heldout"])
def test_cases_are_deterministic_and_their_contract_states_the_argument(split: str) -> None:
    cases = tool_call_cases(split, 2, 80)  # type: ignore[arg-type]
    assert cases == tool_call_cases(split, 2, 80)  # type: ignore[arg-type]
    seen = calls_seen(cases)
    assert set(seen) == {"none", "schedule_payment", "send_copy", "file_contract"}
    assert 0.1 < seen["none"] / len(cases) < 0.4  # about NO_CALL_SHARE (0.25)
    for case in cases:
        content = case.messages[0]["content"]
        if case.call is None:
            assert case.answer and content.endswith("Answer in one line.")
            continue
        name, arguments = case.call
        (value,) = arguments.values()
        if name == "schedule_payment":
            assert isinstance(value, int) and f"{value} days" in content
        else:
            assert isinstance(value, str) and value in content


def test_a_case_s_facts_are_its_split_s() -> None:
    assert not {c.messages[0]["content"] for c in tool_call_cases("train", 0, 100)} & {
        c.messages[0]["content"] for c in tool_call_cases("eval", 0, 100)}
    for i in range(30):
        for split in ("train", "eval"):
            rng = random.Random(f"{split}/0/tool/{i}")
            facts = draw_facts(rng)
            while not in_split(facts, split):  # type: ignore[arg-type]
                facts = draw_facts(rng)
            case = tool_call_case(split, 0, i)  # type: ignore[arg-type]
            if case.call is not None and case.call[0] == "file_contract":
                assert case.call[1] == {"law": facts.law}
            if case.call is not None and case.call[0] == "schedule_payment":
                assert case.call[1] == {"days": facts.payment_days}


def test_the_target_is_the_template_s_call_and_the_worker_s_parser_reads_it_back(
    tokenizer: Tokenizer,
) -> None:
    fmt = call_format(tokenizer.chat_template)
    assert fmt == "qwen3_xml"
    spec = parse_tools(list(TOOLS), "auto", max_tools=8)
    for case in tool_call_cases("train", 0, 40):
        target = tool_call_target(case, tokenizer)
        parsed = parse_calls(target, spec, fmt)
        assert parsed.malformed is None
        if case.call is None:
            assert target == case.answer and not parsed.calls
        else:
            assert [(c.name, c.arguments) for c in parsed.calls] == [case.call]
            assert target.startswith("<tool_call>\n<function=") and target.endswith("</tool_call>")


def test_a_row_is_the_served_prompt_with_the_tools_then_the_target_then_eos(tokenizer: Tokenizer) -> None:
    from worker.execution import prompt_ids

    eos = tokenizer.eos_token_ids[0]
    for case in tool_call_cases("train", 1, 12):
        row = tool_call_row(case, tokenizer, block=4)
        prompt = tool_call_prompt(case, tokenizer)
        assert prompt == prompt_ids(case.job_input(), {}, tokenizer)  # what the worker builds for the job
        assert list(row.ids[: len(prompt)]) == prompt and not any(row.predicted[: len(prompt)])
        target = tokenizer.encode(tool_call_target(case, tokenizer))
        assert list(row.ids[len(prompt) : len(prompt) + len(target)]) == target
        assert row.ids[len(prompt) + len(target)] == eos and all(row.predicted[len(prompt):])
        assert len(row.ids) % 4 == 0 and "<tools>" in tokenizer.decode(prompt, skip_special_tokens=True)


def test_a_rows_keys_are_its_first_token_the_functions_name_and_the_arguments_value(
    tokenizer: Tokenizer,
) -> None:
    for case in tool_call_cases("train", 1, 16):
        row = tool_call_row(case, tokenizer, block=4)
        start = len(tool_call_prompt(case, tokenizer))
        assert row.keys[0] == start and all(row.predicted[p] for p in row.keys)
        read = tokenizer.decode([row.ids[p] for p in row.keys[1:]], skip_special_tokens=False)
        if case.call is None:
            assert row.keys == (start,)
        else:  # the keys may reach into the neighbouring markup by a token piece, never miss a character
            name, arguments = case.call
            assert name in read and str(next(iter(arguments.values()))) in read
            assert "parameter" not in read.replace(name, "").replace(str(next(iter(arguments.values()))), "")


def test_the_tally_scores_calls_questions_and_malformed_answers() -> None:
    chat = ({"role": "user", "content": "c"},)
    call = ToolCallCase(messages=chat, call=("send_copy", {"party": "Acme Ltd"}), answer="")
    pay = ToolCallCase(messages=chat, call=("schedule_payment", {"days": 30}), answer="")
    question = ToolCallCase(messages=chat, call=None, answer="The laws of Spain.")

    tally = ToolCallTally()
    tally.add(call, "", openai_calls([ParsedCall("send_copy", {"party": "Acme Ltd"})], "j1"))  # right
    tally.add(pay, "", openai_calls([ParsedCall("schedule_payment", {"days": "30"})], "j2"))  # "30" is not 30
    tally.add(pay, "<tool_call>\n<function=schedule_payment>", None, retries=1)  # malformed after a retry
    tally.add(question, "The laws of Spain.", None)  # right
    tally.add(question, "<tool_call>\n<function=file_contract>", None)  # an unreadable call is a call
    needless = openai_calls([ParsedCall("file_contract", {"law": "Spain"})], "j3")
    tally.add(question, "", needless)  # a call where none was needed
    tally.add(call, None, None)  # failed job
    d = tally.as_dict()
    assert (d["jobs"], d["failed_jobs"], d["call_cases"], d["question_cases"]) == (7, 1, 4, 3)
    assert d["right_function"] == 0.5 and d["right_call"] == 0.25 and d["accuracy"] == round(2 / 7, 4)
    assert d["no_call_when_none_needed"] == round(1 / 3, 4) and d["right_answer"] == round(1 / 3, 4)
    assert d["malformed_calls"] == 2 and d["invalid_output_retries"] == 1
    assert d["right_call_by_function"] == {"schedule_payment": 0.0, "send_copy": 0.5}
    assert json.dumps(d)


def test_tool_share_turns_generation_rows_into_tool_chats(tokenizer: Tokenizer) -> None:
    """Every generation row a tool chat at share 1 (decision rows stay; the unset option draws
    nothing: test_training_demo's hashes of the first recipe's batches)."""
    config = TrainConfig(arch="clover", steps=2, batch=8, decision_share=0.5, tool_share=1.0)
    kinds = {"decision": 0, "tools": 0}
    for step in range(2):
        for row in _batch(step, config, tokenizer, 4):
            text = tokenizer.decode(list(row.ids), skip_special_tokens=True)
            if row.units:
                kinds["decision"] += 1
                assert "<tools>" not in text
            else:
                kinds["tools"] += 1
                assert "<tools>" in text
    assert kinds["decision"] and kinds["tools"]


def test_tool_keys_noise_a_tool_row_at_a_block_of_its_keys_and_weigh_them(
    tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """``tool_keys``: a tool row's pass is at a block holding a deciding token in about half the
    rows (else any block), every one of them in the block a target, weighted ``tool_keys``; a
    decision row keeps ``decision_weight``. It needs the per-target loss (``buckets``)."""
    import torch

    from worker.training.trainer import TrainConfigError, _noisy_batch, target_weights, train_demo

    config = TrainConfig(batch=8, decision_share=0.5, tool_share=1.0, tool_keys=4.0, decision_weight=3.0,
                         served_slots=True, buckets=2)  # fmt: skip
    rows = _batch(0, config, tokenizer, 4) + _batch(1, config, tokenizer, 4)
    assert any(r.keys for r in rows) and any(r.units for r in rows)
    at_keys = 0
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        noisy, _, masked, commit, _ = _noisy_batch(rows, 4, tokenizer.mask_token_id, gen, True, None, True)
        weight = target_weights(rows, config, masked.shape[1])
        for r, row in enumerate(rows):
            start = int(commit[r])
            if row.units:
                assert bool((weight[r] == 3.0).all())
                continue
            here = [p for p in row.keys if start <= p < start + 4]
            at_keys += bool(here)
            assert all(masked[r, p] for p in here)
            assert all(noisy[r, p] == tokenizer.mask_token_id for p in here)
            assert {float(weight[r, p]) for p in row.keys if p < masked.shape[1]} == {4.0}
            assert {float(weight[r, p]) for p in range(start, start + 4) if p not in row.keys} <= {1.0}
    tool_rows = 5 * sum(1 for r in rows if not r.units)
    assert 0.5 * tool_rows < at_keys < tool_rows  # half at a key block, some others by chance
    for wrong in (TrainConfig(tool_share=0.3, tool_keys=3.0), TrainConfig(buckets=2, tool_keys=3.0),
                  TrainConfig(buckets=2, tool_share=0.3, tool_keys=0.0), TrainConfig(joint_share=1.5)):
        with pytest.raises(TrainConfigError, match=r"tool_share and buckets|joint_share is a share"):
            train_demo(tmp_path / "demo", wrong)
    assert not (tmp_path / "demo").exists()  # refused before anything is written


def test_a_golden_tool_case_checks_the_calls_and_their_validity() -> None:
    from worker.training.golden import differences, golden_inputs, record

    (case,) = golden_inputs(decisions=0, generations=0, extractions=0, tools=1)
    assert case["id"] == "tools-0" and case["body"]["input"]["tool_choice"] == "auto"
    good = {"text": "", "token_ids": [1, 2],
            "tool_calls": openai_calls([ParsedCall("file_contract", {"law": "Spain"})], "job-a")}  # fmt: skip
    golden = record(case, good)
    assert [c["type"] for c in golden["checks"]] == ["calls_valid", "calls", "tokens"]
    again = {**good, "tool_calls": openai_calls([ParsedCall("file_contract", {"law": "Spain"})], "job-b")}
    assert differences(golden, again) == []  # another job's call ids: the same calls
    wrong = {**good, "tool_calls": openai_calls([ParsedCall("file_contract", {"law": "Italy"})], "job-c")}
    assert differences(golden, wrong) == ["tool calls: [['file_contract', {'law': 'Italy'}]] != "
                                          "[['file_contract', {'law': 'Spain'}]]"]  # fmt: skip
    invalid = {**good, "tool_calls": openai_calls([ParsedCall("schedule_payment", {"days": "soon"}),
                                                   ParsedCall("delete_all", {})], "job-d")}  # fmt: skip
    problems = differences(golden, invalid)
    assert "the arguments of 'schedule_payment' are not valid against its parameters" in problems
    assert "a call of 'delete_all', which is not one of the job's tools" in problems


def test_a_tokenizer_that_learned_the_tool_chats_has_one_id_per_call_tag() -> None:
    from worker.training.tokenizer import TOOL_TAGS, train_tokenizer, wrap

    plain = wrap(train_tokenizer(0, total_vocab=2048, cases=40))
    tools = wrap(train_tokenizer(0, total_vocab=2048, cases=40, tools=True))
    assert all(len(tools.encode(tag)) == 1 for tag in TOOL_TAGS)
    assert all(len(plain.encode(tag)) > 1 for tag in TOOL_TAGS)  # without the option: pieces
    case = next(c for c in tool_call_cases("train", 0, 20) if c.call is not None)
    target = tool_call_target(case, tools)
    ids = tools.encode(target)
    assert tools.decode(ids, skip_special_tokens=True) == target  # decoded as text: the parser reads it
    assert len(ids) < len(plain.encode(target))
    special = [tools.mask_token_id, *tools.eos_token_ids]
    assert min(special) > max(tools.encode("".join(TOOL_TAGS)))  # the special tokens stay last


def test_train_demo_says_which_options_cannot_go_together_as_a_usage_error(tmp_path: Path) -> None:
    """A user's mistake on the command line is a one-line usage error (exit 2), no traceback, and
    nothing is written: options that cannot go together, and a shape option on a further stage
    (the trainer's own check, which the command no longer repeats)."""
    from click.testing import CliRunner

    from cli.main import cli
    from worker.model.demo_trained import TRAINED_CLOVER_DEMO

    result = CliRunner().invoke(cli, ["model", "train-demo", str(tmp_path / "demo"), "--steps", "1",
                                      "--tool-keys", "3"])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "needs tool_share and buckets" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "demo").exists()
    further = ["--init-from", str(TRAINED_CLOVER_DEMO), "--vocab", "2048"]  # a shape option: refused
    result = CliRunner().invoke(cli, ["model", "train-demo", str(tmp_path / "demo"), "--steps", "1",
                                      *further])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "drop vocab" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "demo").exists()
