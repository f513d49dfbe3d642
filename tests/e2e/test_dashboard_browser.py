"""The operator dashboard in a real headless Chromium against ``cloverq up``.

Starts the stack exactly as the README does (``cloverq up`` in a temp data dir, embedded
SQLite + redis-server + demo model), submits jobs over HTTP with the dev key ``up`` created,
then drives ``/dashboard`` with Playwright on Debian's ``chromium``: sign in with the key,
see the jobs, click one, see its detail. Skips (with the reason) when no chromium or no
Playwright is installed; ``.ci/run`` installs chromium.

With ``CLOVERQ_DASHBOARD_SCREENSHOT=path`` the test also saves a screenshot there (that is how
``docs/dashboard.png`` is made).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
FINAL = {"succeeded", "failed", "cancelled", "expired"}
STACK_TIMEOUT = 180.0


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Stack:
    base_url: str
    key: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """``cloverq up`` on free ports in a temp dir; SIGTERM at the end (children must go too)."""
    if CHROMIUM is None:
        pytest.skip("no chromium installed (apt-get install -y chromium); .ci/run installs it")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    workdir = tmp_path_factory.mktemp("dashboard")
    data_dir = workdir / "data"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOVERQ_")}
    env.update(
        {
            "CLOVERQ_DATA_DIR": str(data_dir),
            "CLOVERQ_EMBEDDED_REDIS_PORT": str(_free_port()),
            "CLOVERQ_ENGINE_MAX_BATCH": "4",
            "CLOVERQ_WORKER_METRICS_INTERVAL": "0.5",
            "PYTHONUNBUFFERED": "1",
        }
    )
    log_path = workdir / "up.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "up", "--port", str(port)],
            cwd=workdir,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    key_file = data_dir / "dev_api_key"
    deadline = time.monotonic() + STACK_TIMEOUT
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"cloverq up exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"cloverq up not ready in {STACK_TIMEOUT}s:\n{log_path.read_text()[-4000:]}")
            if key_file.is_file() and _ready(base_url):
                break
            time.sleep(0.3)
        yield Stack(base_url=base_url, key=key_file.read_text().strip(), proc=proc, log_path=log_path)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def _ready(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/readyz", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _submit_and_finish(stack: Stack, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {stack.key}"}
    with httpx.Client(base_url=stack.base_url, headers=headers, timeout=10.0) as client:
        ids = []
        for body in bodies:
            response = client.post("/v1/jobs", json=body)
            assert response.status_code == 202, response.text
            ids.append(response.json()["id"])
        deadline = time.monotonic() + 120.0
        while True:
            jobs = [client.get(f"/v1/jobs/{job_id}").json() for job_id in ids]
            if all(job["status"] in FINAL for job in jobs):
                return jobs
            if time.monotonic() > deadline:
                pytest.fail(f"jobs not finished: {[j['status'] for j in jobs]}\n{stack.log()[-3000:]}")
            time.sleep(0.2)


def _relabel_as_second_version(stack: Stack, job_id: str) -> str:
    """Record ``job_id`` as run on a second version of the model (what a canary's jobs look like
    in SQL), straight in the stack's SQLite file; returns that version's label."""
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{stack.log_path.parent / 'data' / 'cloverq.db'}")
    try:
        with engine.begin() as conn:
            served = conn.execute(text("SELECT model_version FROM jobs WHERE id = :id"),
                                  {"id": job_id.replace("-", "")}).scalar()
            assert served, "the finished job records the version it ran on"
            second = "canary-v2"  # a version label is "<version>@<manifest digest>"
            conn.execute(text("UPDATE jobs SET model_version = :v WHERE id = :id"),
                         {"v": f"{second}@{str(served).split('@')[-1]}", "id": job_id.replace("-", "")})
    finally:
        engine.dispose()
    return second


def test_dashboard_lists_jobs_and_opens_a_detail(stack: Stack, tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    prompts = ["Summarise the contract.", "List three risks.", "Write a haiku about queues."]
    bodies = [
        {"kind": "generate", "input": {"prompt": p}, "params": {"max_new_tokens": 8 * (i + 1)}}
        for i, p in enumerate(prompts)
    ]
    jobs = _submit_and_finish(stack, bodies)
    assert all(job["status"] == "succeeded" for job in jobs), jobs
    second = _relabel_as_second_version(stack, jobs[0]["id"])

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.goto(f"{stack.base_url}/dashboard")
            # Auth is on: the page asks for the admin key first.
            expect(page.locator("#login")).to_be_visible()
            page.fill("#login-key", "cq_not_a_key")
            page.click("#login-form button[type=submit]")
            expect(page.locator("#login-error")).to_be_visible()
            page.fill("#login-key", stack.key)
            page.click("#login-form button[type=submit]")
            page.wait_for_selector("body[data-loaded=true]", timeout=20_000)
            expect(page.locator("#app")).to_be_visible()

            for job in jobs:  # every job the test created is listed
                expect(page.locator(f'#jobs-table tr[data-job-id="{job["id"]}"]')).to_be_visible()
            succeeded_tile = page.locator('.tile[data-status="succeeded"] .n')
            assert int(succeeded_tile.inner_text()) >= len(jobs)
            expect(page.locator("#workers-table tbody tr[data-worker]")).to_have_count(1)
            # The model versions table, side by side: the served version and the second one the
            # record shows (a canary's jobs carry their own version; one such job is relabelled).
            expect(page.locator("#versions-table tbody tr[data-version]")).to_have_count(2)
            expect(page.locator(f'#versions-table tbody tr[data-version="{second}"]')).to_be_visible()
            assert page.locator("#chart-run circle").count() >= len(jobs)

            target = jobs[1]
            page.click(f'#jobs-table tr[data-job-id="{target["id"]}"]')
            detail = page.locator("#job-detail-body")
            expect(detail).to_be_visible()
            expect(detail.locator("code").first).to_have_text(target["id"])
            expect(detail).to_contain_text("succeeded")
            expect(detail).to_contain_text("Timeline")
            expect(detail.locator(".timeline li")).to_have_count(4)  # created, started, finished, expires
            expect(detail).to_contain_text(f"{target['progress']['steps_used']}")
            assert "Write a haiku" not in page.content()  # operators see no prompts

            # Filters narrow the list (server-side).
            page.select_option("#filters select[name=status]", "failed")
            expect(page.locator(f'#jobs-table tr[data-job-id="{jobs[0]["id"]}"]')).to_have_count(0)
            page.select_option("#filters select[name=status]", "")
            expect(page.locator(f'#jobs-table tr[data-job-id="{jobs[0]["id"]}"]')).to_be_visible()

            shot = tmp_path / "dashboard.png"
            page.click(f'#jobs-table tr[data-job-id="{target["id"]}"]')
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            wanted = os.environ.get("CLOVERQ_DASHBOARD_SCREENSHOT")
            if wanted:
                shutil.copyfile(shot, wanted)
        finally:
            browser.close()
