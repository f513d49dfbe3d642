"""OpenAI's request and response shapes, translated to and from cloverq jobs (pure; no I/O).

A chat or completion request becomes exactly the body of a ``POST /v1/jobs`` generate job
(:func:`chat_job` / :func:`completion_job`), which then takes the one submit path of the job
API (keys, tenancy, limits, admission, routing). The finished job becomes OpenAI's answer
(:func:`chat_response` / :func:`completion_response`, and the ``*_chunk`` builders for
``stream: true``).

Mapping (what is not listed is refused with a 400 naming the parameter, as OpenAI refuses
parameters it does not know):

- ``messages`` (text content, or text parts) -> ``input.messages`` (``developer`` is ``system``);
  ``prompt`` (one string) -> ``input.prompt``;
- ``max_completion_tokens`` / ``max_tokens`` -> ``params.max_new_tokens``; ``temperature``,
  ``top_p``, ``seed`` as they are (left out: cloverq's defaults, greedy included);
- ``stop`` (up to 16 strings): applied to the text (the job still decodes to EOS or its length;
  a stream that meets one ends and cancels its job); ``n``: 1 only; ``metadata`` -> job metadata;
- thinking: ``thinking``, ``chat_template_kwargs.enable_thinking`` or ``reasoning_effort``
  (``"none"`` off, else on); the reasoning is answered as ``reasoning_content``;
- cloverq's own knobs as extra body fields: ``steps_per_block``, ``step_budget``,
  ``block_size``, ``strategy``, ``threshold``, ``top_k``, ``priority``;
- ``response_format``: ``json_schema`` -> ``input.response_schema`` (its ``schema``; ``strict``
  either way: valid by construction), ``json_object`` -> ``{"type": "object"}``; the content is
  the JSON text (docs/structured.md); a schema outside the subset is a 400 with its code;
- ``tools``, ``tool_choice``, ``parallel_tool_calls`` -> ``input.tools`` / ``tool_choice`` /
  ``parallel_tool_calls`` as they are (checked at submit, ``scheduler/jobs/tool_spec.py``);
  assistant ``tool_calls`` and ``tool`` messages -> the same fields of ``input.messages``; the
  worker renders them through the chat template and returns the calls it read
  (``result.tool_calls``), answered as ``message.tool_calls`` with ``finish_reason:
  "tool_calls"`` (docs/structured.md#tools);
- accepted and ignored: ``user``, ``service_tier``, ``store``, and the no-op values of
  ``logprobs`` (false), penalties (0), ``response_format`` (text), ``best_of`` (1), ``echo``
  (completions: supported);
- refused: the legacy ``functions`` / ``function_call``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.errors import ApiError
from api.schemas.jobs import GenerateJobCreate, JobOut
from scheduler.infra.settings import Settings
from scheduler.jobs.models import ErrorCode, JobStatus

MAX_STOP_SEQUENCES = 16
_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_STOP_CHARS = 1024
FINISH_REASONS = {"eos": "stop", "length": "length", "budget": "length"}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool | None = None
    # cloverq's knobs (extra body fields of OpenAI clients: ``extra_body={...}``)
    steps_per_block: int | None = None
    step_budget: int | None = None
    block_size: int | None = None
    strategy: Literal["static", "dynamic"] | None = None
    threshold: float | None = None
    top_k: int | None = None
    thinking: bool | None = None
    priority: str | None = None
    retention_seconds: int | None = None  # data retention (docs/security.md#retention)


class ChatCompletionRequest(_Request):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    modalities: list[str] | None = None


class CompletionRequest(_Request):
    """``POST /v1/completions``."""

    prompt: str | list[Any]
    echo: bool | None = None
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None


def _bad(message: str, param: str | None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, code, message, [{"loc": ["body", *(param.split(".") if param else [])],
                                          "message": message}], param=param)


def _unsupported(param: str, why: str = "is not supported by this server") -> ApiError:
    return _bad(f"'{param}' {why}.", param, code="unsupported_parameter")


def _field_name(loc: Sequence[Any]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def parse_request(model: type[_Request], body: Any) -> Any:
    """The OpenAI request in ``body`` (400 naming the first bad or unknown parameter)."""
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.", None)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = _field_name(first.get("loc", ()))
        if first.get("type") == "extra_forbidden":
            raise _bad(f"Unrecognized request argument supplied: {param}", param,
                       code="unrecognized_argument") from None
        raise _bad(f"Invalid value for '{param}': {first.get('msg')}", param) from None


def _check_common(req: _Request) -> None:
    if req.n not in (None, 1):
        raise _unsupported("n", "must be 1 (one choice per request)")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise _unsupported(name)
    if req.logit_bias:
        raise _unsupported("logit_bias")
    if req.stream_options is not None and not req.stream:
        raise _bad("'stream_options' is only allowed with 'stream': true.", "stream_options")


def stop_sequences(stop: str | list[str] | None) -> list[str]:
    """``stop`` as a list of non-empty strings (400 when there are too many or too long)."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise _bad(f"'stop' holds at most {MAX_STOP_SEQUENCES} sequences.", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad(f"A stop sequence has at most {MAX_STOP_CHARS} characters.", "stop")
    return [s for s in stops if s]


def include_usage(req: _Request) -> bool:
    return bool((req.stream_options or {}).get("include_usage"))


def _params(req: _Request, max_new_tokens: int | None, thinking: bool | None) -> dict[str, Any]:
    values = {
        "max_new_tokens": max_new_tokens, "temperature": req.temperature, "top_p": req.top_p,
        "seed": req.seed, "steps_per_block": req.steps_per_block, "step_budget": req.step_budget,
        "block_size": req.block_size, "strategy": req.strategy, "threshold": req.threshold,
        "top_k": req.top_k, "thinking": thinking,
    }
    return {name: value for name, value in values.items() if value is not None}


# cloverq's field (where the job model found a problem) -> the OpenAI parameter to name
_JOB_FIELDS = {("params", "max_new_tokens"): "max_tokens", ("input", "prompt"): "prompt",
               ("input", "messages"): "messages",
               ("input", "response_schema"): "response_format.json_schema.schema",
               ("input", "tools"): "tools", ("input", "tool_choice"): "tool_choice",
               ("input", "parallel_tool_calls"): "parallel_tool_calls"}


def _job_param(loc: Sequence[Any], *, max_tokens_name: str) -> str:
    parts = [p for p in loc if p != "body"]
    for (first, second), name in _JOB_FIELDS.items():
        if tuple(parts[:2]) == (first, second):
            rest = parts[2:]
            if name == "max_tokens":
                name = max_tokens_name
            return name + (_field_name(["x", *rest])[1:] if rest else "")
    if parts and parts[0] == "params":
        parts = parts[1:]
    return _field_name(parts) or "body"


def openai_param(exc: ApiError, *, max_tokens_name: str = "max_tokens") -> ApiError:
    """``exc`` (from the job API's validation or limits) naming the OpenAI parameter."""
    details = exc.details
    entries = details if isinstance(details, list) else [details]
    for entry in entries:
        loc = entry.get("loc") if isinstance(entry, Mapping) else None
        if isinstance(loc, list | tuple):
            exc.param = _job_param(loc, max_tokens_name=max_tokens_name)
            break
    return exc


def _job(body: dict[str, Any], *, max_tokens_name: str) -> GenerateJobCreate:
    try:
        return GenerateJobCreate.model_validate(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        param = _job_param(first.get("loc", ()), max_tokens_name=max_tokens_name)
        raise _bad(f"Invalid value for '{param}': {first.get('msg')}", param) from None


def _metadata(req: _Request) -> dict[str, Any] | None:
    return dict(req.metadata) if req.metadata else None


def _content(message: Mapping[str, Any], index: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            text = part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else None
            if not isinstance(text, str):
                raise _unsupported(f"messages[{index}].content", "may only hold text parts")
            texts.append(text)
        return "\n".join(texts)
    raise _bad("Message content must be a string or a list of text parts.", f"messages[{index}].content")


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_MESSAGE_KEYS = {"role", "content", "name", "refusal"}
_ROLE_KEYS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}


def _tool_calls(calls: Any, index: int) -> list[dict[str, Any]]:
    """An assistant turn's ``tool_calls`` as the job carries them (OpenAI's shape; the job model
    checks that each ``arguments`` is a JSON object as text)."""
    param = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise _bad(f"'{param}' must be a list of tool calls.", param)
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or call.get("type", "function") != "function":
            raise _bad(f"'{param}[{k}]' must be {{\"id\", \"type\": \"function\", \"function\": "
                       "{\"name\", \"arguments\"}}.", f"{param}[{k}]")
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function.get("name"), "arguments": function.get("arguments")}})
    return out


def _messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for index, message in enumerate(messages):
        role = _ROLES.get(str(message.get("role")))
        if role is None:
            raise _unsupported(f"messages[{index}].role", f"'{message.get('role')}' is not supported "
                               "(system, developer, user, assistant, tool)")
        unknown = sorted(set(message) - _MESSAGE_KEYS - _ROLE_KEYS.get(role, set()))
        if unknown and not (unknown == ["tool_calls"] and not message.get("tool_calls")):
            raise _unsupported(f"messages[{index}].{unknown[0]}")
        turn: dict[str, Any] = {"role": role, "content": _content(message, index)}
        if role == "assistant" and message.get("tool_calls"):
            turn["tool_calls"] = _tool_calls(message["tool_calls"], index)
        if role == "tool":
            turn["tool_call_id"] = message.get("tool_call_id")
        out.append(turn)
    return out


def _thinking(req: ChatCompletionRequest) -> bool | None:
    thinking = req.thinking
    kwargs = req.chat_template_kwargs or {}
    if set(kwargs) - {"enable_thinking"}:
        raise _unsupported("chat_template_kwargs", "may only hold 'enable_thinking'")
    if "enable_thinking" in kwargs:
        thinking = bool(kwargs["enable_thinking"])
    if req.reasoning_effort is not None and thinking is None:
        thinking = req.reasoning_effort != "none"
    return thinking


def chat_job(req: ChatCompletionRequest) -> GenerateJobCreate:
    """The generate job of a chat completion request (400 for what cloverq cannot do)."""
    _check_common(req)
    if req.logprobs or req.top_logprobs:
        raise _unsupported("logprobs")
    if req.functions or req.function_call not in (None, "none"):
        raise _unsupported("functions", "(the legacy function calling) is not supported; use 'tools'")
    if req.modalities not in (None, ["text"]):
        raise _unsupported("modalities")
    stop_sequences(req.stop)
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    job_input: dict[str, Any] = {"messages": _messages(req.messages)}
    schema = response_schema(req.response_format)
    if schema is not None:
        job_input["response_schema"] = schema
    for field in ("tools", "tool_choice", "parallel_tool_calls"):
        if getattr(req, field) is not None:
            job_input[field] = getattr(req, field)
    body = {
        "kind": "generate",
        "input": job_input,
        "params": _params(req, req.max_completion_tokens if req.max_completion_tokens is not None
                          else req.max_tokens, _thinking(req)),
        "priority": req.priority,
        "retention_seconds": req.retention_seconds,
        "metadata": _metadata(req),
    }
    return _job({k: v for k, v in body.items() if v is not None}, max_tokens_name=name)


_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def response_schema(response_format: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The job's ``input.response_schema`` for OpenAI's ``response_format``: ``text`` (or none)
    -> none; ``json_object`` -> ``{"type": "object"}`` (free string key/value pairs);
    ``json_schema`` -> its ``schema``. ``strict`` true or false makes no difference: the value is
    valid by construction either way. The subset check itself runs at submit (``api.limits``)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind not in _FORMAT_KEYS:
        raise _bad("'response_format.type' must be 'text', 'json_object' or 'json_schema'.",
                   "response_format.type")
    unknown = sorted(set(response_format) - _FORMAT_KEYS[kind])
    if unknown:
        raise _bad(f"Unrecognized request argument supplied: response_format.{unknown[0]}",
                   f"response_format.{unknown[0]}", code="unrecognized_argument")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping):
        raise _bad("'response_format.json_schema' must be an object with 'name' and 'schema'.",
                   "response_format.json_schema")
    unknown = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise _bad(f"Unrecognized request argument supplied: response_format.json_schema.{unknown[0]}",
                   f"response_format.json_schema.{unknown[0]}", code="unrecognized_argument")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise _bad("'response_format.json_schema.name' must match ^[a-zA-Z0-9_-]{1,64}$.",
                   "response_format.json_schema.name")
    if not isinstance(spec.get("strict", False), bool | None):
        raise _bad("'response_format.json_schema.strict' must be a boolean.",
                   "response_format.json_schema.strict")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: omitted means any JSON object
    if not isinstance(schema, dict):
        raise _bad("'response_format.json_schema.schema' must be a JSON Schema object.",
                   "response_format.json_schema.schema", code="invalid_schema")
    return schema


def completion_prompt(req: CompletionRequest) -> str:
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise _unsupported("prompt", "must be one string (no token ids, one prompt per request)")
        prompt = prompt[0]
    return prompt


def completion_job(req: CompletionRequest) -> GenerateJobCreate:
    """The generate job of a (legacy) completion request."""
    _check_common(req)
    if req.logprobs:
        raise _unsupported("logprobs")
    if req.suffix:
        raise _unsupported("suffix")
    if req.best_of not in (None, 1):
        raise _unsupported("best_of", "must be 1")
    stop_sequences(req.stop)
    body = {
        "kind": "generate",
        "input": {"prompt": completion_prompt(req)},
        "params": _params(req, req.max_tokens, req.thinking),
        "priority": req.priority,
        "retention_seconds": req.retention_seconds,
        "metadata": _metadata(req),
    }
    return _job({k: v for k, v in body.items() if v is not None}, max_tokens_name="max_tokens")


# --- models -----------------------------------------------------------------------------------


def served_model_id(settings: Settings) -> str:
    """The model name clients pass as ``model``: the served store model, else the checkpoint
    folder's name (the deployment serves one model)."""
    return settings.model.served or settings.resolved_model_dir.name


def model_card(settings: Settings) -> dict[str, Any]:
    config = settings.resolved_model_dir / "config.json"
    try:
        created = int(config.stat().st_mtime)
    except OSError:
        created = 0
    return {"id": served_model_id(settings), "object": "model", "created": created, "owned_by": "cloverq"}


def check_model(model: str, settings: Settings) -> str:
    served = served_model_id(settings)
    if model != served:
        raise ApiError(404, "model_not_found", f"The model '{model}' does not exist; this server serves "
                       f"'{served}' (GET /v1/models).", {"model": model}, param="model")
    return served


# --- responses --------------------------------------------------------------------------------


def apply_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` cut before the first stop sequence, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


class StopScanner:
    """Streams text through the stop sequences: holds back what may be the start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.pending = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """What may be sent now; after a stop sequence is found (``hit``), nothing more."""
        if self.hit:
            return ""
        buffer = self.pending + text
        if not self.stops:
            self.pending = ""
            return buffer
        cut, found = apply_stop(buffer, self.stops)
        if found:
            self.hit, self.pending = True, ""
            return cut
        hold = max((k for s in self.stops for k in range(1, len(s)) if buffer.endswith(s[:k])), default=0)
        self.pending = buffer[len(buffer) - hold:] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        rest, self.pending = self.pending, ""
        return "" if self.hit else rest


class ToolCallHold:
    """Streams the content of an answer that may hold tool calls.

    The worker answers the content as the text outside the calls, stripped
    (``worker/structured/tool_parsers.py``), and the calls themselves in ``result.tool_calls``.
    So the stream sends the raw text's content only up to the first ``<tool_call>`` (both call
    formats open with it), holds what may be the start of that tag or of a stop sequence, and
    holds leading and trailing whitespace; the rest of the content and the calls come with the
    final status. What it sent is then always a prefix of the final content."""

    OPEN = "<tool_call>"

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.sent = ""
        self.hit = False  # a stop sequence cut the content

    def _candidate(self, text: str) -> str:
        cut = text.find(self.OPEN)
        if cut >= 0:
            text = text[:cut]
        else:
            markers = [self.OPEN, *self.stops]
            hold = max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
            text = text[: len(text) - hold]
        text, hit = apply_stop(text, self.stops)
        self.hit = self.hit or hit
        return text.strip()

    def _send(self, candidate: str) -> str:
        if not candidate.startswith(self.sent):  # never taken back: wait for the final content
            return ""
        new, self.sent = candidate[len(self.sent):], candidate
        return new

    def feed(self, text: str) -> str:
        """The raw answer so far -> the content that may be sent now (new part)."""
        return "" if self.hit else self._send(self._candidate(text))

    def finish(self, content: str) -> str:
        """The final content (the worker's) -> the part not sent yet, through the stop sequences."""
        cut, hit = apply_stop(content, self.stops)
        self.hit = self.hit or hit
        return self._send(cut)


def finish_reason(job: JobOut, stop_hit: bool) -> str:
    if stop_hit:
        return "stop"
    reason = job.result.finish_reason if job.result else None
    return FINISH_REASONS.get(reason or "", "stop")


def usage(job: JobOut) -> dict[str, Any]:
    used = (job.result.usage if job.result else None) or {}
    prompt = int(used.get("prompt_tokens") or 0)
    completion = int(used.get("completion_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "steps_used": used.get("steps_used"), "blocks": used.get("blocks")}


def created_of(job: JobOut) -> int:
    created = job.timings.created_at
    return int(created.timestamp()) if created is not None else 0


def chat_id(job_id: str) -> str:
    return f"chatcmpl-{job_id}"


def completion_id(job_id: str) -> str:
    return f"cmpl-{job_id}"


def job_failure(job: JobOut) -> ApiError:
    """The error a finished, unsuccessful job answers with."""
    if job.status == JobStatus.CANCELLED:
        return ApiError(409, "job_cancelled", f"Job {job.id} was cancelled before it finished.",
                        {"job_id": job.id})
    if job.status == JobStatus.EXPIRED:
        return ApiError(410, "job_expired", f"Job {job.id} expired.", {"job_id": job.id})
    code = job.error.code if job.error and job.error.code else "job_failed"
    message = (job.error.message if job.error else None) or "the job failed"
    status = 400 if code == ErrorCode.INVALID_INPUT else 500
    return ApiError(status, code, f"Job {job.id} failed: {message}", {"job_id": job.id})


def tool_calls_of(job: JobOut) -> list[dict[str, Any]]:
    """The calls the worker read from the output (``result.tool_calls``, OpenAI's shape)."""
    return list((job.result.tool_calls if job.result else None) or [])


def chat_finish_reason(job: JobOut, stop_hit: bool) -> str:
    """``tool_calls`` when the answer holds calls (a stop sequence only cuts the content)."""
    return "tool_calls" if tool_calls_of(job) else finish_reason(job, stop_hit)


def chat_message(job: JobOut, stops: Sequence[str]) -> tuple[dict[str, Any], bool]:
    result = job.result
    text, hit = apply_stop((result.text or "") if result else "", stops)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = tool_calls_of(job)
    if calls:
        message["content"] = text or None  # OpenAI: null content beside calls
        message["tool_calls"] = calls
    if (job.params or {}).get("thinking"):
        message["reasoning_content"] = result.reasoning if result else None
    return message, hit


def chat_response(job: JobOut, *, model: str, stops: Sequence[str]) -> dict[str, Any]:
    message, hit = chat_message(job, stops)
    return {
        "id": chat_id(job.id), "object": "chat.completion", "created": created_of(job), "model": model,
        "system_fingerprint": job.model_version,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": chat_finish_reason(job, hit)}],
        "usage": usage(job),
    }


def tool_call_deltas(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A stream's ``delta.tool_calls`` for finished calls: each call whole in one entry, with
    its ``index`` (OpenAI's chunk shape; clients join deltas of one index)."""
    return [{"index": i, "id": call.get("id"), "type": "function",
             "function": {"name": (call.get("function") or {}).get("name"),
                          "arguments": (call.get("function") or {}).get("arguments")}}
            for i, call in enumerate(calls)]


def completion_response(job: JobOut, *, model: str, stops: Sequence[str], echo: str | None) -> dict[str, Any]:
    text, hit = apply_stop((job.result.text or "") if job.result else "", stops)
    return {
        "id": completion_id(job.id), "object": "text_completion", "created": created_of(job), "model": model,
        "system_fingerprint": job.model_version,
        "choices": [{"index": 0, "text": (echo or "") + text, "logprobs": None,
                     "finish_reason": finish_reason(job, hit)}],
        "usage": usage(job),
    }


def chat_chunk(job: JobOut, *, model: str, delta: dict[str, Any] | None, finish: str | None = None,
               usage_doc: dict[str, Any] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": chat_id(job.id), "object": "chat.completion.chunk", "created": created_of(job), "model": model,
        "system_fingerprint": job.model_version,
        "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}],
    }
    if usage_doc is not None:
        chunk["usage"] = usage_doc
    return chunk


def completion_chunk(job: JobOut, *, model: str, text: str | None, finish: str | None = None,
                     usage_doc: dict[str, Any] | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": completion_id(job.id), "object": "text_completion", "created": created_of(job), "model": model,
        "system_fingerprint": job.model_version,
        "choices": [] if text is None else [{"index": 0, "text": text, "logprobs": None,
                                             "finish_reason": finish}],
    }
    if usage_doc is not None:
        chunk["usage"] = usage_doc
    return chunk
