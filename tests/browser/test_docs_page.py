"""/docs in a real headless browser: Swagger UI renders every operation, with nothing loaded from outside."""

from __future__ import annotations

import re

import pytest
import requests

from tests.browser.conftest import page_requests

pytestmark = pytest.mark.stack


def html_pages(stack) -> list[str]:
    """Every page the API serves: the documented GET operations whose answer is HTML."""
    document = requests.get(f"{stack.api_url}/openapi.json", timeout=10).json()
    return [
        path
        for path, operations in document["paths"].items()
        if "text/html" in operations.get("get", {}).get("responses", {}).get("200", {}).get("content", {})
    ]


def test_the_docs_page_renders_every_operation_without_the_internet(stack, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    document = requests.get(f"{stack.api_url}/openapi.json", timeout=10).json()
    operations = {(method.upper(), path) for path, ops in document["paths"].items() for method in ops}
    page_requests(browser)  # forget earlier pages' requests
    browser.get(f"{stack.api_url}/docs")
    WebDriverWait(browser, 30).until(lambda b: len(b.find_elements(By.CSS_SELECTOR, ".opblock")) >= len(operations))
    shown = {
        (block.find_element(By.CSS_SELECTOR, ".opblock-summary-method").text.strip(),
         block.find_element(By.CSS_SELECTOR, ".opblock-summary-path").get_attribute("data-path"))
        for block in browser.find_elements(By.CSS_SELECTOR, ".opblock")
    }  # fmt: skip
    assert shown == operations
    assert "Model-as-a-Service" in browser.title
    fetched = page_requests(browser)
    assert f"{stack.api_url}/openapi.json" in fetched
    assert [url for url in fetched if not url.startswith((stack.api_url, "data:", "blob:"))] == []
    errors = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert errors == []


def test_no_page_the_api_serves_references_another_site(stack):
    pages = html_pages(stack)
    assert "/docs" in pages
    for path in pages:
        page = requests.get(f"{stack.api_url}{path}", timeout=10)
        assert page.status_code == 200
        # Every src, href and action is a path on this server: no scheme, no host.
        references = re.findall(r"""(?:src|href|action)\s*=\s*["']?([^"'\s>]+)""", page.text)
        assert references, path
        assert [ref for ref in references if not ref.startswith("/") or ref.startswith("//")] == [], path
        assert not re.search(r"https?://|@import", page.text), path
        assert "default-src 'self'" in page.headers["Content-Security-Policy"], path
        for ref in references:
            asset = requests.get(f"{stack.api_url}{ref}", timeout=10)
            assert asset.status_code == 200, ref
