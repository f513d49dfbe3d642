"""The API process of ``python -m bench.api --tracing``: ``cloverq api`` whose tracing setup can be
switched while it serves (off, sample ratio 0.1, ratio 1.0), on a loopback control port.

Why one process for every setup: two identical API processes on the 2-core machine differ by up
to 10-15% in throughput and CPU per request (measured: an A/A pair of tracing-off processes gave
ratios 0.85-1.06), more than the 3% the issue asks to resolve. Switching inside one process, in
short blocks whose order rotates, removes that process-to-process spread; what is left is printed
by the bench as the spread between two tracing-off blocks.

Both tracing setups are made by the product's own :func:`scheduler.observability.tracing.setup_tracing`
(a real SDK provider, the bounded span queue and the OTLP/HTTP exporter, pointed by
``OTEL_EXPORTER_OTLP_ENDPOINT`` at ``bench.otlp_sink``); switching sets the module's globals
that every call site reads (``_provider``, ``_tracer``, ``_enabled``, ``_step_spans``, ``_root_ratio``), as
the unit tests do.

Control lines (one per connection, answered ``ok``): ``use off|0.1|1.0|1.0-steps``; ``flush`` exports every
queued span before answering, so that a block's export work is counted in that block's CPU time;
``cpu`` answers ``ok <seconds>``: the CPU time so far of the span export threads (the SDK's
``OtelBatchSpanRecordProcessor``), so the bench can say what share of tracing's cost is export.

Run: ``python -m bench.tracing_switch --port 8000 --control-port 8001`` (the bench starts it).
"""

from __future__ import annotations

import argparse
import contextlib
import socketserver
import threading
import time
from typing import Any

from opentelemetry import trace

from scheduler.infra.settings import get_settings
from scheduler.observability import tracing

RATIOS: tuple[str, ...] = ("0.1", "1.0")
STEP_SPANS = "1.0-steps"  # ratio 1.0 with tracing_step_spans: the submit's steps as child spans
Setup = tuple[Any, trace.Tracer | None, bool, bool, float | None]  # tracing's globals, as use() sets them


def build_setups() -> dict[str, Setup]:
    """``off``, one product tracing setup per ratio (the default settings otherwise) and
    ``1.0-steps`` (the 1.0 provider, steps as spans); leaves the process with tracing off."""
    base = get_settings()
    setups: dict[str, Setup] = {"off": (None, None, False, False, None)}
    for ratio in RATIOS:
        tracing.setup_tracing(base.replaced(tracing_enabled=True, tracing_sample_ratio=float(ratio)),
                              process="api")
        setups[ratio] = (tracing._provider, tracing._tracer, tracing._enabled, tracing._step_spans,
                         tracing._root_ratio)
        tracing._provider, tracing._tracer, tracing._enabled = None, None, False
    provider, tracer, enabled, _, root_ratio = setups["1.0"]
    setups[STEP_SPANS] = (provider, tracer, enabled, True, root_ratio)
    return setups


def use(setup: Setup) -> None:
    tracing._provider, tracing._tracer, tracing._enabled, tracing._step_spans, tracing._root_ratio = setup


EXPORT_THREAD_PREFIX = "OtelBatchSpan"


def export_cpu_seconds() -> float:
    """CPU seconds used so far by this process's span export threads (live ones)."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith(EXPORT_THREAD_PREFIX) and thread.ident is not None:
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


def serve_control(port: int, setups: dict[str, Setup]) -> None:
    """Answer control lines on 127.0.0.1:``port`` in a daemon thread."""

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            words = self.rfile.readline().decode().split()
            if words[:1] == ["use"] and len(words) == 2 and words[1] in setups:
                use(setups[words[1]])
            elif words == ["flush"]:
                for provider, *_ in setups.values():
                    if provider is not None:
                        provider.force_flush(10_000)
            elif words == ["cpu"]:
                self.wfile.write(f"ok {export_cpu_seconds():.6f}\n".encode())
                return
            else:
                self.wfile.write(b"error\n")
                return
            self.wfile.write(b"ok\n")

    server = socketserver.ThreadingTCPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="tracing-switch", daemon=True).start()


def main() -> None:
    from cli.services import api

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--control-port", type=int, required=True)
    args = parser.parse_args()
    serve_control(args.control_port, build_setups())
    # `cloverq api` itself, in this process (its app reads the tracing globals per request).
    assert api.callback is not None
    api.callback(host="127.0.0.1", port=args.port, admin_port=None, ops_port=None, workers=1,
                 access_log=False, keep_alive=75, fd=None, admin_fd=None, ops_fd=None)


if __name__ == "__main__":
    main()
