"""The engine's per-sequence length comes from settings and fits every request the API accepts;
requests that cannot fit are refused by the API (422), never failed by the worker's engine."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter

from api.errors import ApiError
from api.limits import check_generate_limits
from api.prompt_tokens import PromptTokenCounter
from api.schemas.jobs import JobCreate
from scheduler.infra.settings import Settings, available_cpus
from scheduler.infra.settings_groups.limits import CHAT_TEMPLATE_SLACK_TOKENS
from worker.engine.types import GenerationRequest, SamplingParams
from worker.sampler.layout import build_layout

create = TypeAdapter(JobCreate)


def _check(settings: Settings, prompt: str, **params: object) -> dict[str, object]:
    body = create.validate_python({"kind": "generate", "input": {"prompt": prompt}, "params": params})
    counter = PromptTokenCounter(None)
    return check_generate_limits(body, settings=settings, counter=counter, faults_enabled=False)


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 32, 64])
def test_default_engine_max_len_fits_the_largest_accepted_request(block_size: int) -> None:
    settings = Settings(max_prompt_tokens=1000, max_new_tokens_limit=333)
    prompt = [5] * (settings.limits.max_prompt_tokens + CHAT_TEMPLATE_SLACK_TOKENS)  # prompt + chat template
    request = GenerationRequest("big", prompt,
                                SamplingParams(max_new_tokens=settings.limits.max_new_tokens_limit))
    layout = build_layout(request, block_size, vocab_size=10, max_len=settings.resolved_engine_max_len)
    assert layout.total_len <= settings.resolved_engine_max_len


def test_explicit_engine_max_len_wins() -> None:
    assert Settings(engine_max_len=512).resolved_engine_max_len == 512


def test_torch_threads_setting_then_omp_num_threads_then_the_cpus_of_the_affinity(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert Settings().resolved_torch_threads == 3
    assert Settings(torch_threads=5).resolved_torch_threads == 5  # the setting wins
    for ignored in ("0", "-2", "two", "", "²"):  # not a positive integer: OpenMP ignores it too
        monkeypatch.setenv("OMP_NUM_THREADS", ignored)
        assert Settings().resolved_torch_threads == available_cpus()
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert Settings().resolved_torch_threads == available_cpus()
    assert Settings(torch_threads=3).resolved_torch_threads == 3


def test_api_refuses_a_request_the_engine_cannot_hold() -> None:
    settings = Settings(engine_max_len=100)
    assert _check(settings, "x" * 10, max_new_tokens=90)["max_new_tokens"] == 90  # 10 + 90 fits
    with pytest.raises(ApiError) as caught:
        _check(settings, "x" * 10, max_new_tokens=91)
    assert caught.value.status_code == 422 and caught.value.code == "request_too_long"
    with pytest.raises(ApiError):  # whole blocks: 10 + 80 rounds up to 128 positions
        _check(settings, "x" * 10, max_new_tokens=80, block_size=64)


def test_api_refuses_huge_blocks_over_the_default_engine_max_len() -> None:
    settings = Settings()
    with pytest.raises(ApiError) as caught:
        _check(settings, "x" * settings.limits.max_prompt_tokens,
               max_new_tokens=settings.limits.max_new_tokens_limit,
               block_size=1000)  # 6144 positions in blocks of 1000: 7000
    assert caught.value.code == "request_too_long"
