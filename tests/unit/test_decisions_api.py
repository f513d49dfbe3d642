"""The ``decide`` request model, its deployment limits, routing and thinking defaults (pure)."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from api.decision_limits import check_decide_limits
from api.errors import ApiError
from api.limits import check_generate_limits
from api.prompt_tokens import PromptTokenCounter
from api.schemas.jobs import DecideJobCreate, GenerateJobCreate, JobCreate
from scheduler.infra.settings import Settings
from scheduler.jobs.models import QueueName
from scheduler.jobs.routing import route_job

ADAPTER: TypeAdapter = TypeAdapter(JobCreate)
SETTINGS = Settings(decide_max_questions=4, decide_max_choices=3, joint_default_step_budget=777)
COUNTER = PromptTokenCounter(None)  # byte bound


def _decide(**input_overrides) -> dict:
    body = {
        "kind": "decide",
        "input": {"context": "doc", "questions": [{"id": "a", "text": "ok?"}, {"id": "b", "text": "fine?"}]},
    }
    body["input"].update(input_overrides)
    return body


def test_decide_is_a_member_of_the_job_union_with_yes_no_default() -> None:
    job = ADAPTER.validate_python(_decide())
    assert isinstance(job, DecideJobCreate)
    assert job.input.mode == "independent" and job.input.rationale is False
    assert job.input.questions[0].choices == ["yes", "no"]
    generate = ADAPTER.validate_python({"kind": "generate", "input": {"prompt": "x"}})
    assert isinstance(generate, GenerateJobCreate)


@pytest.mark.parametrize(
    "bad",
    [
        {"questions": []},
        {"questions": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]},  # duplicate ids
        {"questions": [{"id": "a", "text": "x", "choices": ["yes", "yes"]}]},
        {"questions": [{"id": "a", "text": "x", "choices": ["only"]}]},
        {"mode": "together"},
        {"surprise": 1},  # unknown fields are rejected
    ],
)
def test_invalid_decide_bodies_rejected(bad: dict) -> None:
    with pytest.raises(ValidationError):
        ADAPTER.validate_python(_decide(**bad))


GATE = {"questions": ["a", "b"], "allowed": [["yes", "yes"], ["yes", "no"], ["no", "no"]]}


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"constraints": [GATE]}, 'need mode "joint"'),  # independent questions never see each other
        ({"mode": "joint", "constraints": [{**GATE, "questions": ["a", "z"]}]}, "no question 'z'"),
        ({"mode": "joint", "constraints": [{**GATE, "allowed": [["yes", "maybe"]]}]}, "'maybe' is not a"),
        ({"mode": "joint", "constraints": [{**GATE, "allowed": [["yes"]]}]}, "one choice per question"),
        ({"mode": "joint", "constraints": [{**GATE, "allowed": [["yes", "no"], ["yes", "no"]]}]}, "distinct"),
        ({"mode": "joint", "constraints": [{**GATE, "questions": ["a", "a"]}]}, "distinct"),
        ({"mode": "joint", "constraints": [{"questions": ["a"], "allowed": [["yes"]]}]}, "at least 2"),
        ({"mode": "joint", "constraints": [{**GATE, "allowed": []}]}, "at least 1"),
        ({"mode": "joint", "constraints": [GATE, {**GATE, "questions": ["b", "a"]}]}, "in two constraints"),
    ],
)
def test_constraints_that_do_not_fit_their_questions_are_refused(bad: dict, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        ADAPTER.validate_python(_decide(**bad))


def test_joint_constraints_are_accepted_and_stored_as_given() -> None:
    job = ADAPTER.validate_python(_decide(mode="joint", constraints=[GATE]))
    assert job.input.model_dump()["constraints"] == [GATE]


def _check(job, *, faults: bool = False) -> dict:
    return check_decide_limits(job.input, job.params, settings=SETTINGS, counter=COUNTER,
                               faults_enabled=faults)


def test_limits_fill_joint_budget_and_refuse_too_many_questions() -> None:
    params = _check(ADAPTER.validate_python(_decide(mode="joint")))
    assert params["step_budget"] == 777
    assert "steps_per_block" not in params  # unset here and in settings: the model family's default
    many = ADAPTER.validate_python(_decide(questions=[{"id": str(i), "text": "q"} for i in range(5)]))
    with pytest.raises(ApiError) as err:
        _check(many)
    assert err.value.status_code == 422
    faulty = ADAPTER.validate_python({**_decide(), "params": {"fault": "invalid_rationale_once"}})
    with pytest.raises(ApiError):
        _check(faulty)
    assert _check(faulty, faults=True)["fault"] == "invalid_rationale_once"


def test_joint_routes_to_joint_queue_and_cost_counts_questions() -> None:
    joint = route_job(kind="decide", input=_decide(mode="joint")["input"], params={}, priority=None,
                      settings=SETTINGS)
    assert joint.queue == QueueName.JOINT
    one = route_job(kind="decide", input=_decide(questions=[{"id": "a", "text": "x"}])["input"], params={},
                    priority=None, settings=SETTINGS)
    two = route_job(kind="decide", input=_decide()["input"], params={}, priority=None, settings=SETTINGS)
    assert one.queue != QueueName.JOINT and two.cost == 2 * one.cost


@pytest.mark.parametrize(("thinking", "default", "expect"), [(None, False, False), (None, True, True),
                                                            (True, False, True), (False, True, False)])
def test_thinking_defaults(thinking: bool | None, default: bool, expect: bool) -> None:
    settings = Settings(default_thinking=default, thinking_default_max_new_tokens=300,
                        thinking_default_step_budget=900)
    params = {} if thinking is None else {"thinking": thinking}
    body = ADAPTER.validate_python({"kind": "generate", "input": {"prompt": "x"}, "params": params})
    stored = check_generate_limits(body, settings=settings, counter=COUNTER, faults_enabled=False)
    assert stored["thinking"] is expect
    assert stored["max_new_tokens"] == (300 if expect else settings.limits.default_max_new_tokens)
    assert stored.get("step_budget") == (900 if expect else None)
