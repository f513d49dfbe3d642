"""The asyncio client (``httpx.AsyncClient``): the same calls as :class:`client.sync.Client`, awaited."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from client._core import (
    DEFAULT_BASE_URL,
    MAX_LONG_POLL_SECONDS,
    RETRY_STATUSES,
    CloverqError,
    JobTimeout,
    RetryPolicy,
    SSEParser,
    decide_body,
    extract_body,
    generate_body,
    headers,
    idempotency_headers,
    list_query,
)
from client.models import Batch, Job, JobEvent, JobPage
from client.text import TextAssembler

STREAM_TIMEOUT = httpx.Timeout(10.0, read=60.0)  # the server sends a comment every 10 s


class AsyncClient:
    """cloverq's HTTP API from asyncio code::

        async with AsyncClient("http://127.0.0.1:8000", api_key) as cq:
            job = await cq.submit("Write a haiku", max_new_tokens=32)
            async for piece in cq.stream_text(job.id):
                print(piece, end="", flush=True)
            print((await cq.wait(job.id)).result.usage)

    Every call raises :class:`CloverqError` for an error answer; 429 and 503 are retried first
    (``retry``, honouring ``Retry-After``).
    """

    def __init__(self, base_url: str = DEFAULT_BASE_URL, api_key: str | None = None, *,
                 timeout: float = 30.0, retry: RetryPolicy | None = None,
                 admin_url: str | None = None, ops_url: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        # Where the admin and ops planes answer when the API serves them on ports of their own.
        self.admin_url = (admin_url or base_url).rstrip("/")
        self.ops_url = (ops_url or base_url).rstrip("/")
        self.retry = retry or RetryPolicy()
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=headers(api_key), timeout=timeout,
                                  transport=transport)

    # --- plumbing ------------------------------------------------------------------------------
    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def request(self, method: str, path: str, *, retry: bool = True, **kwargs: Any) -> httpx.Response:
        """One API call with the retry policy; raises :class:`CloverqError` for an error answer."""
        attempt = 0
        while True:
            try:
                response = await self._http.request(method, path, **kwargs)
            except httpx.ConnectError:
                if not retry or attempt >= self.retry.max_retries:
                    raise
                await asyncio.sleep(self.retry.delay(attempt, None))
                attempt += 1
                continue
            if retry and response.status_code in RETRY_STATUSES and attempt < self.retry.max_retries:
                await asyncio.sleep(self.retry.delay(attempt, response))
                attempt += 1
                continue
            if response.status_code >= 400:
                raise CloverqError.from_response(response)
            return response

    async def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return (await self.request(method, path, **kwargs)).json()

    # --- jobs ----------------------------------------------------------------------------------
    async def submit_job(self, body: Mapping[str, Any], *, idempotency_key: str | None = None) -> Job:
        """``POST /v1/jobs`` with any job body (``kind`` generate, decide or extract)."""
        return Job.model_validate(await self._json("POST", "/v1/jobs", json=dict(body),
                                             headers=idempotency_headers(idempotency_key)))

    async def submit(self, prompt: str | None = None, *, messages: Sequence[Mapping[str, str]] | None = None,
               params: Mapping[str, Any] | None = None, priority: str | None = None,
               metadata: Mapping[str, Any] | None = None, webhook_url: str | None = None,
               idempotency_key: str | None = None, **param_values: Any) -> Job:
        """Queue a generation job: ``prompt`` or chat ``messages``; decoding parameters as
        ``params`` or keywords (``max_new_tokens=32, steps_per_block=4, thinking=True``)."""
        body = generate_body(prompt, messages, {**(params or {}), **param_values}, priority=priority,
                             metadata=metadata, webhook_url=webhook_url)
        return await self.submit_job(body, idempotency_key=idempotency_key)

    async def decide(self, context: str, questions: Sequence[Mapping[str, Any]], *, mode: str = "independent",
               rationale: bool = False, params: Mapping[str, Any] | None = None, priority: str | None = None,
               metadata: Mapping[str, Any] | None = None, webhook_url: str | None = None,
               idempotency_key: str | None = None,
               constraints: Sequence[Mapping[str, Any]] | None = None) -> Job:
        """Queue a decision job: ``questions`` as ``{"id", "text", "choices"?}`` about ``context``;
        ``constraints`` (joint mode) as ``{"questions": [ids], "allowed": [[choice, ...], ...]}``."""
        body = decide_body(context, questions, mode=mode, rationale=rationale, params=params,
                           priority=priority, metadata=metadata, webhook_url=webhook_url,
                           constraints=constraints)
        return await self.submit_job(body, idempotency_key=idempotency_key)

    async def extract(self, context: str, schema: Mapping[str, Any], *, instructions: str | None = None,
                      params: Mapping[str, Any] | None = None, priority: str | None = None,
                      metadata: Mapping[str, Any] | None = None, webhook_url: str | None = None,
                      idempotency_key: str | None = None, **param_values: Any) -> Job:
        """Queue an extract job: a value valid against the JSON Schema ``schema``, read from the
        document ``context`` (``instructions``: what to look for). Once it succeeded, ``job.data``
        is the value and ``job.result.confidence`` each choice field's probability; decoding
        parameters as ``params`` or keywords (``temperature=0.7, seed=3``)."""
        body = extract_body(context, schema, instructions=instructions,
                            params={**(params or {}), **param_values}, priority=priority, metadata=metadata,
                            webhook_url=webhook_url)
        return await self.submit_job(body, idempotency_key=idempotency_key)

    async def get(self, job_id: str, *, wait: float = 0) -> Job:
        """``GET /v1/jobs/{id}``; ``wait`` > 0 long-polls up to that many seconds (at most 30)."""
        query = {"wait": min(wait, MAX_LONG_POLL_SECONDS)} if wait > 0 else None
        timeout = httpx.Timeout(30.0, read=wait + 30.0) if wait > 0 else None  # the server holds it
        return Job.model_validate(await self._json("GET", f"/v1/jobs/{job_id}", params=query,
                                             **({"timeout": timeout} if timeout else {})))

    async def wait(self, job_id: str, *, timeout: float | None = None) -> Job:
        """The job once it is final (long polling); :class:`JobTimeout` after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = MAX_LONG_POLL_SECONDS if deadline is None else deadline - time.monotonic()
            job = await self.get(job_id, wait=max(0.0, min(left, MAX_LONG_POLL_SECONDS)))
            if job.is_final:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise JobTimeout(job)

    async def cancel(self, job_id: str) -> Job:
        """Cancel: a queued job at once, a running one within one denoising pass."""
        return Job.model_validate(await self._json("POST", f"/v1/jobs/{job_id}/cancel"))

    async def list_jobs(self, *, status: str | None = None, kind: str | None = None, queue: str | None = None,
                  limit: int | None = None, cursor: str | None = None) -> JobPage:
        query = list_query(status=status, kind=kind, queue=queue, limit=limit, cursor=cursor)
        return JobPage.model_validate(await self._json("GET", "/v1/jobs", params=query))

    # --- streaming -----------------------------------------------------------------------------
    async def stream(self, job_id: str, *, after: str | None = None) -> AsyncIterator[JobEvent]:
        """The job's events (``GET /v1/jobs/{id}/events``): ``status``, ``progress``, ``delta``,
        finally ``result``. A dropped connection is resumed after the last event seen."""
        parser = SSEParser()
        parser.last_id = after
        failures = 0
        while True:
            extra = {"Last-Event-ID": parser.last_id} if parser.last_id else {}
            try:
                async with self._http.stream("GET", f"/v1/jobs/{job_id}/events", headers=extra,
                                             timeout=STREAM_TIMEOUT) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        if response.status_code in RETRY_STATUSES and failures < self.retry.max_retries:
                            await asyncio.sleep(self.retry.delay(failures, response))
                            failures += 1
                            continue
                        raise CloverqError.from_response(response)
                    async for line in response.aiter_lines():
                        event = parser.feed(line)
                        if event is None:
                            continue
                        failures = 0
                        yield event
                        if event.event == "result":
                            return
            except (httpx.TransportError, httpx.StreamError):
                if failures >= self.retry.max_retries:
                    raise
                await asyncio.sleep(self.retry.delay(failures, None))
                failures += 1
                continue
            if parser.stopping:  # that replica stops: go on from another one, after the last event
                parser.stopping = False
                continue
            return  # the server ended the stream without a result (the job is gone)

    async def stream_text(self, job_id: str) -> AsyncIterator[str]:
        """The job's answer as it is committed, piece by piece (block by block); the pieces
        join to the final ``result.text``."""
        text = TextAssembler()
        async for event in self.stream(job_id):
            piece = text.feed(event)
            if piece:
                yield piece

    # --- batches -------------------------------------------------------------------------------
    async def create_batch(self, jobs: Sequence[Mapping[str, Any]], *, webhook_url: str | None = None,
                     metadata: Mapping[str, Any] | None = None) -> Batch:
        """``POST /v1/batches`` with job bodies (each exactly a ``POST /v1/jobs`` body)."""
        body: dict[str, Any] = {"jobs": [dict(job) for job in jobs]}
        if webhook_url is not None:
            body["webhook_url"] = webhook_url
        if metadata is not None:
            body["metadata"] = dict(metadata)
        return Batch.model_validate(await self._json("POST", "/v1/batches", json=body))

    async def upload_batch(self, jsonl: str | bytes | Path, *, webhook_url: str | None = None) -> Batch:
        """``POST /v1/batches`` with a JSONL file (one job body per line)."""
        content = Path(jsonl).read_bytes() if isinstance(jsonl, Path) else (
            jsonl.encode() if isinstance(jsonl, str) else jsonl)
        return Batch.model_validate(await self._json(
            "POST", "/v1/batches", content=content, headers={"Content-Type": "application/x-ndjson"},
            params=list_query(webhook_url=webhook_url)))

    async def get_batch(self, batch_id: str) -> Batch:
        return Batch.model_validate(await self._json("GET", f"/v1/batches/{batch_id}"))

    async def cancel_batch(self, batch_id: str) -> Batch:
        return Batch.model_validate(await self._json("POST", f"/v1/batches/{batch_id}/cancel"))

    async def wait_batch(self, batch_id: str, *, timeout: float | None = None,
                         poll_interval: float = 1.0) -> Batch:
        """The batch once every job is final (polling); :class:`JobTimeout` after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = await self.get_batch(batch_id)
            if batch.is_final:
                return batch
            if deadline is not None and time.monotonic() >= deadline:
                raise JobTimeout(batch)
            await asyncio.sleep(poll_interval)

    async def batch_results(self, batch_id: str) -> AsyncIterator[dict[str, Any]]:
        """One dict per job in submission order (``index``, ``job_id``, ``status``, ``result``, ...)."""
        async with self._http.stream("GET", f"/v1/batches/{batch_id}/results",
                                     timeout=STREAM_TIMEOUT) as response:
            if response.status_code >= 400:
                await response.aread()
                raise CloverqError.from_response(response)
            async for line in response.aiter_lines():
                if line.strip():
                    yield json.loads(line)

    # --- operations ----------------------------------------------------------------------------
    async def overview(self) -> dict[str, Any]:
        """``GET /v1/admin/overview`` (an admin key): counts, queues, workers, throughput."""
        data: dict[str, Any] = await self._json("GET", f"{self.admin_url}/v1/admin/overview")
        return data

    async def ready(self) -> tuple[bool, dict[str, Any]]:
        """``GET /readyz``: (ready, checks); a 503 is an answer here, not an error."""
        response = await self._http.get(f"{self.ops_url}/readyz")
        try:
            body = response.json()
        except ValueError:
            body = {}
        return response.status_code == 200, body if isinstance(body, dict) else {}
