"""``attnkit explain --html``: the step-by-step page, driven in headless Chromium — hover a score,
the query and key rows that made it light up and the readout spells out the dot product; hover an
output, the weights row and the value column it blends light up.

Set ``ATTNKIT_SCREENSHOT_DIR`` to keep the screenshots somewhere to look at.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_browser import _shot, browser  # noqa: F401  (the shared headless Chromium fixture)

from attnkit.cli import main

pytestmark = [pytest.mark.browser]


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    out = tmp_path_factory.mktemp("explain")
    plain, masked = out / "three.html", out / "masked.html"
    assert main(["explain", "--html", str(plain)]) == 0
    assert main(["explain", "--mask", "causal", "--html", str(masked)]) == 0
    return plain, masked


def _classes(el):
    return (el.get_attribute("class") or "").split()


def test_page_is_self_contained_and_has_the_numbers(pages):
    text = pages[0].read_text(encoding="utf-8")
    assert not re.search(r"https?:|(src|href)\s*=|@import", text)
    # the 3-token example: its weights and first output row
    for n in ("0.4011", "0.1978", "5.0000", "0.707107 = 1/√2"):
        assert n in text
    assert 'id="masked"' not in text  # no mask, no mask step
    assert 'id="masked"' in pages[1].read_text(encoding="utf-8")


def test_hover_score_highlights_its_query_and_key(pages, browser, tmp_path):  # noqa: F811
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    drv = browser
    drv.get(pages[0].as_uri())
    assert drv.execute_script("return document.body.getAttribute('data-ready')") == "1"
    assert drv.execute_script("return performance.getEntriesByType('resource').length") == 0
    assert not [e for e in drv.get_log("browser") if e.get("level") == "SEVERE"]
    readout = lambda: drv.find_element(By.ID, "readout").text  # noqa: E731
    before = readout()
    assert drv.find_elements(By.CSS_SELECTOR, ".hl") == []

    # score[q2, k0] = q2 · k0 = 1×1 + 1×1 = 2
    cell = drv.find_element(By.CSS_SELECTOR, '#scores td[data-i="2"][data-j="0"]')
    ActionChains(drv).move_to_element(cell).perform()
    assert readout() != before
    assert readout().startswith("score[q2, k0] = q2 · k0 = 1.0000×1.0000 + 1.0000×1.0000 = 2.0000")
    assert "weight 0.5035" in readout()
    assert "sel" in _classes(cell)
    hl_rows = {(r.find_element(By.XPATH, "ancestor::table").get_attribute("id"), r.get_attribute("data-i"))
               for r in drv.find_elements(By.CSS_SELECTOR, "tr.hl")}
    assert hl_rows == {("Q", "2"), ("K", "0")}
    q_cells = drv.find_elements(By.CSS_SELECTOR, '#Q tr[data-i="2"] td')
    assert all("hl" in _classes(c) for c in q_cells)
    assert q_cells[0].value_of_css_property("outline-style") == "solid"
    assert not any("hl" in _classes(c) for c in drv.find_elements(By.CSS_SELECTOR, '#Q tr[data-i="1"] td'))
    assert {g.get_attribute("data-step") for g in drv.find_elements(By.CSS_SELECTOR, "#flow g.hl")} == {
        "Q", "K", "matmul1"}
    shot = _shot(drv, tmp_path, "attnkit-explain-hover-score.png")

    # output[q0, dv0] = 0.4011×10 + 0.4011×0 + 0.1978×5 = 5
    out = drv.find_element(By.CSS_SELECTOR, '#output td[data-i="0"][data-j="0"]')
    ActionChains(drv).move_to_element(out).perform()
    assert readout() == ("output[q0, dv0] = Σ_j weight[q0, j] × V[j, dv0] = 0.4011×10.0000 + 0.4011×0.0000 + "
                         "0.1978×5.0000 = 5.0000")
    v_hl = [(c.get_attribute("data-i"), c.get_attribute("data-j"))
            for c in drv.find_elements(By.CSS_SELECTOR, "#V td.hl")]
    assert v_hl == [("0", "0"), ("1", "0"), ("2", "0")]
    assert [r.get_attribute("data-i") for r in drv.find_elements(By.CSS_SELECTOR, "#weights tr.hl")] == ["0"]
    assert drv.find_elements(By.CSS_SELECTOR, "#Q tr.hl") == []  # the previous highlight is gone
    _shot(drv, tmp_path, "attnkit-explain-hover-output.png")
    assert shot.exists()


def test_masked_page_shows_the_mask(pages, browser, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By

    drv = browser
    drv.get(pages[1].as_uri())
    cells = drv.find_elements(By.CSS_SELECTOR, '#masked tr[data-i="0"] td')
    assert [c.text for c in cells] == ["0.7071", "-inf", "-inf"]
    w = [c.text for c in drv.find_elements(By.CSS_SELECTOR, '#weights tr[data-i="0"] td')]
    assert w == ["1.0000", "0.0000", "0.0000"]
    assert drv.find_elements(By.CSS_SELECTOR, '#flow g[data-step="mask"]')
    drv.set_window_size(1200, 2600)
    _shot(drv, tmp_path, "attnkit-explain-masked-full.png")


def test_page_escapes_labels():
    import attnkit
    from attnkit.viz import explain_page

    t = attnkit.explain(np.eye(2), np.eye(2), np.eye(2))
    page = explain_page(t, title="<b>x</b>", q_tokens=["</script><i>", "a"], k_tokens=["&", "b"])
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page
    assert "</script><i>" not in page and "&amp;" in page


def test_html_for_positional_is_a_user_error(tmp_path, capsys):
    assert main(["explain", "--example", "positional", "--html", str(tmp_path / "p.html")]) == 2
    assert "--html" in capsys.readouterr().err


def test_html_for_too_many_tokens_is_a_user_error(tmp_path, capsys):
    for n in "qkv":
        np.save(tmp_path / f"{n}.npy", np.ones((65, 2)))
    rc = main(["explain", "--q", str(tmp_path / "q.npy"), "--k", str(tmp_path / "k.npy"), "--v",
               str(tmp_path / "v.npy"), "--html", str(tmp_path / "p.html")])
    out, err = capsys.readouterr()
    assert out == ""  # refused before anything is printed
    assert rc == 2 and "--html: the page shows every number, so at most 64" in err and "L=65" in err
    assert not (tmp_path / "p.html").exists()
