"""The studio's page in a real browser: Chromium, headless, driven through Selenium against studio.py
started as a user starts it. Each panel is used as a person would use it and photographed into the
test's folder."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess

import pytest

from tests.common import TINY_OVERRIDES, start_script, train_here
from tests.conftest import in_ci

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")


def browser():
    """Headless Chromium, or the test is skipped where there is none (in CI it must be there)."""
    webdriver = pytest.importorskip("selenium.webdriver")
    if CHROMIUM is None or DRIVER is None:
        if in_ci():
            pytest.fail("CI runs the browser test: install chromium and chromium-driver (.ci/run does)")
        pytest.skip("needs Chromium and its driver: apt-get install chromium chromium-driver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(DRIVER), options=options)


@pytest.fixture(scope="module")
def studio(tmp_path_factory, small_text):
    """studio.py on a run trained here; yields its address."""
    folder = tmp_path_factory.mktemp("browser")
    overrides = [o for o in TINY_OVERRIDES if o != "latest_link=null"]  # outputs/latest, which studio.py serves
    done = train_here(*overrides, "data=text", f"data.path={small_text}", cwd=folder)  # (in this process)
    assert done.returncode == 0, done.stderr[-2000:]
    server = start_script("studio.py", "--port", "0", cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        yield re.search(r"http://\S+", server.stdout.readline()).group(0)
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=60)


def wait_for(driver, condition, timeout=60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(lambda d: condition(d))


def open_tab(driver, name: str) -> None:
    driver.find_element("css selector", f'#tabs button[data-panel="{name}"]').click()


def test_the_page_talks_shows_alternatives_attention_lens_walk_history_and_copies(studio, tmp_path):
    driver = browser()
    count = lambda selector: len(driver.find_elements("css selector", selector))  # noqa: E731
    try:
        driver.get(studio)
        wait_for(driver, lambda d: "layers" in d.find_element("id", "model-info").text)
        n_layer, n_head = (
            int(n) for n in re.findall(r"(\d+) (?:layers|heads)", driver.find_element("id", "model-info").text)
        )

        prompt = driver.find_element("id", "prompt")
        prompt.clear()
        prompt.send_keys("ROMEO:")
        driver.find_element("id", "max-new-tokens").clear()
        driver.find_element("id", "max-new-tokens").send_keys("20")
        driver.find_element("id", "generate").click()
        wait_for(driver, lambda d: "tokens in" in d.find_element("id", "talk-status").text)
        generated = driver.find_elements("css selector", "#output .token:not(.prompt)")
        assert 0 < len(generated) <= 20
        driver.save_screenshot(str(tmp_path / "talk.png"))

        generated[len(generated) // 2].click()
        wait_for(driver, lambda d: d.find_element("id", "alternatives").is_displayed())
        assert count("#alternatives .alt") == 11 and count("#alternatives .alt.chosen") == 1
        driver.save_screenshot(str(tmp_path / "alternatives.png"))

        tokens = count("#output .token")
        T = min(tokens, 32)  # the tiny model's context
        open_tab(driver, "attention")
        wait_for(driver, lambda d: count("#heatmap rect.cell") > 0)
        assert count("#heatmap rect.cell") == T * T
        assert count("#head-grid .head") == n_head
        cell = driver.find_element("css selector", "#heatmap rect.cell")
        from selenium.webdriver.common.action_chains import ActionChains

        ActionChains(driver).move_to_element(cell).perform()
        wait_for(driver, lambda d: "→" in d.find_element("id", "attention-hover").text)
        driver.save_screenshot(str(tmp_path / "attention.png"))

        # longer texts are drawn on one canvas, a pixel a cell: the page's own function on made-up weights
        driver.execute_script(
            "const T = 200; drawHeatmap(Array.from({length: T}, (_, q) => Array.from({length: T}, "
            "(_, k) => k <= q ? 1 / (q + 1) : 0)), Array.from({length: T}, (_, i) => 't' + i));"
        )
        canvas = driver.find_element("css selector", "#heatmap canvas.cells")
        assert canvas.get_attribute("data-rows") == "200" and count("#heatmap rect.cell") == 0
        assert canvas.size == {"width": 600, "height": 600}  # three pixels a cell
        driver.execute_script("arguments[0].scrollIntoView()", canvas)
        ActionChains(driver).move_to_element_with_offset(canvas, -148, 152).perform()  # (x 152, y 452)
        wait_for(driver, lambda d: d.find_element("id", "attention-hover").text == "t150 → t50: 0.0066")
        pixel = driver.execute_script(
            "return [...arguments[0].getContext('2d').getImageData(50, 150, 1, 1).data]", canvas
        )
        assert pixel == [round(255 - 230 / 151), round(255 - 175 / 151), round(255 - 55 / 151), 255]
        driver.save_screenshot(str(tmp_path / "attention-long.png"))

        open_tab(driver, "lens")
        wait_for(driver, lambda d: count("#lens tr") > 0)
        assert count("#lens tr") == 1 + n_layer + 1 and count("#lens td.first") == T
        driver.save_screenshot(str(tmp_path / "lens.png"))

        open_tab(driver, "walk")
        wait_for(driver, lambda d: count("#walk .step") > 5)
        assert "c_attn" in driver.find_element("id", "walk").text
        driver.save_screenshot(str(tmp_path / "walk.png"))

        open_tab(driver, "history")
        wait_for(driver, lambda d: count("#curves polyline") == 2)
        assert driver.find_element("css selector", "#samples pre").text
        driver.save_screenshot(str(tmp_path / "history.png"))

        open_tab(driver, "copies")
        state = lambda: driver.find_element("id", "copies-status").get_attribute("data-state")  # noqa: E731
        wait_for(driver, lambda d: state() != "building", timeout=300)
        assert state() == "ready", driver.find_element("id", "copies-status").text
        driver.find_element("id", "find-copies").click()
        wait_for(driver, lambda d: d.find_element("id", "copies-status").text)
        assert "word for word in the training text" in driver.find_element("id", "copies-status").text
        driver.save_screenshot(str(tmp_path / "copies.png"))

        errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        assert errors == []
    finally:
        driver.quit()
