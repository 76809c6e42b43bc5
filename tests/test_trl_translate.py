"""The TRL adapter's translation of a contract's algorithm (harnesses/trl/translate.py).

No TRL needed.

What TRL 1.16.0's GRPOTrainer cannot run must be named (a cell's NOT_RUN reason), and what
it can run must map to the GRPOConfig fields whose normalisation is the contract's.
"""

from __future__ import annotations

import pytest

from harnesses.trl import translate
from qualify.contract import AlgorithmSpec


def _alg(**kw: object) -> AlgorithmSpec:
    base: dict[str, object] = {"name": "grpo", "gamma": 1.0, "lam": 1.0, "clip_ratio": 0.2,
                               "micro_batch_size": 4, "rounds": 2}
    return AlgorithmSpec(**{**base, **kw})  # type: ignore[arg-type]


@pytest.mark.parametrize(("kw", "loss_type", "level"), [
    ({}, "dapo", "token"),
    ({"loss_agg_mode": "seq-mean-token-mean"}, "grpo", "token"),
    ({"loss_agg_mode": "seq-mean-token-sum"}, "luspo", "token"),
    ({"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 16.0}, "dr_grpo", "token"),
    ({"policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"}, "grpo", "sequence"),
    ({"policy_loss": "cispo", "clip_ratio_low": 1.0, "clip_ratio_high": 4.0}, "cispo", "token"),
])
def test_runs_and_maps(kw: dict[str, object], loss_type: str, level: str) -> None:
    alg = _alg(**kw)
    assert translate.unsupported(alg) == []
    cfg = translate.grpo_config_kwargs(alg, response_len=10)
    assert (cfg["loss_type"], cfg["importance_sampling_level"]) == (loss_type, level)
    assert cfg["use_bias_correction_kl"] is False  # never TRL's default (True)
    if loss_type == "dr_grpo":
        assert cfg["max_completion_length"] == 16
    if loss_type == "cispo":  # TRL clamps the ratio at epsilon_high itself
        assert cfg["epsilon_high"] == 5.0


@pytest.mark.parametrize(("kw", "roles", "named"), [
    ({}, ("actor", "critic"), "roles=critic"),
    ({"name": "decoupled_ppo"}, ("actor",), "name=decoupled_ppo"),
    ({"clip_ratio_c": 3.0}, ("actor",), "clip_ratio_c=3.0"),
    ({"kl_loss_coef": 0.1, "kl_loss_estimator": "k1"}, ("actor",), "kl_loss_estimator=k1"),
    ({"loss_agg_mode": "token-sum"}, ("actor",), "loss_agg_mode=token-sum"),
    ({"policy_loss": "cispo"}, ("actor",), "clip_ratio_low=0.2"),
    ({"entropy_coef": 0.01, "loss_agg_mode": "seq-mean-token-mean"}, ("actor",),
     "entropy_coef=0.01"),
    ({"rollout_is": "token", "rollout_is_threshold": 2.0}, ("actor",), "rollout_is=token"),
])
def test_refuses_and_names(kw: dict[str, object], roles: tuple[str, ...], named: str) -> None:
    got = translate.unsupported(_alg(**kw), roles)
    assert any(g.startswith(named) for g in got), got
