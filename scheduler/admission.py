"""Admission control: refuse overload fast (429) instead of queueing without bound.

Three rules, all checked *before* anything is stored, so a refused request leaves no trace:

1. Per-key rate limit: a token bucket per API key, kept in Redis and updated by one Lua script
   (atomic across every API process; the clock is Redis' ``TIME``, so API hosts with skewed
   clocks agree). The same script answers whether the key was revoked (see ``scheduler.keys``),
   so authentication + rate limiting cost one Redis round trip per request.
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

_RATE_LIMIT_LUA = """
if redis.replicate_commands then pcall(redis.replicate_commands) end
if ARGV[5] ~= '' and redis.call('SISMEMBER', KEYS[3], ARGV[5]) == 1 then
  return {1, 0, 0, 0}
end
local lim = redis.call('HMGET', KEYS[2], 'rate_per_second', 'rate_burst',
                       'rate_per_second:' .. ARGV[1], 'rate_burst:' .. ARGV[1])
local rate = tonumber(lim[3]) or tonumber(lim[1]) or tonumber(ARGV[2])
local burst = tonumber(lim[4]) or tonumber(lim[2]) or tonumber(ARGV[3])
if rate <= 0 then return {0, 1, 0, -1} end
local cost = tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
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
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {0, allowed, retry_ms, math.floor(tokens)}
"""

# KEYS: limits hash, the queue's lists, then (when ARGV[3] == '1') the job's enqueued marker,
# which is set in the same round trip when the job fits the queue (cap ARGV[4], '' = none;
# ARGV[5] jobs; marker value ARGV[6], TTL ARGV[7] s). Returns depth, overrides, marker set.
_QUEUE_LUA = """
local lim = redis.call('HMGET', KEYS[1], 'queue_max_depth:' .. ARGV[1],
                       'tenant_max_active:' .. ARGV[2], 'tenant_max_active')
local last = #KEYS
if ARGV[3] == '1' then last = last - 1 end
local depth = 0
for i = 2, last do depth = depth + redis.call('LLEN', KEYS[i]) end
local marked = 0
if ARGV[3] == '1' then
  local cap = tonumber(lim[1]) or tonumber(ARGV[4])
  if cap == nil or depth + tonumber(ARGV[5]) <= cap then
    redis.call('SET', KEYS[#KEYS], ARGV[6], 'EX', ARGV[7])
    marked = 1
  end
end
return {depth, lim[1] or '', lim[2] or lim[3] or '', marked}
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
        self._tenant_counts = TenantCountCache(settings.tenant_count_cache_seconds)

    def check_rate(self, bucket: str, *, key_id: str | None, cost: int = 1) -> RateDecision:
        """Take ``cost`` tokens from ``bucket``; also reports whether ``key_id`` was revoked."""
        revoked, allowed, retry_ms, remaining = self._rate_script(
            keys=[BUCKET_PREFIX + bucket, LIMITS_KEY, REVOKED_SET],
            args=[
                bucket,
                self._settings.rate_limit_per_second,
                self._settings.rate_limit_burst,
                cost,
                key_id or "",
            ],
        )
        return RateDecision(
            revoked=bool(revoked),
            allowed=bool(allowed),
            retry_after_seconds=max(1, math.ceil(int(retry_ms) / 1000)) if not allowed else 0,
            remaining=int(remaining),
        )

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
            queue_cap = _int_or(queue_override, self._settings.queue_max_depth.get(queue))
            if queue_cap is not None and int(depth) + count > queue_cap:
                if marked:
                    self._forget_marker(enqueued_marker)
                raise AdmissionRefused(
                    "queue_full",
                    f"The {queue} queue is full ({int(depth)} waiting, cap {queue_cap}); retry later.",
                    retry_after_seconds=5,
                    details={"queue": queue, "depth": int(depth), "max_depth": queue_cap},
                )
        total = sum(per_queue.values())
        tenant_cap = _int_or(tenant_override, self._settings.tenant_max_active_jobs)
        if active_jobs is None or tenant_cap is None:
            return marked
        try:
            if callable(active_jobs):
                active_jobs = self._tenant_counts.active_jobs(tenant, cap=tenant_cap, adding=total,
                                                              count=active_jobs)
        except BaseException:
            if marked:
                self._forget_marker(enqueued_marker)
            raise
        if active_jobs + total > tenant_cap:
            if marked:
                self._forget_marker(enqueued_marker)  # nothing stored for a refused request
            raise AdmissionRefused(
                "tenant_limit",
                f"Tenant has {active_jobs} queued or running jobs (cap {tenant_cap}); retry later.",
                retry_after_seconds=5,
                details={"active_jobs": active_jobs, "max_active_jobs": tenant_cap},
            )
        self._tenant_counts.admitted(tenant, total)
        return marked

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
