"""A real headless Chromium (Debian's, through its chromedriver) for the pages the API serves.

`browser` is one session-wide Chrome; `page_requests(browser)` lists the URLs the browser fetched since
the last call (from Chrome's performance log), so a test can say a page loaded nothing from elsewhere.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest

CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    driver_path = shutil.which("chromedriver") or CHROMEDRIVER
    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1280,2000")
    options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def page_requests(driver) -> list[str]:
    """The URLs of every request the browser sent since the last call (documents, scripts, styles, XHR...)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls
