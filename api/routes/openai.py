"""OpenAI-compatible routes over the job system: chat completions, completions, models.

Mounted twice: under ``/v1`` (``base_url="http://HOST/v1"``, as vLLM and SGLang) and under
``/openai/v1`` (the base URL that also carries the OpenAI Batch API, ``api/routes/openai_batches.py``,
which cannot live under ``/v1/batches``: that is cloverq's own batch API).

Every request is a real job: the body is translated (``api/openai_compat.py``) into a
``POST /v1/jobs`` generate body and submitted through the same function (``_submit_blocking``:
the ``submit`` scope, deployment limits, prompt token count, admission with its 429s, routing to a
queue and class, the committed row, the published message; ``Idempotency-Key`` is honoured). The
answer waits on the job (``api/job_follow.py``): the blocking form until it is final, ``stream:
true`` as Server-Sent Events with one chunk per committed block, then ``data: [DONE]``. A client
that disconnects before the end cancels its job. Errors take OpenAI's shape (``api/errors.py``).

These routes are not in cloverq's OpenAPI document (their contract is OpenAI's API; they are
tested with the official ``openai`` package).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import suppress
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api import openai_compat as oa
from api.auth import Caller
from api.deps import (
    AdmittedSubmitCaller,
    JobReaderDep,
    ReadCaller,
    SettingsDep,
    TokenCounterDep,
    visible_tenant,
)
from api.errors import ApiError, openai_error_body
from api.job_follow import Followed, JobReader, follow_job
from api.json_input import LimitedJsonRoute
from api.prompt_tokens import PromptTokenCounter
from api.routes.jobs import MAX_IDEMPOTENCY_KEY_LENGTH
from api.routes.jobs import _submit_blocking as submit_blocking  # THE submit path of POST /v1/jobs
from api.schemas.jobs import GenerateJobCreate, JobOut
from api.sse import SSE_HEADERS, EventStreamResponse, sse_comment, sse_event
from scheduler.infra.settings import Settings
from scheduler.jobs.models import JobStatus

DONE = "data: [DONE]\n\n"

IdempotencyKey = Annotated[
    str | None, Header(alias="Idempotency-Key", min_length=1, max_length=MAX_IDEMPOTENCY_KEY_LENGTH)
]


def _data(payload: Any) -> str:
    return sse_event(None, payload)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body was read already: the next ASGI message
    is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _submit(request: Request, caller: Caller, settings: Settings, counter: PromptTokenCounter,
                  idempotency_key: str | None, translate: Callable[[Any], tuple[Any, GenerateJobCreate]],
                  max_tokens_name: Callable[[Any], str]) -> tuple[Any, JobOut]:
    """Parse and translate the OpenAI body, then submit the job exactly as ``POST /v1/jobs`` does.

    A refusal spends the caller's rate-limit token too (``AdmittedSubmitCaller`` takes it when
    the admission did not run, and its 401 / 429 wins)."""
    try:
        raw = await request.json()
        req, body = translate(raw)
    except json.JSONDecodeError as exc:
        raise ApiError(400, "invalid_request", f"The body is not valid JSON: {exc.msg}",
                       [{"loc": ["body"], "message": exc.msg}]) from None
    try:
        job, _created = await run_in_threadpool(submit_blocking, body, request, caller, settings, counter,
                                                idempotency_key)
    except ApiError as exc:
        raise oa.openai_param(exc, max_tokens_name=max_tokens_name(req)) from None
    return req, job


async def _answer(request: Request, reader: JobReader, caller: Caller, job: JobOut,
                  build: Callable[[JobOut], dict[str, Any]]) -> Response:
    """Wait for the job (cancelling it if the client leaves first), then answer."""
    tenant = visible_tenant(caller)
    waiting = asyncio.ensure_future(reader.wait(job.id, tenant))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        done, _ = await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
        if waiting not in done:  # the client left: nobody wants the answer any more
            waiting.cancel()
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(reader.cancel, job.id, tenant)
            return Response(status_code=499)
        final = waiting.result()
    finally:
        for task in (waiting, gone):
            if not task.done():
                task.cancel()
                with suppress(asyncio.CancelledError, Exception):
                    await task
    if final is None:
        raise ApiError(404, "job_not_found", f"Job {job.id} is gone.", {"job_id": job.id})
    if final.status != JobStatus.SUCCEEDED:
        raise oa.job_failure(final)
    return JSONResponse(build(final), headers=_job_headers(final))


def _job_headers(job: JobOut) -> dict[str, str]:
    return {"X-Cloverq-Job-Id": job.id, "Location": f"/v1/jobs/{job.id}"}


def _error_chunk(exc: ApiError) -> str:
    return _data(openai_error_body(exc.status_code, exc.code, exc.message, exc.param))


class _Text:
    """One channel (answer or reasoning) of a streamed job: the worker's text rebuilt from block
    deltas, and how much of it the client was sent."""

    def __init__(self, stops: list[str] | None = None) -> None:
        self.text = ""
        self.sent = 0
        self.scanner = oa.StopScanner(stops or [])

    def apply(self, offset: Any, delta: Any) -> None:
        if isinstance(offset, int) and isinstance(delta, str):
            self.text = self.text[: max(0, offset)] + delta

    def take(self) -> str:
        """The text not sent yet (through the stop sequences)."""
        new = self.text[self.sent:] if len(self.text) > self.sent else ""
        self.sent = max(self.sent, len(self.text))
        return self.scanner.feed(new)

    def finish(self, final: str) -> str:
        """The rest, from the final text (SQL's), and whatever the stop scanner held back."""
        rest = final[self.sent:] if len(final) > self.sent else ""
        self.sent = max(self.sent, len(final))
        return self.scanner.feed(rest) + self.scanner.flush()


async def _stream(reader: JobReader, caller: Caller, job: JobOut, *, chat: bool, model: str,
                  stops: list[str], with_usage: bool, echo: str | None,
                  structured: bool = False, tools: bool = False) -> AsyncIterator[str]:
    """The SSE body of ``stream: true``: one chunk per committed block, the finish, ``[DONE]``.
    Cancels the job if the client leaves before the end (or a stop sequence ends it early).

    ``structured`` (a ``response_format`` schema): the blocks hold the raw canvas (pads, closed
    gates), not a prefix of the JSON read back from it, so the content is held and sent whole
    with the finish: the deltas add up to the final JSON.

    ``tools`` (tools that may be called): the content goes through ``oa.ToolCallHold`` (sent up
    to the first ``<tool_call>``, the rest with the final status) and the calls the worker read
    are sent as one ``delta.tool_calls`` chunk before the finish: the simple, always-correct
    shape (a call is never sent half-parsed)."""
    tenant = visible_tenant(caller)
    answer = _Text(stops)
    reasoning = _Text()
    hold = oa.ToolCallHold(stops) if tools else None
    thinking = bool((job.params or {}).get("thinking"))
    completed = False
    followed: AsyncGenerator[Followed, None] | None = None

    def chunk(content: str | None, reasoning_text: str | None = None, *, finish: str | None = None,
              usage_doc: dict[str, Any] | None = None, empty: bool = False) -> str:
        if chat:
            delta: dict[str, Any] | None = None
            if not empty:
                delta = {}
                if content is not None:
                    delta["content"] = content
                if reasoning_text:
                    delta["reasoning_content"] = reasoning_text
            return _data(oa.chat_chunk(job, model=model, delta=delta, finish=finish, usage_doc=usage_doc))
        return _data(oa.completion_chunk(job, model=model, text=None if empty else (content or ""),
                                         finish=finish, usage_doc=usage_doc))

    def finish_chunks(reason: str, usage_doc: dict[str, Any]) -> str:
        text = chunk(None if chat else "", finish=reason)
        if with_usage:  # OpenAI's last chunk: no choices, the usage
            text += chunk(None, usage_doc=usage_doc, empty=True)
        return text + DONE

    try:
        if chat:
            yield _data(oa.chat_chunk(job, model=model, delta={"role": "assistant", "content": ""}))
        elif echo:
            yield chunk(echo)
        stopped = False  # a stop sequence ended the answer; the job was cancelled
        followed = follow_job(reader, job.id, tenant, first=job)
        async for item in followed:
            if item.kind == "keepalive":
                yield sse_comment("keep-alive")
            elif item.kind == "block" and structured:
                yield sse_comment("keep-alive")  # content is sent whole at the end (docstring)
            elif item.kind == "block" and item.event is not None and hold is not None:
                event = item.event
                answer.apply(event.get("offset"), event.get("delta"))
                reasoning.apply(event.get("reasoning_offset"), event.get("reasoning_delta"))
                content, more = hold.feed(answer.text), reasoning.take() if thinking else None
                yield chunk(content, more) if content or more else sse_comment("keep-alive")
            elif item.kind == "block" and item.event is not None and not stopped:
                event = item.event
                answer.apply(event.get("offset"), event.get("delta"))
                reasoning.apply(event.get("reasoning_offset"), event.get("reasoning_delta"))
                yield chunk(answer.take(), reasoning.take() if thinking else None)
                if answer.scanner.hit:  # the answer is complete: the rest of the job is not needed
                    stopped = True
                    with anyio.CancelScope(shield=True):
                        await run_in_threadpool(reader.cancel, job.id, tenant)
            elif item.kind == "final" and item.job is not None:
                final = item.job
                completed = True
                if stopped:  # cancelled on our behalf: its usage counts what it committed meanwhile
                    yield finish_chunks("stop", oa.usage(final))
                    return
                if final.status != JobStatus.SUCCEEDED:
                    yield _error_chunk(oa.job_failure(final))
                    yield DONE
                    return
                result = final.result
                if hold is not None:
                    rest = hold.finish((result.text or "") if result else "")
                    more_reasoning = reasoning.finish((result.reasoning or "") if result and thinking else "")
                    if rest or more_reasoning:
                        yield chunk(rest, more_reasoning or None)
                    calls = oa.tool_calls_of(final)
                    if calls:
                        yield _data(oa.chat_chunk(final, model=model,
                                                  delta={"tool_calls": oa.tool_call_deltas(calls)}))
                    yield finish_chunks(oa.chat_finish_reason(final, hold.hit), oa.usage(final))
                    return
                rest = answer.finish((result.text or "") if result else "")
                more_reasoning = reasoning.finish((result.reasoning or "") if result and thinking else "")
                if rest or more_reasoning:
                    yield chunk(rest, more_reasoning or None)
                yield finish_chunks(oa.finish_reason(final, answer.scanner.hit), oa.usage(final))
                return
        completed = True  # the job disappeared (expired and deleted): end the stream cleanly
        yield DONE
    finally:
        with anyio.CancelScope(shield=True):
            if followed is not None:
                with suppress(RuntimeError):  # already closed by the error that ends us
                    await followed.aclose()  # unregisters from the job waiter now, not at GC
            if not completed:  # the client went away (or the server stops): cancel the job
                await run_in_threadpool(reader.cancel, job.id, tenant)


def _streaming_response(reader: JobReader, caller: Caller, job: JobOut, **kwargs: Any) -> Response:
    return EventStreamResponse(_stream(reader, caller, job, **kwargs), headers={**SSE_HEADERS,
                                                                              **_job_headers(job)})


def _translate_chat(raw: Any) -> tuple[oa.ChatCompletionRequest, GenerateJobCreate]:
    req = oa.parse_request(oa.ChatCompletionRequest, raw)
    return req, oa.chat_job(req)


def _translate_completion(raw: Any) -> tuple[oa.CompletionRequest, GenerateJobCreate]:
    req = oa.parse_request(oa.CompletionRequest, raw)
    return req, oa.completion_job(req)


async def chat_completions(request: Request, caller: AdmittedSubmitCaller, settings: SettingsDep,
                           counter: TokenCounterDep, reader: JobReaderDep,
                           idempotency_key: IdempotencyKey = None) -> Response:
    """OpenAI ``POST /chat/completions`` as a cloverq generate job (``messages`` input)."""

    def translate(raw: Any) -> tuple[oa.ChatCompletionRequest, GenerateJobCreate]:
        req, body = _translate_chat(raw)
        oa.check_model(req.model, settings)
        return req, body

    req, job = await _submit(request, caller, settings, counter, idempotency_key, translate,
                             lambda r: "max_completion_tokens" if r.max_completion_tokens is not None
                             else "max_tokens")
    model = oa.served_model_id(settings)
    stops = oa.stop_sequences(req.stop)
    if req.stream:
        return _streaming_response(reader, caller, job, chat=True, model=model, stops=stops,
                                   with_usage=oa.include_usage(req), echo=None,
                                   structured=oa.response_schema(req.response_format) is not None,
                                   tools=bool(req.tools) and req.tool_choice != "none")
    return await _answer(request, reader, caller, job,
                         lambda final: oa.chat_response(final, model=model, stops=stops))


async def completions(request: Request, caller: AdmittedSubmitCaller, settings: SettingsDep,
                      counter: TokenCounterDep, reader: JobReaderDep,
                      idempotency_key: IdempotencyKey = None) -> Response:
    """OpenAI ``POST /completions`` (legacy) as a cloverq generate job (``prompt`` input)."""

    def translate(raw: Any) -> tuple[oa.CompletionRequest, GenerateJobCreate]:
        req, body = _translate_completion(raw)
        oa.check_model(req.model, settings)
        return req, body

    req, job = await _submit(request, caller, settings, counter, idempotency_key, translate,
                             lambda _r: "max_tokens")
    model = oa.served_model_id(settings)
    stops = oa.stop_sequences(req.stop)
    echo = oa.completion_prompt(req) if req.echo else None
    if req.stream:
        return _streaming_response(reader, caller, job, chat=False, model=model, stops=stops,
                                   with_usage=oa.include_usage(req), echo=echo)
    return await _answer(request, reader, caller, job,
                         lambda final: oa.completion_response(final, model=model, stops=stops, echo=echo))


async def list_models(caller: ReadCaller, settings: SettingsDep) -> dict[str, Any]:
    """OpenAI ``GET /models``: the model this deployment serves."""
    return {"object": "list", "data": [oa.model_card(settings)]}


async def get_model(model_id: str, caller: ReadCaller, settings: SettingsDep) -> dict[str, Any]:
    """OpenAI ``GET /models/{model}``."""
    oa.check_model(model_id, settings)
    return oa.model_card(settings)


def _router(prefix: str) -> APIRouter:
    router = APIRouter(prefix=prefix, tags=["openai"], route_class=LimitedJsonRoute, include_in_schema=False)
    router.add_api_route("/chat/completions", chat_completions, methods=["POST"])
    router.add_api_route("/completions", completions, methods=["POST"])
    router.add_api_route("/models", list_models, methods=["GET"])
    router.add_api_route("/models/{model_id:path}", get_model, methods=["GET"])
    return router


router = _router("/v1")
openai_router = _router("/openai/v1")

