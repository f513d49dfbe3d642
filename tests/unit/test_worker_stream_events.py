"""The worker's side of streaming and progress (no Redis server: a recording pipeline): one
``block`` event per committed block with append-only text deltas, the attempt's ``status``
events, ``blocks_total`` from the layout, and final progress that never goes below the live one."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pytest

from scheduler.infra.settings import Settings
from scheduler.jobs import event_stream
from scheduler.jobs.lifecycle import Lease
from worker.engine.types import GenerationRequest, Progress, SamplingParams
from worker.job_handler import planned_blocks
from worker.monitor import JobMonitor, TextTracker
from worker.sampler.layout import build_layout


class _Pipe:
    def __init__(self, log: list[tuple[str, Any, Any]]) -> None:
        self.log = log

    def set(self, key: str, value: str, ex: int | None = None) -> None:
        self.log.append(("set", key, json.loads(value)))

    def delete(self, key: str) -> None:
        self.log.append(("delete", key, None))

    def xadd(self, key: str, fields: dict[str, str], **_: Any) -> None:
        self.log.append(("xadd", key, json.loads(fields[event_stream.FIELD])))

    def expire(self, key: str, seconds: int) -> None:
        self.log.append(("expire", key, seconds))

    def execute(self) -> None:
        return None


class _Redis:
    def __init__(self) -> None:
        self.log: list[tuple[str, Any, Any]] = []

    def pipeline(self, transaction: bool = False) -> _Pipe:
        return _Pipe(self.log)


TEXT = {1: "He", 2: "Hell", 3: "Hello\ufffd", 4: "Hello\u00e9"}  # 3: half a character


def _monitor(redis: _Redis) -> JobMonitor:
    return JobMonitor(settings=Settings(), sessions=None, redis_client=redis, worker_id="w",  # type: ignore[arg-type]
                      decode=lambda ids: TEXT[len(ids)], heartbeat=lambda: None)


def _progress(n: int) -> Progress:
    return Progress(blocks_done=n, steps_used=2 * n, step_budget=None, tokens_committed=n,
                    committed_token_ids=list(range(n)))


def test_one_block_event_per_committed_block_then_the_attempts_end() -> None:
    redis = _Redis()
    monitor = _monitor(redis)
    job_id = uuid.uuid4()
    running = monitor.add(Lease(job_id, 2), cancel_event=threading.Event(), step_budget=None)
    monitor.on_plan(job_id)(blocks_total=6)
    report = monitor.on_progress(job_id)
    report(_progress(1))
    report(_progress(2))  # two blocks between ticks: two events
    monitor._push_progress([running])
    report(_progress(3))
    report(_progress(4))
    final = monitor.final_progress(running, steps_used=9, tokens=4, blocks=4, complete=True)
    monitor.finish(running, "succeeded")

    events = [value for op, key, value in redis.log if op == "xadd" and key == f"cloverq:events:{job_id}"]
    assert events[0] == {"type": "status", "status": "running", "attempt": 2}
    blocks = [e for e in events if e["type"] == "block"]
    assert [e["blocks_done"] for e in blocks] == [1, 2, 3, 4] and {e["blocks_total"] for e in blocks} == {6}
    assert [(e["offset"], e["delta"]) for e in blocks] == [(0, "He"), (2, "ll"), (4, "o"), (5, "\u00e9")]
    assert events[-1] == {"type": "status", "status": "succeeded", "attempt": 2}
    hot = [value for op, key, value in redis.log if op == "set"][-1]
    figures = ("blocks_done", "blocks_total", "steps_used", "tokens_committed")
    assert tuple(hot[name] for name in figures) == (4, 4, 9, 4)
    assert (final["blocks_done"], final["blocks_total"], final["steps_used"]) == (4, 4, 9)
    assert "partial_text" not in final


def test_final_progress_is_never_below_the_live_one() -> None:
    monitor = _monitor(_Redis())
    job_id = uuid.uuid4()
    running = monitor.add(Lease(job_id, 1), cancel_event=threading.Event(), step_budget=None)
    monitor.on_plan(job_id)(blocks_total=6)
    monitor.on_progress(job_id)(_progress(3))
    # a cancelled attempt whose outcome carries fewer figures than it reported keeps the live ones
    doc = monitor.final_progress(running, steps_used=1, tokens=None, blocks=None, complete=False)
    figures = ("blocks_done", "steps_used", "tokens_committed", "blocks_total")
    assert tuple(doc[name] for name in figures) == (3, 6, 3, 6)


def test_text_tracker_appends_holds_half_characters_and_corrects() -> None:
    text = TextTracker()
    assert text.advance("ab") == (0, "ab")
    assert text.advance("abc\ufffd") == (2, "c")
    assert text.advance("abcd") == (3, "d")
    assert text.advance("abXY") == (2, "XY")  # an earlier character changed: say where
    assert text.advance("abXY\ufffd", final=True) == (4, "\ufffd")


@pytest.mark.parametrize("block_size", [1, 3, 4, 8])
@pytest.mark.parametrize("prompt_len", [1, 4, 5, 11])
@pytest.mark.parametrize("new_tokens", [1, 4, 13])
def test_planned_blocks_match_the_layout(block_size: int, prompt_len: int, new_tokens: int) -> None:
    request = GenerationRequest("r", list(range(prompt_len)), SamplingParams(max_new_tokens=new_tokens))
    layout = build_layout(request, block_size, vocab_size=64, max_len=4096)
    first, last = layout.region_start // block_size, (layout.total_len - 1) // block_size
    assert planned_blocks(prompt_len, new_tokens, block_size) == last - first + 1


def test_final_hot_status_write_never_raises_when_redis_is_gone() -> None:
    """Issue 16: it runs after the SQL commit; a Redis blip must not cost the summary line,
    metrics and notices that follow it."""
    import socket

    import redis as redis_lib

    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    gone = redis_lib.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.5)
    monitor = JobMonitor(settings=Settings(), sessions=None, redis_client=gone, worker_id="w",  # type: ignore[arg-type]
                         decode=lambda ids: "", heartbeat=lambda: None)
    running = monitor.add(Lease(uuid.uuid4(), 1), cancel_event=threading.Event(), step_budget=None)
    monitor.finish(running, "succeeded")
    assert running.status == "succeeded" and monitor.running_count() == 0


def test_the_hot_status_shows_the_prefill_before_the_first_block() -> None:
    redis = _Redis()
    monitor = _monitor(redis)
    job_id = uuid.uuid4()
    running = monitor.add(Lease(job_id, 1), cancel_event=threading.Event(), step_budget=None)
    monitor.on_plan(job_id)(blocks_total=6, prompt_tokens=3000)
    before = monitor.snapshot(running)
    assert (before["prompt_tokens_done"], before["prompt_tokens"], before["blocks_done"]) == (0, 3000, 0)
    monitor.on_progress(job_id)(_progress(1))  # the first block: the prompt was prefilled
    after = monitor.snapshot(running)
    assert (after["prompt_tokens_done"], after["blocks_done"]) == (3000, 1)
