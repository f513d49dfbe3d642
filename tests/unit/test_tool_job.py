"""The worker's tool job on a scripted engine: an ``auto`` answer's calls are read, a malformed call
is retried once (new seed, the retry temperature, the metric) and then returned as text, and a
named call's canvas is the prompt's continuation."""

from __future__ import annotations

import json
from concurrent.futures import Future
from typing import Any

import pytest

from scheduler.infra.settings import Settings
from scheduler.jobs.models import JobStatus
from worker import tool_job
from worker.engine.types import FinishReason, GenerationRequest, GenerationResult, SlotChoice
from worker.execution import run_generate
from worker.job_handler import EngineContext, JobSpec
from worker.model.demo_tokenizer import CHAT_TEMPLATE, build_demo_tokenizer
from worker.model.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
GOOD = ("Sure.\n\n<tool_call>\n<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n"
        "</tool_call>")
BAD = "<tool_call>\n<function=get_time>\n<parameter=zone>\nPST\n</parameter>\n</function>\n</tool_call>"


def _tokenizer() -> Tokenizer:
    backend = build_demo_tokenizer(512)
    return Tokenizer(backend, chat_template=CHAT_TEMPLATE, mask_token_id=backend.token_to_id("<|mask|>"),
                     eos_token_ids=(backend.token_to_id("<|im_end|>"),),
                     pad_token_id=backend.token_to_id("<|pad|>"))


class Engine:
    """Answers each request with the next scripted text (or the template's own tokens)."""

    def __init__(self, tok: Tokenizer, answers: list[str]) -> None:
        self.tok = tok
        self.answers = answers
        self.requests: list[GenerationRequest] = []

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        self.requests.append(request)
        if request.template is not None:  # a canvas: every slot takes its first choice
            ids = list(request.template.token_ids)
            choices = [SlotChoice(index=0, confidence=1.0,
                                  token_ids=list(s.allowed_sequences[0]) if s.allowed_sequences else [])
                       for s in request.template.slots]
        else:
            ids, choices = self.tok.encode(self.answers.pop(0)), []
        future: Future[GenerationResult] = Future()
        future.set_result(GenerationResult(request_id=request.request_id, token_ids=ids,
                                           finish_reason=FinishReason.EOS, steps_used=3, blocks=1,
                                           tokens=len(ids), prompt_tokens=len(request.prompt_ids),
                                           slot_choices=choices))
        return future


def _run(answers: list[str], tool_choice: Any = "auto") -> tuple[Any, Engine]:
    tok = _tokenizer()
    engine = Engine(tok, answers)
    ctx = EngineContext(submit=engine.submit, tokenizer=tok, settings=Settings(), deadline=None,
                        cancel_event=None, on_progress=lambda _p: None)
    job = JobSpec(job_id="j1", kind="generate", queue="interactive", attempt=1, params={"seed": 5},
                  input={"messages": [{"role": "user", "content": "Time?"}], "tools": TOOLS,
                         "tool_choice": tool_choice})
    return run_generate(job, ctx), engine


@pytest.fixture(autouse=True)
def _no_redis(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    counted: list[int] = []
    monkeypatch.setattr(tool_job, "_count_retry", lambda _ctx: counted.append(1))
    return counted


def test_auto_reads_the_calls_and_the_prompt_holds_the_tools() -> None:
    outcome, engine = _run([GOOD])
    assert outcome.status is JobStatus.SUCCEEDED
    assert outcome.result["text"] == "Sure." and outcome.result["usage"]["attempts"] == 1
    (call,) = outcome.result["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": json.dumps({"zone": "CET"})}
    prompt = engine.tok.decode(engine.requests[0].prompt_ids, skip_special_tokens=False)
    assert "# Tools" in prompt and '"name": "get_time"' in prompt


def test_a_malformed_auto_call_is_retried_once_then_returned_as_text(_no_redis: list[int]) -> None:
    outcome, engine = _run([BAD, GOOD])
    assert len(engine.requests) == 2 and _no_redis == [1]
    retry = engine.requests[1].params
    assert retry.seed != 5 and retry.temperature == Settings().decisions.retry_temperature
    assert outcome.result["tool_calls"][0]["function"]["name"] == "get_time"
    assert outcome.steps_used == 6 and outcome.result["usage"]["attempts"] == 2  # both decodes counted

    outcome, engine = _run([BAD, BAD])
    assert len(engine.requests) == 2
    assert outcome.result["text"] == BAD and "tool_calls" not in outcome.result


def test_a_named_call_is_the_canvas_after_the_prompt() -> None:
    outcome, engine = _run([], tool_choice={"type": "function", "function": {"name": "get_time"}})
    (request,) = engine.requests
    assert request.template is not None
    canvas_text = engine.tok.decode(list(request.template.token_ids))
    assert canvas_text.startswith("<tool_call>\n<function=get_time>\n<parameter=zone>\n")
    assert outcome.result["text"] == "" and outcome.result["data"] == {"zone": "UTC"}
    assert json.loads(outcome.result["tool_calls"][0]["function"]["arguments"]) == {"zone": "UTC"}
