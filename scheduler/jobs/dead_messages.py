"""Messages of jobs cancelled while queued: not counted as queue depth, skipped fast, purged.

A job cancelled while queued is final in SQL at once, but its Celery message stays in the queue's
Redis list until a worker takes it. After two cancelled 10k batches the bulk lists held ~20k such
messages (issue 31): the depth cap (``scheduler.access.admission``) counted them, so new uploads got
``429 queue_full`` with six jobs queued in SQL, and workers spent minutes claiming and skipping
them at ~85/s, each through a task thread, the capacity gate and a SQL claim.

The rule, on the job's enqueued marker (which names the Celery queue its message went to):

- **cancel** (``mark_dead``, after the SQL commit): in one script, a job whose marker exists has a
  message waiting; the marker is deleted and the job id added to the queue's *dead set*
  (``redis_keys.dead_messages``, scored by expiry). The admission script subtracts the dead set's
  size from the lists' length, so the cap counts live jobs.
- **a worker takes a dead message** (``take_if_dead``): one ``ZREM``; a member is skipped before
  any gate or SQL claim (the job is cancelled: the set is written only after that commit).
- **the reconciler purges** (``purge_dead_messages``, every tick): it scans the lists of queues
  whose dead set is not empty, removes those messages (``LREM`` of the exact entry) and their
  members, a bounded number per tick; when it read every list of a queue to its end, members
  whose message it found nowhere are dropped too (their lists were deleted without the set).

Exactly one of the cancel and a worker's claim deletes the marker, so a message is counted dead
only while it is still waiting; a member whose message vanished otherwise (a Redis flush takes the
set too) expires with the marker's TTL.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterable
from typing import Any, cast

import redis
import structlog

from scheduler.infra import redis_keys
from scheduler.infra.celery_app import RUN_JOB_TASK
from scheduler.infra.queue_names import CANARY_LANE_PREFIX, JOB_QUEUES

log = structlog.get_logger(__name__)

PRIORITY_SUFFIXES: tuple[str, ...] = ("", "\x06\x163", "\x06\x166", "\x06\x169")  # kombu's lists per queue
SCAN_CHUNK = 1000  # list entries per LRANGE
MAX_SCAN = 50_000  # entries one purge reads per list (the next tick goes on)
MARK_CHUNK = 500  # jobs per cancel script call

# KEYS: the jobs' enqueued markers. ARGV: the dead-set key prefix, then one job id per marker.
# Per job: the marker exists -> delete it and add the id to <prefix><queue the marker names>.
_MARK_DEAD_LUA = """
local t = redis.call('TIME')
local expiry = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
local n = 0
for i, marker in ipairs(KEYS) do
  local queue = redis.call('GET', marker)
  if queue then
    redis.call('DEL', marker)
    local key = ARGV[1] .. queue
    redis.call('ZADD', key, expiry, ARGV[2 + i])
    redis.call('PEXPIRE', key, tonumber(ARGV[2]) + 1000)
    n = n + 1
  end
end
return n
"""


def _dead_prefix() -> str:
    return redis_keys.dead_messages("")


def all_lanes() -> list[str]:
    """Every Celery queue a job message can wait in: the job queues and their canary lanes."""
    queues = [str(q) for q in JOB_QUEUES]
    return [*queues, *(CANARY_LANE_PREFIX + q for q in queues)]


def mark_dead(client: redis.Redis, job_ids: Iterable[uuid.UUID | str]) -> int:
    """After committing the cancel of queued jobs: count the messages still waiting for them as
    dead (see the module docstring). Returns how many had a message waiting."""
    ids = [str(job_id) for job_id in job_ids]
    ttl_ms = redis_keys.ENQUEUED_TTL_SECONDS * 1000
    script = client.register_script(_MARK_DEAD_LUA)
    marked = 0
    for start in range(0, len(ids), MARK_CHUNK):
        chunk = ids[start:start + MARK_CHUNK]
        marked += int(cast("int", script(keys=[redis_keys.enqueued(job_id) for job_id in chunk],
                                         args=[_dead_prefix(), ttl_ms, *chunk])))
    return marked


def take_if_dead(client: redis.Redis, queue: str, job_id: uuid.UUID | str) -> bool:
    """A worker got ``job_id``'s message from ``queue``: True (and the member removed) when it is a
    cancelled job's dead message, to be skipped without a claim."""
    return bool(client.zrem(redis_keys.dead_messages(queue), str(job_id)))


def job_id_of_message(message: Any) -> uuid.UUID | None:
    """The job id of a ``cloverq.run_job`` message as kombu's Redis transport stores it (a dict
    with ``headers``, ``properties`` and the encoded ``body``); None for anything else."""
    try:
        if message.get("headers", {}).get("task") != RUN_JOB_TASK:
            return None
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        return uuid.UUID(str(json.loads(body)[0][0]))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None


def _job_id_of_entry(raw: bytes | str) -> uuid.UUID | None:
    try:
        return job_id_of_message(json.loads(raw))
    except ValueError:
        return None


def purge_dead_messages(client: redis.Redis, *, lanes: Iterable[str] | None = None,
                        max_scan: int = MAX_SCAN) -> int:
    """Remove the waiting messages of cancelled jobs from the lists of every queue with a non-empty
    dead set (at most ``max_scan`` entries read per list); returns how many were removed."""
    removed = 0
    for queue in lanes if lanes is not None else all_lanes():
        dead_key = redis_keys.dead_messages(queue)
        client.zremrangebyscore(dead_key, "-inf", _now_ms(client))
        dead = {_text(member) for member in cast("list[Any]", client.zrange(dead_key, 0, -1))}
        if not dead:
            continue
        scanned_whole = True
        for suffix in PRIORITY_SUFFIXES:
            found, whole = _purge_list(client, queue + suffix, dead, max_scan)
            scanned_whole = scanned_whole and whole
            if found:
                client.zrem(dead_key, *found)
                dead -= set(found)
                removed += len(found)
            if not dead:
                break
        if dead and scanned_whole:
            _forget_vanished(client, dead_key, queue, dead)
    if removed:
        log.info("reconciler.dead_messages_purged", messages=removed)
    return removed


def _forget_vanished(client: redis.Redis, dead_key: str, queue: str, members: set[str]) -> None:
    """Drop dead-set members whose message is in none of the queue's lists (every list was read to
    its end): the lists were deleted or flushed without the set. Left in place they would lower the
    queue's live depth, and so its cap, until their TTL (a day). A member whose message a worker
    holds right now (taken from the list, not yet checked) is dropped too: that worker then finds
    the job cancelled at its SQL claim and skips it, a slower path with the same outcome."""
    client.zrem(dead_key, *members)
    log.info("reconciler.dead_members_forgotten", queue=queue, members=len(members))


def _purge_list(client: redis.Redis, key: str, dead: set[str], max_scan: int) -> tuple[list[str], bool]:
    """LREM the entries of ``key`` whose job is in ``dead``: the ids of those removed, and whether the
    list was read to its end (or every dead member was found before it)."""
    found: list[str] = []
    start = 0
    while start < max_scan and len(found) < len(dead):
        entries = cast("list[bytes]", client.lrange(key, start, start + SCAN_CHUNK - 1))
        if not entries:
            return found, True
        kept = 0
        for raw in entries:
            job_id = _job_id_of_entry(raw)
            if job_id is not None and str(job_id) in dead and client.lrem(key, 1, cast("str", raw)):
                found.append(str(job_id))
            else:
                kept += 1
        start += kept  # removed entries shifted the rest left
    return found, len(found) == len(dead)


def _now_ms(client: redis.Redis) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
