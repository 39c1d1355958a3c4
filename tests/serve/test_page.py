"""The page at / in a real headless Chromium (Debian's chromium + chromium-driver through selenium): a
streamed answer, the per-turn table (TTFT, prefill tokens/s, cached vs new) and the last prefill's timeline.

Nothing downloads a browser: without `chromium` and `chromedriver` on the PATH the tests skip, saying so.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serve.conftest import RunningServer

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install 'hetero[test]')")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="no headless browser here: apt-get install chromium chromium-driver")


@pytest.fixture
def browser() -> Iterator["webdriver.Chrome"]:
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service as DriverService

    profile = tempfile.mkdtemp(prefix="hetero-chromium-")
    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={profile}", "--window-size=1280,800"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=DriverService(DRIVER), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def test_page_streams_a_chat_and_shows_the_prefill(server: RunningServer, browser: "webdriver.Chrome") -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    wait = WebDriverWait(browser, 120)
    wait.until(lambda d: d.find_element(By.ID, "model").text == server.model)
    for turn, question in enumerate(["What is the capital of France?", "And of Italy?"], 1):
        box = browser.find_element(By.ID, "prompt")
        box.send_keys(question)
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant[data-done='1']")) == turn)
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#turns tbody tr")) == turn)
    answers = [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".assistant")]
    assert "Paris" in answers[0] and all(answers)
    rows = [[td.text for td in tr.find_elements(By.TAG_NAME, "td")]
            for tr in browser.find_elements(By.CSS_SELECTOR, "#turns tbody tr")]
    turn_no, client_ttft, server_ttft, tps, cached, new, out = rows[1]
    assert float(client_ttft) > 0 and float(server_ttft) > 0 and float(tps) > 0 and int(out) > 0
    assert int(cached) > int(new) > 0  # the second turn reuses the first turn's prompt and answer
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#timeline rect.node")))
    nodes = browser.find_elements(By.CSS_SELECTOR, "#timeline rect.node")
    assert len(nodes) >= 3 and "tokens from position" in browser.find_element(By.ID, "timeline-info").text
    legend = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#legend span")]
    kinds = {n.find_element(By.TAG_NAME, "title").get_attribute("textContent").split(", ")[2].split(" on ")[0]
             for n in nodes}
    assert legend and set(legend) == kinds  # the kinds the method reported (the default's: layer_attn, layer_ffn)
    shot = os.environ.get("HETERO_PAGE_SCREENSHOT")
    if shot:
        Path(shot).parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(shot)
