"""Logs, metrics, traces and readiness (``settings.observability``)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from scheduler.infra.settings_groups.base import SettingsGroup


class ObservabilitySettings(SettingsGroup):
    """Logs, metrics (scheduler/observability/metric_families.py), traces (tracing.py), readiness."""

    log_level: str = "INFO"
    log_payloads: bool = Field(False, description="Log prompts, contexts and outputs (off by default).")
    prometheus_multiproc_dir: Path | None = Field(
        None,
        json_schema_extra={"env": "PROMETHEUS_MULTIPROC_DIR"},
        description="prometheus-client multiprocess dir; set when one host runs several API processes.",
    )
    worker_metrics_interval: float = Field(
        5.0, gt=0, description="Seconds between a worker's metric snapshots (tokens/s, memory, experts)."
    )
    readiness_timeout_seconds: float = Field(
        2.0, gt=0, description="/readyz answers within this: a database or Redis check that has not "
        "answered by then counts as failed (503).",
    )
    tracing_enabled: bool = Field(
        False, description="OpenTelemetry traces (docs/observability.md): one trace per job across the API, "
        "worker and beat, exported over OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT (default "
        "http://localhost:4318); OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES apply. Off: no exporter.",
    )
    tracing_sample_ratio: float | None = Field(
        None, ge=0, le=1, description="Share of new traces recorded (parent-based: a client's sampled "
        "traceparent is followed). Unset: OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG, default all.",
    )
    tracing_queue_size: int = Field(
        2048, ge=1, description="Finished spans a process buffers for export; beyond it (a collector "
        "down or slow) spans are dropped and counted (cloverq_trace_spans_dropped_total), never waited on.",
    )
    tracing_step_spans: bool = Field(
        False, description="Steps inside one request (the submit's admission, SQL commit and publish) as "
        "child spans instead of timed events on the request's span: bars in a trace UI, ~0.1-0.2 ms "
        "more CPU per traced submit (docs/observability.md).",
    )
    tracing_ui_url: str | None = Field(
        None, description="Dashboard: a job's trace links to this http(s) URL with {trace_id} replaced "
        "(a Grafana Explore, Jaeger or vendor trace page); unset: the trace id is shown without a link.",
    )

    @field_validator("tracing_ui_url")
    @classmethod
    def _trace_ui_template(cls, value: str | None) -> str | None:
        """Only an http(s) URL with the placeholder: the dashboard renders it as a link (never a
        ``javascript:`` one)."""
        if value is not None and (not value.startswith(("http://", "https://")) or "{trace_id}" not in value):
            raise ValueError("tracing_ui_url must be an http(s) URL containing {trace_id}")
        return value
