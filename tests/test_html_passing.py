"""``report.html`` of a passing run: the shared tiny chain (every torch_tp cell PASSES).

:func:`shared_artifacts.tiny_chain` is the real candidate stage of the torch_tp-only tiny
contract on its sealed reference, compared (tests/test_pipeline.py asserts every cell
passes). Its page is made by the real command line (``qualify report RUN_DIR --html PATH``)
and read with :mod:`html.parser`, then, when ``chromium-headless-shell`` is on PATH (always
in ``.ci/run``: ``QUALIFY_REQUIRE_CHROMIUM=1``), rendered by headless Chromium: a PNG
screenshot (copied to ``$QUALIFY_SCREENSHOT_DIR`` as ``report-passing-chromium.png``) and
assertions on the DOM Chromium built.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from shared_artifacts import copy_tree, tiny_chain
from test_html_report import CHROMIUM, Page, chromium_render

from qualify.cli.main import main
from qualify.errors import ExitCode
from qualify.evidence import store


@pytest.fixture(scope="module")
def passing(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], Path]:
    """A copy of the passing chain's run, its ``report.json`` and its page."""
    chain = tiny_chain(tmp_path_factory)
    work = tmp_path_factory.mktemp("passing")
    for part in ("references", "evidence"):
        copy_tree(chain.root / part, work / part)
    run_dir = work / "evidence" / chain.doc["contract"] / chain.doc["run_id"]
    doc: dict[str, Any] = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    path = work / "passing.report.html"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["report", str(run_dir), "--html", str(path)])
    assert code == ExitCode.OK, buf.getvalue()
    assert buf.getvalue().splitlines() == [f"report.html: {path}"]  # no root cause to print
    store.make_writable(work)
    return run_dir, doc, path


def test_passing_page_says_so(passing: tuple[Path, dict[str, Any], Path]) -> None:
    _, doc, path = passing
    assert doc["passed"] is True
    assert {c["verdict"] for c in doc["cells"]} == {"PASS"}
    text = path.read_text(encoding="utf-8")
    page = Page(text)
    assert ('class="result result-passed"><strong>Comparator verdict (before the policy): '
            'PASSED</strong>') in text
    # the headline is the decision the report sealed (no policy file: the verdict decides)
    assert text.index('id="gate"') < text.index("Comparator verdict")
    assert "<strong>Gate: PASS</strong> (exit 0) by the report verdict" in text
    assert page.h2[0] == "Root causes"
    assert "root-causes-none" in page.order
    assert page.causes == []
    heat = page.figures["heatmap-trainer"]
    assert heat["svg"] == 1
    assert {c["cell"] for c in doc["cells"]} <= set(heat["text"])
    assert "heatmap-sampler" not in page.figures  # the chain has no sampler cell
    band = page.tables["clip-band"]  # today's comparator always writes the section
    assert [r[0] for r in band[1:]] == [r["source"] for r in doc["clip_band"]]
    assert "gate-sealed" in page.order  # without --contract: the decision sealed at compare


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("QUALIFY_REQUIRE_CHROMIUM"),
                    reason="no headless Chromium on PATH (see tests/test_html_report.py)")
def test_headless_chromium_renders_the_passing_page(
        passing: tuple[Path, dict[str, Any], Path], tmp_path: Path) -> None:
    assert CHROMIUM is not None, "QUALIFY_REQUIRE_CHROMIUM is set (.ci/run) but no Chromium"
    import matplotlib.image as mpimg
    import numpy as np

    _, doc, path = passing
    png = tmp_path / "report-passing.png"
    rendered = Page(chromium_render(path, png, width=1280, height=1600))
    assert rendered.causes == []
    assert "root-causes-none" in rendered.order
    assert {c["cell"] for c in doc["cells"]} <= set(rendered.figures["heatmap-trainer"]["text"])
    image = mpimg.imread(png)
    assert image.shape[:2] == (1600, 1280)
    rgb = image[..., :3]
    gray = rgb.mean(axis=2)
    assert gray.min() < 0.3 < 0.9 < gray.max()  # dark text on a light page
    assert float(np.mean(gray < 0.9)) > 0.02  # not a blank page
    dest = os.environ.get("QUALIFY_SCREENSHOT_DIR")
    if dest:
        Path(dest).mkdir(parents=True, exist_ok=True)
        shutil.copy(png, Path(dest) / "report-passing-chromium.png")
