"""The request middleware: request id in and out, HTTP metrics by route template."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.routes.metrics import ObservabilityMiddleware
from scheduler.observability.logging import current_request_id
from scheduler.observability.process_metrics import HTTP_REQUEST_SECONDS, HTTP_REQUESTS


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/items/{item_id}")
    def read_item(item_id: str) -> dict[str, str | None]:  # sync: runs in the thread pool
        return {"item": item_id, "request_id": current_request_id()}

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError("boom")

    app.add_middleware(ObservabilityMiddleware)
    return app


def _count(route: str, method: str, status: str) -> float:
    return HTTP_REQUESTS.labels(route=route, method=method, status=status)._value.get()


def test_request_id_is_echoed_and_visible_to_the_endpoint() -> None:
    client = TestClient(_app())
    response = client.get("/items/7", headers={"X-Request-ID": "trace-42"})
    assert response.headers["X-Request-ID"] == "trace-42"
    assert response.json()["request_id"] == "trace-42"

    generated = client.get("/items/8")
    rid = generated.headers["X-Request-ID"]
    assert len(rid) == 32 and generated.json()["request_id"] == rid

    unsafe = client.get("/items/9", headers={"X-Request-ID": "a b\tc"})
    assert unsafe.headers["X-Request-ID"] != "a b\tc"


def test_requests_are_counted_by_route_template_and_status() -> None:
    client = TestClient(_app(), raise_server_exceptions=False)
    before_ok = _count("/items/{item_id}", "GET", "200")
    before_missing = _count("unmatched", "GET", "404")
    before_error = _count("/boom", "GET", "500")
    hist = HTTP_REQUEST_SECONDS.labels(route="/items/{item_id}", method="GET")
    before_observed = sum(b.get() for b in hist._buckets)
    for item in ("a", "b", "c"):
        assert client.get(f"/items/{item}").status_code == 200
    assert client.get("/nowhere").status_code == 404
    assert client.get("/boom").status_code == 500
    assert _count("/items/{item_id}", "GET", "200") - before_ok == 3  # one series, not one per id
    assert _count("unmatched", "GET", "404") - before_missing == 1
    assert _count("/boom", "GET", "500") - before_error == 1
    assert sum(b.get() for b in hist._buckets) - before_observed == 3
    before_other = _count("unmatched", "other", "404")
    client.request("BREW", "/pot")  # label values a client picks are folded: bounded series
    assert _count("unmatched", "other", "404") - before_other == 1
