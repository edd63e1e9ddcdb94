"""The run report as a person sees it: the Prefect UI of a real server, read by headless Chromium.

A training deployment run (real server, process worker with its reconciler: tests/integration/conftest.py)
is looked at while it trains, then SIGKILLed mid-unit, restarted by the reconciler as the same flow run, and
looked at again: its Artifacts tab must show one card per artifact, the progress card of the killed attempt
being the one that moved on to "complete", and the curves and metrics pages must render. A second flow run
hands the report hostile names, which must reach the page as text only.

Chromium is installed from Debian's package when missing (tests/integration/browser.py), or the tests skip
saying why. ``UPDATE_UI_SCREENSHOTS=1`` also copies each page's screenshot to docs/ (shown in docs/deployments.md).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect.client.schemas.objects import StateType

from flows.artifact_content import safe_column
from flows.artifacts import artifact_key
from tests.conftest import ROOT
from tests.integration import browser
from tests.integration.hostile_report import HOSTILE, RUN_NAME
from tests.integration.test_deployments import (
    flow_run_process,
    pause_config,
    read_run,
    start_run,
    wait_for,
    wait_for_state,
)

pytestmark = [pytest.mark.slow, pytest.mark.system, pytest.mark.timeout(600)]

WHATS = ["progress", "metrics", "curves", "checkpoints", "summary"]
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def chromium() -> str:
    """Requested before ``prefect_stack``: a machine without a browser skips before starting a server."""
    return browser.find_or_install()


def ui_url(stack, path: str) -> str:
    return stack.api_url.removesuffix("/api") + path


def keep_screenshot(page: browser.Page, tmp_path: Path, name: str) -> Path:
    shot = page.screenshot(tmp_path / name)
    if os.environ.get("UPDATE_UI_SCREENSHOTS") == "1":
        shutil.copyfile(shot, DOCS / name)
    return shot


def artifact_cards(page: browser.Page, expected: int) -> dict[str, list[dict]]:
    """The flow run's Artifacts tab, once it shows ``expected`` cards: {key: [{"text", "href"}, ...]}."""
    page.click(".p-tab", "Artifacts")
    read = (
        "[...document.querySelectorAll('.artifact-card')]"
        ".map(c => ({text: c.innerText, href: c.closest('a') ? c.closest('a').href : ''}))"
    )

    def rendered(found: list[dict]) -> bool:  # type, key, date, "Created" and the description: the UI fills a
        # card's description after the card itself appears (a loaded machine caught a card without it)
        return all(len([line for line in c["text"].splitlines() if line.strip()]) >= 5 for c in found)

    cards = page.wait_for(
        lambda p: (found := p.evaluate(read)) and len(found) >= expected and rendered(found) and found, "cards"
    )
    by_key: dict[str, list[dict]] = {}
    for card in cards:
        lines = [line.strip() for line in card["text"].splitlines() if line.strip()]
        by_key.setdefault(lines[1], []).append({"text": "\n".join(lines), "href": card["href"]})
    return by_key


def open_run(page: browser.Page, stack, run_id) -> None:
    page.goto(ui_url(stack, f"/runs/flow-run/{run_id}"))
    page.wait_for(
        lambda p: "Artifacts" in p.evaluate("[...document.querySelectorAll('.p-tab')].map(t => t.innerText).join()"),
        "tabs",
    )


def rendered_tables(page: browser.Page) -> list[list[str]]:
    """Each row of the page's tables as the cell texts a person reads."""
    return page.evaluate(
        "[...document.querySelectorAll('table tr')].map(r => [...r.children].map(c => c.innerText.trim()))"
    )


def filled_table(page: browser.Page, rows: int) -> list[list[str]]:
    """The page's table once it has ``rows`` rows (header included) and every cell is rendered: string cells
    are markdown, which the UI renders a moment after the numbers."""

    def ready(p: browser.Page):
        table = rendered_tables(p)
        return len(table) >= rows and all(all(cells) for cells in table) and table

    return page.wait_for(ready, f"a table of {rows} rendered rows")


def decoded_svg_images(page: browser.Page) -> list[int]:
    """Widths of the inline SVG images the browser decoded and laid out (0 would be a broken image)."""
    return page.evaluate(
        "[...document.querySelectorAll('img')].filter(i => i.src.startsWith('data:image/svg+xml'))"
        ".map(i => i.complete ? i.naturalWidth : 0)"
    )


def wait_completed_and_settled(stack, run_id, quiet: float = 15, timeout: float = 300):
    """The run once it is Completed and stays so for ``quiet`` seconds. A killed run may be reported Crashed
    twice and restarted twice (docs/deployments.md, "Restart after a dead machine"): the extra attempt finds the run
    complete but republishes its artifacts, which the test must not read halfway."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = wait_for_state(stack, run_id, StateType.COMPLETED, timeout=max(deadline - time.monotonic(), 1))
        still = time.monotonic() + quiet
        while time.monotonic() < still and read_run(stack, run_id).state_id == run.state_id:
            time.sleep(1)
        if read_run(stack, run_id).state_id == run.state_id:
            return run
    raise AssertionError(f"flow run {run_id} did not stay Completed for {quiet}s within {timeout}s")


def test_ui_shows_live_progress_curves_and_one_card_each_after_a_crash_restart(chromium, prefect_stack, tmp_path):
    folder, markers, name = tmp_path / "runs", tmp_path / "markers", "ui_run.1"
    keys = {what: artifact_key(name, what) for what in WHATS}
    run_id = start_run(prefect_stack, "train/default", {"config": pause_config(folder, name, markers)})
    wait_for(lambda: (markers / "paused").exists(), 240, "the run to pause in unit 1, after unit 0 committed")

    with browser.Page(chromium) as page:  # the run is alive, between units: what it has published so far
        open_run(page, prefect_stack, run_id)
        live = artifact_cards(page, expected=3)
        keep_screenshot(page, tmp_path, "ui-run-artifacts-live.png")
    assert sorted(live) == sorted(keys[w] for w in ["progress", "metrics", "curves"])
    assert "unit 0 done" in live[keys["progress"]][0]["text"]
    assert re.search(r"256 / 768 samples · ETA \d", live[keys["progress"]][0]["text"])
    assert "training loss" in live[keys["curves"]][0]["text"] and "after 1 unit" in live[keys["curves"]][0]["text"]
    progress_card = live[keys["progress"]][0]["href"]

    os.kill(flow_run_process(prefect_stack.worker.pid, run_id), signal.SIGKILL)
    run = wait_completed_and_settled(prefect_stack, run_id)
    assert run.run_count >= 2  # the same flow run, restarted by the reconciler

    with browser.Page(chromium) as page:
        open_run(page, prefect_stack, run_id)
        cards = artifact_cards(page, expected=len(WHATS))
        keep_screenshot(page, tmp_path, "ui-run-artifacts.png")
        # one card per artifact: the killed attempt left none behind
        assert {key: len(found) for key, found in cards.items()} == {keys[w]: 1 for w in WHATS}
        progress = cards[keys["progress"]][0]
        assert progress["href"] == progress_card  # the killed attempt's card is the one that moved on
        assert "complete · 768 / 768 samples" in progress["text"] and "restarted" in progress["text"]
        assert "unit 0 done" not in progress["text"]  # nothing stale of the killed attempt
        assert "all 3 units" in cards[keys["metrics"]][0]["text"]
        assert "all 3" in cards[keys["checkpoints"]][0]["text"]

        page.goto(cards[keys["curves"]][0]["href"])  # where a click on the card leads
        widths = page.wait_for(lambda p: [w for w in decoded_svg_images(p) if w > 0], "the curves image")
        keep_screenshot(page, tmp_path, "ui-curves.png")
        assert widths == [560]
        assert re.search(r"training loss: \S+ [\d.]+ → [\d.]+ \(3 units, last at step 24\)", page.text())

        page.goto(cards[keys["metrics"]][0]["href"])
        rows = filled_table(page, rows=4)
        keep_screenshot(page, tmp_path, "ui-metrics.png")
    header, body = rows[0], rows[1:]
    assert header == [
        "unit",
        "epoch",
        "step",
        "samples",
        "train_loss",
        "samples/s",
        "checkpoint s",
        "attempt",
        "resumed from",
        "checkpoint",
    ]
    table = [dict(zip(header, row, strict=True)) for row in body]
    assert [(r["unit"], r["samples"], r["checkpoint"]) for r in table] == [
        ("0", "256", "ep1-ba8-sa256"),
        ("1", "512", "ep2-ba16-sa512"),
        ("2", "768", "ep3-ba24-sa768"),
    ]
    # unit 0 was trained by the killed attempt; the restarted one resumed from its checkpoint
    assert table[0]["attempt"] == "1" and table[0]["resumed from"] == "fresh initialization"
    assert int(table[1]["attempt"]) >= 2 and table[1]["resumed from"] == "checkpoint ep1-ba8-sa256"
    assert all(float(r["train_loss"]) > 0 and float(r["checkpoint s"]) >= 0 for r in table)


def test_hostile_names_reach_the_ui_as_text_only(chromium, prefect_stack, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.hostile_report", str(tmp_path / "runs")],
        cwd=ROOT,
        env=prefect_stack.env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = proc.stdout.strip().splitlines()[-1]
    # markup a name could add: any element but the app's own and the curves' inline SVG image
    injected = (
        "[...document.body.querySelectorAll('img, b, script, iframe, a[href^=\\'javascript:\\']')]"
        ".filter(e => !(e.tagName === 'IMG' && e.src.startsWith('data:image/svg+xml')))"
        ".filter(e => !(e.tagName === 'SCRIPT' && (e.getAttribute('src') || '').startsWith('/assets/')))"
        ".map(e => e.outerHTML.slice(0, 200))"
    )

    with browser.Page(chromium, width=2000) as page:  # wide enough for the whole table in the screenshot
        open_run(page, prefect_stack, run_id)
        cards = artifact_cards(page, expected=len(WHATS))
        assert {key: len(found) for key, found in cards.items()} == {artifact_key(RUN_NAME, w): 1 for w in WHATS}
        page.goto(cards[artifact_key(RUN_NAME, "metrics")][0]["href"])
        rows = filled_table(page, rows=4)
        keep_screenshot(page, tmp_path, "ui-hostile-metrics.png")
        assert page.evaluate(injected) == [], "the metrics page rendered markup from a name"
        header = rows[0]
        assert header[5:7] == sorted(["eval_accuracy", safe_column("eval_" + HOSTILE)])
        assert [row[header.index("resumed from")] for row in rows[1:]] == [HOSTILE] * 3  # as typed

        page.goto(cards[artifact_key(RUN_NAME, "summary")][0]["href"])
        page.wait_for(lambda p: HOSTILE in p.text() and decoded_svg_images(p), "the summary")
        keep_screenshot(page, tmp_path, "ui-hostile-summary.png")
        assert page.evaluate(injected) == [], "the summary rendered markup from a name"
        assert page.evaluate("document.title") != "1"
        assert decoded_svg_images(page) == [560]  # one image: loss, eval_accuracy and the hostile metric's panels
        assert f"this flow run started from: {HOSTILE};" in page.text()
        assert [HOSTILE, "0.5000"] in rendered_tables(page)  # the final metric's name, in the metric table
