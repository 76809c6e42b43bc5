"""Which clip branch a token took (qualify/branches.py), by hand from PPO's losses.

Value loss ``max((v - R)^2, (v_old + clip(v - v_old, -e, e) - R)^2)``: outside the clip
range the clipped term has zero gradient and wins exactly when ``v`` is nearer the return
than the clip edge is. Surrogate ``max(-A r, -A clip(r, 1 - e, 1 + e))``: with ``A > 0`` the
clipped term wins above ``1 + e``, with ``A < 0`` below ``1 - e`` (Schulman et al. 2017).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qualify import branches

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
