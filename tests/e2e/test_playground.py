"""The playground in a real headless browser (Debian's chromium and chromedriver) against the real stack."""

from __future__ import annotations

import base64
import io
import json
import os
import uuid

import pytest
import requests
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.conftest import TEST_API_KEYS, png_b64

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
    settled(browser)
    assert len(Select(browser.find_element(By.ID, "model")).options) > 1, browser.find_element(By.ID, "key-error").text
    Select(browser.find_element(By.ID, "model")).select_by_value("sd15-txt2img")
    settled(browser)


def settled(browser) -> None:
    """Waits until no list is loading (the form's aria-busy): overlapping loads each re-draw their list as they land,
    and an option read while one is in flight can be replaced under the reader (a stale element)."""
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "form").get_attribute("aria-busy") == "false")


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


def test_a_painted_stroke_is_sent_as_a_black_and_white_mask_and_the_inpainted_image_shown(browser, stack, tmp_path):
    from PIL import Image

    open_playground(browser, stack)
    Select(browser.find_element(By.ID, "model")).select_by_value("sd15-inpaint")
    assert browser.find_element(By.ID, "mask-editor").is_displayed() is False  # no image yet, nothing to paint on
    photo = tmp_path / "photo.png"
    photo.write_bytes(base64.b64decode(png_b64(64, 64, noise=True)))
    browser.find_element(By.ID, "image").send_keys(str(photo))
    WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "mask-editor").is_displayed())
    # Record the bodies the page sends (the request itself still goes to the API).
    browser.execute_script(
        "window.sentBodies = []; const send = window.fetch;"
        "window.fetch = (url, init) => { if (init && init.body) window.sentBodies.push(init.body);"
        " return send(url, init); };"
    )
    canvas = browser.find_element(By.ID, "mask-canvas")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", canvas)  # strokes aim at its center
    shown = canvas.size["width"]  # the 64 px image is shown larger; the stroke is in screen pixels
    stroke = ActionChains(browser).move_to_element_with_offset(canvas, -shown // 4, 0).click_and_hold()
    for _ in range(4):
        stroke.move_by_offset(shown // 8, 0)
    stroke.release().perform()  # a horizontal stroke through the middle, a quarter of the width to three quarters
    fill(browser, "prompt", f"a door {uuid.uuid4().hex}")
    fill(browser, "size", "64x64")
    fill(browser, "steps", "2")
    browser.find_element(By.ID, "submit").click()
    WebDriverWait(browser, 60).until(lambda b: b.find_element(By.ID, "status").text in ("succeeded", "failed"))
    assert browser.find_element(By.ID, "status").text == "succeeded", browser.find_element(By.ID, "form-error").text
    image = browser.find_element(By.CSS_SELECTOR, "#results img")
    assert browser.execute_script("return [arguments[0].naturalWidth, arguments[0].naturalHeight]", image) == [64, 64]

    (body,) = [json.loads(sent) for sent in browser.execute_script("return window.sentBodies")]
    (instance,) = body["instances"]
    assert instance["image"] == base64.b64encode(photo.read_bytes()).decode()
    mask = Image.open(io.BytesIO(base64.b64decode(instance["mask"]))).convert("L")
    assert mask.size == (64, 64)  # the image's own size
    pixels = mask.load()
    assert {pixels[x, y] for x in range(64) for y in range(64)} == {0, 255}  # white or black, nothing between
    assert all(pixels[x, 32] == 255 for x in range(18, 47))  # along the stroke: repaint
    brush = 24 * 64 / shown  # the brush's default 24 screen pixels, in image pixels
    reach = int(brush / 2) + 2
    painted = [(x, y) for x in range(64) for y in range(64) if pixels[x, y] == 255]
    assert all(16 - reach <= x <= 48 + reach and abs(y - 32) <= reach for x, y in painted)  # the rest: keep


def test_a_registered_control_model_is_picked_with_its_image_and_sent_in_the_parameters(browser, stack, tmp_path):
    """sd15-txt2img takes control models (GET /v1/models' control_kinds): the page lists those registered for it
    (`make up`'s tiny-edges and tiny-style), sends the chosen ControlNet with its image and scale in
    `parameters.controls`, and shows the answer; a model that takes none offers none."""
    open_playground(browser, stack)
    options = {option.get_attribute("value"): option.text for option in Select(browser.find_element(By.ID, "control"))
               .options}  # fmt: skip
    assert options["tiny-edges"] == "tiny-edges (controlnet)" and options["tiny-style"] == "tiny-style (ip_adapter)"
    Select(browser.find_element(By.ID, "control")).select_by_value("tiny-edges")
    edges = tmp_path / "edges.png"
    edges.write_bytes(base64.b64decode(png_b64(64, 64, noise=True)))
    browser.find_element(By.ID, "control-image").send_keys(str(edges))
    fill(browser, "control-scale", "0.8")
    browser.execute_script(
        "window.sentBodies = []; const send = window.fetch;"
        "window.fetch = (url, init) => { if (init && init.body) window.sentBodies.push(init.body);"
        " return send(url, init); };"
    )
    fill(browser, "prompt", f"a lighthouse {uuid.uuid4().hex}")
    fill(browser, "size", "64x64")
    fill(browser, "steps", "2")
    browser.find_element(By.ID, "submit").click()
    WebDriverWait(browser, 60).until(lambda b: b.find_element(By.ID, "status").text in ("succeeded", "failed"))
    assert browser.find_element(By.ID, "status").text == "succeeded", browser.find_element(By.ID, "form-error").text
    assert browser.find_elements(By.CSS_SELECTOR, "#results img")
    (body,) = [json.loads(sent) for sent in browser.execute_script("return window.sentBodies")]
    assert body["parameters"]["controls"] == [
        {"name": "tiny-edges", "image": base64.b64encode(edges.read_bytes()).decode(), "scale": 0.8}
    ]
    Select(browser.find_element(By.ID, "model")).select_by_value("noop")
    assert browser.find_element(By.ID, "control-editor").is_displayed() is False
