"""Golden sets: fixed job inputs with expected outputs, and the check of a version's results.

A golden set is a JSON file (``GOLDEN_FILE``: the trained demo's, recorded from it) of cases,
each a job body and one or more checks of its result:

- ``tokens``: the generated token ids equal ``expected`` exactly (greedy generation cases);
- ``equals``: the result field (``text``, or ``answers``: the choices in question order) equals
  ``expected``;
- ``contains``: the ``text`` contains ``expected``;
- ``in_choices``: every answer is one of its question's choices (a format check);
- ``schema_valid``: the result's ``data`` is valid against the job's schema (``jsonschema``, an
  implementation independent of the canvas that decoded it);
- ``calls``: the result's tool calls, as ``[name, arguments]`` pairs, equal ``expected`` (a call's
  id names its job, so the calls are compared without it);
- ``calls_valid``: each tool call names one of the job's tools and its arguments are valid
  against that tool's parameters (``jsonschema``).

``golden_inputs`` makes the default inputs from the corpus's evaluation split (greedy decisions
in both modes, greedy generation with thinking off, extractions, tool-call chats); ``record``
turns results into checks; ``differences`` lists how a result breaks its case's checks. Pure
logic: ``cloverq model golden`` runs the jobs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema

from worker.model.demo_trained import TRAINED_CLOVER_DEMO
from worker.training.corpus import decision_cases, extraction_cases, generation_cases, tool_call_cases
from worker.training.tool_calls import TOOL_TOKENS, call_parts

GOLDEN_FILE = TRAINED_CLOVER_DEMO.parent / "clover-golden.json"
GOLDEN_SEED = 7
GOLDEN_TOKENS = 32


def golden_inputs(
    decisions: int = 6, generations: int = 6, extractions: int = 4, tools: int = 4
) -> list[dict[str, Any]]:
    """``{"id", "body"}`` of the default golden cases (greedy: the same version gives the same output)."""
    cases: list[dict[str, Any]] = []
    for i, case in enumerate(decision_cases("eval", GOLDEN_SEED, decisions)):
        for mode in ("joint", "independent"):
            body = {"kind": "decide", "input": case.job_input(mode), "params": {}}
            cases.append({"id": f"decide-{i}-{mode}", "body": body})
    gens = [c for c in generation_cases("eval", GOLDEN_SEED, 4 * generations) if not c.thinking][:generations]
    for i, gen in enumerate(gens):
        body = {"kind": "generate", "input": {"messages": list(gen.messages)},
                "params": {"max_new_tokens": GOLDEN_TOKENS, "thinking": False}}  # fmt: skip
        cases.append({"id": f"generate-{i}", "body": body})
    for i, extraction in enumerate(extraction_cases("eval", GOLDEN_SEED, extractions)):
        body = {"kind": "extract", "input": extraction.job_input(), "params": {}}
        cases.append({"id": f"extract-{i}", "body": body})
    for i, chat in enumerate(tool_call_cases("eval", GOLDEN_SEED, tools)):
        body = {"kind": "generate", "input": chat.job_input(),
                "params": {"max_new_tokens": TOOL_TOKENS, "thinking": False}}  # fmt: skip
        cases.append({"id": f"tools-{i}", "body": body})
    return cases


def _calls(result: Mapping[str, Any]) -> list[list[Any]]:
    """``[name, arguments]`` of each tool call of ``result`` (arguments decoded from JSON text)."""
    return [list(call_parts(call)) for call in result.get("tool_calls") or []]


def _answers(result: Mapping[str, Any]) -> list[str] | None:
    answers = result.get("answers")
    return None if answers is None else [str(a.get("choice")) for a in answers]


def record(case: Mapping[str, Any], result: Mapping[str, Any]) -> dict[str, Any]:
    """The golden case of ``case``'s input with checks that ``result`` (a good version's) passes."""
    if case["body"]["kind"] == "decide":
        checks = [
            {"type": "in_choices"},
            {"type": "equals", "field": "answers", "expected": _answers(result)},
        ]
    elif case["body"]["input"].get("tools"):
        checks = [{"type": "calls_valid"}, {"type": "calls", "expected": _calls(result)},
                  {"type": "tokens", "expected": list(result.get("token_ids") or [])}]  # fmt: skip
    elif case["body"]["kind"] == "extract":
        checks = [{"type": "schema_valid"},
                  {"type": "equals", "field": "data", "expected": result.get("data")}]  # fmt: skip
    else:
        line = str(result.get("text", "")).strip().split("\n")[0][:24]
        checks = [{"type": "tokens", "expected": list(result.get("token_ids") or [])},
                  {"type": "contains", "expected": line}]  # fmt: skip
    return {"id": case["id"], "body": case["body"], "checks": checks}


def differences(case: Mapping[str, Any], result: Mapping[str, Any] | None) -> list[str]:
    """How ``result`` breaks ``case``'s checks (empty: it passes). ``None``: the job failed."""
    if result is None:
        return ["the job did not succeed"]
    problems = []
    for check in case["checks"]:
        kind = check["type"]
        if kind == "tokens":
            got = list(result.get("token_ids") or [])
            if got != check["expected"]:
                pairs = enumerate(zip(got, check["expected"], strict=False))
                first = next((i for i, (a, b) in pairs if a != b), min(len(got), len(check["expected"])))
                problems.append(
                    f"tokens differ from position {first} ({len(got)} vs {len(check['expected'])})"
                )
        elif kind == "equals":
            got_value = _answers(result) if check["field"] == "answers" else result.get(check["field"])
            if got_value != check["expected"]:
                problems.append(f"{check['field']}: {got_value!r} != {check['expected']!r}")
        elif kind == "contains":
            if str(check["expected"]) not in str(result.get("text", "")):
                problems.append("text lacks the expected fragment")
        elif kind == "in_choices":
            questions = case["body"]["input"]["questions"]
            given = _answers(result) or []
            if len(given) != len(questions) or any(
                a not in (q.get("choices") or ["yes", "no"]) for a, q in zip(given, questions, strict=False)
            ):
                problems.append("an answer is not one of its question's choices")
        elif kind == "schema_valid":
            schema = case["body"]["input"]["schema"]
            if not jsonschema.Draft202012Validator(schema).is_valid(result.get("data")):
                problems.append("data is not valid against the schema")
        elif kind == "calls":
            if _calls(result) != check["expected"]:
                problems.append(f"tool calls: {_calls(result)!r} != {check['expected']!r}")
        elif kind == "calls_valid":
            problems.extend(_invalid_calls(case["body"]["input"].get("tools") or [], _calls(result)))
        else:
            problems.append(f"unknown check {kind!r}")
    return problems


def _invalid_calls(tools: list[Mapping[str, Any]], calls: list[list[Any]]) -> list[str]:
    """Calls of a function the job does not offer, or with arguments its parameters refuse."""
    parameters = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    problems = []
    for name, arguments in calls:
        if name not in parameters:
            problems.append(f"a call of {name!r}, which is not one of the job's tools")
        elif not jsonschema.Draft202012Validator(parameters[name]).is_valid(arguments):
            problems.append(f"the arguments of {name!r} are not valid against its parameters")
    return problems


def load_golden(path: Path) -> tuple[list[dict[str, Any]], str]:
    """The cases of a golden file and its sha256 (which file a recorded result checked)."""
    data = path.read_bytes()
    return list(json.loads(data)["cases"]), hashlib.sha256(data).hexdigest()


def write_golden(path: Path, cases: list[dict[str, Any]]) -> None:
    """Keys in their order, not sorted: a schema's ``properties`` order is the order its canvas
    lays the fields out (and the prompt lists them), so a sorted file would ask another job."""
    path.write_text(json.dumps({"cases": cases}, indent=1) + "\n")
