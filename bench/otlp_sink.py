"""A stand-in OpenTelemetry collector for ``python -m bench.api --tracing``: it accepts OTLP/HTTP
exports (``POST /v1/traces``), counts the spans' bytes and answers 200 at once.

It runs as its own process so that, as with a real collector, receiving spans costs the API
process nothing but the export itself (the span queue and the background export thread).

Run: ``python -m bench.otlp_sink --port 4318``.
"""

from __future__ import annotations

import argparse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the exporter reuses its connection

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # readiness probe of bench.api
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), _Sink).serve_forever()


if __name__ == "__main__":
    main()
