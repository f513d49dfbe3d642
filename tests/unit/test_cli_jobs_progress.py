"""``cloverq submit --wait`` shows a long prompt's prefill (issue 33: a long prompt showed
``blocks_done 0`` for ~80 s): ``prefill N/M tokens`` while ``prompt_tokens_done`` <
``prompt_tokens``, then blocks. The event stream reports progress per committed block only, so
the prefill is polled from ``GET /v1/jobs/{id}`` between the job's start and its first block."""

from __future__ import annotations

import io
import json
from typing import Any

import httpx
import pytest
from rich.console import Console
from rich.progress import Progress, TaskID

import cli.jobs
from client import Client, Job

RUNNING = {"id": "j1", "kind": "generate", "status": "running", "attempt": 1, "timings": {}}


def _row(bar: Progress, task: TaskID) -> str:
    """The bar's row of ``task`` as the terminal shows it (no colours)."""
    console = Console(file=io.StringIO(), width=120, record=True, color_system=None)
    console.print(bar.make_tasks_table([next(t for t in bar.tasks if t.id == task)]))
    return console.export_text().strip()


def _bar() -> tuple[Progress, TaskID, TaskID]:
    bar = Progress(*cli.jobs._bars().columns, console=Console(file=io.StringIO()))
    return bar, bar.add_task("blocks", total=None, detail=""), bar.add_task("steps", total=None, detail="")


def test_the_bar_shows_the_prefill_while_it_runs_then_blocks() -> None:
    bar, blocks, steps = _bar()
    cli.jobs._show(bar, blocks, steps, {"prompt_tokens": 3000, "prompt_tokens_done": 0, "blocks_done": 0,
                                        "blocks_total": 6}, "running")
    row = _row(bar, blocks)
    assert row.startswith("prefill") and "0/3000 tokens running" in row, row
    cli.jobs._show(bar, blocks, steps, {"prompt_tokens": 3000, "prompt_tokens_done": 3000, "blocks_done": 1,
                                        "blocks_total": 6}, "running")
    row = _row(bar, blocks)
    assert row.startswith("blocks") and "1/6 running" in row and "3000" not in row, row


def test_without_prompt_figures_the_bar_shows_blocks() -> None:
    """An older server (no prompt_tokens) and a stream's progress event: blocks as before."""
    bar, blocks, steps = _bar()
    cli.jobs._show(bar, blocks, steps, {"blocks_done": 0, "blocks_total": 4}, "running")
    assert _row(bar, blocks).startswith("blocks") and "0/4 running" in _row(bar, blocks)


def _sse(*events: tuple[str, dict[str, Any]]) -> httpx.Response:
    text = "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events)
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=text.encode())


def test_wait_polls_the_prefill_between_the_start_and_the_first_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefill = {"prompt_tokens": 3000, "prompt_tokens_done": 0, "blocks_done": 0, "blocks_total": 2}
    prefilled = {**prefill, "prompt_tokens_done": 3000, "blocks_done": 1}
    polls = [{**RUNNING, "progress": prefill}, {**RUNNING, "progress": prefill},
             {**RUNNING, "progress": prefilled}]
    done = {**RUNNING, "status": "succeeded", "result": {"text": "ok"},
            "progress": {**prefilled, "blocks_done": 2}}
    streams = [
        _sse(("status", {"status": "queued", "attempt": 0}), ("status", {"status": "running", "attempt": 1})),
        _sse(("status", {"status": "running", "attempt": 1}),
             ("progress", {"blocks_done": 1, "blocks_total": 2}),
             ("progress", {"blocks_done": 2, "blocks_total": 2}), ("result", done)),
    ]
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path.endswith("/events"):
            return streams.pop(0)
        return httpx.Response(200, json=polls.pop(0))

    shown: list[str] = []
    original = cli.jobs._show

    def recording(
        bar: Progress, blocks: TaskID, steps: TaskID, progress: dict[str, Any], status: str,
    ) -> None:
        original(bar, blocks, steps, progress, status)
        shown.append(_state(bar, blocks))

    monkeypatch.setattr(cli.jobs, "_show", recording)
    monkeypatch.setattr(cli.jobs, "_console", Console(file=io.StringIO()))
    with Client("http://api", transport=httpx.MockTransport(handler)) as cq:
        job = cli.jobs._wait_with_progress(cq, Job.model_validate({**RUNNING, "status": "queued"}), 0)
    assert job.status == "succeeded" and job.text == "ok"
    assert asked == ["/v1/jobs/j1/events", "/v1/jobs/j1", "/v1/jobs/j1", "/v1/jobs/j1", "/v1/jobs/j1/events"]
    assert shown == ["prefill 0/3000", "prefill 0/3000", "blocks 1/2", "blocks 1/2", "blocks 2/2"]
    assert not streams and not polls


def _state(bar: Progress, task: TaskID) -> str:
    """``prefill 0/3000``: the task's description and counts."""
    state = next(t for t in bar.tasks if t.id == task)
    total = "?" if state.total is None else int(state.total)
    return f"{state.description} {int(state.completed)}/{total}"
