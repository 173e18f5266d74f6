"""The playground in a real headless browser (Debian's chromium and chromedriver) against the real stack."""

from __future__ import annotations

import os
import uuid

import pytest
import requests
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.conftest import TEST_API_KEYS

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    yield driver
    driver.quit()


def open_playground(browser, stack) -> None:
    browser.get(f"{stack.api_url}/playground")
    key = browser.find_element(By.ID, "key")
    key.clear()
    key.send_keys(TEST_API_KEYS[0])
    browser.execute_script("document.getElementById('key').dispatchEvent(new Event('change'))")
    WebDriverWait(browser, 20).until(lambda b: len(Select(b.find_element(By.ID, "model")).options) > 1)
    Select(browser.find_element(By.ID, "model")).select_by_value("sd15-txt2img")


def fill(browser, field: str, value: str) -> None:
    element = browser.find_element(By.ID, field)
    element.clear()
    element.send_keys(value)


def test_the_page_is_served_with_a_strict_policy_and_linked_from_docs(stack):
    page = requests.get(f"{stack.api_url}/playground", timeout=10)
    policy = page.headers["Content-Security-Policy"]
    assert page.status_code == 200 and "script-src 'self'" in policy and "default-src 'none'" in policy
    assert "http" not in page.text.replace('href="/docs"', "")  # every file is served by the API itself
    document = requests.get(f"{stack.api_url}/openapi.json", timeout=10).json()
    assert "(/playground)" in document["info"]["description"]
    assert requests.get(f"{stack.api_url}/playground/secrets.py", timeout=10).status_code == 404


def test_generate_an_image_with_progress_then_refuse_a_bad_size_and_never_run_a_prompts_script(browser, stack):
    open_playground(browser, stack)
    assert browser.execute_script("return sessionStorage.getItem('maas-api-key')") == TEST_API_KEYS[0]
    prompt = f"<script>window.pwned = 1</script><img src=x onerror='window.pwned = 2'> {uuid.uuid4().hex}"
    fill(browser, "prompt", prompt)
    fill(browser, "size", "64x64")
    fill(browser, "steps", "40")
    browser.find_element(By.ID, "submit").click()
    seen: list[int] = []

    def finished(b) -> bool:
        seen.append(int(b.find_element(By.ID, "progress").get_attribute("value")))
        return b.find_element(By.ID, "status").text == "succeeded"

    WebDriverWait(browser, 40, poll_frequency=0.05).until(finished)
    assert any(0 < value < 100 for value in seen), seen  # the bar moved while the job ran
    image = browser.find_element(By.CSS_SELECTOR, "#results img")
    size = browser.execute_script("const i = arguments[0]; return [i.naturalWidth, i.naturalHeight, i.width];", image)
    assert size == [64, 64, 64]  # rendered at its natural size
    caption = browser.find_element(By.CSS_SELECTOR, "#results figcaption").text
    assert prompt in caption  # shown as text...
    assert browser.execute_script("return window.pwned") is None  # ...never run
    assert not browser.find_elements(By.CSS_SELECTOR, "#results script, #results img[src='x']")
    if screenshot := os.environ.get("MAAS_PLAYGROUND_SCREENSHOT"):  # how the README's and the docs' picture is made
        browser.save_screenshot(screenshot)

    fill(browser, "size", "4096x64")
    browser.find_element(By.ID, "submit").click()
    WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "size-error").text)
    assert "1024" in browser.find_element(By.ID, "size-error").text
    assert browser.find_element(By.ID, "form-error").text == ""
