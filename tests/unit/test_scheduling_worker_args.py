"""``cloverq worker`` argument handling: our options are honoured (and published), the rest pass on."""

from __future__ import annotations

import sys

from scheduler.infra.settings import Settings
from worker.celery_worker import _option, _without_options, apply_switch_interval, worker_argv

OURS = ("-Q", "--queues", "-c", "--concurrency", "-n", "--hostname")


def test_options_are_read_in_both_spellings_last_one_wins() -> None:
    args = ["-Q", "bulk", "--queues=interactive,standard", "-c", "3", "--loglevel=DEBUG"]
    assert _option(args, "-Q", "--queues") == "interactive,standard"
    assert _option(args, "-c", "--concurrency") == "3"
    assert _option(args, "-n", "--hostname") is None


def test_our_options_are_removed_and_the_rest_is_passed_through() -> None:
    args = ["-Q", "bulk", "--concurrency=2", "--loglevel=DEBUG", "-n", "gpu0@host", "--without-heartbeat"]
    assert _without_options(args, *OURS) == ["--loglevel=DEBUG", "--without-heartbeat"]


def test_worker_argv_uses_a_threads_pool_and_keeps_queue_order() -> None:
    argv = worker_argv(Settings(), queues=["interactive", "standard", "bulk"], concurrency=16, hostname="w@h")
    assert "--pool=threads" in argv and "--concurrency=16" in argv
    assert "--queues=interactive,standard,bulk" in argv and "--hostname=w@h" in argv


def test_the_worker_shortens_pythons_thread_switch_interval() -> None:
    """The engine thread must hand the GIL to a claiming task thread within the setting, not 5 ms."""
    before = sys.getswitchinterval()
    try:
        apply_switch_interval(Settings(worker_switch_interval_ms=0.5))
        assert sys.getswitchinterval() == 0.0005
        assert Settings().worker.switch_interval_ms < 5.0  # below Python's default
    finally:
        sys.setswitchinterval(before)
