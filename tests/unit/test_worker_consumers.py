"""Which queues a worker consumes: the pure rule (``consumed_queues``) and its one controller."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import replace
from typing import Any

import pytest
import redis

from worker.consumers import ConsumerController, ConsumerState, consumed_queues, ordered_queues
from worker.queue_drain import DrainFollower

ALL = ("interactive", "standard", "bulk", "joint")
SHORT = ("interactive", "standard", "bulk")


def lanes(*names: str) -> frozenset[str]:
    return frozenset(f"canary.{name}" for name in names)


# (why, state, expected Celery queues)
CASES: list[tuple[str, ConsumerState, frozenset[str]]] = [
    ("configured, nothing else", ConsumerState(ALL), frozenset(ALL)),
    ("no queues configured", ConsumerState(()), frozenset()),
    ("one drained", ConsumerState(ALL, drained=frozenset({"bulk"})),
     frozenset({"interactive", "standard", "joint"})),
    ("every one drained", ConsumerState(SHORT, drained=frozenset(SHORT)), frozenset()),
    ("a drained queue it does not consume", ConsumerState(SHORT, drained=frozenset({"joint"})),
     frozenset(SHORT)),
    ("switching", ConsumerState(ALL, switching=True), frozenset()),
    ("switching wins over everything", ConsumerState(ALL, switching=True, canary_lane=True,
                                                     drained=frozenset({"bulk"})), frozenset()),
    ("joint gate full", ConsumerState(ALL, joint_full=True), frozenset(SHORT)),
    ("joint gate full, joint not configured", ConsumerState(SHORT, joint_full=True), frozenset(SHORT)),
    ("joint gate full and joint drained", ConsumerState(ALL, joint_full=True, drained=frozenset({"joint"})),
     frozenset(SHORT)),
    ("capacity full: the interactive reserve", ConsumerState(ALL, capacity_full=True),
     frozenset({"interactive", "joint"})),
    ("capacity full: joint is the joint gate's", ConsumerState(("interactive", "joint"), capacity_full=True),
     frozenset({"interactive", "joint"})),
    ("both gates full", ConsumerState(ALL, joint_full=True, capacity_full=True), frozenset({"interactive"})),
    ("both gates full, interactive drained",
     ConsumerState(ALL, joint_full=True, capacity_full=True, drained=frozenset({"interactive"})),
     frozenset()),
    ("capacity full and standard drained",
     ConsumerState(ALL, capacity_full=True, drained=frozenset({"standard"})),
     frozenset({"interactive", "joint"})),
    ("canary lane", ConsumerState(ALL, canary_lane=True), lanes(*ALL)),
    ("canary lane, one drained (flags are per class)",
     ConsumerState(ALL, canary_lane=True, drained=frozenset({"standard"})),
     lanes("interactive", "bulk", "joint")),
    ("canary lane, joint gate full", ConsumerState(ALL, canary_lane=True, joint_full=True), lanes(*SHORT)),
    ("canary lane, capacity full", ConsumerState(ALL, canary_lane=True, capacity_full=True),
     lanes("interactive", "joint")),
    ("canary lane, switching", ConsumerState(ALL, canary_lane=True, switching=True), frozenset()),
    ("stopping", ConsumerState(ALL, stopping=True), frozenset()),
    ("stopping while switching", ConsumerState(ALL, stopping=True, switching=True), frozenset()),
    ("stopping on the canary lane", ConsumerState(ALL, stopping=True, canary_lane=True), frozenset()),
]


@pytest.mark.parametrize(("why", "state", "expected"), CASES, ids=[case[0] for case in CASES])
def test_consumed_queues(why: str, state: ConsumerState, expected: frozenset[str]) -> None:
    assert consumed_queues(state) == expected, why


@pytest.mark.parametrize("canary_lane", [False, True])
@pytest.mark.parametrize("switching", [False, True])
@pytest.mark.parametrize("joint_full", [False, True])
@pytest.mark.parametrize("capacity_full", [False, True])
@pytest.mark.parametrize("drained", [frozenset(), frozenset({"interactive"}), frozenset({"joint", "bulk"})])
def test_every_combination_follows_the_rules(canary_lane: bool, switching: bool, joint_full: bool,
                                             capacity_full: bool, drained: frozenset[str]) -> None:
    """The rules, one by one, over every combination of the inputs."""
    state = ConsumerState(ALL, drained=drained, switching=switching, joint_full=joint_full,
                          capacity_full=capacity_full, canary_lane=canary_lane)
    got = consumed_queues(state)
    prefix = "canary." if canary_lane else ""
    assert all(name.startswith(prefix) for name in got)
    classes = {name.removeprefix("canary.") for name in got}
    assert classes <= set(ALL)
    assert not classes & drained
    if switching:
        assert got == frozenset()
    if joint_full:
        assert "joint" not in classes
    if capacity_full:
        assert not classes & {"standard", "bulk"}
    if not switching:  # interactive is paused by nothing but a drain
        assert ("interactive" in classes) == ("interactive" not in drained)
    assert ordered_queues(state) == [prefix + q for q in ALL if q in classes]  # priority order kept


class FakeConsumer:
    """A Celery consumer and its event loop, as the controller sees them (``ConsumerHandle``).

    Like kombu's ``Hub`` (pending callbacks in a ``set``), ``run_loop`` runs what was queued with
    ``call_soon`` in an order of its own (shuffled by a seeded generator), which is what broke the
    remote-control commands of old (issue 31). ``external`` changes the consumer behind the
    controller's back (a stray broadcast, a Celery restart)."""

    def __init__(self, consuming: set[str], *, seed: int = 0) -> None:
        self.queues = set(consuming)
        self.pending: list[Any] = []
        self.log: list[tuple[str, str]] = []
        self.failing: set[str] = set()
        self.restarting = False
        self._random = random.Random(seed)

    def call_soon(self, callback: Any) -> None:
        self.pending.append(callback)

    def consuming(self) -> frozenset[str] | None:
        return None if self.restarting else frozenset(self.queues)

    def add(self, queue: str) -> None:
        if queue in self.failing:
            raise ConnectionError("broker down")
        self.log.append(("add", queue))
        self.queues.add(queue)

    def cancel(self, queue: str) -> None:
        self.log.append(("cancel", queue))
        self.queues.discard(queue)

    def run_loop(self) -> None:
        """One event-loop iteration: every pending callback, in no particular order."""
        todo, self.pending = self.pending, []
        self._random.shuffle(todo)
        for callback in todo:
            callback()

    def take(self) -> list[tuple[str, str]]:
        self.run_loop()
        log, self.log = self.log, []
        return log


def live(queues: tuple[str, ...] = ALL, **kwargs: Any) -> tuple[ConsumerController, FakeConsumer]:
    consumer = FakeConsumer(set(queues))
    controller = ConsumerController(queues, **kwargs)
    controller.go_live(consumer)
    assert consumer.take() == []  # consuming what `celery worker --queues` selected already
    return controller, consumer


def test_the_controller_changes_only_the_difference() -> None:
    controller, consumer = live()
    controller.update(joint_full=True)
    assert consumer.take() == [("cancel", "joint")]
    controller.update(capacity_full=True)
    assert consumer.take() == [("cancel", "standard"), ("cancel", "bulk")]
    controller.update(capacity_full=True)  # no change: nothing done
    assert consumer.take() == []
    controller.update(joint_full=False)
    assert consumer.take() == [("add", "joint")]
    controller.update(capacity_full=False)
    assert consumer.take() == [("add", "standard"), ("add", "bulk")]
    assert controller.consuming == frozenset(ALL)


@pytest.mark.parametrize("seed", range(20))
def test_changes_applied_in_any_order_end_on_the_newest_state(seed: int) -> None:
    """The issue-31 sequence: the capacity gate fills and frees within one loop iteration, many
    times, and the loop runs its callbacks in any order: the consumer ends on every queue."""
    controller, consumer = live()
    consumer._random.seed(seed)
    for _ in range(5):
        controller.update(capacity_full=True)
        controller.update(capacity_full=False)
        controller.update(joint_full=True)
        controller.update(joint_full=False)
    consumer.run_loop()
    assert consumer.queues == set(ALL) and controller.consuming == frozenset(ALL)
    controller.update(capacity_full=True)
    consumer.run_loop()
    assert consumer.queues == {"interactive", "joint"} == set(controller.consuming)


def test_a_consumer_changed_behind_the_controllers_back_is_healed_and_counted() -> None:
    healed: list[str] = []
    controller, consumer = live(on_heal=healed.append)
    consumer.queues -= {"standard", "bulk"}  # what the reordered broadcasts did
    controller.heal()  # the heartbeat
    assert consumer.take() == [("add", "standard"), ("add", "bulk")]
    assert consumer.queues == set(ALL) and sorted(healed) == ["bulk", "standard"]
    controller.heal()
    assert consumer.take() == [] and len(healed) == 2  # nothing to heal any more


def test_unconsumed_names_what_the_consumer_lacks_and_a_silent_consumer_lacks_everything() -> None:
    controller, consumer = live(stale_after_seconds=0.2)
    consumer.failing = {"bulk"}
    controller.update(capacity_full=True)
    consumer.take()
    controller.update(capacity_full=False)
    consumer.take()
    assert controller.unconsumed() == ["bulk"]  # wanted, not consumed: /readyz and the alert
    consumer.failing = set()
    controller.heal()
    consumer.take()
    assert controller.unconsumed() == []
    controller.update(capacity_full=True)  # a gate that pauses on purpose is not a fault
    consumer.take()
    assert controller.unconsumed() == []
    time.sleep(0.3)  # the consumer's thread has not answered for longer than the bound
    assert controller.unconsumed() == ["interactive", "joint"]


def test_a_restarting_consumer_is_left_alone_until_it_is_back() -> None:
    controller, consumer = live()
    consumer.restarting = True
    controller.update(joint_full=True)
    assert consumer.take() == []
    consumer.restarting = False
    controller.heal()
    assert consumer.take() == [("cancel", "joint")]


def test_a_gate_freeing_up_never_resumes_a_drained_queue() -> None:
    """What the joint gate's 'unless drained' check did, the rule does now."""
    controller, consumer = live()
    controller.update(joint_full=True)
    assert consumer.take() == [("cancel", "joint")]
    controller.update(drained={"joint"})
    assert consumer.take() == []
    controller.update(joint_full=False)
    assert consumer.take() == []
    controller.update(drained=set())
    assert consumer.take() == [("add", "joint")]


def test_a_switch_consumes_nothing_and_a_gate_cannot_add_meanwhile() -> None:
    controller, consumer = live()
    controller.update(joint_full=True)
    consumer.take()
    waiter = threading.Thread(target=lambda: controller.update(switching=True, wait=True))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()  # waits until the consumer's thread applied it
    consumer.run_loop()
    waiter.join(5)
    assert not waiter.is_alive() and consumer.queues == set()
    consumer.take()
    controller.update(joint_full=False)  # the last joint job finishes during the drain
    controller.update(drained={"bulk"})  # an operator drains bulk meanwhile
    controller.update(canary_lane=True)  # switched to the canary version
    assert consumer.take() == []
    controller.update(switching=False)
    assert consumer.take() == [("add", "canary.interactive"), ("add", "canary.standard"),
                               ("add", "canary.joint")]


def test_moving_lanes_keeps_a_full_gate_paused() -> None:
    controller, consumer = live()
    controller.update(joint_full=True)
    consumer.take()
    controller.update(canary_lane=True)
    assert consumer.take() == [("cancel", "interactive"), ("cancel", "standard"), ("cancel", "bulk"),
                               ("add", "canary.interactive"), ("add", "canary.standard"),
                               ("add", "canary.bulk")]
    controller.update(joint_full=False)
    assert consumer.take() == [("add", "canary.joint")]


def test_nothing_is_changed_before_live_or_once_stopping() -> None:
    controller = ConsumerController(ALL)
    controller.update(joint_full=True)
    controller.update(drained={"bulk"})
    consumer = FakeConsumer(set(ALL))
    controller.go_live(consumer)  # the consumer exists now: what changed since start is applied
    assert consumer.take() == [("cancel", "bulk"), ("cancel", "joint")]
    controller.update(stopping=True)
    controller.update(joint_full=False, drained=set())
    controller.heal()
    assert consumer.take() == []
    assert consumed_queues(controller.state) == frozenset() and controller.unconsumed() == []


def test_a_failed_switch_is_tried_again_at_the_next_heartbeat() -> None:
    controller, consumer = live()
    consumer.failing = {"joint"}
    controller.update(joint_full=True)
    consumer.take()
    controller.update(joint_full=False)
    consumer.take()
    assert "joint" not in consumer.queues and controller.unconsumed() == ["joint"]
    consumer.failing = set()
    controller.heal()
    assert consumer.take() == [("add", "joint")]
    assert consumer.queues == set(ALL) and controller.consuming == frozenset(ALL)


def test_kombus_event_loop_runs_pending_callbacks_in_no_fixed_order() -> None:
    """The root cause of issue 31, on kombu's own ``Hub``: Celery's add/cancel_consumer commands
    each become one ``call_soon`` callback, and callbacks queued in one loop iteration do not run
    in the order they were queued. (The controller's single, order-free callback does not care.)"""
    from kombu.asynchronous import Hub

    hub = Hub()
    ran: list[int] = []
    for i in range(64):  # four commands per gate fill-and-free, sixteen times
        hub.call_soon(ran.append, i)
    hub.close()  # runs every pending callback, as one loop iteration does
    assert sorted(ran) == list(range(64))
    assert ran != list(range(64))


def test_a_sync_on_the_consumers_own_thread_applies_at_once() -> None:
    """A remote-control command (the drain flags) runs on the consumer's thread: it must not wait
    for a callback that only that thread could run."""
    controller, consumer = live()
    consumer.take()
    controller.update(capacity_full=True)  # runs the first reconcile: the loop thread is known now
    consumer.run_loop()
    controller.update(drained={"joint"}, wait=True)  # same thread as the loop: applied inline
    assert "joint" not in consumer.queues


class FakeAmqpQueues:
    """The slice of ``app.amqp.queues`` the start-up selection uses."""

    def __init__(self, selected: list[str]) -> None:
        self._consume_from: dict[str, Any] = {name: object() for name in selected}

    @property
    def consume_from(self) -> dict[str, Any]:
        return self._consume_from

    def deselect(self, exclude: list[str]) -> None:
        for name in exclude:
            self._consume_from.pop(name, None)

    def select_add(self, queue: str) -> Any:
        self._consume_from[queue] = object()


def test_start_selection_skips_drained_queues_and_uses_the_lanes() -> None:
    controller = ConsumerController(ALL)
    controller.update(drained={"standard"}, canary_lane=True)
    queues = FakeAmqpQueues(list(ALL))
    assert controller.select_at_start(queues) == ["canary.interactive", "canary.bulk", "canary.joint"]
    assert list(queues.consume_from) == ["canary.interactive", "canary.bulk", "canary.joint"]
    consumer = FakeConsumer(set(queues.consume_from))
    controller.go_live(consumer)
    assert consumer.take() == []  # the selection is what the state wants


def test_start_selection_of_a_plain_worker_changes_nothing() -> None:
    controller = ConsumerController(SHORT)
    queues = FakeAmqpQueues(list(SHORT))
    assert controller.select_at_start(queues) == list(SHORT)
    assert list(queues.consume_from) == list(SHORT)


class FakeRedis:
    def __init__(self, drained: set[str] | None = None) -> None:
        self.drained = drained

    def smembers(self, key: str) -> set[bytes]:
        if self.drained is None:
            raise redis.ConnectionError("down")
        return {name.encode() for name in self.drained}


def test_the_drain_follower_feeds_the_flags_to_the_controller() -> None:
    controller, consumer = live()
    client = FakeRedis({"bulk"})
    follower = DrainFollower(redis_client=client, controller=controller, node="w1")  # type: ignore[arg-type]
    follower.sync()
    assert controller.state.drained == frozenset({"bulk"})
    assert consumer.take() == [("cancel", "bulk")]
    follower.sync()
    assert consumer.take() == []
    client.drained = None  # Redis down: keep what is known, change nothing
    follower.sync()
    assert follower.read() is None and controller.state.drained == frozenset({"bulk"})
    assert consumer.take() == []
    assert replace(controller.state, drained=frozenset()) == ConsumerState(ALL)


def test_the_runtime_wires_its_gates_to_the_one_controller() -> None:
    from scheduler.infra.settings import Settings
    from worker.runtime import WorkerRuntime

    settings = Settings(database_url="sqlite://", redis_url="redis://127.0.0.1:1/0", engine_joint_slot_cap=1,
                        engine_max_batch=1, engine_interactive_reserve=1)
    runtime = WorkerRuntime(settings, worker_id="w1", queues=ALL)
    joint, capacity = runtime.runner.joint_gate, runtime.runner.capacity_gate
    assert joint is not None and capacity is not None
    assert joint.try_enter() and runtime.consumers.state.joint_full  # not live yet: recorded only
    assert capacity.try_enter() and runtime.consumers.state.capacity_full
    assert consumed_queues(runtime.consumers.state) == frozenset({"interactive"})
    joint.leave()
    capacity.leave()
    assert consumed_queues(runtime.consumers.state) == frozenset(ALL)
    plain = WorkerRuntime(settings, worker_id="w2", queues=("standard", "bulk"))
    assert plain.runner.joint_gate is None and plain.runner.capacity_gate is None
    assert plain.runner.faults is None  # fault injection is off unless the setting is on


def test_a_sigterm_during_the_start_up_selection_does_not_deadlock() -> None:
    """Celery runs its SIGTERM handler (mark_draining -> record) on the main thread, which may be
    inside select_at_start at that moment: the state lock is re-entrant."""
    controller = ConsumerController(ALL)

    class Interrupted(FakeAmqpQueues):
        def select_add(self, queue: str) -> Any:
            controller.record(stopping=True)  # the handler, on the same thread
            return super().select_add(queue)

    controller.update(canary_lane=True)
    controller.select_at_start(Interrupted(list(ALL)))
    assert controller.state.stopping
