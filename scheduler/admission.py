"""Admission control: refuse overload fast (429) instead of queueing without bound.

Three rules, all checked *before* anything is stored, so a refused request leaves no trace:

1. Per-key rate limit: a token bucket per API key, kept in Redis and updated by one Lua script
   (atomic across every API process; the clock is Redis' ``TIME``, so API hosts with skewed
   clocks agree). The same script answers whether the key was revoked (see ``scheduler.keys``),
   so authentication + rate limiting cost one Redis round trip per request; on the submit path
   the same round trip also checks the queue rule below (``Admission.admit_job``).
2. Per-tenant cap on queued + running jobs (counted in SQL, the system of record). Far below
   the cap an API process reuses its last count for ``tenant_count_cache_seconds`` (plus what
   it admitted since), which saves a SQL round trip per submit; near the cap, and before every
   refusal, it counts in SQL, so refusals and their details are exact.
3. Per-queue cap on the broker queue depth (``LLEN`` of the Celery queue lists: O(1)).

Limits have defaults in ``Settings`` and runtime overrides in the Redis hash ``LIMITS_KEY``
(written by the admin API), so every API process sees a change at once without a restart.
Under concurrency the tenant cap may be overshot by the number of that tenant's submits in
flight at the same instant (count, then insert); it bounds load, it is not a quota ledger.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from scheduler.keys import REVOKED_SET
from scheduler.models import Job, JobStatus
from scheduler.redis_keys import ENQUEUED_TTL_SECONDS
from scheduler.settings import Settings

LIMITS_KEY = "cloverq:limits"  # Redis hash of runtime overrides (field -> number)
BUCKET_PREFIX = "cloverq:ratelimit:"  # + bucket id (key id, or "tenant:<t>" without keys)

# Celery's Redis transport keeps one list per queue and priority step: "<q>" and "<q>\x06\x16<n>".
_PRIORITY_SUFFIXES: tuple[str, ...] = ("", "\x06\x163", "\x06\x166", "\x06\x169")

# Override fields accepted in LIMITS_KEY (a trailing ":" means "per <thing>": field + ":" + name).
GLOBAL_FIELDS: frozenset[str] = frozenset({"rate_per_second", "rate_burst", "tenant_max_active"})
PER_NAME_FIELDS: frozenset[str] = frozenset(
    {"rate_per_second:", "rate_burst:", "tenant_max_active:", "queue_max_depth:"}
)

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

# Depth of a queue (its lists are KEYS[first..last]) and the limit overrides; when ``marker_key``
# is given, the job's enqueued marker is set in the same call if ``count`` jobs fit the cap
# (override, else ``cap0``; '' = none). {depth, queue override, tenant override, marker set}.
_ADMIT_QUEUE_LUA = """
local function admit_queue(limits_key, first, last, marker_key, queue, tenant, cap0, count, value, ttl)
  local lim = redis.call('HMGET', limits_key, 'queue_max_depth:' .. queue,
                         'tenant_max_active:' .. tenant, 'tenant_max_active')
  local depth = 0
  for i = first, last do depth = depth + redis.call('LLEN', KEYS[i]) end
  local marked = 0
  if marker_key then
    local cap = tonumber(lim[1]) or tonumber(cap0)
    if cap == nil or depth + tonumber(count) <= cap then
      redis.call('SET', marker_key, value, 'EX', ttl)
      marked = 1
    end
  end
  return {depth, lim[1] or '', lim[2] or lim[3] or '', marked}
end
"""

# KEYS: bucket, limits hash, revoked set. ARGV: bucket, rate, burst, cost, key id ('' = none).
_RATE_LIMIT_LUA = _SCRIPT_PRELUDE + _TAKE_TOKEN_LUA + """
return take_token(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
"""

# KEYS: limits hash, the queue's lists, then (when ARGV[3] == '1') the job's enqueued marker.
# ARGV: queue, tenant, marker?, cap, jobs, marker value, marker TTL s.
_QUEUE_LUA = _ADMIT_QUEUE_LUA + """
local last = #KEYS
local marker = nil
if ARGV[3] == '1' then
  marker = KEYS[last]
  last = last - 1
end
return admit_queue(KEYS[1], 2, last, marker, ARGV[1], ARGV[2], ARGV[4], ARGV[5], ARGV[6], ARGV[7])
"""

# Both for one job: the rate rule first; a revoked key or an empty bucket stops there.
# KEYS: bucket, limits hash, revoked set, the queue's lists, the job's enqueued marker.
# ARGV: the rate script's five, then queue, tenant, cap, marker value, marker TTL s.
# Returns the rate script's four values followed by the queue script's four.
_SUBMIT_LUA = _SCRIPT_PRELUDE + _TAKE_TOKEN_LUA + _ADMIT_QUEUE_LUA + """
local r = take_token(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
if r[1] == 1 or r[2] == 0 then
  return {r[1], r[2], r[3], r[4], 0, '', '', 0}
end
local q = admit_queue(KEYS[2], 4, #KEYS - 1, KEYS[#KEYS], ARGV[6], ARGV[7], ARGV[8], 1, ARGV[9], ARGV[10])
return {r[1], r[2], r[3], r[4], q[1], q[2], q[3], q[4]}
"""


# A cached tenant count is only trusted this far below the cap: max(MIN, cap // DIVISOR) jobs.
CACHE_MIN_HEADROOM = 64
CACHE_HEADROOM_DIVISOR = 10

ActiveJobCount = Callable[[], int]  # counts a tenant's queued + running jobs (SQL)


@dataclass(slots=True)
class _CachedCount:
    count: int  # last SQL count + jobs admitted by this process since
    counted_at: float  # time.monotonic() of the SQL count


class TenantCountCache:
    """Per-process estimate of each tenant's active jobs, used only far below the cap.

    The estimate is the last SQL count plus what this process admitted since; it ignores
    jobs that finished (it only over-counts, which sends the next check to SQL) and jobs
    other API processes admitted in the same ``ttl_seconds`` (bounded by the headroom).
    """

    def __init__(self, ttl_seconds: float) -> None:
        self._ttl = ttl_seconds
        self._lock = threading.Lock()
        self._counts: dict[str, _CachedCount] = {}

    def active_jobs(self, tenant: str, *, cap: int, adding: int, count: ActiveJobCount) -> int:
        """The tenant's active jobs: the cached estimate when far below ``cap``, else ``count()``."""
        headroom = max(CACHE_MIN_HEADROOM, cap // CACHE_HEADROOM_DIVISOR)
        if self._ttl > 0:
            now = time.monotonic()
            with self._lock:
                cached = self._counts.get(tenant)
                if cached is not None and now - cached.counted_at < self._ttl \
                        and cached.count + adding <= cap - headroom:
                    return cached.count
        counted = count()
        if self._ttl > 0:
            with self._lock:
                self._counts[tenant] = _CachedCount(counted, time.monotonic())
        return counted

    def admitted(self, tenant: str, jobs: int) -> None:
        """Add ``jobs`` just admitted for ``tenant`` to its estimate."""
        with self._lock:
            cached = self._counts.get(tenant)
            if cached is not None:
                cached.count += jobs


@dataclass(frozen=True, slots=True)
class RateDecision:
    """Outcome of one rate-limit check."""

    revoked: bool
    allowed: bool
    retry_after_seconds: int  # whole seconds for the Retry-After header (>= 1 when refused)
    remaining: int  # tokens left; -1 when the limit is disabled


class AdmissionRefused(Exception):
    """A request refused by admission control: the API answers 429 with ``code``."""

    def __init__(self, code: str, message: str, *, retry_after_seconds: int, details: dict[str, Any]) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_seconds = retry_after_seconds
        self.details = details


class Admission:
    """Admission checks of one API process (a Redis client + the settings' defaults)."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self._redis = client
        self._settings = settings
        self._rate_script = client.register_script(_RATE_LIMIT_LUA)
        self._queue_script = client.register_script(_QUEUE_LUA)
        self._submit_script = client.register_script(_SUBMIT_LUA)
        self._tenant_counts = TenantCountCache(settings.tenant_count_cache_seconds)

    def check_rate(self, bucket: str, *, key_id: str | None, cost: int = 1) -> RateDecision:
        """Take ``cost`` tokens from ``bucket``; also reports whether ``key_id`` was revoked."""
        return _rate_decision(self._rate_script(keys=self._rate_keys(bucket),
                                                args=self._rate_args(bucket, key_id, cost)))

    def _rate_keys(self, bucket: str) -> list[str]:
        return [BUCKET_PREFIX + bucket, LIMITS_KEY, REVOKED_SET]

    def _rate_args(self, bucket: str, key_id: str | None, cost: int) -> list[Any]:
        return [bucket, self._settings.rate_limit_per_second, self._settings.rate_limit_burst, cost,
                key_id or ""]

    def admit_job(
        self, *, bucket: str, key_id: str | None, tenant: str, queue: str, enqueued_marker: str,
        active_jobs: int | ActiveJobCount | None,
    ) -> tuple[RateDecision, bool]:
        """The rate limit of ``bucket`` and the queue and tenant rules for one job, with ONE
        Redis round trip (the API's submit path; elsewhere :meth:`check_rate` and
        :meth:`check_batch` run separately).

        Returns the rate decision and whether the job's enqueued marker was set. When the
        decision refuses (revoked key or empty bucket) nothing else was checked or written:
        the caller answers 401/429. Raises :class:`AdmissionRefused` like :meth:`check_batch`.
        """
        cap = self._settings.queue_max_depth.get(queue)
        reply = self._submit_script(
            keys=[*self._rate_keys(bucket), *(queue + suffix for suffix in _PRIORITY_SUFFIXES),
                  enqueued_marker],
            args=[*self._rate_args(bucket, key_id, 1), queue, tenant, "" if cap is None else cap,
                  queue, ENQUEUED_TTL_SECONDS],
        )
        decision = _rate_decision(reply[:4])
        if decision.revoked or not decision.allowed:
            return decision, False
        depth, queue_override, tenant_override, marked = reply[4:]
        marker = enqueued_marker if marked else None
        self._refuse_full_queue(queue, 1, int(depth), queue_override, marker)
        return decision, self._admit_tenant(tenant, 1, tenant_override, active_jobs, marker)

    def check_submission(
        self, *, tenant: str, queue: str, active_jobs: int | ActiveJobCount | None, count: int = 1
    ) -> None:
        """Raise :class:`AdmissionRefused` unless ``count`` more jobs fit ``queue`` and ``tenant``.

        ``active_jobs`` is the tenant's queued + running count from SQL (see
        :func:`count_active_jobs`), or a function that counts it (called only when the
        process' cached estimate is not far enough below the cap); None skips the tenant rule.
        """
        self.check_batch(tenant=tenant, per_queue={queue: count}, active_jobs=active_jobs)

    def check_batch(
        self, *, tenant: str, per_queue: Mapping[str, int], active_jobs: int | ActiveJobCount | None,
        enqueued_marker: str | None = None,
    ) -> bool:
        """Like :meth:`check_submission` for jobs spread over queues (``{queue: count}``).

        One script call per queue (a single job: one Redis round trip); all or nothing.
        ``enqueued_marker`` (one queue only): the job's enqueued-marker key, set by the same
        script when the job is admitted, which saves the publisher a round trip; it is removed
        again if the tenant rule refuses. Returns whether the marker was set.
        """
        if enqueued_marker is not None and len(per_queue) != 1:
            raise ValueError("an enqueued marker needs exactly one queue")
        tenant_override: Any = None
        marked = False
        for queue, count in per_queue.items():
            cap = self._settings.queue_max_depth.get(queue)
            marker_keys = [enqueued_marker] if enqueued_marker is not None else []
            depth, queue_override, tenant_override, marked_now = self._queue_script(
                keys=[LIMITS_KEY, *(queue + suffix for suffix in _PRIORITY_SUFFIXES), *marker_keys],
                args=[queue, tenant, "1" if marker_keys else "0", "" if cap is None else cap, count,
                      queue, ENQUEUED_TTL_SECONDS],
            )
            marked = bool(marked_now)
            self._refuse_full_queue(queue, count, int(depth), queue_override,
                                    enqueued_marker if marked else None)
        total = sum(per_queue.values())
        return self._admit_tenant(tenant, total, tenant_override, active_jobs,
                                  enqueued_marker if marked else None)

    def _refuse_full_queue(self, queue: str, count: int, depth: int, override: Any,
                           marker: str | None) -> None:
        """Raise ``queue_full`` if ``count`` more jobs do not fit (removing a marker just set)."""
        queue_cap = _int_or(override, self._settings.queue_max_depth.get(queue))
        if queue_cap is not None and depth + count > queue_cap:
            self._forget_marker(marker)
            raise AdmissionRefused(
                "queue_full",
                f"The {queue} queue is full ({depth} waiting, cap {queue_cap}); retry later.",
                retry_after_seconds=5,
                details={"queue": queue, "depth": depth, "max_depth": queue_cap},
            )

    def _admit_tenant(self, tenant: str, total: int, override: Any, active_jobs: int | ActiveJobCount | None,
                      marker: str | None) -> bool:
        """Raise ``tenant_limit`` if ``total`` more jobs pass the tenant's cap (removing
        ``marker``, set for a job that will now not be stored); returns whether a marker stands."""
        tenant_cap = _int_or(override, self._settings.tenant_max_active_jobs)
        if active_jobs is None or tenant_cap is None:
            return marker is not None
        try:
            if callable(active_jobs):
                active_jobs = self._tenant_counts.active_jobs(tenant, cap=tenant_cap, adding=total,
                                                              count=active_jobs)
        except BaseException:
            self._forget_marker(marker)
            raise
        if active_jobs + total > tenant_cap:
            self._forget_marker(marker)  # nothing stored for a refused request
            raise AdmissionRefused(
                "tenant_limit",
                f"Tenant has {active_jobs} queued or running jobs (cap {tenant_cap}); retry later.",
                retry_after_seconds=5,
                details={"active_jobs": active_jobs, "max_active_jobs": tenant_cap},
            )
        self._tenant_counts.admitted(tenant, total)
        return marker is not None

    def _forget_marker(self, marker: str | None) -> None:
        """Remove a marker set for a job that will not be stored; a Redis failure here must not
        turn the refusal into an admission (the marker expires, and the reconciler only reads
        markers of stored rows)."""
        if marker is None:
            return
        try:
            self._redis.delete(marker)
        except redis.RedisError:
            return

    def tenant_cap(self, tenant: str) -> int:
        """The tenant's effective cap (override or default)."""
        values = self._redis.hmget(LIMITS_KEY, [f"tenant_max_active:{tenant}", "tenant_max_active"])
        override = next((value for value in values if value is not None), None)
        cap = _int_or(override, self._settings.tenant_max_active_jobs)
        assert cap is not None
        return cap


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


# --- runtime limits (admin API) ----------------------------------------------------------------


def effective_limits(client: redis.Redis, settings: Settings) -> dict[str, Any]:
    """Defaults from Settings, overrides from Redis, and what is in force for each knob."""
    raw = client.hgetall(LIMITS_KEY)
    overrides = {_text(field): float(value) for field, value in raw.items()}
    queues = dict(settings.queue_max_depth)
    return {
        "defaults": {
            "rate_per_second": settings.rate_limit_per_second,
            "rate_burst": settings.rate_limit_burst,
            "tenant_max_active": settings.tenant_max_active_jobs,
            "queue_max_depth": queues,
        },
        "overrides": {field: _number(value) for field, value in sorted(overrides.items())},
        "effective": {
            "rate_per_second": _number(overrides.get("rate_per_second", settings.rate_limit_per_second)),
            "rate_burst": int(overrides.get("rate_burst", settings.rate_limit_burst)),
            "tenant_max_active": int(overrides.get("tenant_max_active", settings.tenant_max_active_jobs)),
            "queue_max_depth": {
                queue: int(overrides.get(f"queue_max_depth:{queue}", cap)) for queue, cap in queues.items()
            },
        },
    }


def validate_limit_field(field: str) -> None:
    """Raise ValueError for a field that no admission rule reads."""
    if field in GLOBAL_FIELDS:
        return
    prefix, sep, name = field.partition(":")
    if sep and f"{prefix}:" in PER_NAME_FIELDS and name:
        return
    raise ValueError(f"unknown limit {field!r}")


def update_limits(client: redis.Redis, updates: Mapping[str, float | None]) -> None:
    """Set (number) or clear (None) runtime overrides; one MULTI so readers never see half."""
    for field in updates:
        validate_limit_field(field)
    pipe = client.pipeline(transaction=True)
    for field, value in updates.items():
        if value is None:
            pipe.hdel(LIMITS_KEY, field)
        else:
            pipe.hset(LIMITS_KEY, field, repr(float(value)))
    pipe.execute()


def queue_depths(client: redis.Redis, queues: Iterable[str]) -> dict[str, int]:
    """Messages waiting in each Celery queue (all priority lists), one pipelined round trip."""
    names = list(queues)
    pipe = client.pipeline(transaction=False)
    for queue in names:
        for suffix in _PRIORITY_SUFFIXES:
            pipe.llen(queue + suffix)
    lengths = pipe.execute()
    per = len(_PRIORITY_SUFFIXES)
    return {queue: int(sum(lengths[i * per:(i + 1) * per])) for i, queue in enumerate(names)}


def mark_revoked(client: redis.Redis, key_ids: Iterable[str]) -> None:
    """Tell every API process at once that these keys are revoked (read by the rate script)."""
    ids = list(key_ids)
    if ids:
        client.sadd(REVOKED_SET, *ids)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value
