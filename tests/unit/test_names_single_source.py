"""Redis key names, queue names and job outcome codes each come from one module
(``scheduler/infra/redis_keys.py``, ``scheduler/infra/queue_names.py``, the enums) and keep their values:
they are on the wire, in Redis and in SQL, so a rename must be a deliberate change here too."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args

from api.schemas.jobs import Priority
from scheduler.batches.service import BatchStatus
from scheduler.infra import queue_names, redis_keys
from scheduler.infra.settings import Settings
from scheduler.jobs.error_codes import ErrorCode
from scheduler.jobs.models import ErrorCode as ModelsErrorCode
from scheduler.jobs.models import JobStatus, QueueName
from scheduler.jobs.routing import PRIORITY_ALIASES
from worker.run_outcome import RunOutcome

ROOT = Path(__file__).resolve().parents[2]


def test_redis_key_values() -> None:
    assert redis_keys.WORKERS_SET == "cloverq:workers"
    assert redis_keys.DRAINED_SET == "cloverq:queues:drained"
    assert redis_keys.LIMITS_KEY == "cloverq:limits"
    assert redis_keys.REVOKED_SET == "cloverq:keys:revoked"
    assert redis_keys.JOBS_FINISHED_CHANNEL == "cloverq:jobs:finished"
    assert redis_keys.METRICS_WORKERS_SET == "cloverq:metrics:workers"
    assert redis_keys.enqueued("j") == "cloverq:enqueued:j"
    assert redis_keys.queue_reservations("bulk") == "cloverq:reserved:queue:bulk"
    assert redis_keys.tenant_reservations("t") == "cloverq:reserved:tenant:t"
    assert redis_keys.tenant_admissions("t") == "cloverq:admitted:tenant:t"
    assert redis_keys.rate_bucket("tenant:t") == "cloverq:ratelimit:tenant:t"
    assert redis_keys.progress("j") == "cloverq:progress:j"
    assert redis_keys.events("j") == "cloverq:events:j"
    assert redis_keys.cancel("j") == "cloverq:cancel:j"
    assert redis_keys.worker("w") == "cloverq:worker:w"
    assert redis_keys.model_switch_turn("m") == "cloverq:model:switch-turn:m"
    assert redis_keys.metrics_counter("f") == "cloverq:metrics:c:f"
    assert redis_keys.metrics_histogram("f") == "cloverq:metrics:h:f"
    assert redis_keys.metrics_worker("w") == "cloverq:metrics:w:w"


def _string_constants(path: Path) -> list[tuple[int, str]]:
    """Every string literal (and the literal parts of f-strings) of a module, outside docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value) for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_redis_key_name_outside_redis_keys() -> None:
    key = re.compile(r"^cloverq:[a-z]")
    found = []
    for package in ("scheduler", "api", "worker", "cli", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "scheduler/infra/redis_keys.py":
                continue
            found += [f"{rel}:{line}: {value!r}"
                      for line, value in _string_constants(path) if key.match(value)]
    assert found == []


def test_queue_names() -> None:
    assert queue_names.JOB_QUEUES == ("interactive", "standard", "bulk", "joint")
    assert [q.rank for q in QueueName] == [0, 1, 2, 3]
    assert queue_names.ALL_QUEUES == ("interactive", "standard", "bulk", "joint", "maintenance", "webhooks")
    assert queue_names.CANARY_LANE_PREFIX == "canary."
    assert queue_names.DEFAULT_WORKER_QUEUES == ("interactive", "standard", "bulk")
    settings = Settings()
    assert settings.worker.queues == "interactive,standard,bulk"
    assert settings.admission.queue_max_depth == {"interactive": 1000, "standard": 5000, "bulk": 20000,
                                                  "joint": 500}


def test_api_priority_names_are_the_classes_and_aliases() -> None:
    assert get_args(Priority) == ("interactive", "standard", "bulk", "high", "normal", "low")
    assert set(get_args(Priority)) == {q.value for q in queue_names.PRIORITY_CLASSES} | set(PRIORITY_ALIASES)


def test_outcome_enum_values() -> None:
    assert ModelsErrorCode is ErrorCode
    assert {c.value for c in ErrorCode} == {
        "retries_exhausted", "invalid_input", "deadline_exceeded", "internal_error",
        "invalid_model_output", "budget_exhausted", "incomplete_output",
    }
    assert [s.value for s in JobStatus] == [
        "queued", "running", "succeeded", "failed", "cancelled", "expired",
    ]
    assert [s.value for s in BatchStatus] == ["running", "cancelling", "completed", "cancelled"]
    assert [o.value for o in RunOutcome] == [
        "invalid", "handed_back", "skipped", "lost", "succeeded", "failed", "cancelled",
        "retry:queued", "retry:failed",
    ]
    assert RunOutcome.retried(JobStatus.QUEUED) is RunOutcome.RETRY_QUEUED
    assert RunOutcome.finished(JobStatus.CANCELLED) is RunOutcome.CANCELLED
