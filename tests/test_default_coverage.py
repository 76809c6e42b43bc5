"""The default contracts exercise every rule they check (issue #15, "contract coverage").

A check that cannot fail is not evidence: ``coverage.json`` of a sealed reference
(:mod:`qualify.reference.coverage`) counts what each rule of the losses, the padding and the
optimizer touches on the frozen rollout. The fast tests check the contract's settings
alone; the slow one seals a real reference of the committed default contract (its vLLM
rollout, every lane: ``fp32``, ``bf16-castmasters``, ``bf16-autocast``) and requires every rule
exercised but the one the contract schema cannot reach:

- ``reward_kl_active``: the schema's only reference policy is the actor's initial weights
  (``roles.reference = "actor_init"``), so the reward's KL term on the rollout the actor
  itself scored is exactly 0. Its power needs a reference policy other than the actor
  (a schema change), not another setting.

The slow test reads the session's shared reference of the default contract
(:func:`shared_artifacts.default_reference`, which test_vllm_rollout checks too): about
45 s on 2 idle cores when this module is the first to need it, minutes when they are shared.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from shared_artifacts import default_reference

from qualify.contract import Contract, default_contract_path, load_contract
from qualify.evidence import store
from qualify.layout import COVERAGE_FILE
from qualify.reference.coverage import ADAMW_DEFAULTS
from qualify.resources import contracts_dir

UNREACHABLE = {("reward_kl_active", None, None, None)}
"""Rules no setting of the current contract schema can exercise (module docstring)."""

PER_LANE = {"policy_upper_clipped", "policy_upper_unclipped", "policy_lower_clipped",
            "policy_lower_unclipped", "ratio_far_from_one", "loss_kl_active",
            "entropy_bonus_active", "value_clipped", "value_unclipped", "grad_clip_engaged"}
GLOBAL = {"reward_kl_active", "prompts_left_padded", "responses_right_padded",
          "loss_aggregation", "gradient_accumulation", "adamw_betas", "adamw_eps",
          "adamw_weight_decay", "lr_schedule"}


@pytest.mark.parametrize("name", ["tiny-qwen3.toml", "tiny-qwen3-vocab32k.toml"])
def test_contract_settings_are_not_library_defaults(name: str) -> None:
    """AdamW settings differ from torch's, and every loss term has a non-zero weight."""
    c = load_contract(contracts_dir() / name)
    o, a = c.optimizer, c.algorithm
    assert tuple(o.betas) != ADAMW_DEFAULTS["betas"]
    assert o.eps != ADAMW_DEFAULTS["eps"]
    assert o.weight_decay != ADAMW_DEFAULTS["weight_decay"]
    assert a.kl_loss_coef > 0
    assert a.entropy_coef > 0
    assert a.kl_coef > 0
    assert a.rounds >= 2  # the clip branches exist from round 2 on
    lengths = {len(p) for p in c.prompts.token_ids or []}
    assert len(lengths) > 1  # prompts of different lengths: the batch is left-padded


def test_large_vocabulary_contract_matches_the_default_but_the_vocabulary() -> None:
    default = load_contract(default_contract_path())
    big = load_contract(contracts_dir() / "tiny-qwen3-vocab32k.toml")
    assert big.model.config["vocab_size"] == 32768 >= 32 * default.model.config["vocab_size"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert big.model.config[key] == default.model.config[key], key
    assert big.algorithm == default.algorithm
    assert big.optimizer == default.optimizer
    assert set(big.matrix.precisions) == {"fp32", "bf16"}
    assert set(big.matrix.tp_sizes) == {1, 2}


@pytest.fixture(scope="module")
def coverage(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    contract: Contract = load_contract(default_contract_path())
    ref = default_reference(tmp_path_factory) / "references" / \
        f"{contract.name}-{contract.digest12}"
    assert store.is_sealed(ref)
    doc: dict[str, Any] = json.loads((ref / COVERAGE_FILE).read_text("utf-8"))
    return doc


@pytest.mark.slow
def test_default_contract_exercises_every_rule(coverage: dict[str, Any]) -> None:
    rules = coverage["rules"]
    missing = {(r["rule"], r["label"], r["role"], r["round"]) for r in rules
               if not r["exercised"]}
    assert missing == UNREACHABLE, coverage["summary"]["no_power"]
    assert {r["rule"] for r in rules if r["label"] is None} == GLOBAL
    labels = {r["label"] for r in rules if r["label"] is not None}
    assert labels == {"fp32", "bf16-castmasters", "bf16-autocast"}
    for label in labels:
        assert {r["rule"] for r in rules if r["label"] == label} == PER_LANE, label
    assert coverage["summary"]["no_power"] == [
        "NO POWER: no token with a non-zero reward KL (the reference policy equals the "
        "scored actor)"]
