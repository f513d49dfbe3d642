"""The per-process tenant count cache: trusted only far below the cap, SQL otherwise."""

from __future__ import annotations

from scheduler.admission import CACHE_MIN_HEADROOM, TenantCountCache


class CountingSql:
    """A stand-in for the SQL count: returns ``value`` and counts how often it was asked."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        return self.value


def test_far_below_the_cap_the_cached_count_plus_admitted_jobs_is_used() -> None:
    cache, sql = TenantCountCache(ttl_seconds=60.0), CountingSql(10)
    assert cache.active_jobs("t", cap=10_000, adding=1, count=sql) == 10
    cache.admitted("t", 1)
    sql.value = 999  # SQL changed behind our back: the estimate is still trusted far from the cap
    assert cache.active_jobs("t", cap=10_000, adding=1, count=sql) == 11
    assert sql.calls == 1


def test_near_the_cap_every_check_counts_in_sql() -> None:
    cache, sql = TenantCountCache(ttl_seconds=60.0), CountingSql(0)
    cap = CACHE_MIN_HEADROOM  # any estimate is within the headroom of this cap
    for expected in (0, 1, 2):
        sql.value = expected
        assert cache.active_jobs("t", cap=cap, adding=1, count=sql) == expected
        cache.admitted("t", 1)
    assert sql.calls == 3


def test_headroom_is_a_tenth_of_a_large_cap() -> None:
    cache, sql = TenantCountCache(ttl_seconds=60.0), CountingSql(0)
    cache.active_jobs("t", cap=10_000, adding=1, count=sql)
    cache.admitted("t", 8_999)  # estimate 8,999: adding one reaches cap - headroom (9,000)
    assert cache.active_jobs("t", cap=10_000, adding=1, count=sql) == 8_999
    cache.admitted("t", 1)
    assert cache.active_jobs("t", cap=10_000, adding=1, count=sql) == 0  # past it: SQL again
    assert sql.calls == 2


def test_a_zero_ttl_always_counts_and_tenants_are_separate() -> None:
    cache, sql = TenantCountCache(ttl_seconds=0.0), CountingSql(5)
    for _ in range(3):
        assert cache.active_jobs("t", cap=10**9, adding=1, count=sql) == 5
    assert sql.calls == 3
    cached = TenantCountCache(ttl_seconds=60.0)
    cached.active_jobs("a", cap=10**9, adding=1, count=CountingSql(7))
    assert cached.active_jobs("b", cap=10**9, adding=1, count=CountingSql(3)) == 3


def test_an_expired_entry_is_counted_again() -> None:
    cache, sql = TenantCountCache(ttl_seconds=1e-9), CountingSql(4)
    cache.active_jobs("t", cap=10**9, adding=1, count=sql)
    assert cache.active_jobs("t", cap=10**9, adding=1, count=sql) == 4
    assert sql.calls == 2
