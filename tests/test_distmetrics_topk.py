"""The top-k path of the decode-path distribution rows (qualify.distmetrics.topk_metrics).

Invariants (hypothesis, on random distributions and perturbations of every scale): the
lumped-tail KL is at most the full KL in both directions (data-processing inequality); the
lumped TV is at most the full TV, which is at most ``tv_upper``. With ``k = V`` the top-k
path gives the full path's statistics. Classes of defect the rows must catch: a top-k mask
leaking into the untruncated logprobs, a temperature applied twice on decode positions only;
a sampler cell without the tensors, or with fewer than the sealed ``k``, is ``NOT_RUN``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from qualify.compare.distribution import distribution_rows
from qualify.distmetrics import (
    STATISTICS,
    TOPK,
    TOPK_STATISTICS,
    distribution_metrics,
    tail_resolution,
    topk_metrics,
    topk_of,
)
from qualify.reference.distribution import FLOORS

B, R, V = 3, 5, 40
T = 0.9
CELL = "vllm-fp32-sampler-tp1"


def _lsm(x: np.ndarray, t: float = 1.0) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(x / t), dim=-1).numpy()


def _case(seed: int, v: int = V) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed)
    tokens = g.integers(0, v, (B, R))
    mask = np.ones((B, R), dtype=np.int64)
    mask[1, 3:] = 0
    return g.normal(0.0, 3.0, (B, R, v)), tokens, mask


def _topk_side(lp: np.ndarray, tokens: np.ndarray, k: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-k ids (:func:`topk_of`) with their values in ``lp``'s own dtype."""
    ids = topk_of(lp, k)[1]
    return (np.take_along_axis(lp, ids, axis=-1), ids,
            np.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0])


def _both(cand: np.ndarray, ref: np.ndarray, tokens: np.ndarray, mask: np.ndarray,
          k: int) -> dict:
    cv, ci, ct = _topk_side(cand, tokens, k)
    rv, ri, rt = _topk_side(ref, tokens, k)
    return topk_metrics(cv, ci, rv, ri, cand_token=ct, ref_token=rt, mask=mask,
                        clip_ratio=0.2)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(TOPK, V - 3),
       st.sampled_from([1e-3, 0.05, 0.5, 3.0]), st.sampled_from([0.5, 1.0, 3.0]))
def test_lumped_bounds_hold(seed: int, k: int, noise: float, scale: float) -> None:
    """Lumped KL <= full KL both ways; lumped TV <= full TV <= tv_upper.

    Where both tails are above the FP32 resolution of the kept masses (below it the bucket is
    not resolved; the k = V test covers that regime).
    """
    logits, tokens, mask = _case(seed)
    ref = _lsm(logits * scale / 3.0)
    cand = _lsm(logits * scale / 3.0
                + np.random.default_rng(seed + 1).normal(0.0, noise, logits.shape))
    tails = [1.0 - np.exp(_topk_side(x, tokens, k)[0]).sum(-1)[mask != 0] for x in (ref, cand)]
    assume(min(float(t.min()) for t in tails) > 10 * tail_resolution(k))
    full = distribution_metrics(cand, ref, tokens, mask, clip_ratio=0.2)
    got = _both(cand, ref, tokens, mask, k)
    for s in ("kl_ref_cand_max", "kl_ref_cand_mean", "kl_cand_ref_max", "kl_cand_ref_mean",
              "seq_max_kl_mean", "tv_max", "tv_mean"):
        assert got[s] <= full[s] * (1 + 1e-9) + 1e-15, (s, got[s], full[s])
    assert full["tv_max"] <= got["tv_upper_max"] * (1 + 1e-9) + 1e-15
    assert full["tv_mean"] <= got["tv_upper_mean"] * (1 + 1e-9) + 1e-15
    # exact on the top-k path: top-1, top-5 sets, ratio tails at the response token
    for s in ("top1_mismatch", "topk_disagreement_mean", "ratio_outside_2",
              "ratio_outside_clip"):
        assert got[s] == pytest.approx(full[s], abs=1e-12), s
    assert 0.0 <= got["missing_ref_max"] <= 1.0


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 10_000))
def test_k_equal_to_the_vocabulary_is_the_full_path(seed: int) -> None:
    logits, tokens, mask = _case(seed)
    ref = _lsm(logits).astype(np.float32)
    cand = _lsm(logits + np.random.default_rng(seed).normal(0, 0.3, logits.shape)
                ).astype(np.float32)
    full = distribution_metrics(cand, ref, tokens, mask, clip_ratio=0.2)
    got = _both(cand, ref, tokens, mask, V)
    for s in STATISTICS:
        assert got[s] == pytest.approx(full[s], rel=1e-9, abs=1e-15), s
    assert got["worst"] == full["worst"]
    assert got["tv_upper_max"] == pytest.approx(full["tv_max"], rel=1e-9)
    assert got["topk_set_disagreement_mean"] == 0.0
    same = _both(ref, ref, tokens, mask, 8)
    for s in TOPK_STATISTICS:
        if not s.startswith("tv_upper"):
            assert same[s] == pytest.approx(0.0, abs=1e-12), s


def test_disjoint_tails_reach_the_upper_bound() -> None:
    """Two distributions with the same top-5 that put their tails on different tokens:
    lumped TV and KL 0, true TV the tail mass (true KL infinite), tv_upper exactly the true TV
    (the bound is sharp)."""
    p, q = np.zeros(20), np.zeros(20)
    p[:5] = q[:5] = [0.5, 0.1, 0.1, 0.1, 0.1]
    p[5], q[6] = 0.1, 0.1
    with np.errstate(divide="ignore"):
        lp, lq = np.log(p)[None, None], np.log(q)[None, None]
    tokens, mask = np.zeros((1, 1), dtype=np.int64), np.ones((1, 1))
    got = _both(lq, lp, tokens, mask, 5)
    full = distribution_metrics(lq, lp, tokens, mask, clip_ratio=0.2)
    assert full["tv_max"] == pytest.approx(0.1)
    assert 0.1 <= got["tv_upper_max"] <= 0.1 + 1e-5  # plus the buckets' FP32 resolution
    assert got["tv_max"] == pytest.approx(0.0, abs=1e-15)
    assert full["kl_ref_cand_max"] == np.inf
    assert got["kl_ref_cand_max"] == pytest.approx(0.0, abs=1e-15)
    assert got["topk_set_disagreement_mean"] == 0.0
    assert got["missing_ref_max"] == pytest.approx(0.1)


def _sealed(tmp: Path, ref: np.ndarray, tokens: np.ndarray, mask: np.ndarray, k: int, *,
            control: np.ndarray) -> Path:
    """A top-k sealed-reference stand-in (distribution.{json,safetensors}): each statistic's
    bound is 4 x that of ``control`` against ``ref`` + the floor, both as the FP32 logprobs
    the reference stores, as the reference seals it."""
    got = _both(control.astype(np.float32), ref.astype(np.float32), tokens, mask, k)
    bounds = {s: {"bound": 4.0 * got[s] + FLOORS[s], "control": "decode",
                  "control_error": got[s], "k": 4.0, "floor": FLOORS[s]}
              for s in TOPK_STATISTICS}
    doc = {"clip_ratio": 0.2, "topk": {"k": k, "why": "test"},
           "raw": {"bounds": bounds}, "tempered": {"bounds": bounds},
           "decode_vs_prefill": {"bound": 2e-5, "control": "decode"}}
    (tmp / "distribution.json").write_text(json.dumps(doc))
    vals, ids, tok = _topk_side(ref, tokens, k)
    save_file({f"{kind}_{n}": torch.from_numpy(np.array(a, copy=True))
               for kind in ("raw", "tempered")
               for n, a in (("topk_logprobs", vals.astype(np.float32)), ("topk_ids", ids),
                            ("token_logprobs", tok.astype(np.float32)))},
              str(tmp / "distribution.safetensors"))
    return tmp


def _sampler(kind_lp: dict[str, np.ndarray], tokens: np.ndarray, k: int) -> dict:
    out = {"round2/sampler/logprobs": np.zeros((B, R)),
           "round2/sampler/decode_logprobs": np.zeros((B, R))}
    for kind, lp in kind_lp.items():
        vals, ids, tok = _topk_side(lp, tokens, k)
        out.update({f"round1/sampler/decode_{kind}_topk_logprobs": vals,
                    f"round1/sampler/decode_{kind}_topk_ids": ids,
                    f"round1/sampler/decode_{kind}_logprobs": tok})
    return out


@pytest.mark.parametrize("fault", ["topk_mask_leak_raw", "double_temperature_decode"])
def test_planted_sampler_faults_fail_the_topk_rows(tmp_path: Path, fault: str) -> None:
    v, k = 300, 16
    logits, tokens, mask = _case(11, v)
    logits *= 2.0  # peaked: the top-16 hold most of the mass, tv_upper is judged
    ref = _lsm(logits, T)
    control = _lsm(logits + np.random.default_rng(1).normal(0.0, 1e-5, logits.shape), T)
    clean = ref + np.float32(1e-7)  # FP32-level noise of a conforming engine
    bad = clean.copy()
    if fault == "double_temperature_decode":
        bad[:, 1:] = _lsm(logits[:, 1:], T * T)  # decode steps only; position 0 is prefill
    else:  # the sampling top-k (8) applied before the raw logprobs are taken
        kth = np.sort(logits, axis=-1)[..., -8][..., None]
        bad = _lsm(np.where(logits >= kth, logits, -np.inf), T)
    ref_dir = _sealed(tmp_path, ref, tokens, mask, k, control=control)
    faulty = "raw" if fault == "topk_mask_leak_raw" else "tempered"
    for cand, ok in ((clean, True), (bad, False)):
        lps = {"raw": clean, "tempered": clean, faulty: cand}
        rows = distribution_rows(cell=CELL, tensors=_sampler(lps, tokens, k + 4),
                                 ref_dir=ref_dir, mask=mask, responses=tokens)
        mine = [r for r in rows if r.family == f"decode_{faulty}_topk"]
        assert {r.statistic for r in mine} == set(TOPK_STATISTICS)
        assert all(r.verdict == "PASS" for r in rows
                   if r.family.startswith("decode_") and r.family != f"decode_{faulty}_topk")
        failed = {r.statistic for r in mine if r.verdict == "FAIL"}
        if ok:
            assert not failed
            assert "k=16" in mine[0].where
        else:
            assert {"kl_ref_cand_max", "tv_max", "seq_max_kl_mean"} <= failed


def test_missing_or_short_tensors_are_not_run(tmp_path: Path) -> None:
    logits, tokens, mask = _case(4, 300)
    ref = _lsm(logits)
    ref_dir = _sealed(tmp_path, ref, tokens, mask, 16, control=ref)
    for tensors, why in (({}, "(a sampler cell of older code)"),
                         (_sampler({"raw": ref, "tempered": ref}, tokens, 8),
                          "fewer than the sealed top-16")):
        rows = [r for r in distribution_rows(cell=CELL, tensors=tensors, ref_dir=ref_dir,
                                             mask=mask, responses=tokens)
                if r.klass == "sampler_distribution"]
        assert len(rows) == 2 * len(TOPK_STATISTICS)
        assert all(r.verdict == "NOT_RUN" and why in (r.reason or "") for r in rows)


def test_vacuous_upper_bound_is_not_judged(tmp_path: Path) -> None:
    """A tv_upper bound of at least 1 could not fail: no row, its value on the tv row."""
    logits, tokens, mask = _case(6, 300)
    ref = _lsm(0.1 * logits)  # nearly flat: the top-16 miss most of the mass
    ref_dir = _sealed(tmp_path, ref, tokens, mask, 16, control=ref)
    rows = distribution_rows(cell=CELL, tensors=_sampler({"raw": ref, "tempered": ref},
                                                         tokens, 16),
                             ref_dir=ref_dir, mask=mask, responses=tokens)
    stats = {r.statistic for r in rows if r.family == "decode_raw_topk"}
    assert stats == set(TOPK_STATISTICS) - {"tv_upper_max", "tv_upper_mean"}
    tv = next(r for r in rows if r.family == "decode_raw_topk" and r.statistic == "tv_max")
    assert "tv_upper_max not judged" in tv.where
