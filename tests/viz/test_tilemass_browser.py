"""The long-input page in headless Chromium: opens offline, zooms by drag and by its JS hook,
shows finer tiles, and its numbers are the TileMass's (no network request, no console error).

Set ``ATTNKIT_SCREENSHOT_DIR`` to keep the screenshots.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from attnkit.apps.long_inputs import synthetic
from attnkit.tilemass import tile_mass

pytestmark = [pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
DRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1200,1000"]
L = 32768


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    q, k, mask = synthetic(L, H=4, Hkv=2, D=32, mask="document", seed=3)
    tm = tile_mass(q, k, mask=mask, block=64)
    path = tmp_path_factory.mktemp("long") / "long.html"
    html = tm.to_html(path, title="test page", rows=[0, 5000, 32000])
    assert len(html.encode()) <= 5_000_000
    return path, tm


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
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
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


def test_page_opens_offline_zooms_and_reads_out_the_masses(page, browser, tmp_path):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    path, tm = page
    drv = browser
    drv.get(path.as_uri())
    assert drv.execute_script("return document.body.getAttribute('data-ready')") == "1"
    assert drv.find_element(By.ID, "title").text == "test page"
    assert "L=32768" in drv.find_element(By.ID, "sub").text
    view = drv.execute_script("return attnkitLong.view()")
    assert (view["x0"], view["x1"], view["y0"], view["y1"]) == (0, L, 0, L)
    coarse = view["tile"][0]
    assert coarse > 64  # the whole input: tiles of several 64-token blocks

    # drag a rectangle over the top-left corner: the view shrinks, finer tiles appear
    cv = drv.find_element(By.ID, "map2d")
    w, h = cv.size["width"], cv.size["height"]
    ActionChains(drv).move_to_element_with_offset(cv, -w // 2 + 75, -h // 2 + 20).click_and_hold() \
        .move_by_offset(120, 120).release().perform()
    view = drv.execute_script("return attnkitLong.view()")
    assert view["x1"] - view["x0"] < L / 2 and view["y1"] - view["y0"] < L / 2
    assert view["tile"][0] < coarse

    # the JS hook: zoom to the finest tiles; the readout and the colour's share are tm's own numbers
    drv.execute_script("attnkitLong.zoom(0, 1024, 0, 1024)")
    assert drv.execute_script("return attnkitLong.view()")["tile"] == [64, 64]
    mean_mass = tm.mass[0].double().mean(0)
    mean_live = tm.live_rows[0].double().mean(0)
    for qb, kb in tm.tiles.tolist()[:12]:
        i = next(n for n, (a, c) in enumerate(tm.tiles.tolist()) if (a, c) == (qb, kb))
        share = drv.execute_script(f"return attnkitLong.tileShare({qb * 64 + 3}, {kb * 64 + 3})")
        assert abs(share - float(mean_mass[i] / mean_live[qb])) < 1e-5
    text = drv.execute_script("return attnkitLong.hover(70, 10)")
    assert text.startswith("queries 64–127 → keys 0–63") and "mean of heads" in text and "share" in text
    drv.execute_script("attnkitLong.setHead(1)")
    text = drv.execute_script("return attnkitLong.hover(70, 10)")
    i = next(n for n, (a, c) in enumerate(tm.tiles.tolist()) if (a, c) == (1, 0))
    assert "head 1" in text and f"mass {float(tm.mass[0, 1, i]):.2f}" in text
    # an empty tile says so
    qb, kb = next((a, c) for a in range(16) for c in range(16) if tm.kinds[a, c] == 0)
    drv.execute_script(f"attnkitLong.zoom({kb * 64 - 256}, {kb * 64 + 512}, {qb * 64 - 256}, {qb * 64 + 512})")
    assert "never computed" in drv.execute_script(f"return attnkitLong.hover({qb * 64 + 1}, {kb * 64 + 1})")

    # the row panel holds the exact weights of the embedded rows (head 1 of row 5000)
    got = torch.tensor(drv.execute_script("return attnkitLong.rowWeights(1)"))
    r = tm.row_weights(5000)
    nz = r.abs().sum(0).nonzero().flatten()
    n = got.numel() // (tm.H + 1)
    j0 = int(tm.tiles[tm.tiles[:, 0] == 5000 // 64][:, 1].min()) * 64
    assert torch.allclose(got.view(tm.H + 1, n)[1], r[1, j0:j0 + n].float(), atol=1e-7)
    assert nz.min() >= j0 and nz.max() < j0 + n

    drv.execute_script("attnkitLong.reset()")
    drv.execute_script("attnkitLong.back()")
    view = drv.execute_script("return attnkitLong.view()")
    assert view["x1"] - view["x0"] < L
    _shot(drv, tmp_path, "attnkit-long-zoomed.png")
    # nothing was fetched, and the console is clean
    assert drv.execute_script("return performance.getEntriesByType('resource').length") == 0
    logs = [e for e in drv.get_log("browser") if e.get("level") in ("SEVERE", "WARNING")]
    assert not logs, logs
