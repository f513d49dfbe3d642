"""Every authenticated operation documents the answers auth and admission can give anywhere.

An ``api.auth.requires`` dependency runs on every ``/v1`` route, so 401 (no/bad key) and 429
(the per-key rate limit) are possible on each; the schemathesis run cannot see a missing 429 because its
key is never rate-limited, hence this structural check.
"""

from __future__ import annotations

from pathlib import Path

from api.app import create_app
from scheduler.infra.settings import Settings


def test_every_v1_operation_documents_401_and_429(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path, redis_url="redis://127.0.0.1:1/0"))
    spec = app.openapi()
    missing = [
        f"{method.upper()} {path}: {code}"
        for path, operations in spec["paths"].items()
        if path.startswith("/v1/")
        for method, operation in operations.items()
        for code in ("401", "429")
        if code not in operation.get("responses", {})
    ]
    assert missing == []
    assert "HTTPBearer" in spec["components"]["securitySchemes"]
