"""A real HTTP server for the API (uvicorn in a thread, on 127.0.0.1), for clients that need one:
the official ``openai`` package, streaming responses read chunk by chunk as they arrive, and
disconnecting clients. ``TestClient`` buffers a whole response and cannot drop a connection."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from api.app import create_app
from scheduler.infra.settings import Settings
from tests.conftest import free_port


class ApiServer:
    """``create_app(settings)`` served by uvicorn on a free port until :meth:`stop`."""

    def __init__(self, settings: Settings) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app: Any = create_app(settings)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="api-server", daemon=True)

    def start(self, timeout: float = 30.0) -> ApiServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the API server did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
