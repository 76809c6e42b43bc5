"""A BF16 candidate's top-1 ties, resolved at its own logits' precision (issue #48 item 2).

A BF16 engine's logits are BF16 values: two of them at magnitude ~20 differ by a multiple of
the BF16 spacing there (0.125: 8 significant bits in ``[16, 32)``), so a top-1 flip against
the FP32 reference whose own top-2 gap is one or two such spacings is a tie, not a mismatch
(:func:`qualify.distmetrics.tie_resolution`, ``c = 2``), when the candidate recorded its top
raw logit (``round1/actor/prefill_top_logit``, the harness SDK's). Without that tensor
(outputs of older harnesses) the FP32 rule counts it a mismatch, and the row says so. A
gap of three spacings or more is a mismatch either way: the rule can fail.

The candidate is a real BF16 forward of a tiny Qwen3, its tensors formed by the harness
SDK's own :func:`qualify_harness.distribution.distribution_tensors`; the reference is the
same model's FP32 forward, its log-softmax taken here. One position is planted: the FP32
reference prefers token ``a`` (logit 20.0625 against 20.0 for ``c``), the BF16 candidate
prefers ``c`` by ``n`` BF16 spacings (``a`` at 20.0, ``c`` at ``20 + n / 8``), every planted
value exactly representable in BF16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from qualify_harness import distribution as sdk_dist
from safetensors.torch import save_file

from qualify.compare.distribution import trainer_distribution_rows
from qualify.distmetrics import (
    BF16_TIE_RULE,
    BF16_TIE_SPACINGS,
    STATISTICS,
    bf16_spacing,
    distribution_metrics,
    tie_resolution,
    topk_metrics,
    topk_of,
)
from qualify.reference.distribution import FLOORS

KINDS = ("raw", "tempered")
T = 0.9
SPACING_AT_20 = 16 * 2.0 ** -7  # BF16: 8 significant bits, so 2^4 * 2^-7 in [16, 32)
TOPK = 8


@pytest.fixture(scope="module")
def forward() -> dict[str, Any]:
    """A tiny Qwen3's response-window logits ``[B, R, V]`` at BF16 and at FP32, the rollout,
    and the planted position: a valid one where both forwards agree on the top-1 token."""
    from harness_outputs import TINY, tiny_rollout
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      max_position_embeddings=64)
    torch.manual_seed(5)
    model = Qwen3ForCausalLM(cfg).eval()
    roll = tiny_rollout([[1, 5, 6, 7], [1, 8, 9], [1, 10]], (5, 3, 4), 5,
                        torch.Generator().manual_seed(2))
    p, r = roll["prompts"].shape[1], roll["responses"].shape[1]
    ids = torch.cat([roll["prompts"], roll["responses"]], dim=1)
    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        with torch.no_grad():
            out[name] = model.to(dtype)(input_ids=ids, attention_mask=roll["attention_mask"],
                                        position_ids=roll["position_ids"]
                                        ).logits[:, p - 1:p + r - 1]
    assert out["bf16"].dtype == torch.bfloat16  # the engine's compute dtype
    mask = roll["response_mask"].bool()
    agree = mask & (out["bf16"].float().argmax(-1) == out["fp32"].argmax(-1))
    b, t = (int(i) for i in torch.nonzero(agree)[1])
    order = torch.argsort(out["fp32"][b, t], descending=True)
    assert float(out["fp32"].abs().max()) < 16  # the planted pair leads by far
    return {**out, "roll": roll, "mask": mask, "at": (b, t),
            "a": int(order[0]), "c": int(order[1])}


def _planted(f: dict[str, Any], n: int) -> dict[str, Any]:
    """The candidate's SDK tensors and the reference's logprobs with the pair planted
    (``n < 0``: the candidate prefers ``a`` too, no flip)."""
    b, t = f["at"]
    cand, ref = f["bf16"].clone(), f["fp32"].clone()
    ref[b, t, f["a"]], ref[b, t, f["c"]] = 20.0625, 20.0
    cand[b, t, f["a"]], cand[b, t, f["c"]] = 20.0, 20.0 + n * SPACING_AT_20
    assert float(cand[b, t, f["c"]]) == 20.0 + n / 8  # exactly representable: no rounding
    assert int(cand[b, t].float().argmax()) == f["c" if n > 0 else "a"]
    assert int(ref[b, t].argmax()) == f["a"]
    responses = f["roll"]["responses"]
    got = sdk_dist.distribution_tensors(cand, responses, f["mask"], temperature=T, k=TOPK,
                                        topk=False)
    top = sdk_dist.distribution_tensors(cand, responses, f["mask"], temperature=T, k=TOPK,
                                        topk=True)
    ref_lp = {kind: torch.where(f["mask"][..., None], torch.log_softmax(
        ref.double() / (1.0 if kind == "raw" else T), dim=-1).float(), 0.0).numpy()
        for kind in KINDS}
    return {"full": {k: v.numpy() for k, v in got.items()},
            "topk": {k: v.numpy() for k, v in top.items()}, "ref": ref_lp}


def _state(got: dict[str, Any], at: tuple[int, int]) -> str:
    """The top-1 state (agree / mismatch / tie) at position ``at`` of a metrics result."""
    (seq,) = [s for s in got["sequences"] if s["b"] == at[0]]
    return str(seq["top1"][seq["t"].index(at[1])])


def _full(f: dict[str, Any], p: dict[str, Any], kind: str, top_logit: bool) -> dict[str, Any]:
    return distribution_metrics(
        p["full"][f"prefill_{kind}"], p["ref"][kind], f["roll"]["responses"].numpy(),
        f["mask"].numpy(), clip_ratio=0.2, worst_sequences=len(f["mask"]), precision="bf16",
        top_logit=p["full"]["prefill_top_logit"] if top_logit else None,
        temperature=1.0 if kind == "raw" else T)


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_a_bf16_near_tie_flip_is_a_tie_at_its_own_logit_magnitude(
        forward: dict[str, Any], kind: str, n: int) -> None:
    """Gaps of 1 and 2 BF16 spacings at |logit| ~ 20: ties with the top logit recorded,
    mismatches without it (the FP32 rule); 3 and 8 spacings: mismatches either way. The full
    and the top-k path agree."""
    f = forward
    p = _planted(f, n)
    assert float(p["full"]["prefill_top_logit"][f["at"]]) == 20.0 + n / 8
    tie = n <= BF16_TIE_SPACINGS
    with_top, without = _full(f, p, kind, True), _full(f, p, kind, False)
    assert _state(with_top, f["at"]) == ("tie" if tie else "mismatch")
    assert _state(without, f["at"]) == "mismatch"
    # the candidate's resolution there, derived by hand: 2 spacings of 0.125 (over T when
    # tempered) plus the FP32 rule's 4 FP32 spacings at the top logprob (|lp| < 1 here)
    lp = p["full"][f"prefill_{kind}"][f["at"]]
    div = 1.0 if kind == "raw" else T
    want = 2 * 0.125 / div + 4 * 2.0 ** -23
    got = tie_resolution([lp.max()], precision="bf16",
                         top_logit=[20.0 + n / 8], temperature=div)
    assert abs(float(lp.max())) < 1
    assert float(got[0]) == pytest.approx(want, rel=1e-12)
    gap = float(np.sort(lp)[-1] - np.sort(lp)[-2])
    assert gap == pytest.approx(n * 0.125 / div, rel=1e-5)
    # the top-k path, from the SDK's top-k tensors and the reference's own top-k
    ids = topk_of(p["ref"][kind], TOPK)
    for top_logit, state in ((True, "tie" if tie else "mismatch"), (False, "mismatch")):
        tk = topk_metrics(
            p["topk"][f"prefill_{kind}_topk_logprobs"], p["topk"][f"prefill_{kind}_topk_ids"],
            ids[0], ids[1], cand_token=p["topk"][f"prefill_{kind}_logprobs"],
            ref_token=np.take_along_axis(p["ref"][kind], f["roll"]["responses"].numpy()[..., None],
                                         axis=-1)[..., 0],
            mask=f["mask"].numpy(), clip_ratio=0.2, worst_sequences=len(f["mask"]),
            precision="bf16", top_logit=p["topk"]["prefill_top_logit"] if top_logit else None,
            temperature=div)
        assert _state(tk, f["at"]) == state, (top_logit, n)


def _sealed(tmp: Path, ref: dict[str, np.ndarray], top1_bound: dict[str, float], *,
            bf16_rule: bool = True) -> Path:
    """A minimal sealed-reference stand-in (``distribution.{json,safetensors}``): loose
    ceilings, except ``top1_mismatch``'s BF16 one, ``top1_bound`` per kind; its BF16
    controls counted at BF16 resolution (``bf16_rule``) or, as older code did, by the FP32
    rule (no ``bf16_controls_ties``)."""
    tmp.mkdir(parents=True, exist_ok=True)
    def bounds(kind: str, bf16: bool) -> dict[str, Any]:
        return {s: {"bound": (top1_bound[kind] if bf16 and s == "top1_mismatch" else 1e6),
                    "control": "bf16" if bf16 else "decode", "control_error": 0.0, "k": 4.0,
                    "floor": FLOORS[s]} for s in STATISTICS}
    doc = {"clip_ratio": 0.2, "temperature": T,
           **({"bf16_controls_ties": BF16_TIE_RULE} if bf16_rule else {}),
           **{kind: {"bounds": bounds(kind, False), "bounds_bf16": bounds(kind, True)}
              for kind in KINDS}}
    (tmp / "distribution.json").write_text(json.dumps(doc))
    save_file({k: torch.from_numpy(v) for k, v in ref.items()},
              str(tmp / "distribution.safetensors"))
    return tmp


def test_the_trainer_rows_count_by_the_cell_precision_and_its_top_logit(
        forward: dict[str, Any], tmp_path: Path) -> None:
    """Through :func:`trainer_distribution_rows`: a BF16 cell with the planted one-spacing
    flip passes a ``top1_mismatch`` ceiling of the unplanted cell's own count when it
    recorded its top logit, and fails it without (the row says the FP32 rule counted); an
    eight-spacing flip fails it with the top logit too; an FP32 cell, and a BF16 cell of a
    report sealed before the ``bf16_ties`` section, are counted by the FP32 rule whatever
    they recorded, with the ``where`` of those reports."""
    f = forward
    mask, responses = f["mask"].numpy(), f["roll"]["responses"].numpy()
    clean = _planted(f, -1)  # no flip at the planted position
    base = {kind: float(_full(f, clean, kind, True)["top1_mismatch"]) for kind in KINDS}
    base32 = {kind: float(_full(f, clean, kind, False)["top1_mismatch"]) for kind in KINDS}
    ref_dir = _sealed(tmp_path, _planted(f, 1)["ref"], base)

    old_ref = _sealed(tmp_path / "old", _planted(f, 1)["ref"], base, bf16_rule=False)

    def rows(n: int, top_logit: bool, precision: str = "bf16", *,
             bf16_ties: bool = True, ref: Path = ref_dir) -> dict[str, Any]:
        t = _planted(f, n)["full"]
        tensors = {f"round1/actor/{k}": v for k, v in t.items()
                   if top_logit or k != "prefill_top_logit"}
        got = trainer_distribution_rows(cell=f"c-{precision}", precision=precision,
                                        tensors=tensors, ref_dir=ref, mask=mask,
                                        responses=responses, bf16_ties=bf16_ties)
        return {r.family: r for r in got if r.statistic == "top1_mismatch"}

    for kind in KINDS:
        fam = f"prefill_{kind}"
        ok, old, far = rows(1, True)[fam], rows(1, False)[fam], rows(8, True)[fam]
        assert (ok.verdict, ok.error) == ("PASS", base[kind])
        # two spacings: a tie only with the resolution divided by the kind's temperature
        # (the tempered gap is the raw gap / T, above 2 spacings when T < 1)
        two = rows(2, True)[fam]
        assert (two.verdict, two.error) == ("PASS", base[kind])
        assert "ties within 2 BF16 spacings of the top logit" in ok.where
        assert (old.verdict, old.error) == ("FAIL", base32[kind] + 1)
        assert "ties by the FP32 rule (no round1/actor/prefill_top_logit)" in old.where
        assert (far.verdict, far.error) == ("FAIL", base[kind] + 1)
        # a reference whose BF16 controls were counted by the FP32 rule: so is the cell
        older = rows(1, True, ref=old_ref)[fam]
        assert (older.verdict, older.error) == ("FAIL", base32[kind] + 1)
        assert "ties by the FP32 rule (the reference's BF16 controls were counted" in older.where
        sealed = rows(1, True, bf16_ties=False)[fam]  # a report sealed before bf16_ties
        assert (sealed.verdict, sealed.error) == ("FAIL", base32[kind] + 1)
        assert "BF16" not in sealed.where
        assert "FP32 rule" not in sealed.where
        fp32 = rows(1, True, "fp32")[fam]  # FP32 ceilings (loose here): counted, FP32 rule
        assert fp32.error == base32[kind] + 1
        assert "ties" in fp32.where
        assert "BF16" not in fp32.where
        assert "FP32 rule" not in fp32.where


@settings(max_examples=200, deadline=None)
@given(x=st.floats(-1e30, 1e30, allow_nan=False))
def test_bf16_spacing_is_the_gap_to_the_next_bf16_number(x: float) -> None:
    """Derived from torch's BF16: the distance from ``|x|`` rounded down to BF16 to the next
    BF16 number up (``|x|`` below 1 taken as 1)."""
    a = max(abs(x), 1.0)
    lo = torch.tensor(a, dtype=torch.float64).to(torch.bfloat16)
    if float(lo) > a:  # rounded up: the BF16 number below a
        lo = torch.nextafter(lo, torch.tensor(0.0, dtype=torch.bfloat16))
    up = torch.nextafter(lo, torch.tensor(float("inf"), dtype=torch.bfloat16))
    assert float(bf16_spacing(x)) == float(up) - float(lo)


@settings(max_examples=200, deadline=None)
@given(top=st.floats(-60.0, 0.0), z1=st.floats(-1e4, 1e4), z2=st.floats(-1e4, 1e4),
       t=st.floats(0.05, 4.0))
def test_the_bf16_resolution_is_at_least_the_fp32_one_and_grows_with_the_logit(
        top: float, z1: float, z2: float, t: float) -> None:
    """Never below the FP32 rule, non-decreasing in ``|top logit|`` (a negative one at least
    its positive twin's), ``c`` spacings over ``T`` above it; without a top logit (or at
    FP32) it is the FP32 rule."""
    fp32 = tie_resolution([top])
    assert np.array_equal(tie_resolution([top], precision="bf16"), fp32)
    assert np.array_equal(tie_resolution([top], top_logit=[z1], temperature=t), fp32)
    lo, hi = sorted((abs(z1), abs(z2)))
    r_lo, r_hi, r_neg_hi = (float(tie_resolution([top], precision="bf16", top_logit=[z],
                                                 temperature=t)[0]) for z in (lo, hi, -hi))
    assert r_lo >= float(fp32[0])
    assert r_lo <= r_hi <= r_neg_hi
    assert r_lo - float(fp32[0]) == pytest.approx(2 * float(bf16_spacing(lo)) / t, rel=1e-9)


def test_a_negative_top_logit_takes_the_runner_ups_spacing() -> None:
    """Below 0 the runner-up is farther from 0 than the top logit: at ``z = -(2 - 2^-7)``
    (spacing ``2^-7``) a runner-up two such spacings below sits in ``[2, 4)`` (spacing
    ``2^-6``), so the resolution is 2 of those; above 0 it stays the top logit's."""
    fp32 = float(tie_resolution([-0.5])[0])
    z = -(2 - 2.0 ** -7)
    assert float(torch.tensor(z).bfloat16()) == z
    got = float(tie_resolution([-0.5], precision="bf16", top_logit=[z])[0])
    assert got - fp32 == pytest.approx(2 * 2.0 ** -6, rel=1e-12)
    got = float(tie_resolution([-0.5], precision="bf16", top_logit=[-z])[0])
    assert got - fp32 == pytest.approx(2 * 2.0 ** -7, rel=1e-12)


def test_bad_tie_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="precision 'fp16'"):
        tie_resolution([0.0], precision="fp16")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        tie_resolution([0.0], precision="bf16", top_logit=[1.0], temperature=0.0)
    with pytest.raises(ValueError, match="top_logit has shape"):
        tie_resolution([0.0, 0.0], precision="bf16", top_logit=[1.0])
    lp = np.log(np.full((1, 2, 3), 1 / 3))
    with pytest.raises(ValueError, match=r"expected the mask's \(1, 2\)"):
        distribution_metrics(lp, lp, np.zeros((1, 2)), np.ones((1, 2)), clip_ratio=0.2,
                             precision="bf16", top_logit=np.zeros((1, 3)))
