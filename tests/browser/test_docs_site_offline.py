"""The built documentation site in a real headless browser, served from 127.0.0.1 alone: the home page and the HTTP
API reference render, nothing is fetched from elsewhere (no CDN fonts or scripts), and every route of the API's
OpenAPI document is listed on the reference page."""

from __future__ import annotations

import functools
import json
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.docs_site import DOCS, build_site

# The HTTP API reference is the largest page; on a machine loaded by other test runs it has taken tens of seconds.
PAGE_LOAD_SECONDS = 120


@pytest.fixture(scope="module")
def served_site(tmp_path_factory) -> Iterator[str]:
    """The site as `make docs` builds it, served as `make docs-serve` serves it (a static server on 127.0.0.1)."""
    site = tmp_path_factory.mktemp("site")
    result = build_site(site)
    assert result.returncode == 0, result.stderr[-3000:]

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def network(driver) -> tuple[list[str], list[str]]:
    """The URLs the browser requested since the last call, and those that failed or answered 4xx/5xx."""
    requested, failed, urls = [], [], {}
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        params = message["params"]
        if message["method"] == "Network.requestWillBeSent":
            urls[params["requestId"]] = params["request"]["url"]
            requested.append(params["request"]["url"])
        elif message["method"] == "Network.responseReceived" and params["response"]["status"] >= 400:
            failed.append(f"{params['response']['status']} {params['response']['url']}")
        elif (
            message["method"] == "Network.loadingFailed"
            and not params.get("canceled")
            and (
                params.get("errorText") != "net::ERR_ABORTED"  # cut off by the next navigation (the search index)
            )
        ):
            failed.append(f"{params.get('errorText')} {urls.get(params['requestId'], params['requestId'])}")
    return requested, failed


def open_page(browser, url: str) -> tuple[list[str], list[str]]:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    network(browser)  # forget earlier pages' requests
    browser.set_page_load_timeout(PAGE_LOAD_SECONDS)
    try:
        browser.get(url)
        WebDriverWait(browser, PAGE_LOAD_SECONDS).until(lambda b: b.find_elements(By.CSS_SELECTOR, "article h1"))
        WebDriverWait(browser, PAGE_LOAD_SECONDS).until(
            lambda b: b.execute_script("return document.readyState") == "complete"
        )
    finally:
        browser.set_page_load_timeout(30)  # the session's browser, as tests/browser/conftest.py set it
    return network(browser)


def openapi_routes() -> set[str]:
    sys.path.insert(0, str(DOCS / "hooks"))
    import reference

    document = reference.openapi()
    return {f"{method.upper()} {path}" for path, operations in document["paths"].items() for method in operations}


def test_the_home_page_and_the_api_reference_render_offline_and_list_every_route(browser, served_site):
    from selenium.webdriver.common.by import By

    requested, failed = open_page(browser, f"{served_site}/")
    assert "Model-as-a-Service" in browser.title
    assert browser.find_element(By.CSS_SELECTOR, "article h1").text.startswith("Model-as-a-Service")
    assert [url for url in requested if not url.startswith((served_site, "data:", "blob:"))] == []
    assert failed == []

    requested, failed = open_page(browser, f"{served_site}/reference/http-api/")
    assert [url for url in requested if not url.startswith((served_site, "data:", "blob:"))] == []
    assert failed == []
    headings = {element.text.strip() for element in browser.find_elements(By.CSS_SELECTOR, "article h2 code")}
    missing = openapi_routes() - headings
    assert not missing, f"routes of the OpenAPI document not on the reference page: {sorted(missing)}"
    errors = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == []
