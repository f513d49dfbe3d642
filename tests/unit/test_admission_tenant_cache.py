"""The per-process tenant bound: the last SQL count + reservations, plus every admission since
(of any API process, by the shared admission counter), trusted for the cache's ttl."""

from __future__ import annotations

from scheduler.access.admission import TenantCountCache


def test_the_bound_grows_by_every_admission_since_the_count() -> None:
    cache = TenantCountCache(ttl_seconds=60.0)
    assert cache.estimate("t", admitted=5) is None  # nothing counted yet
    cache.counted("t", 10, admitted=5)  # 10 = SQL count + reservations, at the 5th admission
    assert cache.estimate("t", admitted=5) == 10
    assert cache.estimate("t", admitted=9) == 14  # 4 more admitted, by this process or others


def test_a_reset_counter_or_a_zero_ttl_gives_no_bound() -> None:
    cache = TenantCountCache(ttl_seconds=60.0)
    cache.counted("t", 10, admitted=500)
    assert cache.estimate("t", admitted=3) is None  # Redis lost the counter: count again
    off = TenantCountCache(ttl_seconds=0.0)
    off.counted("t", 10, admitted=1)
    assert off.estimate("t", admitted=1) is None


def test_tenants_are_separate_and_entries_expire() -> None:
    cache = TenantCountCache(ttl_seconds=60.0)
    cache.counted("a", 7, admitted=1)
    cache.counted("b", 3, admitted=1)
    assert (cache.estimate("a", admitted=2), cache.estimate("b", admitted=2)) == (8, 4)
    brief = TenantCountCache(ttl_seconds=1e-9)
    brief.counted("t", 4, admitted=1)
    assert brief.estimate("t", admitted=1) is None
