"""Alert rules and the Grafana dashboard only use metrics cloverq really exports.

An alert on a misspelt metric never fires, and a dashboard panel on one stays empty; neither
fails loudly. The names are checked against ``scheduler.observability.metric_families.FAMILIES``
(the contract of the
``/metrics`` exporter). When Debian's ``prometheus`` package is installed, ``promtool`` also
checks the rule syntax and runs the rule unit tests in ``deploy/prometheus/alerts_test.yml``
(those tests skip, with the reason, where promtool is absent).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from scheduler.observability.metric_families import FAMILIES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "cloverq.json"
PROMTOOL = shutil.which("promtool")
NO_PROMTOOL = "promtool not installed (apt-get install -y --no-install-recommends prometheus; .ci/run does)"

# Series Prometheus itself produces (not exported by cloverq).
PROMETHEUS_BUILTINS = {"up"}
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def _selectors(expr: str) -> set[str]:
    """Metric names (and recording-rule names) an expression reads, strings and labels removed."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)  # range / subquery durations
    names = set()
    for match in _IDENT.finditer(text):
        name = match.group(0)
        following = text[match.end() :].lstrip()
        if following.startswith("("):  # a function or aggregation call
            continue
        if name.startswith("cloverq") or name in PROMETHEUS_BUILTINS:
            names.add(name)
    return names


def _family_of(series: str) -> str | None:
    """The exported family a series name belongs to (histograms: strip _bucket/_sum/_count)."""
    if series in FAMILIES:
        return series
    for suffix in _HISTOGRAM_SUFFIXES:
        base = series.removesuffix(suffix)
        if base != series and FAMILIES.get(base) is not None and FAMILIES[base].type == "histogram":
            return base
    return None


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _dashboard_panels() -> Iterator[dict[str, Any]]:
    def walk(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in panels:
            yield panel
            yield from walk(panel.get("panels", []))

    yield from walk(json.loads(DASHBOARD.read_text())["panels"])


def _dashboard_exprs() -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in _dashboard_panels()
        for target in panel.get("targets", [])
        if "expr" in target
    ]


# --- the selector parser itself ----------------------------------------------------------------


def test_selector_parser_finds_metrics_not_functions_or_labels() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (queue, le) (rate(cloverq_job_run_seconds_bucket{queue!="joint"}'
        '[5m]))) / max without (instance, pod) (cloverq:x:rate5m) > on(queue) group_left up{job="a"}'
    )
    assert _selectors(expr) == {"cloverq_job_run_seconds_bucket", "cloverq:x:rate5m", "up"}
    assert _family_of("cloverq_job_run_seconds_bucket") == "cloverq_job_run_seconds"
    assert _family_of("cloverq_jobs_finished_total_bucket") is None  # counters have no buckets
    assert _family_of("cloverq_no_such_metric") is None


# --- alert rules -----------------------------------------------------------------------------


def test_alert_rules_use_only_exported_metrics() -> None:
    rules = _rules()
    recorded = {rule["record"] for rule in rules if "record" in rule}
    selectors = [name for rule in rules for name in _selectors(rule["expr"])]
    assert recorded and selectors  # the rules parsed (an empty file would pass the loop below)
    for rule in rules:
        for name in _selectors(rule["expr"]):
            if ":" in name:
                assert name in recorded, f"{rule.get('alert') or rule['record']}: no rule records {name}"
            elif name not in PROMETHEUS_BUILTINS:
                assert _family_of(name), f"{rule.get('alert') or rule['record']}: {name} is not exported"


def test_recording_rules_follow_the_naming_convention() -> None:
    assert any("record" in rule for rule in _rules())  # there are recording rules to check
    for rule in _rules():
        if "record" in rule:
            assert re.fullmatch(r"cloverq:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]


def _alerts_by_name() -> dict[str, dict[str, Any]]:
    return {rule["alert"]: rule for rule in _rules() if "alert" in rule}


def test_required_alerts_exist_with_severity_and_summary() -> None:
    alerts = _alerts_by_name()
    for rule in alerts.values():
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    expr_of = {name: rule["expr"] for name, rule in alerts.items()}
    # error rate, p95 latency per queue, queue depth, device memory, no ready worker, dead letters
    assert 'status="failed"' in _recorded_expr("cloverq:job_error_ratio:rate10m")
    assert "cloverq:job_error_ratio:rate10m" in expr_of["CloverqJobErrorRateHigh"]
    for name, recorded in (
        ("CloverqQueueWaitP95High", "cloverq:job_queue_wait_seconds:p95_10m"),
        ("CloverqRunTimeP95High", "cloverq:job_run_seconds:p95_10m"),
    ):
        assert "histogram_quantile(0.95" in _recorded_expr(recorded)
        assert "by (queue, le)" in _recorded_expr(recorded)
        for queue in ("interactive", "standard", "bulk", "joint"):
            assert f'{recorded}{{queue="{queue}"}}' in expr_of[name], (name, queue)
    assert "cloverq_queue_depth" in expr_of["CloverqQueueBacklog"]
    memory = alerts["CloverqDeviceMemoryHigh"]
    assert memory["for"] == "5m" and "> 0.95" in memory["expr"]
    assert 'kind="used"' in memory["expr"] and 'kind="total"' in memory["expr"]
    assert (
        "cloverq_workers_ready" in expr_of["CloverqNoReadyWorker"]
        and "== 0" in expr_of["CloverqNoReadyWorker"]
    )
    assert "cloverq_dead_letters_total" in expr_of["CloverqDeadLetters"]


def _recorded_expr(record: str) -> str:
    return next(rule["expr"] for rule in _rules() if rule.get("record") == record)


def test_cluster_wide_counters_are_deduplicated_before_summing() -> None:
    """Worker-recorded counters are exported by every API replica: sum only after dedup."""
    worker_counters = (
        "cloverq_jobs_finished_total",
        "cloverq_dead_letters_total",
        "cloverq_job_retries_total",
    )
    exprs = [rule["expr"] for rule in _rules()] + [expr for _, expr in _dashboard_exprs()]
    summed = [m for expr in exprs for c in worker_counters
              for m in re.finditer(rf"\b(rate|increase)\({c}\b", expr)]
    assert summed  # the rules and dashboards do sum these counters (else the check below checks nothing)
    for expr in exprs:
        for counter in worker_counters:
            for match in re.finditer(rf"\b(rate|increase)\({counter}\b", expr):
                before = expr[: match.start()].rstrip()
                assert before.endswith("max without (instance, pod) ("), expr


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_promtool_checks_the_rules() -> None:
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_promtool_rule_unit_tests_pass() -> None:
    """Alerts fire on synthetic series (and stay quiet below their thresholds)."""
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(DEPLOY / "prometheus" / "alerts_test.yml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)
def test_promtool_checks_the_prometheus_config() -> None:
    result = subprocess.run(
        [PROMTOOL, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_unit_tests_cover_every_alert_family_asked_for() -> None:
    tested = {
        case["alertname"]
        for test in yaml.safe_load((DEPLOY / "prometheus" / "alerts_test.yml").read_text())["tests"]
        for case in test.get("alert_rule_test", [])
    }
    assert tested >= {
        "CloverqNoReadyWorker",
        "CloverqDeviceMemoryHigh",
        "CloverqJobErrorRateHigh",
        "CloverqDeadLetters",
        "CloverqQueueWaitP95High",
        "CloverqQueueBacklog",
        "CloverqCanaryErrorRateAboveStable",
    }
    assert tested <= set(_alerts_by_name())


# --- Grafana dashboard ----------------------------------------------------------------------


def test_dashboard_uses_only_exported_metrics() -> None:
    exprs = _dashboard_exprs()
    assert exprs
    for title, expr in exprs:
        for name in _selectors(expr):
            assert ":" not in name, f"{title}: dashboards must not depend on recording rules ({name})"
            assert _family_of(name), f"panel {title!r}: {name} is not exported"


def test_dashboard_charts_every_exported_family() -> None:
    used = {_family_of(name) for _, expr in _dashboard_exprs() for name in _selectors(expr)}
    missing = set(FAMILIES) - used
    assert not missing, f"families without a panel: {sorted(missing)}"


def test_dashboard_has_separate_joint_mode_panels() -> None:
    panels = list(_dashboard_panels())
    rows = [p for p in panels if p["type"] == "row"]
    assert any("joint" in row["title"].lower() for row in rows)
    joint = [p for p in panels if p["type"] != "row" and p["title"].lower().startswith("joint")]
    assert len(joint) >= 4
    for panel in joint:
        assert all('queue="joint"' in t["expr"] or "invalid_output" in t["expr"] for t in panel["targets"])
    # Independent-mode panels on per-queue families exclude the joint queue: modes never blur.
    for panel in panels:
        if panel["type"] == "row" or panel["title"].lower().startswith("joint"):
            continue
        for target in panel["targets"]:
            families = {_family_of(name) for name in _selectors(target["expr"])}
            if any(f is not None and "queue" in FAMILIES[f].labels for f in families):
                assert 'queue!="joint"' in target["expr"], f"panel {panel['title']!r} mixes in joint mode"


def test_dashboard_layout_and_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    panels = list(_dashboard_panels())
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"panel {panel['title']!r} overlaps another"
                cells.add((x, y))
    provisioned = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text()
    )
    uids = {ds["uid"] for ds in provisioned["datasources"]}
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] in uids, panel["title"]
            assert all(t["datasource"]["uid"] in uids for t in panel["targets"]), panel["title"]


def test_the_deploy_readme_documents_every_alert() -> None:
    readme = (DEPLOY / "README.md").read_text()
    assert _alerts_by_name()  # the alert rules parsed
    for name in _alerts_by_name():
        assert f"`{name}`" in readme, f"deploy/README.md does not document {name}"
