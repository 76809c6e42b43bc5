"""Which clip branch a token took (qualify/branches.py), by hand from PPO's losses.

Value loss ``max((v - R)^2, (v_old + clip(v - v_old, -e, e) - R)^2)``: outside the clip
range the clipped term has zero gradient and wins exactly when ``v`` is nearer the return
than the clip edge is. Surrogate ``max(-A r, -A clip(r, 1 - e, 1 + e))``: with ``A > 0`` the
clipped term wins above ``1 + e``, with ``A < 0`` below ``1 - e`` (Schulman et al. 2017).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qualify import branches
from qualify.contract import Contract, OptimizerSpec

EPS_V = 0.2


def test_critic_full_gradient_by_hand() -> None:
    old = np.zeros((1, 6))
    v = np.array([[0.19, 0.21, 0.25, -0.25, 0.25, 1.9]])
    ret = np.array([[1.0, 1.0, -1.0, -1.0, 0.3, 1.0]])
    full = branches.critic_full_gradient(old, v, ret, EPS_V)
    # 0 inside; 1 outside towards R (zero); 2 outside away from R (full);
    # 3 outside towards R=-1 (zero); 4 outside, nearer R than the edge is (zero);
    # 5 past the mirror point 2R - e = 1.8: the unclipped term wins again (full)
    assert full.tolist() == [[True, False, True, False, False, True]]


def test_actor_full_gradient_by_hand() -> None:
    lr = np.log(np.array([[1.19, 1.21, 1.21, 0.79, 0.79, 1.5]]))
    adv = np.array([[1.0, 1.0, -1.0, -1.0, 1.0, 0.0]])
    full = branches.actor_full_gradient(np.zeros((1, 6)), lr, adv, 0.2)
    assert full.tolist() == [[True, False, True, False, True, True]]


@settings(max_examples=80, deadline=None)
@given(d=st.floats(-0.6, 0.6), ret=st.floats(-2.0, 2.0))
def test_critic_branch_matches_autograd(d: float, ret: float) -> None:
    """``full`` iff torch's autograd of the clipped value loss gives the full gradient."""
    v = torch.tensor(d, dtype=torch.float64, requires_grad=True)
    clipped = torch.clamp(v, -EPS_V, EPS_V)
    torch.maximum((v - ret) ** 2, (clipped - ret) ** 2).backward()
    assert v.grad is not None
    full_grad = 2 * (d - ret)
    full = bool(branches.critic_full_gradient(np.zeros((1, 1)), np.array([[d]]),
                                              np.array([[ret]]), EPS_V)[0, 0])
    if abs(abs(d) - EPS_V) > 1e-9 and abs((clipped.item() - ret) ** 2 - (d - ret) ** 2) > 1e-9:
        if full:
            assert float(v.grad) == full_grad or math.isclose(float(v.grad), full_grad)
        else:
            assert float(v.grad) == 0.0


def test_flipped_tokens_lists_only_valid_flips() -> None:
    old = np.zeros((2, 3), np.float32)
    exp = {"round1/critic/values": old, "round2/critic/values":
           np.array([[0.049, 0.0, 0.049], [0.0, 0.0, 0.0]], np.float32)}
    got = {"round1/critic/values": old, "round2/critic/values":
           np.array([[0.051, 0.0, 0.051], [0.0, 0.0, 0.0]], np.float32)}
    train = {"returns": np.ones((2, 3), np.float32), "advantages": np.zeros((2, 3))}
    mask = np.array([[1, 1, 0], [1, 1, 1]])  # (0, 2) flips too, but is padding
    flips = branches.flipped_tokens(got, exp, role="critic", round_=2, train=train, mask=mask,
                                    value_clip=0.05, clip_ratio=0.2)
    assert flips is not None
    assert [(f["index"], f["obtained"], f["expected"]) for f in flips] == [([0, 0], "zero",
                                                                           "full")]
    assert flips[0]["obtained_x"] == np.float32(0.051)
    text = branches.explain(flips, role="critic", round_=2)
    assert text.startswith("clip branch differs at 1 round-2 critic token(s)")
    assert "(0, 0) zero vs full (v_r - v_old 0.051 vs 0.049)" in text
    assert branches.explain([], role="critic", round_=2) == ""
    # round 1 has no clipping; a missing tensor gives None
    assert branches.flipped_tokens(got, exp, role="critic", round_=1, train=train, mask=mask,
                                   value_clip=0.05, clip_ratio=0.2) is None
    assert branches.flipped_tokens({}, exp, role="critic", round_=2, train=train, mask=mask,
                                   value_clip=0.05, clip_ratio=0.2) is None


# --------------------------------------------------------------------------- sealed flips


def test_ambiguous_tokens_by_hand() -> None:
    """Critic: the clip edge (|d| = 0.2) within the box, or the mirror point 2R - e, makes
    a token ambiguous; a token well inside or well past is not. Actor: only the edge the
    advantage's sign uses counts."""
    old = np.zeros((1, 5))
    v = np.array([[0.199, 0.10, 0.3, 1.801, -0.201]])
    ret = np.array([[1.0, 1.0, 1.0, 1.0, -1.0]])
    got = branches.ambiguous_tokens(
        role="critic", old=old, cur=v, train={"returns": ret}, mask=np.ones((1, 5)),
        tol_old=1e-3, tol_cur=1e-3, value_clip=EPS_V, clip_ratio=0.2)
    assert got == [(0, 0), (0, 3), (0, 4)]
    x = np.log(np.array([[1.2005, 1.2005, 0.7995, 1.1, 0.7995]]))
    adv = np.array([[1.0, -1.0, -1.0, 1.0, 1.0]])
    got = branches.ambiguous_tokens(
        role="actor", old=np.zeros((1, 5)), cur=x, train={"advantages": adv},
        mask=np.array([[1, 1, 1, 1, 0]]), tol_old=1e-3, tol_cur=1e-3, value_clip=EPS_V,
        clip_ratio=0.2)
    assert got == [(0, 0), (0, 2)]


def test_contribution_scale_by_hand() -> None:
    run = {"round1/actor/logprobs": np.array([[-1.0]]),
           "round2/actor/logprobs": np.array([[-0.9]]),
           "round2/critic/values": np.array([[0.7]])}
    train = {"advantages": np.array([[2.0]]), "returns": np.array([[0.2]])}
    a = branches.contribution_scale(run, role="actor", round_=2, b=0, t=0, train=train,
                                    n_valid=4.0)
    assert a == pytest.approx(-2.0 * math.exp(0.1) / 4.0)
    c = branches.contribution_scale(run, role="critic", round_=2, b=0, t=0, train=train,
                                    n_valid=4.0)
    assert c == pytest.approx(0.5 / 4.0)


def _critic_two_rounds(x: torch.Tensor, ret: torch.Tensor, old_shift: torch.Tensor, *,
                       clip: float, max_norm: float, lr: float) -> dict[str, np.ndarray]:
    """A linear critic ``V = x w + b`` trained two rounds by torch (FP64): unclipped round
    1, clipped value loss in round 2 around the round-1 values plus ``old_shift``; global
    norm clipping and ``torch.optim.AdamW``. Returns protocol-named tensors."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(x.shape[-1], dtype=torch.float64) * 0.3)
    b = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
    opt = torch.optim.AdamW([w, b], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            foreach=False)
    n = ret.numel()
    out: dict[str, np.ndarray] = {}
    old = torch.zeros_like(ret)
    for rnd in (1, 2):
        v = x @ w + b
        if rnd == 1:
            old = v.detach() + old_shift
            loss = 0.5 * ((v - ret) ** 2).sum() / n
        else:
            vc = old + torch.clamp(v - old, -clip, clip)
            loss = 0.5 * torch.maximum((v - ret) ** 2, (vc - ret) ** 2).sum() / n
        loss.backward()
        out[f"round{rnd}/critic/values"] = (old if rnd == 1 else v.detach()).numpy().copy()
        for name, p in (("w", w), ("b", b)):
            assert p.grad is not None
            out[f"round{rnd}/critic/grads/{name}"] = p.grad.numpy().copy()
        before = {"w": w.detach().clone(), "b": b.detach().clone()}
        norm = float(torch.nn.utils.clip_grad_norm_([w, b], max_norm))
        out[f"round{rnd}/critic/grad_norm"] = np.asarray(norm)
        out[f"round{rnd}/critic/clip_coef"] = np.asarray(min(1.0, max_norm / (norm + 1e-6)))
        opt.step()
        opt.zero_grad()
        for name, p in (("w", w), ("b", b)):
            st_ = opt.state[p]
            out[f"round{rnd}/critic/exp_avg/{name}"] = st_["exp_avg"].numpy().copy()
            out[f"round{rnd}/critic/exp_avg_sq/{name}"] = st_["exp_avg_sq"].numpy().copy()
            out[f"round{rnd}/critic/updates/{name}"] = (p.detach() - before[name]).numpy()
    return out


def test_adjusted_expected_equals_the_run_on_the_other_branch() -> None:
    """Two torch runs that differ only in one token's round-2 clip centre, which puts it on
    the other branch: the first run moved by that token's ``J_t = dV_t/dθ`` reproduces the
    second's round-2 gradients, norm, clip coefficient, AdamW moments and update."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    ret = torch.randn(2, 3, generator=g, dtype=torch.float64)
    lr, clip = 0.05, 0.04
    first = _critic_two_rounds(x, ret, torch.zeros(2, 3), clip=clip, max_norm=0.1, lr=lr)
    d = first["round2/critic/values"] - first["round1/critic/values"]
    full = branches.critic_full_gradient(first["round1/critic/values"],
                                         first["round2/critic/values"], ret.numpy(), clip)
    zero = np.argwhere(~full)
    assert len(zero) > 0, d
    bt, tt = (int(i) for i in zero[0])
    shift = torch.zeros(2, 3, dtype=torch.float64)
    shift[bt, tt] = float(d[bt, tt]) - np.sign(d[bt, tt]) * clip * 0.5  # inside: full branch
    second = _critic_two_rounds(x, ret, shift, clip=clip, max_norm=0.1, lr=lr)
    train = {"returns": ret.numpy(), "advantages": np.zeros((2, 3))}
    flips = branches.flipped_tokens(second, first, role="critic", round_=2, train=train,
                                    mask=np.ones((2, 3)), value_clip=clip, clip_ratio=0.2)
    assert flips is not None
    assert [f["index"] for f in flips] == [[bt, tt]]
    assert first["round2/critic/clip_coef"] < 1.0  # clipping is active: coef' matters
    key = branches.token_key(bt, tt)
    jac = {f"{key}/w": x[bt, tt].numpy(), f"{key}/b": np.ones(1)}
    pre = np.concatenate([first["round2/critic/grads/w"], first["round2/critic/grads/b"]])
    j = np.concatenate([jac[f"{key}/w"], jac[f"{key}/b"]])
    scalars = {"tokens": {key: {"dot_grad": float(pre @ j)}}, "gram": {key: {key: float(j @ j)}}}
    adjusted, note = branches.adjusted_expected(
        first, role="critic", round_=2, flips=flips, jacobians=jac, scalars=scalars,
        train=train, n_valid=6.0, lr=lr, betas=(0.9, 0.999), eps=1e-8, max_grad_norm=0.1)
    assert adjusted is not None, note
    assert "added" in note
    for name in second:
        if name.startswith("round2/") and "values" not in name:
            np.testing.assert_allclose(adjusted[name], second[name], rtol=1e-9, atol=1e-12,
                                       err_msg=name)
    unmoved = np.asarray(first["round2/critic/grads/b"])
    assert not np.allclose(unmoved, second["round2/critic/grads/b"])


def test_a_tp1_run_on_another_branch_than_the_reference_is_moved_exactly() -> None:
    """``tp_vs_tp1``: the expected run is a candidate (TP = 1) that itself left out a token
    the reference kept; the obtained run (TP = n) kept it, as the reference did. Moving the
    TP = 1 run to the obtained run's branch with the reference's sealed ``<g_ref, J_t>``
    counted ``|J_t|^2`` three times (a false alarm on seed variant 5 of the default
    contract: grad_norm 1.63935 -> 1.73558 against 1.66685); with the TP = 1 run's own
    offsets from the reference (:func:`qualify.branches.branch_offsets`) it is exact."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    ret = torch.randn(2, 3, generator=g, dtype=torch.float64)
    lr, clip = 0.05, 0.04
    tp1 = _critic_two_rounds(x, ret, torch.zeros(2, 3), clip=clip, max_norm=0.1, lr=lr)
    d = tp1["round2/critic/values"] - tp1["round1/critic/values"]
    full = branches.critic_full_gradient(tp1["round1/critic/values"],
                                         tp1["round2/critic/values"], ret.numpy(), clip)
    bt, tt = (int(i) for i in np.argwhere(~full)[0])
    shift = torch.zeros(2, 3, dtype=torch.float64)
    shift[bt, tt] = float(d[bt, tt]) - np.sign(d[bt, tt]) * clip * 0.5
    reference = _critic_two_rounds(x, ret, shift, clip=clip, max_norm=0.1, lr=lr)
    obtained = reference  # the TP = n run took the reference's branches
    train = {"returns": ret.numpy(), "advantages": np.zeros((2, 3))}
    mask = np.ones((2, 3))
    flips = branches.flipped_tokens(obtained, tp1, role="critic", round_=2, train=train,
                                    mask=mask, value_clip=clip, clip_ratio=0.2)
    assert flips is not None
    assert [f["index"] for f in flips] == [[bt, tt]]
    key = branches.token_key(bt, tt)
    jac = {f"{key}/w": x[bt, tt].numpy(), f"{key}/b": np.ones(1)}
    g_ref = np.concatenate([reference["round2/critic/grads/w"],
                            reference["round2/critic/grads/b"]])
    j = np.concatenate([jac[f"{key}/w"], jac[f"{key}/b"]])
    scalars = {"tokens": {key: {"dot_grad": float(g_ref @ j)}},
               "gram": {key: {key: float(j @ j)}}}
    kw: dict[str, Any] = {"role": "critic", "round_": 2, "flips": flips, "jacobians": jac,
                          "scalars": scalars, "train": train, "n_valid": 6.0, "lr": lr,
                          "betas": (0.9, 0.999), "eps": 1e-8, "max_grad_norm": 0.1}
    offsets = branches.branch_offsets(tp1, reference, role="critic", round_=2, train=train,
                                      mask=mask, n_valid=6.0, value_clip=clip,
                                      clip_ratio=0.2)
    assert list(offsets) == [key]
    assert offsets[key] < 0  # the TP = 1 run left the token out
    moved, note = branches.adjusted_expected(tp1, offsets=offsets, **kw)
    assert moved is not None, note
    for name in ("round2/critic/grad_norm", "round2/critic/clip_coef",
                 "round2/critic/grads/w", "round2/critic/exp_avg/w",
                 "round2/critic/exp_avg_sq/w", "round2/critic/updates/w"):
        np.testing.assert_allclose(moved[name], obtained[name], rtol=1e-9, atol=1e-12,
                                   err_msg=name)
    wrong, _ = branches.adjusted_expected(tp1, **kw)  # the reference's <g, J_t> as it stands
    assert wrong is not None
    assert abs(float(wrong["round2/critic/grad_norm"])
               - float(obtained["round2/critic/grad_norm"])) > 1e-6


def test_unsealed_flip_is_not_adjusted() -> None:
    flips = [{"index": [0, 1], "obtained": "full", "expected": "zero"}]
    adjusted, why = branches.adjusted_expected(
        {}, role="critic", round_=2, flips=flips, jacobians={},
        scalars={"tokens": {"0_2": {"dot_grad": 0.0}}}, train={}, n_valid=1.0, lr=1e-3,
        betas=(0.9, 0.999), eps=1e-8, max_grad_norm=1.0)
    assert adjusted is None
    assert "0_1" in why
    assert "not among the tokens the reference sealed" in why


def test_ambiguous_tokens_limit_keeps_the_nearest() -> None:
    x = np.log(np.array([[1.2004, 1.2001, 1.1996, 0.7999]]))
    adv = np.array([[1.0, 1.0, 1.0, -1.0]])
    args = {"role": "actor", "old": np.zeros((1, 4)), "cur": x, "train": {"advantages": adv},
            "mask": np.ones((1, 4)), "tol_old": 5e-4, "tol_cur": 5e-4, "value_clip": EPS_V,
            "clip_ratio": 0.2}
    assert branches.ambiguous_tokens(**args) == [(0, 0), (0, 1), (0, 2), (0, 3)]
    assert branches.ambiguous_tokens(**args, limit=2) == [(0, 1), (0, 3)]


def test_control_flip_after_an_earlier_flip_keeps_its_raw_error(tmp_path: Path) -> None:
    """Three rounds; a control whose critic token (0, 0) is on the other branch in rounds 2
    and 3. Round 3's moved reference would lack round 2's different step, so round 3 is
    not adjusted: its raw error stays and the record says why (the comparator's rule)."""
    from qualify.reference.branches import adjust_control_errors
    from qualify.statistics import ErrorMeasure, MetricKey

    zeros = np.zeros((1, 2), np.float32)
    ref = {"round1/critic/values": zeros,
           "round2/critic/values": np.array([[0.049, 0.0]], np.float32),
           "round3/critic/values": np.array([[0.049, 0.0]], np.float32)}
    ctl = {"round1/critic/values": zeros,
           "round2/critic/values": np.array([[0.051, 0.0]], np.float32),
           "round3/critic/values": np.array([[0.051, 0.0]], np.float32)}
    contract = cast(Contract, SimpleNamespace(
        algorithm=SimpleNamespace(value_clip=0.05, clip_ratio=0.2, name="ppo",
                                  loss_agg_mode="token-mean"),
        optimizer=OptimizerSpec(critic_lr=1e-3, actor_lr=1e-3, betas=(0.9, 0.999),
                                eps=1e-8, weight_decay=0.0, max_grad_norm=1.0)))
    key = MetricKey(round=3, role="critic", family="grads")
    raw = cast(ErrorMeasure, object())
    errors = {"fp32": {"attn_impl": {key: raw}}}
    doc: dict[str, Any] = {"precisions": {"fp32": {"critic": {
        "round2": {"tokens": {}, "gram": {}}, "round3": {"tokens": {}, "gram": {}}}}}}
    records = adjust_control_errors(
        contract, errors, ref_runs={"fp32": ref}, control_runs={"fp32": {"attn_impl": ctl}},
        doc=doc, out=tmp_path, train={"returns": np.ones((1, 2), np.float32),
                                      "advantages": np.zeros((1, 2))},
        mask=np.ones((1, 2)))
    assert [(r["round"], r["tokens"]) for r in records] == [(2, [[0, 0]]), (3, [[0, 0]])]
    assert "not among the tokens the reference sealed" in records[0]["note"]
    assert records[1]["note"].startswith("branches also differ in round(s) [2]")
    assert records[1]["families"] == {}
    assert errors["fp32"]["attn_impl"][key] is raw
