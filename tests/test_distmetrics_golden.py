"""qualify.distmetrics pinned bitwise, and checked against a scalar computation of its
module docstring written here (Python loops over positions, ``math``), not by the code
under test.

The pin (``tests/fixtures/distmetrics_golden.json``, provenance inside) holds every output of
both paths, in order, for one seeded case with a masked position, a planted near-tie, a far
position and an excluded token: a change of any bit, of a key or of the key order fails.
The per-position ``sequences`` records (the worst sequences the report's plot draws) are
checked against the same scalar computation, and their aggregates against the statistics.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qualify.distmetrics import (
    NORM_RESOLUTION,
    STATISTICS,
    TIE_ULPS,
    TOPK,
    TOPK_STATISTICS,
    distribution_metrics,
    topk_metrics,
    topk_of,
)

GOLDEN = Path(__file__).parent / "fixtures" / "distmetrics_golden.json"
B, R, V = 3, 5, 12
CLIP = {"full": 0.2, "full_inf": 0.28, "topk6": 0.2, "topk12": 0.2}


def _lsm(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    top = x.max(-1, keepdims=True)
    return (x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))).astype(np.float32)


def _inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """FP32 logprobs ``cand``, ``ref`` ``[B, R, V]``, tokens and mask ``[B, R]``."""
    g = np.random.default_rng(20261206)
    logits = g.normal(0.0, 3.0, (B, R, V))
    tokens = g.integers(0, V, (B, R))
    mask = np.ones((B, R), dtype=np.int64)
    mask[1, 3:] = 0
    ref = _lsm(logits)
    cand = _lsm(logits + g.normal(0.0, 0.2, logits.shape))
    cand[2, 4] = _lsm(g.normal(0.0, 3.0, V))  # one far position
    # a near tie at (0, 1): the candidate's top two within its FP32 resolution, order swapped
    o = np.argsort(-ref[0, 1], kind="stable")
    cand[0, 1] = ref[0, 1]
    cand[0, 1, o[1]] = cand[0, 1, o[0]]
    a = np.float32(max(abs(float(cand[0, 1, o[0]])), 1.0))
    cand[0, 1, o[0]] -= np.float32(TIE_ULPS * float(np.spacing(a)) / 2)
    return cand, ref, tokens, mask


def _topk_args(cand: np.ndarray, ref: np.ndarray, tokens: np.ndarray, k: int
               ) -> tuple[Any, ...]:
    cv, ci = topk_of(cand, k)
    rv, ri = topk_of(ref, k)
    ct = np.take_along_axis(cand, tokens[..., None], -1)[..., 0]
    rt = np.take_along_axis(ref, tokens[..., None], -1)[..., 0]
    return cv, ci, rv, ri, ct, rt


def _results(worst_sequences: int = 0) -> dict[str, dict[str, Any]]:
    cand, ref, tokens, mask = _inputs()
    out = {"full": distribution_metrics(cand, ref, tokens, mask, clip_ratio=CLIP["full"],
                                        worst_sequences=worst_sequences)}
    inf = cand.copy()
    inf[0, 2, 3] = -np.inf  # the candidate excludes a token the reference keeps
    out["full_inf"] = distribution_metrics(inf, ref, tokens, mask, clip_ratio=CLIP["full_inf"],
                                           worst_sequences=worst_sequences)
    for k in (6, V):
        cv, ci, rv, ri, ct, rt = _topk_args(cand, ref, tokens, k)
        out[f"topk{k}"] = topk_metrics(cv, ci, rv, ri, cand_token=ct, ref_token=rt, mask=mask,
                                       clip_ratio=CLIP[f"topk{k}"],
                                       worst_sequences=worst_sequences)
    return out


def _hex(v: Any) -> Any:
    if isinstance(v, float):
        return v.hex()
    if isinstance(v, list):
        return [_hex(x) for x in v]
    return v


def test_outputs_are_the_pinned_values() -> None:
    """Every output of both paths, bit for bit and key for key, as before the shared helper."""
    want = json.loads(GOLDEN.read_text())["cases"]
    got = {n: [[k, _hex(v)] for k, v in d.items()] for n, d in _results().items()}
    assert got == want


# ------------------------------------------------------------- the scalar computation


def _norm(row: list[float]) -> list[float]:
    """A row of logprobs renormalised in FP64 (``-inf`` kept)."""
    top = max(row)
    lse = top + math.log(math.fsum(math.exp(x - top) for x in row if x != -math.inf))
    return [x - lse for x in row]


def _kl(a: list[float], b: list[float]) -> float:
    """``KL(exp a || exp b)``, ``0 log 0 = 0``, ``inf`` where ``b`` excludes ``a``'s mass."""
    terms = []
    for x, y in zip(a, b, strict=True):
        if x == -math.inf:
            continue
        if y == -math.inf:
            return math.inf
        terms.append(math.exp(x) * (x - y))
    return math.fsum(terms)


def _order(vals: list[float], ids: list[int]) -> list[int]:
    """Positions of ``vals`` by (-value, id)."""
    return sorted(range(len(vals)), key=lambda j: (-vals[j], ids[j]))


def _is_tie(top: float, second: float) -> bool:
    a = np.float32(max(abs(top), 1.0))
    return top - second <= TIE_ULPS * float(np.spacing(a))


def _ratio_tails(lq_y: float, lp_y: float, clip: float) -> tuple[bool, bool]:
    lr = lq_y - lp_y
    r = math.exp(lr) if lr < 700 else math.inf
    return not abs(lr) <= math.log(2.0), not 1.0 - clip <= r <= 1.0 + clip


def _scalar_full(cand: np.ndarray, ref: np.ndarray, tokens: np.ndarray, mask: np.ndarray,
                 clip: float) -> list[dict[str, Any]]:
    """Per valid position (row-major): the module docstring's full-path quantities."""
    out = []
    for b, t in zip(*np.nonzero(mask), strict=True):
        lq, lp = _norm(cand[b, t].tolist()), _norm(ref[b, t].tolist())
        ids = list(range(V))
        oq, op = _order(lq, ids), _order(lp, ids)
        y = int(tokens[b, t])
        differ = oq[0] != op[0]
        out.append({"b": int(b), "t": int(t), "kl_rc": _kl(lp, lq), "kl_cr": _kl(lq, lp),
                    "tv": 0.5 * math.fsum(abs(math.exp(x) - math.exp(z))
                                          for x, z in zip(lp, lq, strict=True)),
                    "differ": differ, "tie": differ and _is_tie(lq[oq[0]], lq[oq[1]]),
                    "agree": len(set(oq[:TOPK]) & set(op[:TOPK])) / TOPK,
                    "ratio": _ratio_tails(lq[y], lp[y], clip)})
    return out


def _scalar_topk(cand: np.ndarray, ref: np.ndarray, tokens: np.ndarray, mask: np.ndarray,
                 k: int, clip: float) -> list[dict[str, Any]]:
    """Per valid position: the module docstring's top-k path (lumped tail) quantities."""
    cv, ci, rv, ri, ct, rt = _topk_args(cand, ref, tokens, k)
    tau = k * 2.0 ** -24
    out = []
    for b, t in zip(*np.nonzero(mask), strict=True):
        q = dict(zip(ci[b, t].tolist(), (float(x) for x in cv[b, t]), strict=True))
        p = dict(zip(ri[b, t].tolist(), (float(x) for x in rv[b, t]), strict=True))
        shared = sorted(set(q) & set(p))
        p_i = math.fsum(math.exp(p[j]) for j in shared)
        q_i = math.fsum(math.exp(q[j]) for j in shared)
        bp_raw, bq_raw = max(1.0 - p_i, 0.0), max(1.0 - q_i, 0.0)
        rho = tau + NORM_RESOLUTION * max(p_i, q_i)
        gap = bq_raw - bp_raw
        bq = bp_raw + math.copysign(max(abs(gap) - rho, 0.0), gap) if gap else bp_raw
        bp = bp_raw
        drop = bp <= tau and bq <= tau
        bp, bq = (0.0, 0.0) if drop else (max(bp, tau), max(bq, tau))
        zp, zq = p_i + bp, q_i + bq
        lpp = [p[j] - math.log(zp) for j in shared]
        lqq = [q[j] - math.log(zq) for j in shared]
        lbp = math.log(bp / zp) if bp > 0 else -math.inf
        lbq = math.log(bq / zq) if bq > 0 else -math.inf
        sh = math.fsum(abs(math.exp(x) - math.exp(z)) for x, z in zip(lpp, lqq, strict=True))
        up = 0.0 if drop else (bp_raw + rho) / zp + (bq_raw + rho) / zq
        oq = _order(list(q.values()), list(q))
        op = _order(list(p.values()), list(p))
        top_q = [list(q)[j] for j in oq]
        top_p = [list(p)[j] for j in op]
        qs = [q[j] for j in top_q]
        differ = top_q[0] != top_p[0]
        out.append({"b": int(b), "t": int(t), "kl_rc": _kl([*lpp, lbp], [*lqq, lbq]),
                    "kl_cr": _kl([*lqq, lbq], [*lpp, lbp]),
                    "tv": 0.5 * (sh + abs(math.exp(lbp) - math.exp(lbq))),
                    "tv_up": 0.5 * (sh + up), "differ": differ,
                    "tie": differ and _is_tie(qs[0], qs[1]),
                    "agree": len(set(top_q[:TOPK]) & set(top_p[:TOPK])) / TOPK,
                    "set": len(shared) / k,
                    "ratio": _ratio_tails(float(ct[b, t]), float(rt[b, t]), clip),
                    "miss_r": max(1.0 - math.fsum(math.exp(x) for x in p.values()), 0.0),
                    "miss_c": max(1.0 - math.fsum(math.exp(x) for x in q.values()), 0.0)})
    return out


def _close(got: float, want: float) -> bool:
    if math.isinf(want):
        return got == want
    return got == pytest.approx(want, rel=1e-10, abs=1e-15)


def _seq_max(pos: list[dict[str, Any]]) -> dict[int, float]:
    out: dict[int, float] = {}
    for x in pos:
        out[x["b"]] = max(out.get(x["b"], -math.inf), x["kl_rc"])
    return out


def _check(got: dict[str, Any], pos: list[dict[str, Any]]) -> None:
    """The statistics of ``got`` against the per-position scalar values ``pos``."""
    n = len(pos)

    def mean(key: str) -> float:
        return math.fsum(x[key] for x in pos) / n

    seq = _seq_max(pos)
    want = {"kl_ref_cand_max": max(x["kl_rc"] for x in pos), "kl_ref_cand_mean": mean("kl_rc"),
            "kl_cand_ref_max": max(x["kl_cr"] for x in pos), "kl_cand_ref_mean": mean("kl_cr"),
            "tv_max": max(x["tv"] for x in pos), "tv_mean": mean("tv"),
            "top1_mismatch": float(sum(x["differ"] and not x["tie"] for x in pos)),
            "topk_disagreement_mean": 1.0 - mean("agree"),
            "ratio_outside_2": sum(x["ratio"][0] for x in pos) / n,
            "ratio_outside_clip": sum(x["ratio"][1] for x in pos) / n,
            "seq_max_kl_mean": math.fsum(seq.values()) / len(seq)}
    for s in STATISTICS:
        assert _close(got[s], want[s]), (s, got[s], want[s])
    worst = max(pos, key=lambda x: x["kl_rc"])
    assert got["worst"] == f"({worst['b']}, {worst['t']})"
    assert (got["n_valid"], got["top1_ties"]) == (n, sum(x["tie"] for x in pos))
    assert all(_close(a, w) for a, w in zip(got["seq_max_kl"], seq.values(), strict=True))


def test_statistics_are_the_docstring_computed_independently() -> None:
    """Both paths (full, full with an excluded token, lumped k = 6, k = V) against the scalar
    computation: every statistic, ``worst``, ties, per-sequence maxima, and the top-k path's
    own (upper TV, set disagreement, missing masses)."""
    cand, ref, tokens, mask = _inputs()
    got = _results()
    pos = _scalar_full(cand, ref, tokens, mask, CLIP["full"])
    assert sum(x["tie"] for x in pos) == 1
    assert sum(x["differ"] for x in pos) == 2
    _check(got["full"], pos)
    inf = cand.copy()
    inf[0, 2, 3] = -np.inf
    _check(got["full_inf"], _scalar_full(inf, ref, tokens, mask, CLIP["full_inf"]))
    assert got["full_inf"]["kl_ref_cand_max"] == math.inf
    for k in (6, V):
        pos = _scalar_topk(cand, ref, tokens, mask, k, CLIP[f"topk{k}"])
        g = got[f"topk{k}"]
        _check(g, pos)
        n = len(pos)
        want = {"tv_upper_max": max(x["tv_up"] for x in pos),
                "tv_upper_mean": math.fsum(x["tv_up"] for x in pos) / n,
                "topk_set_disagreement_mean": 1.0 - math.fsum(x["set"] for x in pos) / n,
                "missing_ref_max": max(x["miss_r"] for x in pos),
                "missing_cand_max": max(x["miss_c"] for x in pos)}
        for s, w in want.items():
            assert _close(g[s], w), (k, s, g[s], w)
        assert set(g) >= set(TOPK_STATISTICS)
    assert got["topk6"]["kl_ref_cand_max"] < got["full"]["kl_ref_cand_max"]  # lumped: lower


@pytest.mark.parametrize("case", ["full", "topk6"])
def test_worst_sequences_are_the_per_position_values(case: str) -> None:
    """``sequences``: the worst sequences by largest token KL, each position's KL both ways,
    top-1 state (the planted near-tie a tie) and top-k agreement, as the scalar computation
    gives them; and asking for them changes no other output."""
    cand, ref, tokens, mask = _inputs()
    pos = (_scalar_full(cand, ref, tokens, mask, 0.2) if case == "full"
           else _scalar_topk(cand, ref, tokens, mask, 6, 0.2))
    got = _results(worst_sequences=3)[case]
    plain = _results()[case]
    assert {k: v for k, v in got.items() if k != "sequences"} == plain
    seq = _seq_max(pos)
    order = sorted(seq, key=lambda b: (-seq[b], b))
    assert [s["b"] for s in got["sequences"]] == order == [2, 1, 0]
    for s in got["sequences"]:
        mine = [x for x in pos if x["b"] == s["b"]]
        assert s["t"] == [x["t"] for x in mine]
        for key, ref_key in (("kl_ref_cand", "kl_rc"), ("kl_cand_ref", "kl_cr"),
                             ("topk_agreement", "agree")):
            assert all(_close(a, x[ref_key]) for a, x in zip(s[key], mine, strict=True)), key
        assert s["top1"] == ["tie" if x["tie"] else "mismatch" if x["differ"] else "agree"
                             for x in mine]
    assert got["sequences"][2]["top1"][1] == "tie"  # the planted near-tie at (0, 1)
    assert max(got["sequences"][0]["kl_ref_cand"]) == got["kl_ref_cand_max"]
    assert _results(worst_sequences=1)[case]["sequences"] == got["sequences"][:1]
