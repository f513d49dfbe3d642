"""The operator dashboard in a real headless Chromium against ``cloverq up``.

Starts the stack exactly as the README does (``cloverq up`` in a temp data dir, embedded
SQLite + redis-server + demo model), submits jobs over HTTP with the dev key ``up`` created,
then drives ``/dashboard`` with Playwright on Debian's ``chromium``: sign in with the key,
see the jobs, click one, see its detail. Skips (with the reason) when no chromium or no
Playwright is installed; ``.ci/run`` installs chromium.

With ``CLOVERQ_DASHBOARD_SCREENSHOT=path`` the test also saves a screenshot there (that is how
``docs/dashboard.png`` is made); ``CLOVERQ_DASHBOARD_LINK_SCREENSHOT`` and
``CLOVERQ_DASHBOARD_BATCH_SCREENSHOT`` take the 1,280 px page signed in via the printed link, with
a batch in progress and a batch job's detail (metadata) open.
"""

from __future__ import annotations

import json
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

from bench.fleet_services import free_port

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
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOVERQ_")}
    env.update(
        {
            "CLOVERQ_DATA_DIR": str(data_dir),
            "CLOVERQ_EMBEDDED_REDIS_PORT": str(free_port()),
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

    # up's default says so, in the banner it prints once it saw the stack ready (the fixture may
    # see /readyz answer a moment before that)
    deadline = time.monotonic() + 30
    while "cloverq is up" not in stack.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "planes: ONE PORT serves public, admin and ops" in stack.log()

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
            prompt_tokens = target["result"]["usage"]["prompt_tokens"]  # a succeeded job prefilled all
            expect(detail.locator("#job-prefill")).to_have_text(
                f"{prompt_tokens} of {prompt_tokens} prompt tokens")
            assert "Write a haiku" not in page.content()  # operators see no prompts

            # Filters narrow the list (server-side).
            page.select_option("#filters select[name=status]", "failed")
            expect(page.locator(f'#jobs-table tr[data-job-id="{jobs[0]["id"]}"]')).to_have_count(0)
            page.select_option("#filters select[name=status]", "")
            expect(page.locator(f'#jobs-table tr[data-job-id="{jobs[0]["id"]}"]')).to_be_visible()

            shot = tmp_path / "dashboard.png"
            page.click(f'#jobs-table tr[data-job-id="{target["id"]}"]')
            assert _overflowing_cards(page) == []  # 1,500 px (the one-column layout's widest)
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            wanted = os.environ.get("CLOVERQ_DASHBOARD_SCREENSHOT")
            if wanted:
                shutil.copyfile(shot, wanted)
        finally:
            browser.close()


BATCH_METADATA = [{"contract_id": f"C-10{n}", "clause": "indemnity"} for n in range(40, 43)]


def _batch_held_in_progress(client: httpx.Client) -> tuple[dict[str, Any], list[str]]:
    """A 3-job batch that stays in progress: its jobs wait in the drained ``bulk`` queue (the dev
    key is an admin key; the caller resumes it) and one is cancelled there, so 1 of 3 is done."""
    assert client.post("/v1/admin/queues/bulk/drain").status_code == 200
    specs = [{"kind": "generate", "input": {"prompt": f"Clause {i} of the contract."},
              "params": {"max_new_tokens": 16}, "metadata": meta} for i, meta in enumerate(BATCH_METADATA)]
    created = client.post("/v1/batches", json={"jobs": specs, "metadata": {"pipeline": "contracts"}})
    assert created.status_code == 202, created.text
    batch = created.json()
    results = client.get(batch["results_url"])
    job_ids = [json.loads(line)["job_id"] for line in results.text.splitlines()]
    assert len(job_ids) == 3, results.text
    assert client.post(f"/v1/jobs/{job_ids[0]}/cancel").json()["status"] == "cancelled"
    held = client.get(f"/v1/batches/{batch['id']}").json()
    assert (held["status"], held["finished"]) == ("running", 1), held
    assert held["counts"] == {"cancelled": 1, "queued": 2}, held
    return held, job_ids


def _overflowing_cards(page: Any) -> list[str]:
    """Titles of the visible cards whose content is wider than the card."""
    return list(page.evaluate(
        "[...document.querySelectorAll('.card')].filter(c => !c.hidden && c.offsetParent"
        " && c.scrollWidth > c.clientWidth + 1).map(c => (c.querySelector('h2') || c).textContent)"))


def _login_link(stack: Stack) -> str:
    """The one-time sign-in link ``cloverq up`` printed (its banner is in the log). The banner
    comes a moment after /readyz first answers 200 (what the fixture waits for): wait for it."""
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        for line in stack.log().splitlines():
            if "/dashboard#login=" in line:
                return line.split()[-1]
        time.sleep(0.2)
    pytest.fail(f"cloverq up printed no dashboard sign-in link:\n{stack.log()[-3000:]}")


def test_the_printed_link_signs_in_once_and_shows_a_batch_in_progress(stack: Stack, tmp_path: Path) -> None:
    """Signed in via the printed link: the form greets without an error, the page shows a batch in
    progress (its row, its done/total bar, its jobs) and a batch job's metadata, all within 1,280 px."""
    link = _login_link(stack)
    assert stack.key not in link  # a code, never the key, in the URL
    headers = {"Authorization": f"Bearer {stack.key}"}
    client = httpx.Client(base_url=stack.base_url, headers=headers, timeout=10.0)
    try:
        batch, job_ids = _batch_held_in_progress(client)
        _check_the_link_and_the_batch(stack, link, batch, job_ids, tmp_path)
    finally:
        assert client.post("/v1/admin/queues/bulk/resume").status_code == 200
        client.close()


def _check_the_link_and_the_batch(
    stack: Stack, link: str, batch: dict[str, Any], job_ids: list[str], tmp_path: Path
) -> None:
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{stack.base_url}/dashboard")  # nothing typed yet: the form, no refusal
            expect(page.locator("#login")).to_be_visible()
            page.wait_for_timeout(500)  # the first (keyless) refresh has answered
            expect(page.locator("#login-error")).to_be_hidden()

            signed_in = browser.new_page(viewport={"width": 1280, "height": 900})
            signed_in.goto(link)
            signed_in.wait_for_selector("body[data-loaded=true]", timeout=20_000)
            expect(signed_in.locator("#app")).to_be_visible()
            assert "#login=" not in signed_in.url  # the code left the address bar at once

            # The batch in progress: its row, its bar (1 of 3 done: the cancelled job) and counts.
            row = signed_in.locator(f'#batches-table tr[data-batch-id="{batch["id"]}"]')
            expect(row).to_be_visible()
            expect(row).to_have_attribute("data-status", "running")
            expect(row.locator("[role=progressbar]")).to_have_attribute("aria-valuenow", "1")
            expect(row.locator("[role=progressbar] .seg[data-status=cancelled]")).to_be_visible()
            expect(row.locator(".progress-label")).to_have_text("1 / 3 done (33%)")
            expect(row).to_contain_text("2 queued")
            expect(row).to_contain_text("pipeline=contracts")
            # Its detail lists the jobs in submission order with their metadata.
            row.click()
            batch_jobs = signed_in.locator("#batch-jobs-table tbody tr")
            expect(batch_jobs).to_have_count(3)
            for index, job_id in enumerate(job_ids):
                expect(batch_jobs.nth(index)).to_have_attribute("data-job-id", job_id)
                expect(batch_jobs.nth(index)).to_contain_text(f"contract_id={BATCH_METADATA[index]['contract_id']}")
            # A batch job's detail shows its metadata (the contract id a pipeline asks about).
            batch_jobs.nth(1).click()
            detail = signed_in.locator("#job-detail-body")
            expect(detail.locator("code").first).to_have_text(job_ids[1])
            expect(detail.locator("#job-metadata")).to_contain_text("contract_id")
            expect(detail.locator("#job-metadata")).to_contain_text(BATCH_METADATA[1]["contract_id"])
            expect(detail).to_contain_text("queued")
            # Fits 1280 px: no card's content is wider than the card (nothing clipped or scrolled),
            # with the batch, its jobs and a job's detail open.
            assert _overflowing_cards(signed_in) == []
            signed_in.set_viewport_size({"width": 1400, "height": 900})  # the width the audit saw clipped
            assert _overflowing_cards(signed_in) == []
            signed_in.set_viewport_size({"width": 1280, "height": 900})
            shot = tmp_path / "dashboard-link.png"
            signed_in.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            for variable in ("CLOVERQ_DASHBOARD_LINK_SCREENSHOT", "CLOVERQ_DASHBOARD_BATCH_SCREENSHOT"):
                wanted = os.environ.get(variable)
                if wanted:
                    shutil.copyfile(shot, wanted)

            reused = browser.new_page()  # a fresh tab: no key in its sessionStorage
            reused.goto(link)
            expect(reused.locator("#login-error")).to_contain_text("already used or has expired")
        finally:
            browser.close()
