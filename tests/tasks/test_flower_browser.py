"""Flower as a person sees it: a real worker, beat and Flower (with basic auth) on a short run,
opened in headless Chromium (Debian's, driven through its chromedriver by Selenium). Without
credentials Flower refuses the page; with them its Workers page lists the worker with the failed
dispatch counted as failed, and on its Tasks page a person who types a dispatch id finds the
`complete_batch` that recorded it and the failed task that shows its failure, with no housekeeping
row anywhere; its Broker page lists the engine's queue with the notifications no engine has read.
Screenshots go to the test's tmp_path.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from headless import chromium
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from k8s_dispatch import celeryconfig as names
from k8s_dispatch.ops import processes
from tests.tasks.test_flower import CAPABILITIES, answers, schedule

USER, PASSWORD = "ops", "s3cret"
WINDOW = (1280, 800)


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    with chromium(window=WINDOW, page_load_timeout_s=30) as driver:
        yield driver


@pytest.fixture
def flower_run(deploy, sim_cluster, tmp_path: Path) -> Iterator[tuple[Any, int]]:
    """A worker, beat (polling every 2 s, as deployed) and Flower with basic auth, on one broker."""
    d = deploy(sim_cluster, capabilities=CAPABILITIES, poll_interval_s="2")
    port = processes.free_port()
    flower = processes.celery_flower(env=d.env, log_dir=tmp_path, port=port, extra=(f"--basic-auth={USER}:{PASSWORD}",))
    flower.start()
    try:
        processes.wait_until(lambda: flower.alive and answers(port), timeout=60, what="Flower's /healthcheck")
        d.start_worker("w1")
        d.start_beat()
        yield d, port
    finally:
        flower.stop(timeout=15)
        print(flower.log_tail(20))


def page_text(driver: WebDriver) -> str:
    try:
        return str(driver.find_element(By.TAG_NAME, "body").text)
    except (StaleElementReferenceException, WebDriverException):
        return ""  # the page is being replaced: read it again


def table_cells(driver: WebDriver, table: str) -> list[list[str]]:
    """The text of each row's cells, read in one script: Flower redraws its tables every few
    seconds, so element handles taken one by one go stale between two reads."""
    script = (
        "return Array.from(document.querySelectorAll(arguments[0] + ' tbody tr'))"
        ".map(row => Array.from(row.cells).map(cell => cell.innerText.trim()));"
    )
    try:
        return list(driver.execute_script(script, table))
    except WebDriverException:
        return []  # the page is being replaced: read it again


def test_a_person_logs_in_to_flower_sees_the_failure_and_finds_a_dispatch_by_its_id(
    flower_run, browser: WebDriver, tmp_path: Path
) -> None:
    d, port = flower_run
    case_id = d.new_case()
    ids = [schedule(d, case_id, capability) for capability in ("sim.ok", "sim.ok", "sim.fail")]
    d.wait_terminal(ids)
    failed = ids[-1]

    # No credentials: Flower answers 401 and shows nothing of its own.
    browser.get(f"http://127.0.0.1:{port}/")
    assert "w1@" not in page_text(browser) and "Workers" not in browser.title

    # Logged in (basic auth: the credentials in the URL, what a person types at the prompt). The
    # Workers page lists w1 online, the failed dispatch counted among its failed tasks.
    browser.get(f"http://{USER}:{PASSWORD}@127.0.0.1:{port}/workers")

    def worker_cells() -> list[str] | None:
        for cells in table_cells(browser, "table#workers-table"):
            if cells and cells[0].startswith("w1@") and cells[4:5] == ["1"]:
                return cells
        browser.refresh()
        return None

    cells = d.wait(worker_cells, timeout_s=30, what="w1 on Flower's Workers page, one task failed")
    browser.save_screenshot(str(tmp_path / "flower-workers.png"))
    _worker, status, _active, processed, failed_count, succeeded = cells[:6]
    assert status == "Online", cells
    assert int(processed) >= len(ids) and int(succeeded) >= len(ids) and failed_count == "1", cells

    # The Tasks page: a person types the failed dispatch's id into the search box.
    browser.get(f"http://127.0.0.1:{port}/tasks")
    typed_at = [-math.inf]

    def rows_of_the_dispatch() -> list[str] | None:
        # Typed again only every few seconds: each keystroke asks Flower for the table anew, and
        # a table asked for on every read is never drawn.
        if time.monotonic() - typed_at[0] > 5:
            box = browser.find_element(By.CSS_SELECTOR, "input[type=search]")
            box.clear()
            box.send_keys(failed)
            typed_at[0] = time.monotonic()
        rows = [" ".join(cells) for cells in table_cells(browser, "table#tasks-table")]
        batch = [r for r in rows if names.COMPLETE_BATCH_TASK in r and "SUCCESS" in r]
        echo = [r for r in rows if names.DISPATCH_FAILED_TASK in r and "FAILURE" in r]
        return rows if batch and echo else None

    rows = d.wait(rows_of_the_dispatch, timeout_s=60, what="the failed dispatch's batch and failure on the Tasks page")
    # Ours ran on w1; the engine's notification is there too, sent and not read (no engine runs here).
    assert all("w1@" in row or row.startswith(f"{d.settings.notify_task} ") for row in rows), rows
    shot = tmp_path / "flower-tasks.png"
    browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000

    # The whole Tasks page (newest first): the work, and no housekeeping row, though beat sent
    # poll and admit every 2 s all along.
    box = browser.find_element(By.CSS_SELECTOR, "input[type=search]")
    box.clear()
    box.send_keys(" ")

    def whole_table() -> list[str] | None:
        rows = [" ".join(cells) for cells in table_cells(browser, "table#tasks-table")]
        return rows if any(names.SCHEDULE_TASK in r for r in rows) else None

    listed = d.wait(whole_table, timeout_s=30, what="the whole Tasks table")
    browser.save_screenshot(str(tmp_path / "flower-all-tasks.png"))
    assert not [r for r in listed if any(name in r for name in names.HOUSEKEEPING_TASKS)], listed

    # The Broker page: our queues, and the engine's holding the notifications no engine has read
    # (no worker here consumes it: plain Flower would leave it out).
    browser.get(f"http://127.0.0.1:{port}/broker")

    def queues() -> dict[str, list[str]] | None:
        rows = {cells[0]: cells for cells in table_cells(browser, "table#queue-table") if len(cells) > 1}
        unread = rows.get(d.settings.notify_queue, ["", ""])[1]
        if unread.isdigit() and int(unread) >= len(ids):
            return rows
        browser.refresh()
        return None

    rows = d.wait(queues, timeout_s=30, what="the engine's queue and its notifications on the Broker page")
    browser.save_screenshot(str(tmp_path / "flower-broker.png"))
    assert {names.JOBS_QUEUE, names.COMPLETE_QUEUE, names.SWEEP_QUEUE} <= set(rows), rows
