"""Releasing held jobs: fill a class's broker list up to its window, next jobs by DRR.

A **pass** over one class queue reads how many live messages its list holds (its lists less the
dead ones, plus admitted messages still on their way), and while that is below
``scheduling.fair_share_window`` picks the next held jobs by weighted deficit round robin
(``scheduler/fairness/drr.py``), checks them in SQL (still queued, uncancelled, due, still in this
class: a cancel or aging may have moved them), takes them out of the index in one script and
publishes them (ids only, as ever). A job picked but no longer publishable is just dropped.

Who runs a pass, and when capacity frees: the submit path and batch publishing (right after they
hold a job), every worker for every message it takes from a class's list
(``scheduler/fairness/kicker.py``), and the beat tick every ``fair_share_tick_seconds``
(``scheduler/fairness/tasks.py``) as the backstop. One process at a time per queue: a short Redis
lock. A caller that finds it taken leaves a request (``fair_again``) that the holder serves
before it lets go, so no request for room is lost; a holder that dies loses the lock to its TTL
and the next kick or tick goes on. Two passes overlapping after a lost lock cannot publish a job
twice: the take script publishes only members it removed itself.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import redis
import structlog
from celery import Celery
from sqlalchemy import select
from sqlalchemy.orm import Session

from scheduler.fairness.drr import DeficitRoundRobin, DrrState
from scheduler.fairness.held import PRIORITY_SUFFIXES, RedisHeads, Taken, parse_member, take
from scheduler.fairness.weights import parse_weights, weight_of
from scheduler.infra import redis_keys
from scheduler.infra.settings import Settings
from scheduler.jobs.enqueue import try_publish_job
from scheduler.jobs.lifecycle import CLOCK_SKEW_TOLERANCE
from scheduler.jobs.models import Job, JobStatus, utcnow
from scheduler.model_versions.canary import current_route
from scheduler.model_versions.canary_routing import lane

log = structlog.get_logger(__name__)

LOCK_TTL_MS = 10_000  # a pass takes milliseconds; a dead holder blocks releases this long at most
AGAIN_TTL_MS = 60_000
REFILLS = 8  # rounds of one pass when picked jobs turned out dead (cancelled, promoted)

_UNLOCK_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

Sessions = Callable[[], AbstractContextManager[Session]]


@dataclass(frozen=True)
class Releaser:
    """What releasing needs: settings (window), SQL (the check), Redis (index, lists), Celery."""

    settings: Settings
    sessions: Sessions
    redis: redis.Redis
    app: Celery

    def release(self, queue: str, *, max_passes: int = 4) -> int:
        """Run passes over ``queue`` while someone asks for one (at most ``max_passes`` here; a
        request left over is served by the next caller or tick). Returns how many were published."""
        client = self.redis
        client.set(redis_keys.fair_again(queue), "1", px=AGAIN_TTL_MS)
        published = 0
        while True:
            token = uuid.uuid4().hex
            if not client.set(redis_keys.fair_lock(queue), token, nx=True, px=LOCK_TTL_MS):
                return published  # the holder serves the request we left
            passes = 0
            try:
                while passes < max_passes and client.delete(redis_keys.fair_again(queue)):
                    published += self.release_pass(queue)
                    passes += 1
            finally:
                client.register_script(_UNLOCK_LUA)(keys=[redis_keys.fair_lock(queue)], args=[token])
            if passes >= max_passes or not client.exists(redis_keys.fair_again(queue)):
                return published

    def release_pass(self, queue: str) -> int:
        """One pass (see the module docstring); call it under the queue's lock."""
        published = 0
        for _ in range(REFILLS):
            room = self.settings.scheduling.fair_share_window - live_messages(self.redis, queue)
            if room <= 0:
                break
            sent, picked = self._fill(queue, room)
            published += sent
            if picked == 0 or sent == picked:  # nothing held, or the room is filled
                break
        return published

    def _fill(self, queue: str, room: int) -> tuple[int, int]:
        """Pick up to ``room`` held jobs, take them, publish the live ones: (published, picked)."""
        client = self.redis
        pipe = client.pipeline(transaction=False)
        pipe.get(redis_keys.fair_drr(queue))
        pipe.smembers(redis_keys.fair_flows(queue))
        pipe.hgetall(redis_keys.LIMITS_KEY)
        raw_state, raw_flows, limits = pipe.execute()
        flows = [flow.decode() if isinstance(flow, bytes) else str(flow) for flow in raw_flows]
        if not flows:
            return 0, 0
        heads = RedisHeads(client, queue, flows)
        policy = DeficitRoundRobin(DrrState.from_json(raw_state), weight_of(parse_weights(limits)))
        policy.sync(heads.flows)
        picked: list[tuple[str, str]] = []
        while len(picked) < room:
            flow = policy.pick(heads)
            if flow is None:
                break
            picked.append((flow, heads.take_member(flow)))
        if not picked:
            client.set(redis_keys.fair_drr(queue), policy.state.to_json())
            return 0, 0
        ids = [parse_member(member)[0] for _, member in picked]
        with self.sessions() as session:
            rows = {row.id: row for row in session.execute(
                select(Job.id, Job.status, Job.queue, Job.cancel_requested, Job.available_at, Job.tenant,
                       Job.request_id, Job.routed_version, Job.trace_id, Job.trace_span_id)
                .where(Job.id.in_(ids))
            )}
            canary = current_route(session, self.settings.model.served)
            session.commit()
        now = utcnow()
        taken = [Taken(flow, member, _publishable(rows.get(job_id), queue, now))
                 for (flow, member), job_id in zip(picked, ids, strict=True)]
        flags = take(client, queue, taken, drr_state=policy.state.to_json())
        published = 0
        for job_id, publish in zip(ids, flags, strict=True):
            if publish:
                row = rows[job_id]
                target = lane(queue, row.routed_version, canary)
                # The marker right before the send (as publish_job sets it); the reservation taken
                # above is released by the message (marker_set + tenant: scheduler.infra.broker).
                client.set(redis_keys.enqueued(job_id), target, ex=redis_keys.ENQUEUED_TTL_SECONDS)
                published += try_publish_job(
                    job_id=job_id, queue=queue, app=self.app, redis_client=client, request_id=row.request_id,
                    marker_set=True, tenant=row.tenant, lane=target,
                    trace_ids=(row.trace_id, row.trace_span_id))
        dropped = len(picked) - sum(flags)
        if dropped:
            log.info("fair_share.dropped_stale", queue=queue, jobs=dropped)
        return published, len(picked)


def _publishable(row: Any, queue: str, now: datetime) -> bool:
    """Whether a picked job may get its message: still queued in this class, uncancelled, due."""
    return (row is not None and row.status == JobStatus.QUEUED.value and row.queue == queue
            and not row.cancel_requested and row.available_at <= now + CLOCK_SKEW_TOLERANCE)


def live_messages(client: redis.Redis, queue: str) -> int:
    """Messages waiting in ``queue``'s plain list (all priority steps) for a worker: less the dead
    ones (``scheduler.jobs.dead_messages``), plus admitted ones still on their way (reservations).
    Canary lanes are not counted: a lane nobody consumes must not close the class's window."""
    now_ms = int(time.time() * 1000)  # reservations are scored by expiry (ms); a skew of a second is noise
    pipe = client.pipeline(transaction=False)
    for suffix in PRIORITY_SUFFIXES:
        pipe.llen(queue + suffix)
    pipe.zcard(redis_keys.dead_messages(queue))
    pipe.zcount(redis_keys.queue_reservations(queue), now_ms, "+inf")
    *lengths, dead, reserved = pipe.execute()
    return max(0, sum(int(n) for n in lengths) - int(dead)) + int(reserved)
