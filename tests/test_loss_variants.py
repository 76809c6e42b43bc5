"""Hand-derived goldens of every loss variant of the reference (qualify/reference/losses.py).

Each golden is worked out by hand on a few tokens whose ratios are exact rationals (the
derivation is in the comment beside it; ``Fraction`` keeps the arithmetic exact and
``math.log`` of a rational is the only transcendental); nothing here calls the function
under test to make an expected number. Values and the gradient with respect to the
current logprobs are checked in FP64: a variant's gradient (which branch is live, where its
paper puts a stop-gradient) is what a stack can get wrong while the value still matches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qualify import aggregation
from qualify.contract import AlgorithmSpec
from qualify.errors import ContractError
from qualify.reference import losses
from qualify.registry import EngineSpec

LN = math.log
F = Fraction


def _logp(ratios: list[Fraction], old: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp [1, T] requiring grad, old [1, T])`` with ``exp(logp - old) = ratio``."""
    o = torch.tensor([old], dtype=torch.float64)
    lp = (o + torch.tensor([[LN(r) for r in ratios]], dtype=torch.float64)).requires_grad_()
    return lp, o


def _value_grad(loss: torch.Tensor, lp: torch.Tensor) -> tuple[list[float], list[float]]:
    (g,) = torch.autograd.grad(loss.sum(), lp)
    return loss.detach().flatten().tolist(), g.flatten().tolist()


def _close(got: Sequence[float], want: Sequence[Fraction | float]) -> None:
    assert got == pytest.approx([float(w) for w in want], abs=1e-14, rel=1e-14)


# ------------------------------------------------------------------------- PPO clip family

# r = 3/2, 1/2, 1/2, 3/2 with A = +1, +1, -1, -1 and eps = 0.2:
#   A=+1, r=3/2: max(-3/2, -6/5) = -6/5, clipped branch: gradient 0
#   A=+1, r=1/2: max(-1/2, -4/5) = -1/2, d/dlogp (-A r) = -A r = -1/2
#   A=-1, r=1/2: max(1/2, 4/5) = 4/5, gradient 0
#   A=-1, r=3/2: max(3/2, 6/5) = 3/2, gradient -A r = 3/2
PPO_R = [F(3, 2), F(1, 2), F(1, 2), F(3, 2)]
PPO_A = [1.0, 1.0, -1.0, -1.0]


def test_ppo_clip_golden() -> None:
    lp, old = _logp(PPO_R, [-1.0] * 4)
    v, g = _value_grad(losses.ppo_clip(lp, old, torch.tensor([PPO_A], dtype=torch.float64),
                                       clip_low=0.2, clip_high=0.2), lp)
    _close(v, [F(-6, 5), F(-1, 2), F(4, 5), F(3, 2)])
    _close(g, [0, F(-1, 2), 0, F(3, 2)])


def test_asymmetric_clip_golden() -> None:
    """DAPO clip-higher: r = 31/25 (1.24), A = +1 is clipped at 1.2 but live below 1.28."""
    lp, old = _logp([F(31, 25)], [-2.0])
    adv = torch.tensor([[1.0]], dtype=torch.float64)
    v, g = _value_grad(losses.ppo_clip(lp, old, adv, clip_low=0.2, clip_high=0.2), lp)
    _close(v, [F(-6, 5)])  # symmetric: max(-31/25, -6/5) = -6/5, gradient 0
    _close(g, [0])
    v, g = _value_grad(losses.ppo_clip(lp, old, adv, clip_low=0.2, clip_high=0.28), lp)
    _close(v, [F(-31, 25)])  # asymmetric: clamp(31/25, 4/5, 32/25) = 31/25: the ratio itself
    _close(g, [F(-31, 25)])


def test_dual_clip_golden() -> None:
    """Dual clip c = 3: A = -1 caps the loss at -A c = 3; A > 0 is untouched."""
    lp, old = _logp([F(4), F(2), F(4)], [-3.0, -3.0, -3.0])
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    v, g = _value_grad(losses.ppo_clip(lp, old, adv, clip_low=0.2, clip_high=0.2,
                                       clip_c=3.0), lp)
    # A=-1, r=4: ppo max(4, 6/5) = 4, dual min(4, 3) = 3 (constant: gradient 0)
    # A=-1, r=2: ppo max(2, 6/5) = 2 < 3, gradient -A r = 2
    # A=+1, r=4: max(-4, -6/5) = -6/5, gradient 0
    _close(v, [3, 2, F(-6, 5)])
    _close(g, [0, 2, 0])
    with pytest.raises(ValueError, match="c > 1"):
        losses.ppo_clip(lp, old, adv, clip_low=0.2, clip_high=0.2, clip_c=1.0)


def test_gspo_golden() -> None:
    """Sequence ratio s = (r1 r2)^(1/2) over the valid tokens; the padded token is ignored."""
    # seq 0: r = 9/8, 1/2 (valid), 7 (masked): s = (9/16)^(1/2) = 3/4; A = +1:
    #   max(-3/4, -4/5) = -3/4 on every token; d/dlogp_t = -A s / n = -3/8 on valid tokens
    # seq 1: r = 3/2, 3/2, 3/2 (all valid): s = 3/2; A = +1: max(-3/2, -6/5) = -6/5, grad 0
    o = torch.full((2, 3), -1.5, dtype=torch.float64)
    lr = torch.tensor([[LN(F(9, 8)), LN(F(1, 2)), LN(7)], [LN(F(3, 2))] * 3], dtype=torch.float64)
    lp = (o + lr).requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss = losses.gspo(lp, o, torch.ones(2, 3, dtype=torch.float64), mask, clip_low=0.2,
                       clip_high=0.2)
    (g,) = torch.autograd.grad((loss * mask).sum(), lp)
    _close(loss.detach().flatten().tolist(), [F(-3, 4)] * 3 + [F(-6, 5)] * 3)
    # valid tokens of seq 0 each receive n = 2 contributions of -s/(2) ... :
    # d/dlogp_t Σ_t' m_t' ℓ = Σ_t' m_t' (-A s / n) = n (-s / n) = -3/4 for t valid, 0 masked
    _close(g.flatten().tolist(), [F(-3, 4), F(-3, 4), 0, 0, 0, 0])


def test_cispo_golden() -> None:
    """CISPO: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp; every token keeps a gradient."""
    # eps_low = 1 (no lower clip), eps_high = 0.28; A = +1, old = -ln 4:
    #   r = 2: weight min(2, 32/25) = 32/25, logp = ln 2 - ln 4 = -ln 2: loss = 32/25 ln 2,
    #          gradient -32/25 (the clipped ratio is a constant, never zeroes the token)
    #   r = 1/2: weight 1/2, logp = -ln 8: loss = 1/2 ln 8, gradient -1/2
    lp, old = _logp([F(2), F(1, 2)], [-LN(4), -LN(4)])
    v, g = _value_grad(losses.cispo(lp, old, torch.ones(1, 2, dtype=torch.float64),
                                    clip_low=1.0, clip_high=0.28), lp)
    _close(v, [F(32, 25) * LN(2), F(1, 2) * LN(8)])
    _close(g, [F(-32, 25), F(-1, 2)])


# ------------------------------------------------------------------------------ KL family

# x = logp - ref = ln 2: k1 = ln 2 (grad 1); k2 = (ln 2)^2 / 2 (grad ln 2);
# k3 = e^{-x} + x - 1 = ln 2 - 1/2 (grad 1 - e^{-x} = 1/2).
# x = -30: low_var_kl clamps -x = 30 to 20, exp(20) - 21 > 10 to 10: value 10, grad 0;
# k3 there is e^30 - 31. A '+' form keeps the value and takes k2's gradient x.
L2 = LN(2)
KL_GOLDEN = {
    "k1": ([L2, -30.0], [1.0, 1.0]),
    "k2": ([L2 * L2 / 2, 450.0], [L2, -30.0]),
    "k3": ([L2 - 0.5, math.exp(30) - 31], [0.5, 1 - math.exp(30)]),
    "low_var_kl": ([L2 - 0.5, 10.0], [0.5, 0.0]),
    "k1+": ([L2, -30.0], [L2, -30.0]),
    "k2+": ([L2 * L2 / 2, 450.0], [L2, -30.0]),
    "k3+": ([L2 - 0.5, math.exp(30) - 31], [L2, -30.0]),
    "low_var_kl+": ([L2 - 0.5, 10.0], [L2, -30.0]),
}


@pytest.mark.parametrize("estimator", sorted(KL_GOLDEN))
def test_kl_golden(estimator: str) -> None:
    ref = torch.tensor([[-3.0, -1.0]], dtype=torch.float64)
    lp = (ref + torch.tensor([[L2, -30.0]], dtype=torch.float64)).requires_grad_()
    v, g = _value_grad(losses.kl_estimate(lp, ref, estimator), lp)
    want_v, want_g = KL_GOLDEN[estimator]
    _close(v, want_v)
    _close(g, want_g)


def test_ratio_weighted_kl_golden() -> None:
    """r k3 with r = 2, x = logp - ref = ln 2: value 2 (ln 2 - 1/2) = 2 ln 2 - 1; gradient
    r k3 + r (1 - e^{-x}) = 2 ln 2 - 1 + 1 = 2 ln 2. At r = 1 (round 1) the value is k3 and
    the gradient k3 + (1 - e^{-x})."""
    ref = torch.tensor([[-2.0, -2.0]], dtype=torch.float64)
    lp = (ref + L2).requires_grad_()
    old = torch.stack([lp.detach()[0, 0] - L2, lp.detach()[0, 1]])[None]  # r = 2, r = 1
    kl = losses.kl_estimate(lp, ref, "k3")
    v, g = _value_grad(losses.ratio_weighted_kl(kl, lp, old, torch.ones(1, 2)), lp)
    _close(v, [2 * L2 - 1, L2 - 0.5])
    _close(g, [2 * L2, L2])
    with pytest.raises(ValueError, match="level"):
        losses.ratio_weighted_kl(kl, lp, old, torch.ones(1, 2), level="batch")


def test_kl_unknown() -> None:
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        losses.kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


# ---------------------------------------------------------------------------- aggregation

MASK = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
X = np.array([[1.0, 2.0, 9.0], [4.0, 9.0, 9.0], [9.0, 9.0, 9.0]])
# valid tokens 1, 2 | 4 | none; B' = 2 (the empty sequence is not counted), N = 3, L = 3:
AGG_GOLDEN = {
    "token-mean": F(7, 3),                 # (1 + 2 + 4) / 3; TRL bnpo, dapo, cispo
    "token-sum": F(7),                     # 1 + 2 + 4
    "seq-mean-token-sum": F(7, 2),         # (3 + 4) / 2
    "seq-mean-token-mean": F(11, 4),       # (3/2 + 4) / 2; TRL grpo
    "seq-mean-token-sum-norm": F(7, 6),    # (3 + 4) / (2 * 3); TRL dr_grpo, L = 3
}


@pytest.mark.parametrize("mode", aggregation.AGG_MODES)
def test_aggregation_golden(mode: str) -> None:
    c = aggregation.token_scale(MASK, mode, scale_factor=3.0)
    assert float((c * X).sum()) == pytest.approx(float(AGG_GOLDEN[mode]), abs=1e-15)


def test_norm_mode_needs_its_factor() -> None:
    with pytest.raises(ValueError, match="loss_scale_factor"):
        aggregation.token_scale(MASK, "seq-mean-token-sum-norm")


# ------------------------------------------------------------------- rollout correction

# log(old / behavior): seq 0 = ln 1/2, ln 3, ln 5/4; seq 1 = ln 2, ln 1/4, (masked ln 9)
RC_LOG = [[LN(F(1, 2)), LN(3), LN(F(5, 4))], [LN(2), LN(F(1, 4)), LN(9)]]
RC_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
RC_GOLDEN: dict[tuple[str, str, float, float | None], list[list[Fraction | int]]] = {
    # token: rho itself; truncate C = 2: min(rho, 2)
    ("token", "truncate", 2.0, None): [[F(1, 2), 2, F(5, 4)], [2, F(1, 4), 0]],
    # token mask [2/5, 5/2]: 3 and 1/4 fall outside -> 0; 1/2, 5/4 and 2 are kept
    ("token", "mask", 2.5, 0.4): [[F(1, 2), 0, F(5, 4)], [2, 0, 0]],
    # sequence: rho_0 = 1/2 * 3 * 5/4 = 15/8, rho_1 = 2 * 1/4 = 1/2 (masked token ignored)
    ("sequence", "truncate", 2.0, None): [[F(15, 8)] * 3, [F(1, 2), F(1, 2), 0]],
    ("sequence", "truncate", 1.5, None): [[F(3, 2)] * 3, [F(1, 2), F(1, 2), 0]],
    # sequence mask C = 3/2: seq 0 (15/8) is dropped whole, seq 1 kept
    ("sequence", "mask", 1.5, None): [[0, 0, 0], [F(1, 2), F(1, 2), 0]],
}


@pytest.mark.parametrize("case", sorted(RC_GOLDEN, key=str))
def test_rollout_correction_golden(case: tuple[str, str, float, float | None]) -> None:
    level, mode, hi, lo = case
    behavior = torch.full((2, 3), -2.0, dtype=torch.float64)
    old = (behavior + torch.tensor(RC_LOG, dtype=torch.float64)).requires_grad_()
    w = losses.rollout_correction_weights(old, behavior, RC_MASK, level=level, mode=mode,
                                          threshold=hi, threshold_low=lo)
    assert not w.requires_grad  # detached: a weight, never a path for the gradient
    _close(w.flatten().tolist(), [x for row in RC_GOLDEN[case] for x in row])


@settings(max_examples=20, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=4, max_size=4),
       st.lists(st.sampled_from([-1.0, 1.0, 0.5, -2.0]), min_size=4, max_size=4),
       st.floats(0.05, 0.5))
def test_variants_agree_on_policy(log_r: list[float], adv: list[float], eps: float) -> None:
    """Invariants: at ratio 1 (round 1) PPO, asymmetric, dual-clip and GSPO losses are all
    -A with gradient -A (GSPO's spread over the sequence); truncating at C never raises a
    weight and a mask keeps it or zeroes it."""
    a = torch.tensor([adv], dtype=torch.float64)
    lp = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
    for loss in (losses.ppo_clip(lp, lp.detach(), a, clip_low=eps, clip_high=2 * eps),
                 losses.ppo_clip(lp, lp.detach(), a, clip_low=eps, clip_high=eps, clip_c=3.0)):
        v, g = _value_grad(loss, lp)
        _close(v, [-x for x in adv])
        _close(g, [-x for x in adv])
    m = torch.ones(1, 4, dtype=torch.int64)
    old = torch.tensor([log_r], dtype=torch.float64)
    for level in losses.IS_LEVELS:
        raw = losses.rollout_correction_weights(old, torch.zeros_like(old), m, level=level,
                                                mode="truncate", threshold=1e9)
        t = losses.rollout_correction_weights(old, torch.zeros_like(old), m, level=level,
                                              mode="truncate", threshold=1.5)
        k = losses.rollout_correction_weights(old, torch.zeros_like(old), m, level=level,
                                              mode="mask", threshold=1.5)
        assert bool((t <= raw).all())
        assert bool(((k == raw) | (k == 0)).all())


# ------------------------------------------------------ the contract names, engines refuse


def _alg(**kw: object) -> AlgorithmSpec:
    base: dict[str, object] = {"name": "grpo", "gamma": 1.0, "lam": 1.0, "clip_ratio": 0.2,
                               "micro_batch_size": 2, "rounds": 2}
    return AlgorithmSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_base_contract_has_no_variants() -> None:
    assert _alg().variants() == ()
    assert _alg(clip_ratio_low=0.2, clip_ratio_high=0.2).variants() == ()


def test_variants_named() -> None:
    alg = _alg(policy_loss="gspo", clip_ratio_high=0.28, kl_loss_type="low_var_kl+",
               loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16.0,
               rollout_is="sequence", rollout_is_mode="mask", rollout_is_threshold=2.0)
    assert alg.variants() == ("policy_loss=gspo", "clip_ratio_high=0.28",
                              "kl_loss_type=low_var_kl+",
                              "loss_agg_mode=seq-mean-token-sum-norm", "rollout_is=sequence_mask")


@pytest.mark.parametrize(("kw", "field"), [
    ({"advantage_estimator": "gae"}, "algorithm.advantage_estimator"),
    ({"clip_ratio_c": 3.0, "policy_loss": "cispo"}, "algorithm.clip_ratio_c"),
    ({"clip_ratio_c": 1.0}, "algorithm.clip_ratio_c"),
    ({"kl_loss_type": "k3+", "kl_loss_estimator": "k1"}, "algorithm.kl_loss_type"),
    ({"loss_agg_mode": "seq-mean-token-sum-norm"}, "algorithm.loss_scale_factor"),
    ({"loss_scale_factor": 4.0}, "algorithm.loss_scale_factor"),
    ({"rollout_is": "token"}, "algorithm.rollout_is_threshold"),
    ({"rollout_is_threshold": 2.0}, "algorithm.rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_is_threshold_low": 0.5},
     "algorithm.rollout_is_threshold_low"),
    ({"name": "decoupled_ppo", "rollout_is": "token", "rollout_is_threshold": 2.0},
     "algorithm.rollout_is"),
])
def test_variant_fields_refused(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ContractError, match=field):
        _alg(**kw)


def test_engine_without_variant_is_not_run() -> None:
    """A trainer that does not declare a variant gets a NOT_RUN reason naming it."""
    alg = _alg(policy_loss="cispo", clip_ratio_high=0.28)
    plain = EngineSpec(name="plain", entry="harnesses.plain.harness:main")
    why = plain.unavailable_reason(False, variants=alg.variants())
    assert why is not None
    assert "policy_loss=cispo" in why
    assert "clip_ratio_high=0.28" in why
    able = EngineSpec(name="able", entry="harnesses.able.harness:main",
                      algorithms=("policy_loss=cispo", "clip_ratio_high=*"))
    assert able.unavailable_reason(False, variants=alg.variants()) is None
    assert plain.unavailable_reason(False, variants=()) is None


# ------------------------------------------- the reference update runs the contract's variant

TINY_CFG: dict[str, Any] = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "max_position_embeddings": 64, "tie_word_embeddings": False}
WIRING: dict[str, dict[str, Any]] = {
    "asymmetric": {"clip_ratio_high": 0.01, "clip_ratio_low": 0.005},
    "gspo": {"policy_loss": "gspo", "clip_ratio": 0.01},
    "cispo": {"policy_loss": "cispo", "clip_ratio_low": 1.0, "clip_ratio_high": 0.01},
    "tis_sequence": {"rollout_is": "sequence", "rollout_is_threshold": 1e6},
    "mis_token": {"rollout_is": "token", "rollout_is_mode": "mask", "rollout_is_threshold": 1.0},
}


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(WIRING))
def test_reference_update_runs_the_variant(variant: str) -> None:
    """Round 2's reported policy loss is the variant's, recomputed in FP64 from the run's own
    reported logprobs, and differs from plain PPO's: the update does not ignore the field.

    (Dual clip is not here: on this batch no negative-advantage token's ratio rises above
    ``c``; its dispatch passes ``clip_ratio_c`` straight to :func:`losses.ppo_clip`.)
    """
    import copy
    import dataclasses

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from qualify.contract import load_contract
    from qualify.protocol import ParamSampling
    from qualify.reference.update import Batch, UpdateSettings, run_actor
    from qualify.resources import contracts_dir

    torch.manual_seed(0)
    cfg = Qwen3Config(**TINY_CFG)
    cfg._attn_implementation = "sdpa"
    actor = Qwen3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(5)
    mask = torch.ones(3, 5, dtype=torch.int64)
    mask[1, 3:] = 0
    batch = Batch(prompts=torch.randint(3, 64, (3, 3), generator=g),
                  responses=torch.randint(3, 64, (3, 5), generator=g) * mask,
                  attention_mask=torch.cat([torch.ones(3, 3, dtype=torch.int64), mask], 1),
                  response_mask=mask, advantages=torch.randn(3, 5, generator=g) * mask,
                  returns=torch.zeros(3, 5), pad_token_id=0,
                  behavior_logprobs=(-4.2 + 0.3 * torch.randn(3, 5, generator=g)) * mask)
    base = load_contract(contracts_dir() / "tiny-qwen3.toml")
    c = dataclasses.replace(base, evidence=ParamSampling(exact_elements=1 << 30, sample_elements=1),
                            optimizer=dataclasses.replace(base.optimizer, actor_lr=3e-2),
                            algorithm=dataclasses.replace(base.algorithm, kl_loss_coef=0.0,
                                                          entropy_coef=0.0, **WIRING[variant]))
    out, _ = run_actor(copy.deepcopy(actor), copy.deepcopy(actor), batch, c,
                       UpdateSettings(precision="fp32", micro_batch_size=2))
    alg, m = c.algorithm, mask.double()
    lp1, lp2 = (out[f"round{r}/actor/logprobs"].double() for r in (1, 2))
    adv = batch.advantages.double()
    if alg.policy_loss == "gspo":
        per = losses.gspo(lp2, lp1, adv, mask, clip_low=alg.clip_low, clip_high=alg.clip_high)
    elif alg.policy_loss == "cispo":
        per = losses.cispo(lp2, lp1, adv, clip_low=alg.clip_low, clip_high=alg.clip_high)
    else:
        per = losses.ppo_clip(lp2, lp1, adv, clip_low=alg.clip_low, clip_high=alg.clip_high,
                              clip_c=alg.clip_ratio_c)
    if alg.rollout_is is not None:
        assert batch.behavior_logprobs is not None
        per = per * losses.rollout_correction_weights(
            lp1, batch.behavior_logprobs.double(), mask, level=alg.rollout_is,
            mode=alg.rollout_is_mode, threshold=float(alg.rollout_is_threshold or 0))
    plain = losses.ppo_clip(lp2, lp1, adv, clip_low=alg.clip_ratio, clip_high=alg.clip_ratio)
    n = float(m.sum())
    want, base_value = float((per * m).sum()) / n, float((plain * m).sum()) / n
    assert float(out["round2/actor/loss/policy"]) == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert abs(want - base_value) > 1e-4, "this batch must make the variant matter"
