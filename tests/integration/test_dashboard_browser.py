"""The dashboard in a real browser (issue 8, item 4): Debian's headless Chromium driven by
Playwright (`executable_path=/usr/bin/chromium`; no browser download) against a live stack.

The run behind it, all real processes and media:
1. a pipeline whose transcode always fails (`TAPELINE_FAIL_POINTS`, storage_transient) with one
   attempt allowed: job DEAD is dead-lettered;
2. a healthy pipeline with a 4 s lease: job DONE (a 4 s clip) completes; job STALLED (a 21 s clip)
   has its transcode worker killed with SIGKILL mid-encode, the supervisor sees it exit and the
   attempt is retried at once (`StallDetected(worker_exited)`), and it completes.

The browser then finds each where it belongs, refuses a replay with a wrong token, replays DEAD
with the token through the page and watches (live refresh, no reload) the job complete, checks a
reason containing HTML shows as text and runs nothing, and saves screenshots of the overview and of
STALLED's job page (paths printed).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest
import uvicorn
from pydantic import SecretStr

from projections.glossary import explain
from cli.wiring import build_app as create_app
from tapeline.samples import sample_video
from tests.conftest import Pipeline, tapeline_cli, wait_for
from tests.faults.conftest import FAULT_TIMING, job_row
from tests.faults.test_worker_faults import submit, wait_state, wait_transcoding

pytestmark = pytest.mark.integration
CHROMIUM = "/usr/bin/chromium"
TOKEN = "browser-test-token"
WHY = 'storage fixed <img src=x onerror="window.__pwned = 1">'


@pytest.fixture(scope="module")
def run(isolated, tmp_path_factory):
    """The three jobs of the module docstring; returns (settings, {"dead", "done", "stalled"} job ids, tmp dir)."""
    tmp = tmp_path_factory.mktemp("dashboard")
    settings = isolated.model_copy(update={**FAULT_TIMING, "retry_backoff_s": (1.0,), "retry_jitter": 0.0})
    broken = Pipeline(settings.model_copy(update={"max_attempts": 1}), tmp / "broken.log",
                      extra_env={"TAPELINE_FAIL_POINTS": "transcode.download:storage_transient"}).start()
    try:
        dead = submit(settings, sample_video("carphone_pristine.mp4"))
        wait_state(settings, dead, "dead_lettered", timeout_s=120)
    finally:
        broken.stop()
    clip = tmp / "bigbuckbunny-x4.mp4"  # about 21 s of 1280x720: long enough to be killed mid-encode
    subprocess.run(["ffmpeg", "-v", "error", "-nostdin", "-stream_loop", "3", "-i", str(sample_video()), "-c", "copy",
                    "-y", str(clip)], check=True, timeout=120)
    healthy = Pipeline(settings, tmp / "healthy.log").start()
    try:
        done = submit(settings, sample_video("carphone_pristine.mp4"))
        wait_state(settings, done, timeout_s=180)
        stalled = submit(settings, clip)
        wait_transcoding(settings, stalled, min_frames=50, timeout_s=120)
        os.kill(healthy.children()["transcode"], signal.SIGKILL)
        wait_state(settings, stalled, timeout_s=240)
        yield settings, {"dead": dead, "done": done, "stalled": stalled}, tmp, healthy
    finally:
        healthy.stop()
        print(healthy.log_text()[-3000:])


@pytest.fixture(scope="module")
def server(run):
    """`tapeline serve`'s app under uvicorn in a thread, with the admin token; yields its base URL."""
    settings = run[0].model_copy(update={"admin_token": SecretStr(TOKEN)})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    wait_for(lambda: uv.started, 30, "uvicorn to start")
    yield f"http://127.0.0.1:{port}"
    uv.should_exit = True
    thread.join(15)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install -y chromium` (scripts/bootstrap.sh installs it)")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-background-networking", "--disable-dev-shm-usage"])
        yield chromium
        chromium.close()


def test_the_dashboard_shows_each_job_where_it_belongs_and_replays_the_dead_letter(run, server, browser):
    from playwright.sync_api import expect

    settings, jobs, tmp, _ = run
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda m: errors.append(m.text) if "Content Security Policy" in m.text else None)

    # Overview: counts by state, the three jobs in the recent list, the throughput chart drawn.
    page.goto(f"{server}/")
    expect(page.locator('#by-state tr[data-state="completed"] td')).to_have_text("2")
    expect(page.locator('#by-state tr[data-state="dead_lettered"] td')).to_have_text("1")
    for name, state in (("done", "completed"), ("stalled", "completed"), ("dead", "dead_lettered")):
        expect(page.locator(f'#recent-jobs tr[data-job-id="{jobs[name]}"] td.state')).to_have_text(state)
    expect(page.locator("#dead-pending")).to_have_text("1")
    # The JS refreshed it from the API (an attribute poll: wait_for_function would need eval, which the CSP forbids).
    expect(page.locator("body")).to_have_attribute("data-refreshes", re.compile(r"^[1-9][0-9]*$"))
    assert page.locator("#throughput rect.bar.completed").count() >= 1
    overview_png = tmp / "overview.png"
    page.screenshot(path=str(overview_png), full_page=True)

    # The stalled-and-retried job: its attempts, the stall in its timeline, one progress line per attempt.
    page.goto(f"{server}/jobs/{jobs['stalled']}")
    expect(page.locator("#job-state")).to_have_text("completed")
    outcomes = page.locator("#attempts tbody tr").evaluate_all(
        "rows => rows.map(r => [...r.cells].slice(0, 4).map(c => c.textContent))")
    assert outcomes == [["transcode", "1", outcomes[0][2], "stalled"], ["transcode", "2", outcomes[1][2], "succeeded"],
                        ["thumbnails", "1", outcomes[2][2], "succeeded"], ["publish", "1", outcomes[3][2], "succeeded"]]
    stall = page.locator('#timeline tr[data-event="StallDetected"] td.detail')
    expect(stall).to_have_count(1)
    expect(stall).to_contain_text("kind=worker_exited")
    expect(page.locator("#progress-chart polyline.series")).to_have_count(2)
    expect(page.locator("#progress-legend .series-key")).to_have_count(2)
    assert "attempt 1 (stalled" in page.locator('#progress-legend .series-key[data-attempt="1"]').inner_text()
    assert "attempt 2 (succeeded" in page.locator('#progress-legend .series-key[data-attempt="2"]').inner_text()
    # The diagnosis on top says what happened in words, the same text `tapeline status JOB` prints.
    expect(page.locator("#diagnosis-summary")).to_contain_text(
        "Completed; it recovered by itself after transcode attempt 1 stalled: the worker process exited (")
    expect(page.locator("#diagnosis-action")).to_have_text(
        "What to do: Nothing to do. If this repeats on one worker host or one file, look there.")

    # One truth per number: the page says what `tapeline status JOB --json` says, and the chart's
    # legend counts the heartbeats the attempts table counts.
    cli = json.loads(tapeline_cli(settings, "status", jobs["stalled"], "--json").stdout)
    expect(page.locator("#diagnosis-summary")).to_have_text("What happened: " + cli["diagnosis"]["summary"])
    expect(page.locator("#job-percent")).to_have_text(cli["percent_text"])  # presenter.percent_text, one wording
    expect(page.locator("#job-stage")).to_have_text(f"{cli['stage']} / {cli['attempt']}")  # the stage's own attempt
    rows = page.locator("#attempts tbody tr").evaluate_all("rows => rows.map(r => [...r.cells].map(c => c.textContent))")
    assert [(r[0], r[1], r[3], float(r[7]) if r[7] else None, r[8]) for r in rows] == [
        (a["stage"], str(a["attempt"]), a["outcome"], a["wasted_s"], str(a["heartbeats"])) for a in cli["attempt_history"]]
    for row in rows[:2]:  # the two transcode attempts
        legend = page.locator(f'#progress-legend .series-key[data-attempt="{row[1]}"]').inner_text()
        assert f", {row[8]} heartbeats" in legend, (legend, row)

    # Every term has its one-line explanation on hover (projections/glossary.py, docs/operating.md).
    expect(page.locator("#attempts th", has_text="wasted (s)")).to_have_attribute(
        "title", "wasted (s): " + explain("wasted (s)"))
    expect(page.locator("#attempts td.outcome.stalled")).to_have_attribute("title", "stalled: " + explain("stalled"))
    expect(page.locator('#timeline tr[data-event="StallDetected"] td.event')).to_have_attribute(
        "title", "StallDetected: " + explain("StallDetected"))
    job_png = tmp / "job-stalled-and-retried.png"
    page.screenshot(path=str(job_png), full_page=True)

    # The done job's source (the real clip, as intake probed it) links the dead job: the same bytes.
    page.goto(f"{server}/jobs/{jobs['done']}")
    expect(page.locator("#source-filename")).to_have_text("carphone_pristine.mp4")
    expect(page.locator("#source-video")).to_contain_text("h264 176x144")
    expect(page.locator("#source-sha256")).to_have_text(re.compile(r"^[0-9a-f]{64}$"))
    expect(page.locator(f'#same-source tr[data-job-id="{jobs["dead"]}"] td.state')).to_have_text("dead_lettered")

    # Nothing is stalled any more (the stall was retried), but the verdict stays listed with what was
    # done about it (TAPELINE_RECENT_STALLS_S, issue 45): an operator arriving late sees what happened.
    page.goto(f"{server}/stalled")
    recent = page.locator(f'#stalls tbody tr[data-job-id="{jobs["stalled"]}"][data-kind="recent_stall"]')
    expect(recent).to_contain_text("worker_exited after")
    expect(recent).to_contain_text("retried as attempt 2; job now completed")
    expect(page.locator("#stalls tbody tr")).to_have_count(1)

    # The dead job's page: why it stopped, that a replay may pass once storage works, and a replay form
    # without a warning (a permanent failure would get one; tests/unit/test_diagnosis.py has those texts).
    page.goto(f"{server}/jobs/{jobs['dead']}")
    expect(page.locator("#diagnosis-summary")).to_contain_text(
        "What happened: Dead-lettered after 1 attempt(s) of transcode: storage_transient (")
    expect(page.locator("#diagnosis-why")).to_have_text(
        "Not permanent: storage_transient: a retry may pass once the object store works again")
    expect(page.locator("#diagnosis-action")).to_contain_text("Fix the object store, then replay")
    expect(page.locator("#replay-warning")).to_have_count(0)
    expect(page.locator('#job-replay-form input[name="dead_letter_id"]')).to_have_value(f"{jobs['dead']}/1")

    # The dead letter with its reason.
    letter_id = f"{jobs['dead']}/1"
    page.goto(f"{server}/dead-letters")
    row = page.locator(f'#dead-letters tr[data-id="{letter_id}"]')
    expect(row.locator("td.error")).to_contain_text("injected failure at transcode.download")
    expect(row.locator("td.replayed")).to_have_text("no")
    expect(row).to_contain_text("storage_transient")
    # The active problems on top (issue 23 item 4): the dead letter, linking its page and its job.
    problem = page.locator('#problems p[data-kind="dead_letters"]')
    expect(problem.locator("a.problem-link")).to_have_attribute("href", "/dead-letters")
    expect(problem.locator("a.problem-job")).to_have_attribute("href", f"/jobs/{jobs['dead']}")

    def fill_replay(token: str) -> None:
        form = page.locator("#replay-form")
        form.locator('input[name="dead_letter_id"]').fill(letter_id)
        form.locator('input[name="token"]').fill(token)
        form.locator('input[name="operator"]').fill("ops-in-browser")
        form.locator('input[name="why"]').fill(WHY)
        form.locator('button[type="submit"]').click()

    # A wrong token: 401, and the dead letter is untouched.
    fill_replay("not-the-token")
    expect(page.locator("h1")).to_have_text("401 Unauthorized")
    assert job_row(settings, jobs["dead"])["state"] == "dead_lettered"

    # The right token: redirected to the job page, which refreshes live until the job completes.
    page.goto(f"{server}/dead-letters")
    fill_replay(TOKEN)
    page.wait_for_url(f"{server}/jobs/{jobs['dead']}?*")
    expect(page.locator("#flash")).to_have_text("replay: transcode attempt 2 queued")
    expect(page.locator("#job-state")).to_have_text("completed", timeout=180_000)  # no reload: the JS refresh
    expect(page.locator('#problems p[data-kind="dead_letters"]')).to_have_count(0)  # the strip refreshes too
    replayed = page.locator('#timeline tr[data-event="JobReplayed"] td.detail')
    # After the JS refresh the detail is still the presenter's (`timeline_detail`, the CLI's words); the
    # script once built its own from a key list, so a refreshed page said it otherwise than the server.
    expect(replayed).to_have_text(f"reason={WHY} operator=ops-in-browser dead_letter_id={letter_id}")
    assert page.locator("#timeline img").count() == 0
    assert page.evaluate("window.__pwned") is None
    expect(page.locator('#attempts tbody tr[data-outcome="succeeded"]')).to_have_count(3)  # transcode, thumbnails, publish

    page.goto(f"{server}/dead-letters")
    expect(page.locator(f'#dead-letters tr[data-id="{letter_id}"] td.replayed')).to_have_text(f"by ops-in-browser: {WHY}")
    assert page.evaluate("window.__pwned") is None
    assert errors == []
    print(f"\nscreenshots: {overview_png} {job_png}")
    assert overview_png.stat().st_size > 10_000 and job_png.stat().st_size > 10_000


def test_the_openapi_page_renders_from_this_server_alone_under_its_policy(server, browser):
    """Swagger UI draws every operation with its assets served here (nothing from a CDN) and no
    Content-Security-Policy violation (its inline script is allowed by hash)."""
    from playwright.sync_api import expect

    page = browser.new_page()
    problems: list[str] = []
    elsewhere: list[str] = []
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    page.on("console", lambda m: problems.append(m.text) if "Content Security Policy" in m.text else None)
    page.on("request", lambda r: elsewhere.append(r.url) if not r.url.startswith(server) else None)
    page.goto(f"{server}/docs")
    expect(page.locator(".opblock").first).to_be_visible(timeout=30_000)
    assert page.locator(".opblock").count() >= 10
    assert problems == [] and elsewhere == [], (problems, elsewhere)
