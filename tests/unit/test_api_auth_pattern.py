"""The one authorization pattern (issue 20): the privilege is in the route's dependency.

Every authenticated route depends on an ``api.auth.requires`` dependency; no route body checks a
scope or takes a rate-limit token itself; the admission-metered variant takes the token exactly
once whatever the route does. Runs without Redis or a database: the app's ``Security`` is a stub.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from api.app import create_app
from api.auth import meter_refused_request, security_of
from api.deps import AdminCaller, AdmittedSubmitCaller, ReadCaller, SubmitCaller
from api.errors import ApiError, install_error_handlers
from scheduler.access.admission import RateDecision
from scheduler.access.api_keys import KeyInfo
from scheduler.access.key_authenticator import KeyRefusal
from scheduler.infra.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = {"/healthz", "/readyz", "/metrics", "/dashboard", "/dashboard/{asset}"}
ALLOWED = RateDecision(revoked=False, allowed=True, retry_after_seconds=0, remaining=5)
EMPTY = RateDecision(revoked=False, allowed=False, retry_after_seconds=3, remaining=0)


def _dependency_names(route: APIRoute) -> set[str]:
    names: set[str] = set()
    pending = list(route.dependant.dependencies)
    while pending:
        dep = pending.pop()
        names.add(getattr(dep.call, "__name__", ""))
        pending.extend(dep.dependencies)
    return names


def test_every_authenticated_route_states_its_privilege_in_a_dependency(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path, redis_url="redis://127.0.0.1:1/0"))
    unguarded = [
        f"{sorted(route.methods)} {route.path}"
        for route in app.routes
        if isinstance(route, APIRoute) and route.path not in PUBLIC
        and not any(name.startswith("requires_") for name in _dependency_names(route))
    ]
    assert unguarded == []


def test_no_route_body_checks_a_scope_or_meters_itself() -> None:
    calls = re.compile(r"\b(require|require_scope|meter_caller|enforce_rate|get_unmetered_caller)\(")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in [*sorted((ROOT / "api" / "routes").glob("*.py")), ROOT / "api" / "openai_compat.py"]
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if calls.search(line)
    ]
    assert offenders == []


class _Authenticator:
    def __init__(self, scopes: frozenset[str]) -> None:
        self.info = KeyInfo(key_id="k1", tenant="acme", scopes=scopes, label=None,
                            created_at=datetime.now(UTC), revoked=False, revoked_at=None)

    def check_cached(self, key: str) -> KeyInfo | KeyRefusal:
        return self.info if key == "good" else KeyRefusal.INVALID

    def note_use(self, key_id: str, address: str | None) -> None:
        pass

    def forget(self, key_id: str) -> None:
        pass


class _Admission:
    """Counts the tokens taken (``check_rate`` and the submit script's ``admit_job``)."""

    def __init__(self, decision: RateDecision) -> None:
        self.decision = decision
        self.tokens = 0

    def check_rate(self, bucket: str, *, key_id: str | None, cost: int = 1) -> RateDecision:
        self.tokens += cost
        return self.decision

    def admit_job(self, **kwargs: Any) -> tuple[RateDecision, bool]:
        self.tokens += 1
        return self.decision, True


class _Security:
    def __init__(self, scopes: frozenset[str], decision: RateDecision) -> None:
        self.authenticator = _Authenticator(scopes)
        self.admission = _Admission(decision)


def _app(tmp_path: Path, scopes: frozenset[str] = frozenset({"submit", "read"}),
         decision: RateDecision = ALLOWED) -> tuple[TestClient, _Admission]:
    app = FastAPI()
    app.state.settings = Settings(data_dir=tmp_path, redis_url="redis://127.0.0.1:1/0")
    security = _Security(scopes, decision)
    app.state.security = security
    install_error_handlers(app, meter_refused=meter_refused_request)

    @app.post("/submit")
    def submit(request: Request, caller: AdmittedSubmitCaller, mode: str = "admit") -> dict[str, str]:
        if mode in ("admit", "admit_then_refuse"):
            decision, _ = security_of(request).admission.admit_job(bucket="k1", key_id="k1")
            if mode == "admit_then_refuse":  # e.g. queue_full: the script took the token first
                raise ApiError(429, "queue_full", "The queue is full.")
            assert decision.allowed
        if mode == "refuse":  # e.g. a deployment limit, before any admission
            raise ApiError(422, "invalid_request", "Too long.")
        return {"tenant": caller.tenant}

    @app.get("/read")
    def read(caller: ReadCaller) -> dict[str, str]:
        return {"tenant": caller.tenant}

    @app.post("/write")
    def write(caller: SubmitCaller) -> dict[str, str]:
        return {"tenant": caller.tenant}

    @app.get("/admin")
    def admin(caller: AdminCaller) -> dict[str, str]:
        return {"tenant": caller.tenant}

    return TestClient(app), security.admission


KEY = {"Authorization": "Bearer good"}


@pytest.mark.parametrize("mode", ["admit", "forgot", "refuse", "admit_then_refuse"])
def test_admitted_submit_takes_exactly_one_token_whatever_the_route_does(tmp_path: Path, mode: str) -> None:
    client, admission = _app(tmp_path)
    answer = client.post(f"/submit?mode={mode}", headers=KEY)
    expected = {"admit": 200, "forgot": 200, "refuse": 422, "admit_then_refuse": 429}[mode]
    assert answer.status_code == expected
    assert admission.tokens == 1


def test_a_refused_submit_with_an_empty_bucket_answers_429(tmp_path: Path) -> None:
    client, admission = _app(tmp_path, decision=EMPTY)
    answer = client.post("/submit?mode=refuse", headers=KEY)
    assert answer.status_code == 429 and answer.json()["error"]["code"] == "rate_limited"
    assert answer.headers["Retry-After"] == "3"
    assert admission.tokens == 1


def test_missing_scope_is_403_after_the_token_and_429_wins(tmp_path: Path) -> None:
    client, admission = _app(tmp_path, scopes=frozenset({"read"}))
    for method, path, scope in (("POST", "/submit", "submit"), ("POST", "/write", "submit"),
                                ("GET", "/admin", "admin")):
        answer = client.request(method, path, headers=KEY)
        assert answer.status_code == 403, path
        error = answer.json()["error"]
        assert (error["code"], error["details"]) == ("forbidden", {"required_scope": scope})
        assert error["message"] == f"This API key lacks the '{scope}' scope."
    assert admission.tokens == 3
    assert client.get("/read", headers=KEY).status_code == 200
    limited, _ = _app(tmp_path, scopes=frozenset({"read"}), decision=EMPTY)
    assert limited.get("/admin", headers=KEY).status_code == 429
    assert limited.post("/submit", headers=KEY).status_code == 429


def test_unknown_or_missing_key_is_401_without_a_token(tmp_path: Path) -> None:
    client, admission = _app(tmp_path)
    for headers in ({}, {"Authorization": "Bearer nope"}):
        for method, path in (("POST", "/submit"), ("GET", "/read")):
            answer = client.request(method, path, headers=headers)
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "unauthorized"
            assert answer.headers["WWW-Authenticate"] == "Bearer"
    assert admission.tokens == 0


def test_admin_key_holds_every_scope(tmp_path: Path) -> None:
    client, admission = _app(tmp_path, scopes=frozenset({"admin"}))
    assert [client.get("/read", headers=KEY).status_code, client.post("/write", headers=KEY).status_code,
            client.get("/admin", headers=KEY).status_code] == [200, 200, 200]
    assert admission.tokens == 3
