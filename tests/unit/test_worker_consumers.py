"""Which queues a worker consumes: the pure rule (``consumed_queues``) and its one controller."""

from __future__ import annotations

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


class Commands:
    """Records what the controller sends; ``failing`` names queues whose commands raise."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str, bool]] = []
        self.failing: set[str] = set()

    def add(self, queue: str, *, wait: bool) -> None:
        self._record("add", queue, wait)

    def cancel(self, queue: str, *, wait: bool) -> None:
        self._record("cancel", queue, wait)

    def _record(self, action: str, queue: str, wait: bool) -> None:
        if queue in self.failing:
            raise ConnectionError("broker down")
        self.sent.append((action, queue, wait))

    def take(self) -> list[tuple[str, str]]:
        sent, self.sent = self.sent, []
        return [(action, queue) for action, queue, _ in sent]


def live(queues: tuple[str, ...] = ALL) -> tuple[ConsumerController, Commands]:
    commands = Commands()
    controller = ConsumerController(queues, commands)
    controller.go_live()
    assert commands.take() == []  # consuming what `celery worker --queues` selected already
    return controller, commands


def test_the_controller_sends_only_the_difference() -> None:
    controller, commands = live()
    controller.update(joint_full=True)
    assert commands.take() == [("cancel", "joint")]
    controller.update(capacity_full=True)
    assert commands.take() == [("cancel", "standard"), ("cancel", "bulk")]
    controller.update(capacity_full=True)  # no change: nothing sent
    assert commands.take() == []
    controller.update(joint_full=False)
    assert commands.take() == [("add", "joint")]
    controller.update(capacity_full=False)
    assert commands.take() == [("add", "standard"), ("add", "bulk")]
    assert controller.consuming == frozenset(ALL)


def test_a_gate_freeing_up_never_resumes_a_drained_queue() -> None:
    """What the joint gate's 'unless drained' check did, the rule does now."""
    controller, commands = live()
    controller.update(joint_full=True)
    assert commands.take() == [("cancel", "joint")]
    controller.update(drained={"joint"})
    assert commands.take() == [("cancel", "joint"), ("cancel", "canary.joint")]  # the flip: both lanes
    controller.update(joint_full=False)
    assert commands.take() == []
    controller.update(drained=set())
    assert commands.take() == [("cancel", "canary.joint"), ("add", "joint")]


def test_a_switch_consumes_nothing_and_a_gate_cannot_add_meanwhile() -> None:
    controller, commands = live()
    controller.update(joint_full=True)
    commands.take()
    controller.update(switching=True, wait=True)
    assert commands.sent == [("cancel", q, True) for q in SHORT]  # waited for: gone before the drain
    commands.take()
    controller.update(joint_full=False)  # the last joint job finishes during the drain
    controller.update(drained={"bulk"})  # an operator drains bulk meanwhile
    assert commands.take() == [("cancel", "bulk"), ("cancel", "canary.bulk")]  # the flip: no-ops
    controller.update(canary_lane=True)  # switched to the canary version
    assert commands.take() == []
    controller.update(switching=False, wait=True)
    assert commands.take() == [("add", "canary.interactive"), ("add", "canary.standard"),
                               ("add", "canary.joint")]


def test_moving_lanes_keeps_a_full_gate_paused() -> None:
    controller, commands = live()
    controller.update(joint_full=True)
    commands.take()
    controller.update(canary_lane=True, wait=True)
    assert commands.take() == [("cancel", "interactive"), ("cancel", "standard"), ("cancel", "bulk"),
                               ("add", "canary.interactive"), ("add", "canary.standard"),
                               ("add", "canary.bulk")]
    controller.update(joint_full=False)
    assert commands.take() == [("add", "canary.joint")]


def test_a_resume_broadcast_on_a_canary_worker_is_corrected() -> None:
    """The operator's broadcast adds the plain queue to every worker configured for it; a canary
    worker must consume its lane only, so a flip of a flag sets both lanes again."""
    controller, commands = live(SHORT)
    controller.update(canary_lane=True)
    controller.update(drained={"standard"})
    commands.take()
    controller.update(drained=set())
    assert commands.take() == [("cancel", "standard"), ("add", "canary.standard")]


def test_nothing_is_sent_before_live_or_once_stopping() -> None:
    commands = Commands()
    controller = ConsumerController(ALL, commands)
    controller.update(joint_full=True)
    controller.update(drained={"bulk"})
    assert commands.take() == []
    controller.go_live()  # the consumer exists now: what changed since start is sent
    assert commands.take() == [("cancel", "bulk"), ("cancel", "joint")]
    controller.update(stopping=True)
    controller.update(joint_full=False, drained=set())
    assert commands.take() == []
    assert consumed_queues(controller.state) == frozenset()


def test_a_failed_command_is_tried_again_at_the_next_change() -> None:
    controller, commands = live()
    commands.failing = {"joint"}
    controller.update(joint_full=True)
    assert commands.take() == [] and "joint" in controller.consuming
    commands.failing = set()
    controller.update(capacity_full=True)
    assert commands.take() == [("cancel", "standard"), ("cancel", "bulk"), ("cancel", "joint")]
    assert controller.consuming == frozenset({"interactive"})


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
    commands = Commands()
    controller = ConsumerController(ALL, commands)
    controller.update(drained={"standard"}, canary_lane=True)
    queues = FakeAmqpQueues(list(ALL))
    assert controller.select_at_start(queues) == ["canary.interactive", "canary.bulk", "canary.joint"]
    assert list(queues.consume_from) == ["canary.interactive", "canary.bulk", "canary.joint"]
    controller.go_live()
    assert commands.take() == []  # the selection is what the state wants


def test_start_selection_of_a_plain_worker_changes_nothing() -> None:
    controller = ConsumerController(SHORT, Commands())
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
    controller, commands = live()
    client = FakeRedis({"bulk"})
    follower = DrainFollower(redis_client=client, controller=controller, node="w1")  # type: ignore[arg-type]
    follower.sync()
    assert controller.state.drained == frozenset({"bulk"})
    assert commands.take() == [("cancel", "bulk"), ("cancel", "canary.bulk")]
    follower.sync()
    assert commands.take() == []
    client.drained = None  # Redis down: keep what is known, change nothing
    follower.sync()
    assert follower.read() is None and controller.state.drained == frozenset({"bulk"})
    assert commands.take() == []
    assert replace(controller.state, drained=frozenset()) == ConsumerState(ALL)


def test_the_runtime_wires_its_gates_to_the_one_controller() -> None:
    from scheduler.settings import Settings
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


class BlockingCommands(Commands):
    """A broker that hangs: commands for ``queue`` wait until ``release`` is set."""

    def __init__(self, queue: str) -> None:
        super().__init__()
        self.queue = queue
        self.entered = threading.Event()
        self.release = threading.Event()

    def cancel(self, queue: str, *, wait: bool) -> None:
        if queue == self.queue:
            self.entered.set()
            assert self.release.wait(10)
        super().cancel(queue, wait=wait)


def test_a_hanging_command_blocks_only_its_sender_and_no_change_is_left_unsent() -> None:
    """A gate on another task thread (or the heartbeat) must not wait for a command stuck on a dead
    broker; what it changed meanwhile is sent by the stuck sender once it gets through."""
    commands = BlockingCommands("joint")
    controller = ConsumerController(ALL, commands)
    controller.go_live()
    sender = threading.Thread(target=lambda: controller.update(joint_full=True))
    sender.start()
    assert commands.entered.wait(10)
    started = time.monotonic()
    controller.update(capacity_full=True)  # another thread's change while the send hangs
    controller.record(drained={"interactive"})
    assert time.monotonic() - started < 1.0
    commands.release.set()
    sender.join(10)
    assert not sender.is_alive()
    assert controller.consuming == frozenset() == consumed_queues(controller.state)


def test_a_sigterm_during_the_start_up_selection_does_not_deadlock() -> None:
    """Celery runs its SIGTERM handler (mark_draining -> record) on the main thread, which may be
    inside select_at_start at that moment: the state lock is re-entrant."""
    controller = ConsumerController(ALL, Commands())

    class Interrupted(FakeAmqpQueues):
        def select_add(self, queue: str) -> Any:
            controller.record(stopping=True)  # the handler, on the same thread
            return super().select_add(queue)

    controller.update(canary_lane=True)
    controller.select_at_start(Interrupted(list(ALL)))
    assert controller.state.stopping
