"""/status in a real headless browser (issue 55): the fleet as one table, a row per model and version whose numbers
are GET /v1/status's, a sparkline each drawn inline, nothing loaded from elsewhere; a screenshot is kept."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from decimal import ROUND_HALF_UP, Decimal

import pytest
import redis
import requests

from contract.stores.inflight import InflightStore
from tests.browser.conftest import page_requests
from tests.conftest import TEST_API_KEYS, open_hold, wait_for

pytestmark = pytest.mark.stack
# One request at a time, 2 s each, on a worker of its own (tests/models.fixtures.yaml): a held call makes a backlog.
MODEL = "sleep-admitted"
FIELDS = ("waiting.high", "waiting.normal", "held", "workers", "answered_per_second", "predicted_start_seconds",
          "run_seconds")  # fmt: skip
# The header's cells in document order: its first row, then the priorities under "Waiting".
HEADINGS = ("Model", "Version", "Waiting", "Held", "Ready workers", "Answered /s", "Predicted wait (s)", "Run time (s)",
            "Last five minutes", "high", "normal")  # fmt: skip
# Each row's model, version and, per number column, its cell's data-value (JSON) and text.
READ_TABLE = """
return [...document.querySelectorAll('#models tr')].map((tr) => [tr.dataset.model, tr.dataset.version,
  Object.fromEntries([...tr.querySelectorAll('td[data-field]')].map((td) => [td.dataset.field,
    [JSON.parse(td.dataset.value), td.textContent]]))]);
"""

# The page's shape: how many tables, the header's cells, and per row its model, its heading and its sparkline's lines.
READ_LAYOUT = """
return {tables: document.querySelectorAll('table').length,
  headings: [...document.querySelectorAll('#fleet thead th')].map((th) => th.textContent.trim()),
  rows: [...document.querySelectorAll('#models tr')].map((tr) => [tr.dataset.model, tr.querySelector('th').textContent,
    tr.querySelectorAll('td.spark svg polyline').length])};
"""


def field(model: dict, name: str):
    value = model
    for part in name.split("."):
        value = value.get(part, 0) if isinstance(value, dict) else value
    return value


def shown(value) -> str:
    """The text a person reads for a number: as given, to at most three decimals (a tie rounded up, as JavaScript's
    `toFixed` does), no trailing zeros; a dash for none."""
    if value is None:
        return "–"
    rounded = Decimal(float(value)).quantize(Decimal("0.001"), rounding=ROUND_HALF_UP)
    return format(rounded.normalize(), "f")


def status_rows(stack, headers) -> list:
    """GET /v1/status as the table should show it, in the table's order (by model, then version)."""
    response = requests.get(f"{stack.api_url}/v1/status", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    models = sorted(response.json()["models"], key=lambda m: (m["model"], m["model_version"]))
    return [
        [m["model"], m["model_version"], {name: [field(m, name), shown(field(m, name))] for name in FIELDS}]
        for m in models
    ]


def job(stack, headers, prompt: str) -> str:
    response = requests.post(f"{stack.api_url}/v1/models/{MODEL}/jobs", json={"instances": [{"prompt": prompt}]},
                             headers=headers, timeout=30)  # fmt: skip
    assert response.status_code == 202, response.text
    return response.json()["id"]


def test_the_status_page_is_one_table_of_the_fleet_with_the_numbers_of_get_status(
    stack, settings, auth_headers, browser, tmp_path
):
    from selenium.webdriver.common.by import By

    warm = requests.post(f"{stack.api_url}/v1/models/{MODEL}:predict", json={"instances": [{"prompt": "warm"}]},
                         headers=auth_headers, timeout=60)  # fmt: skip
    assert warm.status_code == 200, warm.text  # answered: its run time and answer rate are known
    # A backlog that stays put while the page is read: the first call is held after its first step until the end.
    gate = f"status-page-{uuid.uuid4().hex}"
    inflight = InflightStore(redis.Redis.from_url(settings.redis_url))
    jobs = [job(stack, auth_headers, f"!hold {gate}")]
    try:
        wait_for(lambda: jobs[0] in inflight.holders(), f"{MODEL} holding the held job", timeout=60)
        jobs += [job(stack, auth_headers, f"behind {index}") for index in range(3)]

        def backlog() -> bool:
            (row,) = [r for r in status_rows(stack, auth_headers) if r[0] == MODEL]
            return row[2]["held"][0] >= 1 and row[2]["waiting.normal"][0] >= 1

        wait_for(backlog, f"{MODEL} showing requests held and waiting", timeout=60)

        page_requests(browser)  # forget earlier pages' requests
        browser.get(f"{stack.api_url}/status")
        key = browser.find_element(By.ID, "key")
        key.clear()
        key.send_keys(TEST_API_KEYS[0])
        browser.execute_script("document.getElementById('key').dispatchEvent(new Event('change'))")

        # The table the page drew from its latest poll equals GET /v1/status read right after it (polled until one
        # poll and one read fall between the same two changes: the backlog is still, the answer rate may move).
        seen: list = []

        def same_numbers(driver) -> bool:
            seen[:] = [driver.execute_script(READ_TABLE), status_rows(stack, auth_headers)]
            return seen[0] == seen[1]

        deadline = time.monotonic() + 60
        while not same_numbers(browser):
            assert time.monotonic() < deadline, f"the table never showed GET /v1/status: {seen}"
            time.sleep(0.5)
        (mine,) = [row for row in seen[0] if row[0] == MODEL]
        assert mine[2]["held"][0] >= 1 and mine[2]["waiting.normal"][0] >= 1, mine

        # Read in one script: the page redraws its rows every two seconds.
        page = browser.execute_script(READ_LAYOUT)
        assert page["tables"] == 1 and tuple(page["headings"]) == HEADINGS
        assert len(page["rows"]) == len(seen[1]) > 1
        # Each row has its sparkline, drawn inline (an <svg> with a line per series), not an image from elsewhere.
        assert all(lines == 2 for _, _, lines in page["rows"]), page["rows"]
        (heading,) = [heading for model, heading, _ in page["rows"] if model == MODEL]
        assert "admission" in heading
        assert all(url.startswith(stack.api_url) for url in page_requests(browser))

        screenshot = tmp_path / "status.png"
        assert browser.save_screenshot(str(screenshot))
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if copy := os.environ.get("MAAS_STATUS_SCREENSHOT"):  # how the docs' picture is made
            shutil.copyfile(screenshot, copy)
    finally:
        for job_id in jobs:
            requests.delete(f"{stack.api_url}/v1/jobs/{job_id}", headers=auth_headers, timeout=10)
        open_hold(stack, gate)
