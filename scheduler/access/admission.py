"""Admission control: refuse overload fast (429) instead of queueing without bound.

Three rules, all checked *before* anything is stored, so a refused request leaves no trace:

1. Per-key rate limit: a token bucket per API key, kept in Redis and updated by one Lua script
   (atomic across every API process; the clock is Redis' ``TIME``, so API hosts with skewed
   clocks agree). The same script answers whether the key was revoked (see ``scheduler.access.api_keys``),
   so authentication + rate limiting cost one Redis round trip per request; on the submit path
   the same round trip also runs the queue and tenant reservations below (``Admission.admit_job``).
2. Per-queue cap on the broker queue depth, exact under concurrent submits: ONE Lua script
   checks and reserves. A queue's depth counts live jobs: its Celery lists (``LLEN``) less the
   messages of jobs cancelled while queued that are still in them (``scheduler.dead_messages``:
   the cancel moves the job's enqueued marker into the queue's dead set in one step, and the
   message leaves the set when a worker takes it or the reconciler purges it), plus its *reservations*:
   jobs admitted whose message is not in the list yet (``redis_keys.queue_reservations``, a
   sorted set of enqueued-marker keys scored by expiry). The reservation is removed in the same
   MULTI as the message's ``LPUSH`` (``scheduler.infra.broker.Channel._put``, led by the
   ``ADMITTED_HEADER`` of the message), so a job is counted once from admission on, never zero
   times and never twice. A batch reserves all its jobs in every queue they use, or none.
3. Per-tenant cap on queued + running jobs (SQL, the system of record), never passed under
   concurrent submits: the same script reserves the jobs for the tenant too (released with the
   message like the queue's) and bumps the tenant's admission counter; the SQL count runs AFTER
   that, so every other admitted job is either still reserved or already committed (it is
   released only after its commit) and counted: SQL count + reservations >= the tenant's jobs.
   An API process reuses its last such bound for ``tenant_count_cache_seconds`` by adding the
   admissions of EVERY process since (the counter), so the estimate only over-counts (finished
   jobs); only a refusal, or an estimate over the cap, counts in SQL again.

Limits have defaults in ``Settings`` and runtime overrides in the Redis hash ``LIMITS_KEY``
(written by the admin API), so every API process sees a change at once without a restart.
That hash mirrors SQL (``scheduler.fleet.operator_state``: committed there first, restored from there
after a Redis restart); ``scheduler.access.limit_overrides`` reads and writes that hash (the
operator's change goes through ``operator_state.update_limits``: SQL first, then Redis).
A reservation expires after ``redis_keys.ADMISSION_RESERVATION_TTL_SECONDS`` (an API process
that died between admission and publish); a refusal from over-counting is transient (jobs in
the moment between their commit and their publish count twice for the tenant cap).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from scheduler.infra import redis_keys
from scheduler.infra.queue_names import JOB_QUEUES
from scheduler.infra.redis_keys import (
    ADMISSION_RESERVATION_TTL_SECONDS,
    ENQUEUED_TTL_SECONDS,
    LIMITS_KEY,
    REVOKED_SET,
)
from scheduler.infra.settings import Settings
from scheduler.jobs.models import Job, JobStatus

# Celery's Redis transport keeps one list per queue and priority step: "<q>" and "<q>\x06\x16<n>".
_PRIORITY_SUFFIXES: tuple[str, ...] = ("", "\x06\x163", "\x06\x166", "\x06\x169")

# The scripts are built from two Lua functions so that the API's submit path can run both rules
# in one round trip (``Admission.admit_job``) while other routes and batches use one each.
_SCRIPT_PRELUDE = "if redis.replicate_commands then pcall(redis.replicate_commands) end\n"

# Token bucket of ``bucket`` (and whether ``key_id`` is revoked): {revoked, allowed, retry ms, tokens}.
_TAKE_TOKEN_LUA = """
local function take_token(bucket_key, limits_key, revoked_key, bucket, rate0, burst0, cost, key_id)
  if key_id ~= '' and redis.call('SISMEMBER', revoked_key, key_id) == 1 then
    return {1, 0, 0, 0}
  end
  local lim = redis.call('HMGET', limits_key, 'rate_per_second', 'rate_burst',
                         'rate_per_second:' .. bucket, 'rate_burst:' .. bucket)
  local rate = tonumber(lim[3]) or tonumber(lim[1]) or tonumber(rate0)
  local burst = tonumber(lim[4]) or tonumber(lim[2]) or tonumber(burst0)
  if rate <= 0 then return {0, 1, 0, -1} end
  cost = tonumber(cost)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local state = redis.call('HMGET', bucket_key, 'tokens', 'ts')
  local tokens = tonumber(state[1]) or burst
  local ts = tonumber(state[2]) or now
  tokens = math.min(burst, tokens + math.max(0, now - ts) / 1000000 * rate)
  local allowed = 0
  local retry_ms = 0
  if tokens >= cost then
    tokens = tokens - cost
    allowed = 1
  else
    retry_ms = math.ceil((cost - tokens) / rate * 1000)
  end
  redis.call('HSET', bucket_key, 'tokens', tostring(tokens), 'ts', tostring(now))
  redis.call('PEXPIRE', bucket_key, math.ceil(burst / rate * 1000) + 1000)
  return {0, allowed, retry_ms, math.floor(tokens)}
end
"""

# Check every queue's cap and reserve the jobs in one step. KEYS[lk]: the limits hash; from
# ``k``: the tenant's reservations, the tenant's admission counter, then per queue its
# reservations, its 4 lists, its dead messages (``scheduler.dead_messages``) and its count of jobs
# held by fair share (``scheduler.fairness.held``), then (when a
# marker value is given) the job's enqueued marker. ARGV from ``a``:
# tenant, queue count, reservation ttl ms, marker value ('' = none), marker ttl s, then per
# queue: name, cap ('' = none), job count; then every job's member (its enqueued-marker key),
# queue by queue. Returns {admitted, refused queue (1-based; 0), its depth, its cap, tenant
# override, tenant reservations after adding, tenant admissions so far}.
_ADMIT_LUA = """
local function add_members(key, score, first, count)
  local i = 0
  while i < count do
    local n = math.min(count - i, 500)
    local args = {}
    for j = 1, n do
      args[#args + 1] = score
      args[#args + 1] = ARGV[first + i + j - 1]
    end
    redis.call('ZADD', key, unpack(args))
    i = i + n
  end
end

local function admit(lk, k, a)
  local tenant = ARGV[a]
  local nq = tonumber(ARGV[a + 1])
  local ttl = tonumber(ARGV[a + 2])
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local fields = {'tenant_max_active:' .. tenant, 'tenant_max_active'}
  for i = 1, nq do fields[#fields + 1] = 'queue_max_depth:' .. ARGV[a + 5 + (i - 1) * 3] end
  local lim = redis.call('HMGET', KEYS[lk], unpack(fields))
  local tenant_override = lim[1] or lim[2] or ''
  local total = 0
  for i = 1, nq do
    local qa = a + 5 + (i - 1) * 3
    local qk = k + 2 + (i - 1) * 7
    local count = tonumber(ARGV[qa + 2])
    total = total + count
    redis.call('ZREMRANGEBYSCORE', KEYS[qk], '-inf', now)
    redis.call('ZREMRANGEBYSCORE', KEYS[qk + 5], '-inf', now)
    local depth = redis.call('ZCARD', KEYS[qk])
    for j = 1, 4 do depth = depth + redis.call('LLEN', KEYS[qk + j]) end
    depth = math.max(0, depth - redis.call('ZCARD', KEYS[qk + 5]))  -- cancelled jobs' messages
    depth = depth + math.max(0, tonumber(redis.call('GET', KEYS[qk + 6]) or '0'))  -- held, no message
    local cap = tonumber(lim[2 + i]) or tonumber(ARGV[qa + 1])
    if cap ~= nil and depth + count > cap then
      return {0, i, depth, math.floor(cap), tenant_override, 0, 0}
    end
  end
  local member = a + 5 + nq * 3
  local expiry = now + ttl
  for i = 1, nq do
    local qk = k + 2 + (i - 1) * 7
    local count = tonumber(ARGV[a + 5 + (i - 1) * 3 + 2])
    add_members(KEYS[qk], expiry, member, count)
    redis.call('PEXPIRE', KEYS[qk], ttl + 1000)
    member = member + count
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[k], '-inf', now)
  add_members(KEYS[k], expiry, a + 5 + nq * 3, total)
  redis.call('PEXPIRE', KEYS[k], ttl + 1000)
  local pending = redis.call('ZCARD', KEYS[k])
  local admitted = redis.call('INCRBY', KEYS[k + 1], total)
  redis.call('EXPIRE', KEYS[k + 1], 86400)
  if ARGV[a + 3] ~= '' then
    redis.call('SET', KEYS[k + 2 + nq * 7], ARGV[a + 3], 'EX', ARGV[a + 4])
  end
  return {1, 0, 0, 0, tenant_override, pending, admitted}
end
"""

# KEYS: bucket, limits hash, revoked set. ARGV: bucket, rate, burst, cost, key id ('' = none).
_RATE_LIMIT_LUA = _SCRIPT_PRELUDE + _TAKE_TOKEN_LUA + """
return take_token(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
"""

# KEYS: limits hash, then the admission keys; ARGV: the admission arguments.
_QUEUE_LUA = _SCRIPT_PRELUDE + _ADMIT_LUA + """
return admit(1, 2, 1)
"""

# Both for one job: the rate rule first; a revoked key or an empty bucket stops there.
# KEYS: bucket, limits hash, revoked set, then the admission keys.
# ARGV: the rate script's five, then the admission arguments.
# Returns the rate script's four values followed by the admission script's seven.
_SUBMIT_LUA = _SCRIPT_PRELUDE + _TAKE_TOKEN_LUA + _ADMIT_LUA + """
local r = take_token(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
if r[1] == 1 or r[2] == 0 then
  return {r[1], r[2], r[3], r[4], 0, 0, 0, 0, '', 0, 0}
end
local q = admit(2, 4, 6)
return {r[1], r[2], r[3], r[4], q[1], q[2], q[3], q[4], q[5], q[6], q[7]}
"""


ActiveJobCount = Callable[[], int]  # counts a tenant's queued + running jobs (SQL)


@dataclass(slots=True)
class _CachedBound:
    bound: int  # SQL count + the tenant's reservations, right after the admission that counted
    admitted: int  # the tenant's admission counter at that admission
    counted_at: float  # time.monotonic() of the SQL count


class TenantCountCache:
    """Per-process upper bound of each tenant's active jobs, so most submits skip the SQL count.

    ``counted`` stores a bound (SQL count taken after an admission's reservation + the tenant's
    reservations then) with the tenant's admission counter at that admission; ``estimate``
    adds every admission since (of any API process: the counter is in Redis). A job that
    finished is still counted (the estimate only over-counts, which sends the next check to
    SQL); the bound is trusted for ``ttl_seconds``.
    """

    def __init__(self, ttl_seconds: float) -> None:
        self._ttl = ttl_seconds
        self._lock = threading.Lock()
        self._bounds: dict[str, _CachedBound] = {}

    def estimate(self, tenant: str, admitted: int) -> int | None:
        """The tenant's active jobs (an upper bound, this admission included), or None without
        a fresh bound. ``admitted``: the tenant's admission counter after this admission."""
        if self._ttl <= 0:
            return None
        with self._lock:
            cached = self._bounds.get(tenant)
            if cached is None or time.monotonic() - cached.counted_at >= self._ttl \
                    or admitted < cached.admitted:  # a reset counter (Redis flushed): count again
                return None
            return cached.bound + admitted - cached.admitted

    def counted(self, tenant: str, bound: int, admitted: int) -> None:
        """Store a fresh bound: SQL count + reservations, at the admission counter ``admitted``."""
        if self._ttl > 0:
            with self._lock:
                self._bounds[tenant] = _CachedBound(bound, admitted, time.monotonic())


@dataclass(frozen=True, slots=True)
class RateDecision:
    """Outcome of one rate-limit check."""

    revoked: bool
    allowed: bool
    retry_after_seconds: int  # whole seconds for the Retry-After header (>= 1 when refused)
    remaining: int  # tokens left; -1 when the limit is disabled


class AdmissionRefused(Exception):
    """A request refused by admission control: the API answers 429 with ``code``
    (``api.limit_messages.admission_refused`` adds the cap's setting and what to do).
    ``overridden``: the cap in force is a runtime override (``LIMITS_KEY``), not the setting."""

    def __init__(self, code: str, message: str, *, retry_after_seconds: int, details: dict[str, Any],
                 overridden: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_seconds = retry_after_seconds
        self.details = details
        self.overridden = overridden


class Admission:
    """Admission checks of one API process (a Redis client + the settings' defaults)."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self._redis = client
        self._settings = settings
        self._rate_script = client.register_script(_RATE_LIMIT_LUA)
        self._queue_script = client.register_script(_QUEUE_LUA)
        self._submit_script = client.register_script(_SUBMIT_LUA)
        self._tenant_counts = TenantCountCache(settings.admission.tenant_count_cache_seconds)

    def check_rate(self, bucket: str, *, key_id: str | None, cost: int = 1) -> RateDecision:
        """Take ``cost`` tokens from ``bucket``; also reports whether ``key_id`` was revoked."""
        return _rate_decision(self._rate_script(keys=self._rate_keys(bucket),
                                                args=self._rate_args(bucket, key_id, cost)))

    def _rate_keys(self, bucket: str) -> list[str]:
        return [redis_keys.rate_bucket(bucket), LIMITS_KEY, REVOKED_SET]

    def _rate_args(self, bucket: str, key_id: str | None, cost: int) -> list[Any]:
        admission = self._settings.admission
        return [bucket, admission.rate_limit_per_second, admission.rate_limit_burst, cost, key_id or ""]

    def admit_job(
        self, *, bucket: str, key_id: str | None, tenant: str, queue: str, enqueued_marker: str,
        active_jobs: int | ActiveJobCount | None,
    ) -> tuple[RateDecision, bool]:
        """The rate limit of ``bucket`` and the queue and tenant rules for one job, with ONE
        Redis round trip (the API's submit path; elsewhere :meth:`check_rate` and
        :meth:`check_batch` run separately).

        Returns the rate decision and whether the job's enqueued marker was set (with its
        reservations, which its message releases: ``scheduler.infra.broker.admitted_headers``). When
        the decision refuses (revoked key or empty bucket) nothing else was checked or written:
        the caller answers 401/429. Raises :class:`AdmissionRefused` like :meth:`check_batch`.
        """
        jobs = {queue: [enqueued_marker]}
        keys, args = self._admission_call(tenant, jobs, enqueued_marker)
        reply = self._submit_script(keys=[*self._rate_keys(bucket), *keys],
                                    args=[*self._rate_args(bucket, key_id, 1), *args])
        decision = _rate_decision(reply[:4])
        if decision.revoked or not decision.allowed:
            return decision, False
        self._settle(tenant, jobs, reply[4:], active_jobs, enqueued_marker)
        return decision, True

    def check_batch(
        self, *, tenant: str, jobs: Mapping[str, Sequence[str]], active_jobs: int | ActiveJobCount | None,
        enqueued_marker: str | None = None,
    ) -> bool:
        """Admit jobs spread over queues (``{queue: [each job's enqueued-marker key]}``), all or
        nothing, in one Redis round trip: every queue's cap is checked and the jobs reserved
        there and for the tenant (released by their messages), then the tenant rule runs.

        ``active_jobs`` is the tenant's queued + running count from SQL (see
        :func:`count_active_jobs`), or a function that counts it (called only when the
        process' cached bound does not show room; an int must be counted after this call's
        reservation to be exact); None skips the tenant rule. ``enqueued_marker`` (one job
        only): that job's enqueued-marker key, set by the same script when the job is admitted,
        which saves the publisher a round trip; it is removed again if the tenant rule refuses.
        Returns whether the marker was set.
        """
        if enqueued_marker is not None and [list(m) for m in jobs.values()] != [[enqueued_marker]]:
            raise ValueError("an enqueued marker needs exactly one job")
        keys, args = self._admission_call(tenant, jobs, enqueued_marker)
        reply = self._queue_script(keys=[LIMITS_KEY, *keys], args=args)
        self._settle(tenant, jobs, reply, active_jobs, enqueued_marker)
        return enqueued_marker is not None

    def _admission_call(
        self, tenant: str, jobs: Mapping[str, Sequence[str]], marker: str | None
    ) -> tuple[list[str], list[Any]]:
        """KEYS (after the limits hash) and ARGV of ``_ADMIT_LUA`` for ``jobs``."""
        keys = [redis_keys.tenant_reservations(tenant), redis_keys.tenant_admissions(tenant)]
        queue_value = next(iter(jobs)) if marker is not None else ""  # the marker holds the queue
        args: list[Any] = [tenant, len(jobs), ADMISSION_RESERVATION_TTL_SECONDS * 1000, queue_value,
                           ENQUEUED_TTL_SECONDS]
        for queue, members in jobs.items():
            keys += [redis_keys.queue_reservations(queue), *(queue + suffix for suffix in _PRIORITY_SUFFIXES),
                     redis_keys.dead_messages(queue), redis_keys.fair_held(queue)]
            cap = self._settings.admission.queue_max_depth.get(queue)
            args += [queue, "" if cap is None else cap, len(members)]
        for members in jobs.values():
            args += members
        if marker is not None:
            keys.append(marker)
        return keys, args

    def _settle(self, tenant: str, jobs: Mapping[str, Sequence[str]], reply: list[Any],
                active_jobs: int | ActiveJobCount | None, marker: str | None) -> None:
        """Raise ``queue_full`` for a queue the script found full (it reserved nothing then),
        else run the tenant rule, releasing the reservations and marker if it refuses."""
        admitted, refused, depth, cap, tenant_override, reserved, admissions = reply
        if not int(admitted):
            queue = list(jobs)[int(refused) - 1]
            raise AdmissionRefused(
                "queue_full",
                f"The {queue} queue is full ({int(depth)} waiting, cap {int(cap)}).",
                retry_after_seconds=5,
                details={"queue": queue, "depth": int(depth), "max_depth": int(cap)},
                overridden=int(cap) != self._settings.admission.queue_max_depth.get(queue),
            )
        total = sum(len(members) for members in jobs.values())
        try:
            self._admit_tenant(tenant, total, tenant_override, active_jobs, int(reserved), int(admissions))
        except BaseException:
            self.release(tenant, jobs, marker)  # nothing stored for a refused request
            raise

    def _admit_tenant(self, tenant: str, total: int, override: Any, active_jobs: int | ActiveJobCount | None,
                      reserved: int, admissions: int) -> None:
        """Raise ``tenant_limit`` if the tenant's jobs, ``total`` just reserved among its
        ``reserved`` reservations, pass its cap (``admissions``: its admission counter now)."""
        tenant_cap = _int_or(override, self._settings.admission.tenant_max_active_jobs)
        if active_jobs is None or tenant_cap is None:
            return
        if callable(active_jobs):
            bound = self._tenant_counts.estimate(tenant, admissions)
            if bound is not None and bound <= tenant_cap:
                return
            active_jobs = active_jobs()  # counted after the reservation: see the module docstring
        bound = active_jobs + reserved  # a job between its commit and its publish counts twice
        self._tenant_counts.counted(tenant, bound, admissions)
        if bound > tenant_cap:
            others = bound - total
            raise AdmissionRefused(
                "tenant_limit",
                f"Tenant has {others} queued, running or just admitted jobs (cap {tenant_cap}).",
                retry_after_seconds=5,
                details={"active_jobs": others, "max_active_jobs": tenant_cap},
                overridden=override not in (None, b"", ""),
            )

    def release(self, tenant: str, jobs: Mapping[str, Sequence[str]], marker: str | None = None) -> None:
        """Drop the reservations (and the marker) of admitted jobs that will not be stored or
        published. A Redis failure here must not turn a refusal into an admission: the
        reservations expire, and the reconciler only reads markers of stored rows."""
        try:
            with self._redis.pipeline(transaction=False) as pipe:
                everyone: list[str] = []
                for queue, members in jobs.items():
                    if members:
                        pipe.zrem(redis_keys.queue_reservations(queue), *members)
                        everyone += members
                if everyone:
                    pipe.zrem(redis_keys.tenant_reservations(tenant), *everyone)
                if marker is not None:
                    pipe.delete(marker)
                pipe.execute()
        except redis.RedisError:
            return

    def tenant_cap(self, tenant: str) -> int:
        """The tenant's effective cap (override or default)."""
        values = self._redis.hmget(LIMITS_KEY, [f"tenant_max_active:{tenant}", "tenant_max_active"])
        override = next((value for value in values if value is not None), None)
        cap = _int_or(override, self._settings.admission.tenant_max_active_jobs)
        assert cap is not None
        return cap


def forget_admitted(client: redis.Redis, *, tenant: str, marker: str,
                    queues: Iterable[str] = JOB_QUEUES) -> None:
    """Remove the enqueued marker and the admission reservations (in whichever of ``queues``)
    of one admitted job that was not stored after all. Raises ``redis.RedisError``; left alone
    they expire (the marker is only read for stored rows; a reservation over-counts a minute)."""
    with client.pipeline(transaction=False) as pipe:
        pipe.delete(marker)
        for queue in queues:
            pipe.zrem(redis_keys.queue_reservations(queue), marker)
        pipe.zrem(redis_keys.tenant_reservations(tenant), marker)
        pipe.execute()


def _rate_decision(reply: list[Any]) -> RateDecision:
    revoked, allowed, retry_ms, remaining = reply
    return RateDecision(
        revoked=bool(revoked),
        allowed=bool(allowed),
        retry_after_seconds=max(1, math.ceil(int(retry_ms) / 1000)) if not allowed else 0,
        remaining=int(remaining),
    )


def count_active_jobs(session: Session, *, tenant: str) -> int:
    """The tenant's queued + running jobs (index ``ix_jobs_tenant_status_created``)."""
    query = (
        select(func.count())
        .select_from(Job)
        .where(Job.tenant == tenant, Job.status.in_((JobStatus.QUEUED.value, JobStatus.RUNNING.value)))
    )
    return int(session.scalar(query) or 0)


def _int_or(value: bytes | str | None, default: int | None) -> int | None:
    if value in (None, b"", ""):
        return default
    return int(float(value))


def queue_depths(client: redis.Redis, queues: Iterable[str]) -> dict[str, int]:
    """Live jobs waiting in each Celery queue (all priority lists, less the messages of jobs
    cancelled while queued: ``scheduler.dead_messages``, plus the jobs fair share holds without a
    message: ``scheduler.fairness.held``), one pipelined round trip."""
    names = list(queues)
    pipe = client.pipeline(transaction=False)
    for queue in names:
        for suffix in _PRIORITY_SUFFIXES:
            pipe.llen(queue + suffix)
        pipe.zcard(redis_keys.dead_messages(queue))
        pipe.get(redis_keys.fair_held(queue))
    lengths = pipe.execute()
    per = len(_PRIORITY_SUFFIXES) + 2
    return {queue: max(0, int(sum(lengths[i * per:i * per + len(_PRIORITY_SUFFIXES)]))
                       - int(lengths[i * per + len(_PRIORITY_SUFFIXES)]))
            + max(0, int(lengths[(i + 1) * per - 1] or 0))
            for i, queue in enumerate(names)}
