"""Held jobs in Redis: the index the deficit round robin releases from, kept exact by scripts.

A **held** job is a committed ``queued`` row with no Celery message yet (fair share kept it out of
its class's broker list). Redis holds, per class queue (``scheduler.infra.redis_keys``):

- one sorted set per flow (``fair_flow``): members ``<job id>|<cost>``, scored by submission order;
- the set of flows that hold jobs (``fair_flows``) and the number of held jobs (``fair_held``, read
  by admission: held jobs count in their queue's depth, so the depth cap still means "waiting");
- the job's enqueued marker, holding ``held:<queue>`` instead of a lane name: the reconciler and
  the delayed tick see a marker and leave the job alone, exactly as for a job with a message.

Every change goes through one Lua script, so the count, the flow set and the markers never
disagree with the sorted sets, however many API processes, workers and beat ticks run at once.
All of it is transport state (docs/architecture.md §3.1): after a Redis loss the reconciler finds
the rows without markers and stages them again (``stage(..., if_unmarked=True)``), and it heals a
``held:`` marker whose entry is gone the same way.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

import redis

from scheduler.fairness.drr import flow_id, tenant_of
from scheduler.infra import redis_keys
from scheduler.infra.redis_keys import ADMISSION_RESERVATION_TTL_SECONDS, ENQUEUED_TTL_SECONDS

# kombu's Redis transport keeps one list per queue and priority step (as in scheduler.access.admission).
PRIORITY_SUFFIXES: tuple[str, ...] = ("", "\x06\x163", "\x06\x166", "\x06\x169")
SCRIPT_CHUNK = 500  # jobs per script call (a batch of 10,000 is 20 short scripts, not one long one)
HEAD_PREFETCH = 4  # held jobs read per flow per pass (more on demand)

# Stage jobs. KEYS: flows set, held count, the queue's reservations, then per job its marker, its
# flow's sorted set and its tenant's reservations. ARGV: held marker value, marker ttl, mode
# ('force': stage and drop the admission reservations; 'unmarked': only jobs without a marker, or
# with a held marker whose entry is gone), then per job: flow, member, score. Returns 1/0 per job.
_STAGE_LUA = """
local held_value, ttl, mode = ARGV[1], ARGV[2], ARGV[3]
local added = 0
local staged = {}
local n = (#KEYS - 3) / 3
for i = 1, n do
  local marker, flow_key, tenant_res = KEYS[1 + i * 3], KEYS[2 + i * 3], KEYS[3 + i * 3]
  local flow, member, score = ARGV[1 + i * 3], ARGV[2 + i * 3], ARGV[3 + i * 3]
  local ok = true
  if mode == 'unmarked' then
    local held = redis.call('GET', marker)
    if held and (held ~= held_value or redis.call('ZSCORE', flow_key, member)) then ok = false end
  end
  if ok then
    added = added + redis.call('ZADD', flow_key, score, member)
    redis.call('SADD', KEYS[1], flow)
    redis.call('SET', marker, held_value, 'EX', ttl)
    if mode == 'force' then
      redis.call('ZREM', KEYS[3], marker)
      redis.call('ZREM', tenant_res, marker)
    end
    staged[i] = 1
  else
    staged[i] = 0
  end
end
if added > 0 then redis.call('INCRBY', KEYS[2], added) end
return staged
"""

# One submitted job: publish it directly (returns 0) when the class holds nothing and its list has
# room, else stage it like _STAGE_LUA's 'force' (returns 1). KEYS: flows set, held count, queue
# reservations, tenant reservations, marker, flow set, the queue's dead set, its 4 lists. ARGV:
# held marker value, marker ttl, flow, member, score, window.
_SUBMIT_LUA = """
if tonumber(redis.call('GET', KEYS[2]) or '0') <= 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local live = redis.call('ZCOUNT', KEYS[3], now, '+inf') - redis.call('ZCARD', KEYS[7])
  for j = 8, 11 do live = live + redis.call('LLEN', KEYS[j]) end
  if live < tonumber(ARGV[6]) then return 0 end
end
if redis.call('ZADD', KEYS[6], ARGV[5], ARGV[4]) == 1 then redis.call('INCR', KEYS[2]) end
redis.call('SADD', KEYS[1], ARGV[3])
redis.call('SET', KEYS[5], ARGV[1], 'EX', ARGV[2])
redis.call('ZREM', KEYS[3], KEYS[5])
redis.call('ZREM', KEYS[4], KEYS[5])
return 1
"""

# Take released jobs out (and store the round robin's state with them). KEYS: flows set, held count,
# the queue's reservations, the DRR state, then per job its flow's set and its marker. ARGV: the
# DRR state, reservation ttl ms, the held marker value, then per job: flow, member, live ('1':
# publish it; '0': drop it). A live job loses its held marker and gets a queue
# reservation (its message releases it: scheduler.infra.broker), so the depth counts it
# throughout; its publisher sets its marker right before the send, as any publish does, so a
# publisher that dies in between leaves a row without a marker for the reconciler, never one
# hidden by a marker. Returns 1 per job to publish (still held, live), else 0.
_TAKE_LUA = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
local removed = 0
local out = {}
local n = (#KEYS - 4) / 2
for i = 1, n do
  local flow_key, marker = KEYS[3 + i * 2], KEYS[4 + i * 2]
  local flow, member, live = ARGV[1 + i * 3], ARGV[2 + i * 3], ARGV[3 + i * 3]
  local gone = redis.call('ZREM', flow_key, member)
  removed = removed + gone
  if redis.call('GET', marker) == ARGV[3] then redis.call('DEL', marker) end
  if gone == 1 and live == '1' then
    redis.call('ZADD', KEYS[3], expiry, marker)
    out[i] = 1
  else
    out[i] = 0
  end
  if redis.call('ZCARD', flow_key) == 0 then redis.call('SREM', KEYS[1], flow) end
end
if removed > 0 and redis.call('DECRBY', KEYS[2], removed) < 0 then redis.call('SET', KEYS[2], 0) end
redis.call('SET', KEYS[4], ARGV[1])
return out
"""

# Forget held jobs (cancelled, or promoted by aging). KEYS: flows set, held count, then per job its
# flow's set and its marker. ARGV: held marker value, then per job: flow, member. Returns how many.
_FORGET_LUA = """
local removed = 0
local n = (#KEYS - 2) / 2
for i = 1, n do
  local flow_key, marker = KEYS[1 + i * 2], KEYS[2 + i * 2]
  removed = removed + redis.call('ZREM', flow_key, ARGV[i * 2 + 1])
  if redis.call('ZCARD', flow_key) == 0 then redis.call('SREM', KEYS[1], ARGV[i * 2]) end
  if redis.call('GET', marker) == ARGV[1] then redis.call('DEL', marker) end
end
if removed > 0 and redis.call('DECRBY', KEYS[2], removed) < 0 then redis.call('SET', KEYS[2], 0) end
return removed
"""


@dataclass(frozen=True, slots=True)
class HeldJob:
    """What the index needs of a queued job: where it waits, whose it is, what it costs, its order."""

    job_id: uuid.UUID
    queue: str
    tenant: str
    batch_id: uuid.UUID | None
    cost: int
    order: float  # score in its flow: submission order (:func:`submission_order`)

    @property
    def flow(self) -> str:
        return flow_id(self.tenant, self.batch_id)

    @property
    def member(self) -> str:
        return f"{self.job_id}|{self.cost}"


def submission_order(created_at: datetime, seq: int | None = None) -> float:
    """A job's score in its flow: its index in its batch when known (batch jobs share one
    ``created_at``), else its submission time (a recovered batch job goes after the indexed ones)."""
    return float(seq) if seq is not None else 1e12 + created_at.timestamp()


def parse_member(member: bytes | str) -> tuple[uuid.UUID, int]:
    text = member.decode() if isinstance(member, bytes) else member
    job_id, _, cost = text.partition("|")
    return uuid.UUID(job_id), int(cost or 0)


def held_marker(queue: str) -> str:
    return redis_keys.FAIR_HELD_MARKER + queue


def is_held_marker(value: bytes | str | None) -> bool:
    if value is None:
        return False
    text = value.decode() if isinstance(value, bytes) else value
    return text.startswith(redis_keys.FAIR_HELD_MARKER)


def _chunks(items: Sequence[HeldJob]) -> Iterable[Sequence[HeldJob]]:
    for start in range(0, len(items), SCRIPT_CHUNK):
        yield items[start:start + SCRIPT_CHUNK]


def stage(client: redis.Redis, jobs: Sequence[HeldJob], *, if_unmarked: bool = False) -> list[bool]:
    """Hold ``jobs`` (all of one queue). Default (a submit, a batch): unconditionally, dropping the
    admission's reservations (the row is committed; the held count takes over). ``if_unmarked``
    (the reconciler): only jobs without a marker, or whose held marker lost its entry. Returns
    per job whether it was staged now."""
    if not jobs:
        return []
    queue = jobs[0].queue
    script = client.register_script(_STAGE_LUA)
    staged: list[bool] = []
    for chunk in _chunks(jobs):
        keys = [redis_keys.fair_flows(queue), redis_keys.fair_held(queue),
                redis_keys.queue_reservations(queue)]
        args: list[Any] = [held_marker(queue), ENQUEUED_TTL_SECONDS, "unmarked" if if_unmarked else "force"]
        for job in chunk:
            keys += [redis_keys.enqueued(job.job_id), redis_keys.fair_flow(queue, job.flow),
                     redis_keys.tenant_reservations(job.tenant)]
            args += [job.flow, job.member, repr(job.order)]
        staged += [bool(flag) for flag in cast("list[int]", script(keys=keys, args=args))]
    return staged


def stage_or_pass(client: redis.Redis, job: HeldJob, *, window: int, queue_lane: str) -> bool:
    """One submitted job: True when it was held, False when it may be published directly (the
    class holds nothing and ``queue_lane``'s list has room; its marker and reservations are then
    the caller's, as without fair share)."""
    queue = job.queue
    keys = [redis_keys.fair_flows(queue), redis_keys.fair_held(queue), redis_keys.queue_reservations(queue),
            redis_keys.tenant_reservations(job.tenant), redis_keys.enqueued(job.job_id),
            redis_keys.fair_flow(queue, job.flow), redis_keys.dead_messages(queue_lane),
            *(queue_lane + suffix for suffix in PRIORITY_SUFFIXES)]
    args: list[Any] = [held_marker(queue), ENQUEUED_TTL_SECONDS, job.flow, job.member, repr(job.order),
                       window]
    return bool(client.register_script(_SUBMIT_LUA)(keys=keys, args=args))


@dataclass(frozen=True, slots=True)
class Taken:
    """One released job as the take script sees it."""

    flow: str
    member: str
    live: bool  # SQL says it may be published


def take(client: redis.Redis, queue: str, taken: Sequence[Taken], *, drr_state: str) -> list[bool]:
    """Remove released jobs from the index and store the DRR state, atomically; a live job gets
    a queue reservation (its publisher sets its marker). Returns per job whether to publish it."""
    keys = [redis_keys.fair_flows(queue), redis_keys.fair_held(queue), redis_keys.queue_reservations(queue),
            redis_keys.fair_drr(queue)]
    args: list[Any] = [drr_state, ADMISSION_RESERVATION_TTL_SECONDS * 1000, held_marker(queue)]
    for item in taken:
        job_id, _ = parse_member(item.member)
        keys += [redis_keys.fair_flow(queue, item.flow), redis_keys.enqueued(job_id)]
        args += [item.flow, item.member, "1" if item.live else "0"]
    return [bool(flag) for flag in cast("list[int]", client.register_script(_TAKE_LUA)(keys=keys, args=args))]


def forget(client: redis.Redis, jobs: Sequence[HeldJob]) -> int:
    """Drop held jobs from the index (cancelled, or moved by aging) and their held markers.
    Jobs that are not held are left alone (their marker names a lane). Returns how many were held."""
    removed = 0
    by_queue: dict[str, list[HeldJob]] = {}
    for job in jobs:
        by_queue.setdefault(job.queue, []).append(job)
    script = client.register_script(_FORGET_LUA)
    for queue, listed in by_queue.items():
        for chunk in _chunks(listed):
            keys = [redis_keys.fair_flows(queue), redis_keys.fair_held(queue)]
            args: list[Any] = [held_marker(queue)]
            for job in chunk:
                keys += [redis_keys.fair_flow(queue, job.flow), redis_keys.enqueued(job.job_id)]
                args += [job.flow, job.member]
            removed += int(cast("int", script(keys=keys, args=args)))
    return removed


def forget_flow(client: redis.Redis, queue: str, flow: str, jobs: Sequence[HeldJob]) -> int:
    """:func:`forget` for a whole flow (a cancelled batch): its listed jobs, then whatever else
    the flow still holds (jobs staged meanwhile by the reconciler)."""
    removed = forget(client, jobs)
    rest = cast("list[bytes]", client.zrange(redis_keys.fair_flow(queue, flow), 0, -1))
    if rest:
        tenant = tenant_of(flow)
        batch = flow.rsplit("/", 1)[1]
        batch_id = None if batch == "-" else uuid.UUID(batch)
        leftovers = [HeldJob(job_id=job_id, queue=queue, tenant=tenant, batch_id=batch_id, cost=cost,
                             order=0.0) for job_id, cost in map(parse_member, rest)]
        removed += forget(client, leftovers)
    return removed


def held_count(client: redis.Redis, queue: str) -> int:
    return int(cast("bytes | None", client.get(redis_keys.fair_held(queue))) or 0)


def held_by_tenant(client: redis.Redis, queues: Iterable[str]) -> dict[tuple[str, str], int]:
    """Held jobs per ``(queue, tenant)`` (the dashboard's and the metrics' view), two round trips."""
    names = list(queues)
    pipe = client.pipeline(transaction=False)
    for queue in names:
        pipe.smembers(redis_keys.fair_flows(queue))
    flows = [(queue, _text(flow)) for queue, members in zip(names, pipe.execute(), strict=True)
             for flow in cast("set[bytes]", members)]
    if not flows:
        return {}
    pipe = client.pipeline(transaction=False)
    for queue, flow in flows:
        pipe.zcard(redis_keys.fair_flow(queue, flow))
    counts: dict[tuple[str, str], int] = {}
    for (queue, flow), n in zip(flows, pipe.execute(), strict=True):
        key = (queue, tenant_of(flow))
        counts[key] = counts.get(key, 0) + int(n)
    return counts


class RedisHeads:
    """The DRR's view (``scheduler.fairness.drr.Heads``) of one queue's held jobs: the first few
    members of every flow read in one pipeline, more on demand; pops stay local until ``take``."""

    def __init__(self, client: redis.Redis, queue: str, flows: Iterable[str], *,
                 prefetch: int = HEAD_PREFETCH) -> None:
        self._client = client
        self._queue = queue
        self._prefetch = max(1, prefetch)
        self._members: dict[str, deque[str]] = {}
        self._read: dict[str, int] = {}  # members read per flow so far (the next read's offset)
        self._more: dict[str, bool] = {}
        listed = sorted(set(flows))
        pipe = client.pipeline(transaction=False)
        for flow in listed:
            pipe.zrange(redis_keys.fair_flow(queue, flow), 0, self._prefetch - 1)
        for flow, members in zip(listed, pipe.execute(), strict=True):
            self._fill(flow, cast("list[bytes]", members))

    def _fill(self, flow: str, members: list[bytes]) -> None:
        self._members.setdefault(flow, deque()).extend(_text(m) for m in members)
        self._read[flow] = self._read.get(flow, 0) + len(members)
        self._more[flow] = len(members) == self._prefetch

    @property
    def flows(self) -> list[str]:
        """The flows that held jobs when read (the DRR's backlogged set)."""
        return [flow for flow, members in self._members.items() if members]

    def peek(self, flow: str) -> int | None:
        members = self._members.get(flow)
        if members is None:
            return None
        if not members and self._more.get(flow):
            start = self._read[flow]
            self._fill(flow, cast("list[bytes]", self._client.zrange(
                redis_keys.fair_flow(self._queue, flow), start, start + self._prefetch - 1)))
        return parse_member(members[0])[1] if members else None

    def take_member(self, flow: str) -> str:
        """Pop the flow's next member (after :meth:`peek` said there is one)."""
        return self._members[flow].popleft()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def drop_index(client: redis.Redis, queue: str) -> int:
    """Delete ``queue``'s whole index (fair share switched off: the reconciler publishes the jobs,
    whose held markers it then reads as no message). Returns how many jobs it held."""
    flows = [_text(flow) for flow in cast("set[bytes]", client.smembers(redis_keys.fair_flows(queue)))]
    count = held_count(client, queue)
    client.delete(redis_keys.fair_flows(queue), redis_keys.fair_held(queue), redis_keys.fair_drr(queue),
                  *(redis_keys.fair_flow(queue, flow) for flow in flows))
    return count
