"""``cloverq top``: a live terminal view of queues, workers and throughput.

It polls the API's admin overview (``GET /v1/admin/overview``, the same data the web dashboard
shows), so it works from any machine that can reach the API, and renders it with rich. Rates
(jobs finished per second) come from the difference between two polls.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import click
import httpx
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from cli.api_client import Target, api_client, refusal_hint, resolve_target
from client import Client, CloverqError
from scheduler.infra.settings import get_settings
from scheduler.jobs.models import FINAL_STATUSES, JobStatus

STATUSES: tuple[str, ...] = tuple(status.value for status in JobStatus)
STATUS_STYLES: dict[str, str] = {
    JobStatus.QUEUED: "bright_black",
    JobStatus.RUNNING: "blue",
    JobStatus.SUCCEEDED: "green",
    JobStatus.FAILED: "red",
    JobStatus.CANCELLED: "yellow",
    JobStatus.EXPIRED: "bright_black",
}
SPARK = "▁▂▃▄▅▆▇█"


@dataclass
class Rates:
    """Throughput history across polls (bookkeeping only)."""

    history: deque[float] = field(default_factory=lambda: deque(maxlen=40))
    _last_finished: int | None = None
    _last_time: float | None = None

    def update(self, overview: Mapping[str, Any], now: float) -> float | None:
        """Jobs finished per second since the previous poll (None on the first one)."""
        by_status = overview["counts"]["by_status"]
        finished = sum(int(by_status.get(s.value, 0)) for s in FINAL_STATUSES)
        rate = None
        if self._last_finished is not None and self._last_time is not None and now > self._last_time:
            rate = max(0.0, (finished - self._last_finished) / (now - self._last_time))
        self._last_finished, self._last_time = finished, now
        self.history.append(float(overview["throughput"]["tokens_per_second"]))
        return rate


def sparkline(values: Sequence[float]) -> str:
    """A one-line chart of ``values`` (scaled to their max)."""
    if not values:
        return ""
    top = max(values) or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1)))] for v in values)


def _fmt_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.2f}s"


def _fmt_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    n, i = float(value), 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.1f}{units[i]}"


def _model_label(name: str | None, version: str | None) -> str:
    if not version:
        return name or "?"
    if not name or version.startswith(f"{name}@"):
        return version
    return f"{name}@{version}"


def render(
    overview: Mapping[str, Any], *, url: str, job_rate: float | None, tps_history: Sequence[float]
) -> Group:
    """One frame of the view (pure: also used by ``--once`` and the tests)."""
    by_status = overview["counts"]["by_status"]
    header = Text.assemble(
        ("cloverq top", "bold"),
        f"  {url}  ",
        (overview.get("generated_at", ""), "dim"),
    )
    counts = Text("  ").join(
        Text.assemble((f"{s} ", STATUS_STYLES[s]), (str(by_status.get(s, 0)), "bold")) for s in STATUSES
    )

    queues = Table(title="queues", expand=True, title_justify="left")
    for column in (
        "queue",
        "queued",
        "running",
        "succeeded",
        "failed",
        "ready workers",
        "wait p95",
        "run p95",
    ):
        queues.add_column(column, justify="left" if column == "queue" else "right")
    latency = overview.get("latency", {})
    for q in overview["queues"]:
        per_queue = overview["counts"]["by_queue"].get(q["name"], {})
        lat = latency.get(q["name"], {})
        queues.add_row(
            Text.assemble(q["name"], (" drained", "bold red") if q.get("drained") else ""),
            str(q["queued"]),
            str(q["running"]),
            str(per_queue.get(JobStatus.SUCCEEDED.value, 0)),
            str(per_queue.get(JobStatus.FAILED.value, 0)),
            str(q["workers_ready"]),
            _fmt_seconds(lat.get("wait", {}).get("p95")),
            _fmt_seconds(lat.get("run", {}).get("p95")),
        )

    workers = Table(title="workers", expand=True, title_justify="left")
    for column in ("worker", "state", "queues", "model", "tok/s", "batch", "memory used/total"):
        workers.add_column(column, justify="right" if column in ("tok/s", "batch") else "left")
    for w in overview["workers"]:
        workers.add_row(
            w["worker"],
            str(w.get("state") or "-"),
            ",".join(w.get("queues") or []),
            _model_label(w.get("model_name"), w.get("model_version")),
            f"{w.get('tokens_per_second') or 0:.1f}",
            f"{(w.get('batch_occupancy') or 0) * 100:.0f}%",
            f"{_fmt_bytes(w.get('memory_used_bytes'))}/{_fmt_bytes(w.get('memory_total_bytes'))}",
        )
    if not overview["workers"]:
        workers.add_row("(no worker is publishing)", "", "", "", "", "", "")

    throughput = overview["throughput"]
    versions = versions_table(overview)
    rate_text = "-" if job_rate is None else f"{job_rate:.2f}"
    summary = Text.assemble(
        ("throughput ", "bold"),
        f"{throughput['tokens_per_second']:.1f} tok/s  {rate_text} jobs/s  ",
        f"{throughput['finished_last_minute']} finished in the last minute  ",
        (sparkline(tps_history), "cyan"),
    )
    return Group(header, counts, queues, workers, *([versions] if versions is not None else []), summary)


def versions_table(overview: Mapping[str, Any]) -> Table | None:
    """Model versions side by side, canary first (``versions`` of the overview); None when no
    job ran on a known version yet (an older API answers without it too)."""
    rows = overview.get("versions") or []
    if not rows:
        return None
    canaries = overview.get("canaries") or []
    title = "model versions" + "".join(f"  (canary {c['canary']} at {c['percent']:g}% of {c['model']})"
                                       for c in canaries)
    table = Table(title=title, expand=True, title_justify="left")
    for column in ("version", "track", "ready", "jobs", "error rate", "run p50/p95", "steps", "tok/s",
                   "invalid retries"):
        table.add_column(column, justify="left" if column in ("version", "track") else "right")
    for v in rows:
        rate = v.get("error_rate")
        table.add_row(
            str(v["version"]), v.get("track") or "-", str(v.get("workers_ready", 0)), str(v.get("jobs", 0)),
            "-" if rate is None else f"{rate * 100:.1f}%",
            f"{_fmt_seconds(v.get('run_p50'))}/{_fmt_seconds(v.get('run_p95'))}",
            "-" if v.get("steps_mean") is None else f"{v['steps_mean']:.1f}",
            f"{v.get('tokens_per_second') or 0:.1f}", str(v.get("invalid_output_retries", 0)),
        )
    return table


def fetch_overview(client: Client, target: Target | None = None) -> dict[str, Any]:
    """GET the admin overview; raises ``click.ClickException`` with the API's message and, for a
    refusal, what was sent (no key at all, or which key) and what is needed (an admin key)."""
    try:
        return client.overview()
    except CloverqError as exc:
        if exc.status in (401, 403):
            sent = refusal_hint(target, exc.status) if target is not None else "the key was refused"
            raise click.ClickException(
                f"the API refused the request (HTTP {exc.status}): {sent}; `cloverq top` needs a key "
                "with the admin scope (the dev key `cloverq up` prints has it)"
            ) from None
        raise


@click.command("top")
@click.option("--url", default=None,
              help="Base URL of the API (default: CLOVERQ_API_URL, else the running `cloverq up`).")
@click.option("--key", default=None,
              help="Admin API key (default: CLOVERQ_API_KEY, else the dev key of `cloverq up`).")
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.2), help="Seconds.")
@click.option("--once", is_flag=True, help="Print one frame and exit (for scripts).")
def top(url: str | None, key: str | None, interval: float, once: bool) -> None:
    """Live view of queues, workers and throughput (Ctrl-C to quit)."""
    target = resolve_target(get_settings(), url, key)
    url = target.url
    rates = Rates()
    console = Console()
    with api_client(url, target.key, timeout=10.0) as client:
        try:
            overview = fetch_overview(client, target)
        except httpx.HTTPError as exc:
            raise click.ClickException(f"cannot reach {url}: {exc}") from exc
        rate = rates.update(overview, time.monotonic())
        if once:
            console.print(render(overview, url=url, job_rate=rate, tps_history=list(rates.history)))
            return
        with Live(console=console, refresh_per_second=4, screen=False) as live:
            try:
                while True:
                    live.update(render(overview, url=url, job_rate=rate, tps_history=list(rates.history)))
                    time.sleep(interval)
                    try:
                        overview = fetch_overview(client, target)
                    except (httpx.HTTPError, CloverqError) as exc:
                        live.console.print(f"[red]poll failed: {exc}[/red]")
                        continue
                    rate = rates.update(overview, time.monotonic())
            except KeyboardInterrupt:
                return


def register(group: click.Group) -> None:
    """Add ``top`` to the ``cloverq`` group."""
    group.add_command(top)
