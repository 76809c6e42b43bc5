"""``report.html`` (:mod:`qualify.compare.html`) of the committed default run.

The page is made once per module by the real command line (``qualify report RUN_DIR
--html PATH``) from the committed run's ``report.json`` and stored tensors, then read with
:mod:`html.parser` (what the markup holds) and, when ``chromium-headless-shell`` is on
PATH, rendered by headless Chromium: a PNG screenshot under the test's tmp dir (copied to
``$QUALIFY_SCREENSHOT_DIR`` when set) and assertions on the DOM Chromium built.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Final

import pytest
from committed import committed_runs

from qualify.cli.main import main
from qualify.compare.html import default_html_path, render_html
from qualify.compare.plotdata import load_run
from qualify.compare.rootcause import causes_of_report
from qualify.errors import ExitCode
from qualify.jsonio import read_json
from qualify.layout import REPORT_JSON

ROOT: Final = Path(__file__).resolve().parent.parent
RUNS: Final = [run / "report.json" for run in committed_runs("tiny-qwen3")]
CHROMIUM: Final = next((p for p in (shutil.which(n) for n in (
    "chromium-headless-shell", "chromium", "chromium-browser")) if p), None)


def chromium_render(page: Path, png: Path, *, width: int, height: int) -> str:
    """Headless Chromium on ``page``: a ``width x height`` screenshot to ``png``; the DOM.

    Raises:
        subprocess.CalledProcessError: Chromium failed.
    """
    assert CHROMIUM is not None
    url = page.resolve().as_uri()
    flags = [CHROMIUM, "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--window-size={width},{height}"]
    subprocess.run([*flags, f"--screenshot={png}", url], capture_output=True, check=True,
                   timeout=120)
    return subprocess.run([*flags, "--dump-dom", url], capture_output=True, check=True,
                          timeout=120, text=True).stdout


class Page(HTMLParser):
    """What a page holds: elements by id, root-cause lines, tables, figures, outside refs."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.order: list[str] = []  # ids in document order
        self.causes: list[str] = []
        self.h2: list[str] = []
        self.tables: dict[str, list[list[str]]] = {}
        self.figures: dict[str, dict[str, Any]] = {}
        self.tags: dict[str, int] = {}
        self.refs: list[str] = []
        self._stack: list[tuple[str, dict[str, str | None]]] = []
        self._text: list[str] | None = None
        self._table: str | None = None
        self._figure: str | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags[tag] = self.tags.get(tag, 0) + 1
        self.refs += [f"{tag}.{k}={v}" for k, v in a.items()
                      if k in ("src", "href", "xlink:href")
                      and not str(v).startswith("#")]
        if a.get("id"):
            self.order.append(str(a["id"]))
        if tag == "figure":
            self._figure = str(a.get("id"))
            self.figures[self._figure] = {"svg": 0, "text": [], "paths": 0, "caption": ""}
        if self._figure and tag == "svg":
            self.figures[self._figure]["svg"] += 1
        if self._figure and tag in ("path", "use", "rect"):
            self.figures[self._figure]["paths"] += 1
        if tag == "table":
            self._table = str(a.get("id"))
            self.tables[self._table] = []
        if self._table and tag == "tr":
            self.tables[self._table].append([])
        if tag in ("li", "h2", "td", "th", "text", "figcaption", "tspan"):
            self._text = []
        self._stack.append((tag, a))

    def handle_endtag(self, tag: str) -> None:
        while self._stack:
            t, a = self._stack.pop()
            if t == tag:
                break
        text = "".join(self._text or []).strip()
        if tag == "li" and "root-cause" in str(a.get("class")):
            self.causes.append(text)
        elif tag == "h2":
            self.h2.append(text)
        elif tag in ("td", "th") and self._table:
            self.tables[self._table][-1].append(text)
        elif tag in ("text", "tspan") and self._figure and text:
            self.figures[self._figure]["text"].append(text)
        elif tag == "figcaption" and self._figure:
            self.figures[self._figure]["caption"] = text
        if tag in ("li", "h2", "td", "th", "text", "figcaption", "tspan"):
            self._text = None
        if tag == "figure":
            self._figure = None
        if tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._text is not None:
            self._text.append(data)


@pytest.fixture(scope="module")
def run_dir() -> Path:
    """The committed default run."""
    assert len(RUNS) == 1, f"expected one committed tiny-qwen3 run: {RUNS}"
    return RUNS[0].parent


@pytest.fixture(scope="module")
def doc(run_dir: Path) -> dict[str, Any]:
    """Its ``report.json``."""
    out: dict[str, Any] = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    return out


@pytest.fixture(scope="module")
def written(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """``qualify report RUN_DIR --html PATH``: the page's path and what the command printed."""
    path = tmp_path_factory.mktemp("html") / f"{run_dir.name}.report.html"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["report", str(run_dir), "--html", str(path)])
    assert code == ExitCode.OK, buf.getvalue()
    return path, buf.getvalue()


@pytest.fixture(scope="module")
def page(written: tuple[Path, str]) -> Page:
    """The page as :mod:`html.parser` reads it."""
    return Page(written[0].read_text(encoding="utf-8"))


def test_cli_prints_the_causes_and_the_path(written: tuple[Path, str],
                                            doc: dict[str, Any]) -> None:
    path, out = written
    lines = out.splitlines()
    causes = causes_of_report(doc)
    assert lines[:-1] == [f"root cause: {rc.line()}" for rc in causes]
    assert lines[-1] == f"report.html: {path}"


def test_root_causes_lead_the_page(page: Page, doc: dict[str, Any]) -> None:
    assert page.h2[0] == "Root causes"
    assert page.causes == [rc.line() for rc in causes_of_report(doc)]
    assert len(page.causes) == 4  # the DeepSpeed BF16 ZeRO-0 cells
    assert page.causes[1].startswith("deepspeed-bf16-zero0-actor-tp2: round 1 actor grad_norm "
                                     "(candidate_vs_hf; also tp_vs_tp1): abs 2.59 > bound 0.569")
    assert page.order.index("root-causes") < page.order.index("heatmap-trainer")


def test_heat_maps_keep_trainer_and_sampler_apart(page: Page, doc: dict[str, Any]) -> None:
    trainer, sampler = page.figures["heatmap-trainer"], page.figures["heatmap-sampler"]
    assert trainer["svg"] == 1
    assert trainer["paths"] > 100
    cells = [c["cell"] for c in doc["cells"]]
    assert {c for c in cells if "sampler" not in c} <= set(trainer["text"])
    assert {"grad_norm", "clip_coef", "dtypes", "padding"} <= set(trainer["text"])
    assert not {"wrong_shard", "kernels"} & set(trainer["text"])
    assert {"vllm-fp32-sampler-tp1", "vllm-fp32-sampler-tp2", "kernels", "wrong_shard",
            "logprobs"} <= set(sampler["text"])
    assert "4.5" in trainer["text"]  # actor-tp2's worst grad_norm margin (round 1, 4.54)


def test_token_and_parameter_plots_show_what_was_judged(page: Page) -> None:
    for fam in ("logprobs", "entropy", "values"):
        fig = page.figures[f"tokens-{fam}"]
        assert fig["svg"] == 1
        assert "the largest equals the row's stored error" in fig["caption"]
        assert any(t.startswith("bound ") for t in fig["text"])
    assert "deepspeed-bf16-zero0-actor-tp1 round2/actor/logprobs" in \
        page.figures["tokens-logprobs"]["caption"]
    params = page.figures["params-worst"]
    assert params["caption"].startswith("deepspeed-bf16-zero0-critic-tp2 round 1:")
    assert "each panel's largest error equals its row's stored error" in params["caption"]
    rounds = page.figures["rounds"]
    assert {"logprobs", "grad_norm", "updates", "deepspeed-bf16-zero0-actor-tp2"} <= \
        set(rounds["text"])


def test_each_cause_bound_is_the_sealed_rule_again(page: Page, run_dir: Path,
                                                        doc: dict[str, Any]) -> None:
    table = page.tables["cause-bounds"]
    head, body = table[0], table[1:]
    assert head[:2] == ["cell", "root cause"]
    assert [r[0] for r in body] == [rc.cell for rc in causes_of_report(doc)]
    col = {h: i for i, h in enumerate(head)}
    for r in body:
        assert r[col["rule again"]] == r[col["sealed bound"]], r
        assert r[col["k"]] == "4"
        assert r[col["control"]] in ("attn_impl", "microbatch", "fp64", "row_split")
    ds = next(r for r in body if r[0] == "deepspeed-bf16-zero0-actor-tp2")
    assert (ds[col["root cause"]], ds[col["control error"]], ds[col["floor"]],
            ds[col["sealed bound"]]) == ("round1/actor/grad_norm", "0.06757", "0.001", "0.5692")
    data = load_run(run_dir)
    # three lanes (fp32, bf16-castmasters, bf16-autocast) and the TP-only class
    assert len(page.tables["all-bounds"]) - 1 == len(data.bounds) == 315
    for b in data.bounds:  # the sealed rule itself, on every bound the page lists
        rule = (b["k"] * max(b["control_error"], b.get("resolution", 0.0),
                             b.get("propagated", 0.0))
                + b.get("quantum", 0.0) + b["floor"])
        assert math.isclose(rule, b["bound"], rel_tol=1e-6)


def test_field_mismatch_metrics(page: Page, doc: dict[str, Any]) -> None:
    table = page.tables["field-metrics"]
    assert {"token_mult_prob_error", "k3_kl", "prob_pearson"} <= set(table[0])
    rows = doc["field_metrics"]["rows"]
    assert [r[0] for r in table[1:]] == [r["source"] for r in rows]
    tmpe = table[0].index("token_mult_prob_error")
    assert table[1][tmpe] == format(rows[0]["token_mult_prob_error"], ".4g")
    # the clip-band tail: a table of report.json's clip_band rows, or (for a report sealed
    # before the section existed) a note that it is not recorded
    if "clip_band" in doc:
        band = page.tables["clip-band"]
        assert [r[0] for r in band[1:]] == [r["source"] for r in doc["clip_band"]]
        col = band[0].index("fraction_outside")
        for shown, r in zip(band[1:], doc["clip_band"], strict=True):
            assert shown[col] == format(r["fraction_outside"], ".4g")
            assert int(shown[band[0].index("below")]) == r["below"]
    else:
        assert "clip-band" not in page.tables


def test_page_is_self_contained(page: Page, written: tuple[Path, str]) -> None:
    text = written[0].read_text(encoding="utf-8")
    assert page.tags.get("script", 0) == 0
    assert page.tags.get("link", 0) == 0
    assert page.tags.get("img", 0) == page.tags.get("image", 0) == 0  # vector only
    assert page.refs == []  # every href is a reference inside the page (#id)
    outside = {u for u in text.split('"') if u.startswith(("http:", "https:", "//"))}
    assert outside <= {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink",
                       "http://purl.org/dc/elements/1.1/", "http://creativecommons.org/ns#",
                       "http://purl.org/dc/dcmitype/StillImage",
                       "http://www.w3.org/1999/02/22-rdf-syntax-ns#"}, outside


@pytest.mark.slow
def test_same_report_json_gives_the_same_bytes(run_dir: Path,
                                               written: tuple[Path, str]) -> None:
    again = render_html(load_run(run_dir))
    assert again.encode("utf-8") == written[0].read_bytes()
    assert "<dc:date>" not in again
    # `qualify run` hands load_run the report.json it read once (validated before writing)
    assert render_html(load_run(run_dir, doc=read_json(run_dir / REPORT_JSON))) == again
    # the figures drawn in two forked workers, and one after another here: the same page
    assert render_html(load_run(run_dir), workers=2) == again
    assert render_html(load_run(run_dir), workers=1) == again


def test_default_path_is_beside_the_sealed_run(run_dir: Path, tmp_path: Path) -> None:
    assert default_html_path(run_dir) == run_dir.resolve().parent / \
        f"{run_dir.name}.report.html"
    inside = run_dir / "report.html"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["report", str(run_dir), "--html", str(inside)])
    assert code == ExitCode.INTEGRITY_ERROR, err.getvalue()
    assert not inside.exists()
    assert "refusing to write into sealed directory" in err.getvalue()
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    with contextlib.redirect_stderr(io.StringIO()):
        assert main(["report", str(empty)]) == ExitCode.USAGE_ERROR


def test_import_qualify_imports_no_matplotlib() -> None:
    code = ("import sys, qualify, qualify.cli.main, qualify.compare.report, "
            "qualify.compare.html, qualify.compare.plotdata; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("QUALIFY_REQUIRE_CHROMIUM"), reason=(
    "no headless Chromium on PATH (chromium-headless-shell / chromium): on Debian 12 as root "
    "`apt-get install --no-install-recommends chromium-headless-shell` (86 MB); "
    "`python -m playwright install chromium` cannot download here (its CDN is unreachable)"))
def test_headless_chromium_renders_the_page(written: tuple[Path, str], tmp_path: Path,
                                            doc: dict[str, Any]) -> None:
    assert CHROMIUM is not None, "QUALIFY_REQUIRE_CHROMIUM is set (.ci/run) but no Chromium"
    import matplotlib.image as mpimg
    import numpy as np

    png = tmp_path / "report.png"
    rendered = Page(chromium_render(written[0], png, width=1280, height=2400))
    assert rendered.causes == [rc.line() for rc in causes_of_report(doc)]
    heat = rendered.figures["heatmap-trainer"]
    assert heat["svg"] == 1
    assert heat["paths"] > 100
    assert "deepspeed-bf16-zero0-actor-tp2" in heat["text"]
    image = mpimg.imread(png)
    assert image.shape[:2] == (2400, 1280)
    gray = image[..., :3].mean(axis=2)
    assert gray.min() < 0.3 < 0.9 < gray.max()  # dark text on a light page
    assert float(np.mean(gray < 0.9)) > 0.02  # not a blank page: text, figures
    assert (gray[:400] < 0.5).any()  # the title and root causes at the top
    dest = os.environ.get("QUALIFY_SCREENSHOT_DIR")
    if dest:
        Path(dest).mkdir(parents=True, exist_ok=True)
        shutil.copy(png, Path(dest) / "report-chromium.png")


def test_gate_decision_on_the_page(run_dir: Path, page: Page, tmp_path: Path) -> None:
    """Without --contract the page shows the decision sealed in the report (``qualify run``
    compared the run under the contract's policy); with it, the decision by the contract's
    gate policy now (expected failures XFAIL)."""
    from qualify.contract import load_contract
    from qualify.evidence.policy import policy_for
    from qualify.pipeline.chain import run_decision

    assert "gate-sealed" in page.order
    assert "gate-none" not in page.order
    contract_path = ROOT / "contracts" / "tiny-qwen3.toml"
    path = tmp_path / "gated.html"
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["report", str(run_dir), "--html", str(path), "--contract",
                     str(contract_path)])
    assert code == ExitCode.OK
    gated = Page(path.read_text(encoding="utf-8"))
    assert "gate" in gated.order
    assert "gate-none" not in gated.order
    contract = load_contract(contract_path)
    policy = policy_for(contract)
    assert policy.path is not None
    exit_code, ev = run_decision(run_dir, contract, policy)
    text = path.read_text(encoding="utf-8")
    word = "PASS" if exit_code == ExitCode.OK else "FAIL"
    assert f"<strong>Gate: {word}</strong> (exit {int(exit_code)}) by gate policy " in text
    counts = ", ".join(f"{k} {v}" for k, v in ev.counts().items() if v)
    assert f"; required cells: {counts}</p>" in text
    offending = [c for c in ev.cells if c.required and not c.ok]
    assert text.count("<li>", text.index('id="gate"'), text.index("</div>", text.index(
        'id="gate"'))) == min(len(offending), 12) + (len(offending) > 12)
    assert "gate-unverified" in gated.order  # qualify report decides without verifying
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["report", str(run_dir), "--html", str(path), "--policy",
                     str(policy.path)]) == ExitCode.USAGE_ERROR
    err = io.StringIO()
    other = ROOT / "contracts" / "tiny-qwen3-grpo.toml"  # not this run's contract
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        assert main(["report", str(run_dir), "--html", str(path), "--contract",
                     str(other)]) == ExitCode.USAGE_ERROR
    assert "is not the run's (tiny-qwen3," in err.getvalue()
    assert len(err.getvalue().strip().splitlines()) == 1


def test_table_id_is_escaped() -> None:
    """A table's id (a diverge section's carries an unsigned cell id) cannot open markup."""
    import pandas as pd

    from qualify.compare.html import _table

    hostile = 'x"><script>alert(1)</script>'
    out = _table(pd.DataFrame({"a": [1.0]}), hostile)
    assert "<script>" not in out
    assert 'id="x&quot;&gt;&lt;script&gt;alert(1)&lt;/script&gt;"' in out
    assert 'id="diverge-table-torch_tp-fp32-actor-tp2"' in _table(
        pd.DataFrame({"a": [1.0]}), "diverge-table-torch_tp-fp32-actor-tp2")
