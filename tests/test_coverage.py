"""Contract coverage (:mod:`qualify.reference.coverage`) on hand-built rollouts.

Every expected count below is derived by hand from the tensors built here: which token
sits on which side of which clip edge, which sequence is padded where.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import pytest

from qualify.contract import Contract, load_contract
from qualify.reference.coverage import (
    compute_coverage,
    coverage_document,
    no_power_lines,
)
from qualify.resources import contracts_dir


@pytest.fixture(scope="module")
def contract() -> Contract:
    """tiny-qwen3 with every setting these tests count pinned here (not read from the file)."""
    c = load_contract(contracts_dir() / "tiny-qwen3.toml")
    c = dataclasses.replace(c, optimizer=dataclasses.replace(
        c.optimizer, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01))
    return _with(c, clip_ratio=0.2, value_clip=0.05, kl_coef=0.05, kl_loss_coef=0.01,
                 kl_loss_estimator="k3", entropy_coef=0.01, micro_batch_size=4, rounds=2)


def _with(contract: Contract, **alg: Any) -> Contract:
    return dataclasses.replace(contract, algorithm=dataclasses.replace(contract.algorithm,
                                                                        **alg))


# B = 2, P = 2, R = 3. Sequence 0: prompt left-padded, full-length response; sequence 1:
# no prompt padding, response of 2 tokens (right-padded).
ROLLOUT = {
    "prompts": np.array([[0, 5], [7, 8]]),
    "attention_mask": np.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]),
    "response_mask": np.array([[1, 1, 1], [1, 1, 0]]),
}
ADV = np.array([[1.0, -1.0, 1.0], [-1.0, 1.0, 0.0]], np.float32)
RET = np.array([[1.0, -1.0, 0.0], [0.0, 0.0, 0.0]], np.float32)
# Round-2 ratios exp(logp_2 - logp_1): (0,0) 1.3 with A > 0 (upper clipped at eps 0.2),
# (0,1) 0.7 with A < 0 (lower clipped), (0,2) 1.05 with A > 0, (1,0) 0.9 with A < 0,
# (1,1) 1.0 with A > 0; (1,2) is padding (its ratio 2.0 must not count).
RATIOS = np.array([[1.3, 0.7, 1.05], [0.9, 1.0, 2.0]])


def _run(*, clip_coef: tuple[float, float] = (1.0, 0.5)) -> dict[str, np.ndarray]:
    old = np.array([[-1.0, -2.0, -1.5], [-0.5, -1.0, 0.0]])
    return {
        "round1/actor/logprobs": old.astype(np.float32),
        "round2/actor/logprobs": (old + np.log(RATIOS)).astype(np.float32),
        "round1/actor/entropy": np.ones((2, 3), np.float32),
        "round1/critic/values": np.zeros((2, 3), np.float32),
        # d = 0.1 at (0,0) with return 1 (clipped at value_clip 0.05: (0.05-1)^2 > (0.1-1)^2),
        # d = 0.1 at (0,1) with return -1 (unclipped wins), d = 0.01 elsewhere.
        "round2/critic/values": np.array([[0.1, 0.1, 0.01], [0.01, 0.01, 0.5]], np.float32),
        "round1/actor/clip_coef": np.array(clip_coef[0], np.float32),
        "round2/actor/clip_coef": np.array(clip_coef[1], np.float32),
        "round1/critic/clip_coef": np.array(1.0, np.float32),
        "round2/critic/clip_coef": np.array(1.0, np.float32),
    }


def _rules(contract: Contract, *, kl: np.ndarray | None = None,
           run: dict[str, np.ndarray] | None = None) -> dict[tuple[Any, ...], Any]:
    rules = compute_coverage(
        contract, rollout=ROLLOUT,
        targets={"kl": np.zeros((2, 3)) if kl is None else kl},
        train={"advantages": ADV, "returns": RET}, runs={"fp32": run or _run()})
    return {(r.rule, r.label, r.role, r.round): r for r in rules}


def test_clip_edges_counted_on_each_side(contract: Contract) -> None:
    got = _rules(_with(contract, clip_ratio=0.2, value_clip=0.05))
    c = {k[0]: v.count for k, v in got.items() if k[1:] in (("fp32", "actor", 2),
                                                            ("fp32", "critic", 2))}
    assert c["policy_upper_clipped"] == 1  # (0,0)
    assert c["policy_upper_unclipped"] == 2  # (0,2), (1,1)
    assert c["policy_lower_clipped"] == 1  # (0,1)
    assert c["policy_lower_unclipped"] == 1  # (1,0)
    assert c["ratio_far_from_one"] == 2  # |ratio - 1| > 0.1: (0,0), (0,1)
    assert c["value_clipped"] == 1  # (0,0)
    assert c["value_unclipped"] == 4
    assert all(r.total == 5 for k, r in got.items() if k[3] == 2)


def test_a_wider_clip_moves_tokens_across_the_edges(contract: Contract) -> None:
    """clip_ratio 0.35: ratio 1.3 and 0.7 are inside the edges now; nothing is clipped."""
    got = _rules(_with(contract, clip_ratio=0.35))
    key = ("policy_lower_clipped", "fp32", "actor", 2)
    assert got[key].count == 0
    assert not got[key].exercised
    assert got[("policy_upper_clipped", "fp32", "actor", 2)].count == 0
    assert got[("policy_upper_unclipped", "fp32", "actor", 2)].count == 3
    assert got[("policy_lower_unclipped", "fp32", "actor", 2)].count == 2
    assert got[("ratio_far_from_one", "fp32", "actor", 2)].count == 2  # 0.3 > 0.175
    lines = no_power_lines([r.to_dict() for r in got.values()])
    assert ("NO POWER: no token on the lower policy clip edge (A < 0, ratio < 1 - "
            "clip_ratio) (round 2, actor, fp32)") in lines


def test_padding_aggregation_and_accumulation(contract: Contract) -> None:
    got = _rules(contract)
    assert got[("prompts_left_padded", None, None, None)].count == 1
    assert got[("responses_right_padded", None, None, None)].count == 1
    agg = got[("loss_aggregation", None, None, None)]
    assert agg.count == 2
    assert agg.exercised
    acc = got[("gradient_accumulation", None, None, None)]
    assert acc.count == 1
    assert not acc.exercised
    two = _rules(_with(contract, micro_batch_size=1))
    assert two[("gradient_accumulation", None, None, None)].count == 2


def test_kl_entropy_and_coefficients(contract: Contract) -> None:
    got = _rules(contract)
    rkl = got[("reward_kl_active", None, None, None)]
    assert rkl.count == 0
    assert not rkl.exercised
    kl = np.zeros((2, 3))
    kl[0, 1], kl[1, 2] = 0.01, 0.5  # (1,2) is padding
    assert _rules(contract, kl=kl)[("reward_kl_active", None, None, None)].count == 1
    assert _rules(_with(contract, kl_coef=0.0), kl=kl)[
        ("reward_kl_active", None, None, None)].exercised is False
    # Loss KL: k3 of logp_2 - logp_1 (the reference is the actor's init) is non-zero where
    # the ratio is not 1: 4 valid tokens ((1,1) has ratio 1).
    lkl = got[("loss_kl_active", "fp32", "actor", 2)]
    assert lkl.count == 4
    assert lkl.exercised
    off = _rules(_with(contract, kl_loss_coef=0.0))[("loss_kl_active", "fp32", "actor", 2)]
    assert off.count == 0
    assert not off.exercised
    assert "kl_loss_coef = 0" in off.absent
    assert got[("entropy_bonus_active", "fp32", "actor", 1)].count == 5
    assert not _rules(_with(contract, entropy_coef=0.0))[
        ("entropy_bonus_active", "fp32", "actor", 1)].exercised


def test_grad_clip_and_adamw_defaults(contract: Contract) -> None:
    got = _rules(contract)
    assert got[("grad_clip_engaged", "fp32", "actor", None)].count == 1
    critic = got[("grad_clip_engaged", "fp32", "critic", None)]
    assert critic.count == 0
    assert not critic.exercised
    # torch.optim.AdamW's defaults (the fixture's): none of the three is exercised.
    for k in ("adamw_betas", "adamw_eps", "adamw_weight_decay"):
        assert not got[(k, None, None, None)].exercised
    moved = dataclasses.replace(contract, optimizer=dataclasses.replace(
        contract.optimizer, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1))
    m = _rules(moved)
    assert all(m[(k, None, None, None)].count == 1
               for k in ("adamw_betas", "adamw_eps", "adamw_weight_decay"))


def test_document_is_deterministic_and_lists_no_power(contract: Contract) -> None:
    c = _with(contract, clip_ratio=0.35)
    rules = compute_coverage(c, rollout=ROLLOUT, targets={"kl": np.zeros((2, 3))},
                             train={"advantages": ADV, "returns": RET},
                             runs={"fp32": _run(), "bf16": _run()})
    doc = coverage_document(c, rules)
    again = coverage_document(c, compute_coverage(
        c, rollout=ROLLOUT, targets={"kl": np.zeros((2, 3))},
        train={"advantages": ADV, "returns": RET}, runs={"bf16": _run(), "fp32": _run()}))
    assert json.dumps(doc, sort_keys=True) == json.dumps(again, sort_keys=True)
    s = doc["summary"]
    assert s["rules"] == len(doc["rules"])
    assert s["exercised"] + len(s["no_power"]) == s["rules"]
    assert [r["label"] for r in doc["rules"] if r["label"]] == sorted(
        r["label"] for r in doc["rules"] if r["label"])
    assert not any(math.isnan(float(r["count"])) for r in doc["rules"])
