"""report.html's per-position plot of a sampler cell's decode-path distribution: KL and top-k
agreement of its worst sequences, drawn from the stored tensors, saying whether the drawing
reproduces the row that was judged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis.extra.numpy import arrays
from safetensors.numpy import save_file

from qualify.compare import html
from qualify.compare.plotdata import RunData, position_distributions
from qualify.distmetrics import distribution_metrics, position_metrics

B, R, V = 5, 6, 11
CELL = "vllm-bf16-sampler-tp1"


@settings(max_examples=40, deadline=None)
@given(cand=arrays(np.float64, (3, 4, 7), elements=st.floats(-12, 0)),
       ref=arrays(np.float64, (3, 4, 7), elements=st.floats(-12, 0)),
       mask=arrays(np.bool_, (3, 4)))
def test_position_metrics_are_what_the_rows_aggregate(cand: np.ndarray, ref: np.ndarray,
                                                      mask: np.ndarray) -> None:
    """Max token KL is ``kl_ref_cand_max``, mean disagreement ``topk_disagreement_mean``."""
    kl, agree = position_metrics(cand, ref, mask)
    assert np.isnan(kl[~mask]).all()
    assert np.isnan(agree[~mask]).all()
    if not mask.any():
        return
    got = distribution_metrics(cand, ref, np.zeros(mask.shape, np.int64), mask, clip_ratio=0.2)
    assert float(np.max(kl[mask])) == got["kl_ref_cand_max"]
    assert float(np.mean(1.0 - agree[mask])) == pytest.approx(got["topk_disagreement_mean"],
                                                              abs=1e-12)
    assert ((agree[mask] >= 0) & (agree[mask] <= 1)).all()


def _logprobs(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = rng.normal(size=shape) * 3.0
    return (x - np.log(np.exp(x).sum(-1, keepdims=True))).astype(np.float32)


def _run(tmp_path: Path, *, stored_shift: float = 0.0) -> tuple[RunData, dict[str, Any]]:
    """A run whose sampler cell holds ``decode_raw``, its reference ``raw``, and the
    ``kl_ref_cand_max`` row the comparator would write for them (shifted by ``stored_shift``)."""
    rng = np.random.default_rng(0)
    ref = _logprobs(rng, (B, R, V))
    cand = ref.copy()
    cand[3, 2] = _logprobs(rng, (V,))  # one far position: sequence 3 is the worst
    cand[1] += rng.normal(size=(R, V)).astype(np.float32) * 1e-3
    mask = np.ones((B, R), dtype=np.int64)
    mask[4, 3:] = 0
    attempt = tmp_path / "run" / "cells" / CELL / "attempt-1"
    attempt.mkdir(parents=True)
    save_file({"round1/sampler/decode_raw": cand}, str(attempt / "outputs.safetensors"))
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    save_file({"raw": ref}, str(ref_dir / "distribution.safetensors"))
    got = distribution_metrics(cand, ref, np.zeros((B, R), np.int64), mask, clip_ratio=0.2)
    row = {"cell": CELL, "class": "sampler_distribution", "family": "decode_raw",
           "statistic": "kl_ref_cand_max", "error": got["kl_ref_cand_max"] + stored_shift,
           "bound": 0.5, "round": 1, "role": "sampler"}
    doc = {"cells": [{"cell": CELL, "role": "sampler", "status": "COMPLETE",
                      "attempt": f"cells/{CELL}/attempt-1"}], "rows": [row]}
    return RunData(run_dir=tmp_path / "run", doc=doc, ref_dir=ref_dir, bounds=(),
                   mask=mask, lanes={}), got


def test_worst_sequences_are_drawn_and_reproduce_the_judged_row(tmp_path: Path) -> None:
    data, got = _run(tmp_path)
    (pd_,) = position_distributions(data, CELL, n=2)
    assert pd_.kind == "raw"
    assert [s[0] for s in pd_.sequences] == [3, 1]  # largest token KL first
    assert pd_.reproduces
    assert pd_.kl_max == got["kl_ref_cand_max"]
    assert pd_.bound == 0.5
    _, pos, kl, agree = pd_.sequences[0]
    assert int(np.argmax(kl)) == 2
    assert pos.tolist() == list(range(R))
    assert agree[0] == 1.0  # an untouched position: the same top-k
    page = "\n".join(html._distribution_plots(data))
    assert f'id="distribution-{CELL}-raw"' in page
    assert page.count("<svg") == 1
    assert "equals the row&#x27;s stored kl_ref_cand_max" in page


def test_a_drawing_that_is_not_the_judged_row_says_so(tmp_path: Path) -> None:
    data, _ = _run(tmp_path, stored_shift=1e-3)
    (pd_,) = position_distributions(data, CELL)
    assert not pd_.reproduces
    assert "NOTE: the largest" in "\n".join(html._distribution_plots(data))


def test_without_decode_tensors_the_page_says_so(tmp_path: Path) -> None:
    data, _ = _run(tmp_path)
    (data.ref_dir / "distribution.safetensors").unlink()  # type: ignore[operator]
    assert position_distributions(data, CELL) == []
    assert "No decode-path distributions" in "\n".join(html._distribution_plots(data))
