"""GRPO and decoupled PPO: loss aggregation modes, GRPO advantages, the behavior weight.

Golden values are derived by hand below on a 2-sequence example (no code under test is
called to produce an expected value):

- ``MASK = [[1, 1, 0], [1, 0, 0]]``: ``n_0 = 2``, ``n_1 = 1``, ``N = 3``, ``B' = 2``.
- per-token values ``X = [[1, 2, 99], [4, 99, 99]]`` (99 sits on padding and must vanish):
  ``token-mean = (1 + 2 + 4) / 3 = 7 / 3``; ``seq-mean-token-sum = ((1 + 2) + 4) / 2 = 3.5``;
  ``seq-mean-token-mean = (3 / 2 + 4 / 1) / 2 = 2.75`` (verl ``core_algos.agg_loss``;
  Dr. GRPO arXiv 2503.20783; GRPO arXiv 2402.03300 eq. 3).
- decoupled PPO (Hilton et al. 2022; AReaL ``ppo_actor_loss_fn``): ``lp_prox = [[-1, -0.5],
  [-2]]``, ``lp_behav = [[-1, -2.5], [-1]]`` on the valid tokens, so the uncapped weight
  ``w = exp(lp_prox - lp_behav) = [[1, e^2], [e^-1]]``; with cap 5: ``truncate`` ->
  ``[[1, 5], [e^-1]]``, ``filter`` -> ``[[1, 0], [e^-1]]``; one token of three above the cap.
- advantages ``A = [[0.5, -1], [2]]``. Round 1 (``ratio = 1``): per-token surrogate
  ``-A = [[-0.5, 1], [-2]]``. Round 2 with ``lp - lp_prox = [[log 1.5, log 0.7], [log 1.1]]``
  and ``ε = 0.2``: token (0, 0) ``A > 0``, ratio 1.5 clipped to 1.2: ``-0.6``; token (0, 1)
  ``A < 0``, ratio 0.7 clipped to 0.8: ``max(0.7, 0.8) = 0.8``; token (1, 0) ratio 1.1
  inside: ``-2.2``.
- GRPO: one group with scores ``[1, 3]``: mean 2, unbiased std ``sqrt(2)``; advantages
  ``∓1 / (sqrt(2) + 1e-6)`` with the std, ``∓1`` without (Dr. GRPO).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from types import ModuleType
from typing import Any, cast

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from qualify_harness import losses as sdk_losses
from transformers import Qwen3Config, Qwen3ForCausalLM

from qualify import aggregation, branches
from qualify.contract import Contract, load_contract, loads_contract
from qualify.errors import ContractError
from qualify.protocol import ParamSampling
from qualify.reference import targets
from qualify.reference.update import Batch, UpdateSettings, run_actor
from qualify.resources import contracts_dir

torch.set_num_threads(1)

HARNESS_LOSSES: dict[str, ModuleType] = {"sdk": sdk_losses}
MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")

MASK = np.array([[1, 1, 0], [1, 0, 0]])
X = np.array([[1.0, 2.0, 99.0], [4.0, 99.0, 99.0]])
AGG_GOLDEN = {"token-mean": 7.0 / 3.0, "seq-mean-token-sum": 3.5, "seq-mean-token-mean": 2.75}

E = math.e
LP_PROX = np.array([[-1.0, -0.5, 0.0], [-2.0, 0.0, 0.0]])
LP_BEHAV = np.array([[-1.0, -2.5, 0.0], [-1.0, 0.0, 0.0]])
ADV = np.array([[0.5, -1.0, 0.0], [2.0, 0.0, 0.0]])
W_TRUNC = {(0, 0): 1.0, (0, 1): 5.0, (1, 0): 1 / E}
W_FILTER = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 1 / E}
ROUND1_PG = {(0, 0): -0.5, (0, 1): 1.0, (1, 0): -2.0}
ROUND2_DELTA = np.array([[math.log(1.5), math.log(0.7), 0.0], [math.log(1.1), 0.0, 0.0]])
ROUND2_PG = {(0, 0): -0.6, (0, 1): 0.8, (1, 0): -2.2}


def _agg_by_hand(per_token: dict[tuple[int, int], float], mode: str) -> float:
    """The three modes on MASK, written out: N = 3, B' = 2, n_0 = 2, n_1 = 1."""
    s0 = per_token[(0, 0)] + per_token[(0, 1)]
    s1 = per_token[(1, 0)]
    if mode == "token-mean":
        return (s0 + s1) / 3
    if mode == "seq-mean-token-sum":
        return (s0 + s1) / 2
    return (s0 / 2 + s1 / 1) / 2


def _golden_policy(mode: str, pg: dict[tuple[int, int], float],
                   w: dict[tuple[int, int], float]) -> float:
    return _agg_by_hand({k: pg[k] * w[k] for k in pg}, mode)


# --------------------------------------------------------------------------- the reference


@pytest.mark.parametrize("mode", MODES)
def test_reference_aggregation_golden(mode: str) -> None:
    c = aggregation.token_scale(MASK, mode)
    assert float((c * MASK * X).sum()) == pytest.approx(AGG_GOLDEN[mode], abs=1e-15)
    row, denom = aggregation.aggregation_terms(MASK, mode)
    assert float((MASK * X * row[:, None]).sum() / denom) == pytest.approx(AGG_GOLDEN[mode],
                                                                          abs=1e-15)


def test_token_mean_weight_is_exactly_one() -> None:
    """token-mean keeps the protocol's Σ / N bit for bit (row weight exactly 1)."""
    row, denom = aggregation.aggregation_terms(MASK, "token-mean")
    assert row.tolist() == [1.0, 1.0]
    assert denom == 3.0


def test_unknown_mode_and_bad_cap_are_refused() -> None:
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregation.token_scale(MASK, "seq-sum")
    with pytest.raises(ValueError, match="cap must be > 1"):
        aggregation.behavior_weights(LP_PROX, LP_BEHAV, MASK, cap=1.0)


@pytest.mark.parametrize(("cap_mode", "golden"), [("truncate", W_TRUNC), ("filter", W_FILTER)])
def test_reference_behavior_weight_golden(cap_mode: str,
                                          golden: dict[tuple[int, int], float]) -> None:
    w = aggregation.behavior_weights(LP_PROX, LP_BEHAV, MASK, cap=5.0, cap_mode=cap_mode)
    for (b, t), v in golden.items():
        assert w[b, t] == pytest.approx(v, rel=1e-15)
    assert w[0, 2] == 0.0
    assert w[1, 1] == 0.0  # padding
    raw = aggregation.behavior_weights(LP_PROX, LP_BEHAV, MASK, cap=None)
    stats = aggregation.weight_stats(raw, MASK, 5.0)
    assert stats["max"] == pytest.approx(E**2)
    assert stats["min"] == pytest.approx(1 / E)
    assert stats["mean"] == pytest.approx((1 + E**2 + 1 / E) / 3)
    assert stats["fraction_capped"] == pytest.approx(1 / 3)
    assert stats["tokens"] == 3


@pytest.mark.parametrize(("norm", "golden"), [(True, 1 / (math.sqrt(2) + 1e-6)), (False, 1.0)])
def test_grpo_advantages_golden(norm: bool, golden: float) -> None:
    mask = np.array([[1, 1], [1, 0]])
    adv = targets.grpo_advantages([1.0, 3.0], np.array([0, 0]), mask, eps=1e-6,
                                  norm_by_std=norm)
    assert adv[0, 0] == pytest.approx(-golden, rel=1e-14)
    assert adv[0, 1] == pytest.approx(-golden, rel=1e-14)
    assert adv[1, 0] == pytest.approx(golden, rel=1e-14)
    assert adv[1, 1] == 0.0


def test_compute_targets_wires_grpo_norm_by_std() -> None:
    mask = np.array([[1, 1], [1, 0]])
    kw: dict[str, Any] = {"algorithm": "grpo", "scores": [1.0, 3.0], "response_mask": mask,
                          "logprobs": np.zeros((2, 2)), "ref_logprobs": np.zeros((2, 2)),
                          "group_index": np.array([0, 0]), "whiten": False}
    on = targets.compute_targets(**kw)
    off = targets.compute_targets(**kw, grpo_norm_by_std=False)
    assert on.advantages[1, 0] == pytest.approx(1 / (math.sqrt(2) + 1e-6))
    assert off.advantages[1, 0] == 1.0
    assert off.returns[0, 0] == -1.0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("cap_mode", "w"), [("truncate", W_TRUNC), ("filter", W_FILTER)])
def test_branch_loss_factors_golden(mode: str, cap_mode: str,
                                    w: dict[tuple[int, int], float]) -> None:
    """The comparator's per-token factor c_t w_t (clip-branch contributions)."""
    run = {"round1/actor/logprobs": LP_PROX}
    f = branches.loss_factors(run, role="actor", mask=MASK, loss_agg_mode=mode,
                              behavior_logprobs=LP_BEHAV, behavior_weight_cap=5.0,
                              cap_mode=cap_mode)
    unit = dict.fromkeys(w, 1.0)
    for (b, t), v in w.items():
        one = dict.fromkeys(w, 0.0) | {(b, t): 1.0}
        assert f[b, t] == pytest.approx(_agg_by_hand(one, mode) * v, rel=1e-14)
    critic = branches.loss_factors(run, role="critic", mask=MASK, loss_agg_mode=mode)
    assert float((critic * MASK).sum()) == pytest.approx(_agg_by_hand(unit, mode))


# --------------------------------------------------------------------------- the harnesses


def _t(x: np.ndarray) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


@pytest.mark.parametrize("engine", sorted(HARNESS_LOSSES))
@pytest.mark.parametrize("mode", MODES)
def test_harness_aggregation_golden(engine: str, mode: str) -> None:
    mod = HARNESS_LOSSES[engine]
    mask = torch.tensor(MASK, dtype=torch.bool)
    row, denom = mod.aggregation_terms(mask, mode)
    got = float(mod.masked_sum(_t(X) * row[:, None], mask)) / denom
    assert got == pytest.approx(AGG_GOLDEN[mode], rel=1e-6)


@pytest.mark.parametrize("engine", sorted(HARNESS_LOSSES))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("cap_mode", "w"), [("truncate", W_TRUNC), ("filter", W_FILTER)])
@pytest.mark.parametrize("round_", [1, 2])
def test_harness_decoupled_policy_loss_golden(engine: str, mode: str, cap_mode: str,
                                              w: dict[tuple[int, int], float],
                                              round_: int) -> None:
    """Each harness's own policy loss = Σ c_t w_t max(-Aρ, -A clip ρ), the golden numbers."""
    mod = HARNESS_LOSSES[engine]
    mask = torch.tensor(MASK, dtype=torch.bool)
    prox = _t(LP_PROX)
    # The weight is data, never differentiated: from a proximal logprob that requires grad
    # (as the trainer's own would), the harness must return a detached weight.
    w_of_grad, _ = mod.behavior_weight(_t(LP_PROX).requires_grad_(), _t(LP_BEHAV), 5.0,
                                       cap_mode)
    assert not w_of_grad.requires_grad
    weight, raw = mod.behavior_weight(prox, _t(LP_BEHAV), 5.0, cap_mode)
    assert float(raw[0, 1]) == pytest.approx(E**2, rel=1e-6)
    row, denom = mod.aggregation_terms(mask, mode)
    lp = prox if round_ == 1 else prox + _t(ROUND2_DELTA)
    got = float(mod.policy_loss_sum(lp, prox, _t(ADV), mask, 0.2,
                                    weight=row[:, None] * weight)) / denom
    pg = ROUND1_PG if round_ == 1 else ROUND2_PG
    assert got == pytest.approx(_golden_policy(mode, pg, w), rel=1e-6, abs=1e-7)
    stats = mod.weight_stats(raw, mask, 5.0)
    assert stats["fraction_capped"] == pytest.approx(1 / 3)
    assert stats["max"] == pytest.approx(E**2, rel=1e-6)


@pytest.mark.parametrize("engine", sorted(HARNESS_LOSSES))
@pytest.mark.parametrize("mode", MODES)
def test_harness_value_loss_aggregated(engine: str, mode: str) -> None:
    """0.5 (V - G)^2 with V - G = sqrt(2 x) (unclipped: old = V), aggregated: 0.5 · 2x = x."""
    mod = HARNESS_LOSSES[engine]
    mask = torch.tensor(MASK, dtype=torch.bool)
    v = torch.zeros(2, 3)
    g = -torch.sqrt(2 * _t(np.where(MASK == 1, X, 0.0)))
    row, denom = mod.aggregation_terms(mask, mode)
    got = float(mod.value_loss_sum(v, v, g, mask, 10.0, weight=row[:, None])) / denom
    assert got == pytest.approx(AGG_GOLDEN[mode], rel=1e-6)


@st.composite
def _batches(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, list[int]]:
    b = draw(st.integers(2, 7))
    r = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(0, r), min_size=b, max_size=b).filter(any))
    mask = (np.arange(r)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    x = np.array(draw(st.lists(st.floats(-10, 10), min_size=b * r, max_size=b * r)))
    cuts = sorted(set(draw(st.lists(st.integers(1, b - 1), max_size=b))))
    return mask, x.reshape(b, r), cuts


@settings(max_examples=60, deadline=None)
@given(data=_batches(), mode=st.sampled_from(MODES))
def test_every_mode_is_micro_batch_partition_invariant(
        data: tuple[np.ndarray, np.ndarray, list[int]], mode: str) -> None:
    """Σ over micro-batches of each share (global denominators) = the whole-batch loss, on
    the reference and in every harness, for any partition of the rows."""
    mask, x, cuts = data
    edges = [0, *cuts, mask.shape[0]]
    parts = [slice(a, b) for a, b in itertools.pairwise(edges)]
    row, denom = aggregation.aggregation_terms(mask, mode)
    whole = float((mask * x * row[:, None]).sum() / denom)
    split = sum(float((mask[s] * x[s] * row[s, None]).sum() / denom) for s in parts)
    assert split == pytest.approx(whole, rel=1e-12, abs=1e-12)
    # The per-sequence definition, independently: verl agg_loss on the whole batch.
    n_b = mask.sum(1)
    seq = [(x[i] * mask[i]).sum() for i in range(len(n_b)) if n_b[i] > 0]
    tok = [(x[i] * mask[i]).sum() / n_b[i] for i in range(len(n_b)) if n_b[i] > 0]
    direct = {"token-mean": float((x * mask).sum() / mask.sum()),
              "seq-mean-token-sum": float(np.mean(seq)),
              "seq-mean-token-mean": float(np.mean(tok))}[mode]
    assert whole == pytest.approx(direct, rel=1e-12, abs=1e-12)
    mt, xt = torch.tensor(mask, dtype=torch.bool), torch.tensor(x, dtype=torch.float64)
    for mod in HARNESS_LOSSES.values():
        hrow, hden = mod.aggregation_terms(mt, mode)
        hsplit = sum(float(mod.masked_sum(xt[s] * hrow[s, None].double(), mt[s])) / hden
                     for s in parts)
        assert hsplit == pytest.approx(direct, rel=1e-6, abs=1e-6)


# --------------------------------------------------------------------------- contracts


def _algo_toml(**fields: Any) -> str:
    base = (contracts_dir() / "tiny-qwen3.toml").read_text()
    extra = "".join(f"{k} = {v}\n" for k, v in fields.items())
    return base.replace("rounds = 2\n", "rounds = 2\n" + extra, 1)


def test_default_contract_digest_unchanged() -> None:
    """The new fields default when absent: the committed contract keeps its digest."""
    c = load_contract(contracts_dir() / "tiny-qwen3.toml")
    # with its lr schedule, its BF16-representable checkpoint, row_split and the
    # round-to-round term (97421d680c97 before the term, b25af0fe30b3 before the two before)
    assert c.digest12 == "9cd85d5fbd99"
    # Without the lr schedule lines it is the contract sealed before them: the schedule's
    # fields default when absent and keep that digest.
    text = (contracts_dir() / "tiny-qwen3.toml").read_text()
    old = "\n".join(ln for ln in text.splitlines()
                    if not ln.startswith(("lr_schedule =", "total_steps =", "min_lr_ratio =",
                                          "round_to_round =")))
    start = old.index("# A non-constant lr (issue #15)")
    old = old[:start] + old[old.index("\n[matrix]", start) + 1:]
    assert loads_contract(old + "\n").digest12 == "54ce8c02fcc4"
    assert c.algorithm.loss_agg_mode == "token-mean"
    assert c.algorithm.behavior_weight_cap is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"loss_agg_mode": '"seq-sum"'}, "loss_agg_mode"),
    ({"behavior_weight_cap": "5.0"}, "algorithm.behavior_weight_cap: only decoupled_ppo"),
    ({"grpo_norm_by_std": "false"}, "algorithm.grpo_norm_by_std"),
])
def test_contract_field_errors_name_the_field(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ContractError, match=message):
        loads_contract(_algo_toml(**fields))


def test_cap_at_most_one_is_refused_naming_file_and_field() -> None:
    doc = (contracts_dir() / "tiny-qwen3-dppo.toml").read_text()
    bad = doc.replace("behavior_weight_cap = 1.15", "behavior_weight_cap = 1.0")
    assert bad != doc
    with pytest.raises(ContractError, match="behavior_weight_cap"):
        loads_contract(bad, name="x.toml")


def test_grpo_with_a_critic_is_refused(tmp_path: Any) -> None:
    doc = (contracts_dir() / "tiny-qwen3-grpo.toml").read_text()
    path = tmp_path / "grpo-critic.toml"
    path.write_text(doc.replace('roles = ["actor"]', 'roles = ["actor", "critic"]'))
    with pytest.raises(ContractError, match=r"grpo-critic\.toml: matrix\.roles"):
        load_contract(path)


def test_committed_algorithm_contracts_load() -> None:
    g = load_contract(contracts_dir() / "tiny-qwen3-grpo.toml")
    assert g.algorithm.name == "grpo"
    assert g.matrix.roles == ("actor",)
    assert g.sampling.samples_per_prompt >= 4
    assert g.algorithm.kl_loss_estimator == "k3"
    d = load_contract(contracts_dir() / "tiny-qwen3-dppo.toml")
    assert d.algorithm.name == "decoupled_ppo"
    # raw behavior logprobs (w = p_T / p_1 > 1 on likely tokens): a cap that can bind; with
    # processed logprobs w is the kept top-k/top-p mass <= 1 and no cap > 1 binds
    assert d.sampling.logprobs_mode == "raw"
    assert d.algorithm.behavior_weight_cap == 1.15


# --------------------------------------------------------------------------- end to end


CFG: dict[str, Any] = {
    "vocab_size": 384, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "pad_token_id": 0,
    "eos_token_id": 2, "bos_token_id": 1, "attention_dropout": 0.0}


@pytest.fixture(scope="module")
def actor() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    cfg = Qwen3Config(**CFG)
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg)


@pytest.fixture(scope="module")
def batch() -> Batch:
    g = torch.Generator().manual_seed(3)
    b, p, r = 4, 4, 6
    prompts = torch.randint(3, 384, (b, p), generator=g)
    responses = torch.randint(3, 384, (b, r), generator=g)
    mask = torch.ones(b, r, dtype=torch.int64)
    mask[0, 2:] = 0
    mask[2, 4:] = 0
    responses[mask == 0] = 0
    am = torch.cat([torch.ones(b, p, dtype=torch.int64), mask], 1)
    adv = torch.randn(b, r, generator=g) * mask
    behav = (-6.0 + 2.5 * torch.randn(b, r, generator=g)) * mask  # far from the policy
    return Batch(prompts=prompts, responses=responses, attention_mask=am, response_mask=mask,
                 advantages=adv, returns=torch.zeros(b, r), pad_token_id=0,
                 behavior_logprobs=behav)


def _contract(name: Any, **alg: Any) -> Contract:
    c = load_contract(contracts_dir() / "tiny-qwen3.toml")
    return dataclasses.replace(
        c, algorithm=dataclasses.replace(c.algorithm, name=name, **alg),
        evidence=ParamSampling(exact_elements=1 << 30, sample_elements=1))


def _run(actor: Qwen3ForCausalLM, batch: Batch, c: Contract,
         micro: int = 2) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return run_actor(copy.deepcopy(actor), copy.deepcopy(actor), batch, c,
                     UpdateSettings(precision="fp32", micro_batch_size=micro))


def _rel_l2(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str) -> float:
    num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a
              if k.startswith(prefix))
    den = sum(float((b[k].double() ** 2).sum()) for k in a if k.startswith(prefix))
    return math.sqrt(num / den)


@pytest.mark.parametrize("mode", MODES)
def test_reference_round1_policy_loss_by_hand(actor: Qwen3ForCausalLM, batch: Batch,
                                              mode: str) -> None:
    """Round 1 of decoupled PPO (ratio 1): loss = Σ c_t · min(w_t, 5) · (-A_t), computed here
    in FP64 from the run's reported round-1 logprobs and the behavior logprobs."""
    out, meta = _run(actor, batch, _contract("decoupled_ppo", loss_agg_mode=mode,
                                              behavior_weight_cap=5.0))
    lp = out["round1/actor/logprobs"].double().numpy()
    m = batch.response_mask.numpy()
    assert batch.behavior_logprobs is not None
    w = np.minimum(np.exp(lp - batch.behavior_logprobs.double().numpy()), 5.0)
    per = -batch.advantages.double().numpy() * w * m
    n_b = m.sum(1)
    expected = {"token-mean": per.sum() / m.sum(),
                "seq-mean-token-sum": per.sum(1).sum() / 4,
                "seq-mean-token-mean": (per.sum(1) / n_b).sum() / 4}[mode]
    assert float(out["round1/actor/loss/policy"]) == pytest.approx(expected, rel=1e-5)
    stats = meta["behavior_weight"]["round1"]
    assert stats["fraction_capped"] > 0, "the test batch must make the cap bind"
    assert stats == meta["behavior_weight"]["round2"]


def test_reference_partition_invariant_gradients(actor: Qwen3ForCausalLM, batch: Batch) -> None:
    """seq-mean-token-mean with the weight: micro-batch 1 vs 4 agree to FP32 rounding."""
    c = _contract("decoupled_ppo", loss_agg_mode="seq-mean-token-mean", behavior_weight_cap=5.0)
    a, _ = _run(actor, batch, c, micro=1)
    b, _ = _run(actor, batch, c, micro=4)
    assert _rel_l2(a, b, "round2/actor/grads/") < 1e-5


@pytest.mark.parametrize(("ignored", "alg"), [
    ("loss_agg_mode", {"name": "ppo", "loss_agg_mode": "seq-mean-token-mean"}),
    ("loss_agg_mode", {"name": "ppo", "loss_agg_mode": "seq-mean-token-sum"}),
    ("behavior weight", {"name": "decoupled_ppo", "behavior_weight_cap": 5.0}),
    ("behavior_weight_cap", {"name": "decoupled_ppo", "behavior_weight_cap": 1.5}),
])
def test_ignoring_the_mode_or_weight_fails(actor: Qwen3ForCausalLM, batch: Batch, ignored: str,
                                           alg: dict[str, Any]) -> None:
    """A harness that ignores the mode, the weight or the cap computes the token-mean PPO
    (or uncapped) update; its losses and round-1 gradients differ from the right ones by
    far more than the default contract's BF16 floors (losses 1e-3, grads 2e-2 relative L2),
    so such a harness FAILs even in the loosest class."""
    name = alg.pop("name")
    right, _ = _run(actor, batch, _contract(name, **alg))
    wrong_alg: dict[str, Any] = {} if ignored != "behavior_weight_cap" else \
        {"behavior_weight_cap": None}
    wrong, _ = _run(actor, batch, _contract(name if wrong_alg else "ppo", **wrong_alg))
    assert abs(float(right["round1/actor/loss/policy"])
               - float(wrong["round1/actor/loss/policy"])) > 1e-3
    assert _rel_l2(wrong, right, "round1/actor/grads/") > 2e-2


def test_report_lists_reference_and_cell_behavior_weights(tmp_path: Any) -> None:
    """report.json's behavior weights: the reference's and each Actor cell's own rows,
    gathered by the comparator (qualify.compare.weights); report.md renders them."""
    import json
    from types import SimpleNamespace

    from qualify.compare.report import _behavior_weight_lines
    from qualify.compare.weights import behavior_weight_rows

    stats = {"mean": 0.25, "min": 0.2, "max": 0.65, "fraction_capped": 0.0, "tokens": 42}
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "reference.json").write_text(json.dumps(
        {"update_meta": {"hf-fp32": {"actor": {"behavior_weight": {"round1": stats}}},
                         "attn_impl-fp32": {"actor": {"behavior_weight": {"round1": stats}}}}}))
    att = tmp_path / "run" / "cells" / "x-fp32-actor-tp1" / "attempt-1"
    att.mkdir(parents=True)
    (att / "outputs.json").write_text(json.dumps(
        {"behavior_weight": {"round1": {**stats, "mean": 0.26}}}))
    rows = behavior_weight_rows(ref, tmp_path / "run",
                                [("x-fp32-actor-tp1", "cells/x-fp32-actor-tp1/attempt-1")])
    assert [(r["source"], r["mean"]) for r in rows] == [("reference hf-fp32", 0.25),
                                                         ("x-fp32-actor-tp1", 0.26)]
    text = "\n".join(_behavior_weight_lines(cast(Any, SimpleNamespace(behavior_weights=rows))))
    assert "## Behavior importance weights" in text
    assert "| reference hf-fp32 " in text
    assert "attn_impl" not in text  # controls are not listed
    assert "| x-fp32-actor-tp1 " in text
    assert "0.26" in text
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "reference.json").write_text(json.dumps({"update_meta": {"hf-fp32": {"actor": {}}}}))
    assert behavior_weight_rows(empty, tmp_path / "run", []) == ()
    assert _behavior_weight_lines(cast(Any, SimpleNamespace(behavior_weights=()))) == []
