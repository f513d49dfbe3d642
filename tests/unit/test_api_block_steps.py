"""``steps_per_block`` above ``block_size`` is refused with a 422 for both job kinds, never lowered."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pydantic import TypeAdapter

from api.decision_limits import check_decide_limits
from api.errors import ApiError
from api.limits import check_generate_limits
from api.prompt_tokens import PromptTokenCounter
from api.schemas.jobs import DecideJobCreate, GenerateJobCreate, JobCreate
from scheduler.infra.settings import Settings

create = TypeAdapter(JobCreate)
SETTINGS = Settings(default_steps_per_block=4)
Check = Callable[[dict[str, object]], dict[str, object]]


def _generate(params: dict[str, object]) -> dict[str, object]:
    body = create.validate_python({"kind": "generate", "input": {"prompt": "hello"}, "params": params})
    assert isinstance(body, GenerateJobCreate)
    return check_generate_limits(body, settings=SETTINGS, counter=PromptTokenCounter(None),
                                 faults_enabled=False)


def _decide(params: dict[str, object]) -> dict[str, object]:
    body = create.validate_python({
        "kind": "decide", "params": params,
        "input": {"context": "c", "questions": [{"id": "q", "text": "t?", "choices": ["yes", "no"]}]},
    })
    assert isinstance(body, DecideJobCreate)
    return check_decide_limits(body.input, body.params, settings=SETTINGS, counter=PromptTokenCounter(None),
                               faults_enabled=False)


@pytest.mark.parametrize("check", [_generate, _decide])
def test_steps_above_the_block_size_are_refused(check: Check) -> None:
    with pytest.raises(ApiError) as caught:
        check({"block_size": 4, "steps_per_block": 5})
    assert caught.value.status_code == 422 and caught.value.code == "invalid_request"
    assert caught.value.details[0]["loc"] == ["body", "params", "steps_per_block"]
    assert "block_size (4)" in caught.value.message


@pytest.mark.parametrize("check", [_generate, _decide])
def test_steps_up_to_the_block_size_are_kept_and_the_default_fits_the_block(check: Check) -> None:
    assert check({"block_size": 4, "steps_per_block": 4})["steps_per_block"] == 4
    assert check({"block_size": 1024, "steps_per_block": 64})["steps_per_block"] == 64
    assert check({"block_size": 2})["steps_per_block"] == 2  # the default (4) capped at the block
    assert check({})["steps_per_block"] == 4  # no block size: the checkpoint's, the default stands
    assert check({"steps_per_block": 32})["steps_per_block"] == 32
