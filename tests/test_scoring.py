"""Teacher-forced HF scoring: independent derivations, controls, precision records."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import (
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
    Qwen3ForTokenClassification,
)

from qualify.contract import SamplingSpec
from qualify.errors import ContractError
from qualify.reference.rollout import Rollout, build_rollout
from qualify.reference.scoring import (
    Bf16Mode,
    PrecisionMismatchError,
    ScoreRecord,
    rule_rewards,
    score_policy,
    score_rewards,
    score_values,
)

PAD, EOS, BOS = 0, 2, 1
T = 0.9
CONFIG: dict[str, Any] = {
    "vocab_size": 384, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "pad_token_id": PAD, "eos_token_id": EOS, "bos_token_id": BOS,
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads; on a busy 2-core box they lose 10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def build(cls: type, seed: int, attn: str = "sdpa", **extra: Any) -> Any:
    torch.manual_seed(seed)
    config: Any = Qwen3Config
    model = cls(config(**CONFIG, **extra, attn_implementation=attn))
    with torch.no_grad():  # peaked logits so that BF16 and padding effects are visible
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(3.0)
    return model.eval()


@pytest.fixture(scope="module")
def actor() -> Any:
    return build(Qwen3ForCausalLM, 1234)


@pytest.fixture(scope="module")
def critic() -> Any:
    return build(Qwen3ForTokenClassification, 7, num_labels=1)


@pytest.fixture(scope="module")
def reward_model() -> Any:
    return build(Qwen3ForSequenceClassification, 11, num_labels=1)


@pytest.fixture(scope="module")
def rollout() -> Rollout:
    """Ragged prompts and responses: EOS-terminated, length-cut, and a sampled pad id at the end."""
    prompts = [[1, 17, 45, 200, 33], [1, 90, 12], [1, 250, 251, 252, 253, 254, 99], [1, 5, 300, 6]]
    g = torch.Generator().manual_seed(5)
    generated = [torch.randint(3, 384, (8,), generator=g).tolist() for _ in range(8)]
    generated[0][2] = EOS  # EOS-terminated, 3 tokens
    generated[3][0] = EOS  # EOS as the only token
    generated[4][5] = PAD  # a sampled pad id inside a response
    generated[5][7] = PAD  # ... and as the last token of a length-cut response
    generated[6][6] = EOS
    spec = SamplingSpec(engine="hf", temperature=T, top_p=1.0, top_k=0, max_new_tokens=8,
                        samples_per_prompt=2, seed=0, logprobs_mode="processed")
    return build_rollout(
        prompts=prompts, generated=generated, logprobs=[[-1.0] * 8] * 8, sampling=spec,
        pad_token_id=PAD, eos_token_id=EOS, sampler="test", sampler_version="0",
    )


def unpadded(r: Rollout, row: int) -> tuple[torch.Tensor, int, int]:
    """The row's real tokens (prompt + response), the prompt length and the response length."""
    ids = r.input_ids[row][r.attention_mask[row].bool()]
    length = int(r.response_mask[row].sum())
    return ids, len(ids) - length, length


def valid_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b)[mask.bool()].abs().max())


# --- independent derivations ------------------------------------------------------------


def test_logprobs_and_entropy_match_hand_rolled(actor: Any, rollout: Rollout) -> None:
    out, record = score_policy(actor, rollout, temperature=T, micro_batch_size=4)
    assert record.micro_batches == 2
    assert record.temperature == T
    for row in range(rollout.batch_size):
        ids, lq, length = unpadded(rollout, row)
        with torch.no_grad():
            z = actor(ids[None]).logits[0].float() / T
        z = z[lq - 1 : lq - 1 + length]
        want = torch.log_softmax(z, -1).gather(-1, ids[lq:, None]).squeeze(-1)
        ent = torch.distributions.Categorical(logits=z).entropy()
        torch.testing.assert_close(out["logprobs"][row, :length], want, rtol=0, atol=1e-5)
        torch.testing.assert_close(out["entropy"][row, :length], ent, rtol=0, atol=1e-5)
        assert out["logprobs"][row, length:].eq(0).all()
        assert out["entropy"][row, length:].eq(0).all()
    assert (out["entropy"] >= 0).all()
    assert (out["logprobs"] <= 0).all()
    assert out["logprobs"].dtype == out["entropy"].dtype == torch.float32


def test_values_follow_the_position_convention(critic: Any, rollout: Rollout) -> None:
    out, _ = score_values(critic, rollout, micro_batch_size=3)
    for row in range(rollout.batch_size):
        ids, lq, length = unpadded(rollout, row)
        with torch.no_grad():
            v = critic(ids[None]).logits[0, :, 0]
        # value at response position t = critic output at sequence position P - 1 + t
        torch.testing.assert_close(out["values"][row, :length], v[lq - 1 : lq - 1 + length],
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(out["last_values"][row], v[-1], rtol=0, atol=1e-5)
        assert out["values"][row, length:].eq(0).all()


def test_rewards_pool_at_the_last_valid_token(reward_model: Any,
                                              rollout: Rollout) -> None:
    out, _ = score_rewards(reward_model, rollout, micro_batch_size=4)
    for row in range(rollout.batch_size):
        ids, _, _ = unpadded(rollout, row)
        with torch.no_grad():
            hidden = reward_model.model(ids[None]).last_hidden_state
            want = reward_model.score(hidden)[0, -1, 0]
            hf_pooled = reward_model(ids[None]).logits[0, 0]
        torch.testing.assert_close(out["scores"][row], want, rtol=0, atol=1e-5)
        if ids[-1] == PAD:  # HF's own pooling skips a sampled pad id: why we pool by mask
            assert abs(float(hf_pooled - want)) > 1e-4


def test_rule_rewards(rollout: Rollout) -> None:
    scores = rule_rewards(rollout)
    assert scores.dtype == torch.float32
    assert scores.tolist() == rollout.eos_terminated.float().tolist()
    with pytest.raises(ContractError, match="unknown rule 'length_penalty'"):
        rule_rewards(rollout, "length_penalty")


# --- controls: micro-batch partition, padding, attention implementation ------------------

PARTITIONS = [
    pytest.param(1, 0, 0, id="mb1"),
    pytest.param(8, 0, 0, id="mb8"),
    pytest.param(3, 2, 5, id="mb3-left2-right5"),
    pytest.param(4, 0, 3, id="mb4-right3"),
    pytest.param(2, 4, 0, id="mb2-left4"),
]


@pytest.mark.parametrize(("mbs", "left", "right"), PARTITIONS)
def test_partition_and_padding_do_not_change_results(
    actor: Any, critic: Any, reward_model: Any,
    rollout: Rollout, mbs: int, left: int, right: int,
) -> None:
    kw: dict[str, Any] = {
        "micro_batch_size": mbs, "extra_left_padding": left, "extra_right_padding": right,
    }
    base_p, _ = score_policy(actor, rollout, temperature=T, micro_batch_size=4)
    base_v, _ = score_values(critic, rollout, micro_batch_size=4)
    base_r, _ = score_rewards(reward_model, rollout, micro_batch_size=4)
    pol, rec = score_policy(actor, rollout, temperature=T, **kw)
    val, _ = score_values(critic, rollout, **kw)
    rew, _ = score_rewards(reward_model, rollout, **kw)
    assert (rec.extra_left_padding, rec.extra_right_padding) == (left, right)
    m = rollout.response_mask
    for got, want in ((pol["logprobs"], base_p["logprobs"]), (pol["entropy"], base_p["entropy"]),
                      (val["values"], base_v["values"])):
        assert valid_max(got, want, m) <= 1e-5
        assert got[m == 0].eq(0).all()
    torch.testing.assert_close(val["last_values"], base_v["last_values"], rtol=0, atol=1e-5)
    torch.testing.assert_close(rew["scores"], base_r["scores"], rtol=0, atol=1e-5)


def test_eager_and_sdpa_agree(actor: Any, rollout: Rollout) -> None:
    eager = build(Qwen3ForCausalLM, 1234, attn="eager")
    a, rec_a = score_policy(actor, rollout, temperature=T, micro_batch_size=4)
    b, rec_b = score_policy(eager, rollout, temperature=T, micro_batch_size=4)
    assert (rec_a.attn_implementation, rec_b.attn_implementation) == ("sdpa", "eager")
    assert valid_max(a["logprobs"], b["logprobs"], rollout.response_mask) <= 1e-5


# --- precision --------------------------------------------------------------------------


def test_bf16_modes_run_in_bf16_and_differ_plausibly(actor: Any,
                                                     rollout: Rollout) -> None:
    fp32, rec32 = score_policy(actor, rollout, temperature=T, micro_batch_size=4)
    assert (rec32.param_dtypes, rec32.autocast_enabled, rec32.output_dtype) == (
        ("float32",), False, "float32")
    params, rec_p = score_policy(actor, rollout, temperature=T, micro_batch_size=4,
                                 precision="bf16", bf16_mode="params")
    auto, rec_a = score_policy(actor, rollout, temperature=T, micro_batch_size=4,
                               precision="bf16", bf16_mode="autocast")
    assert (rec_p.param_dtypes, rec_p.autocast_enabled, rec_p.output_dtype) == (
        ("bfloat16",), False, "bfloat16")
    assert (rec_a.param_dtypes, rec_a.autocast_enabled, rec_a.autocast_dtype,
            rec_a.output_dtype) == (("float32",), True, "bfloat16", "bfloat16")
    assert {p.dtype for p in actor.parameters()} == {torch.float32}  # master untouched
    m = rollout.response_mask
    for bf16 in (params, auto):
        assert bf16["logprobs"].dtype == torch.float32
        diff = valid_max(bf16["logprobs"], fp32["logprobs"], m)
        assert 0 < diff < 0.5, diff
    assert valid_max(params["logprobs"], auto["logprobs"], m) > 0  # the bf16_mode control


def test_bf16_values_and_rewards(critic: Any, reward_model: Any,
                                 rollout: Rollout) -> None:
    v32, _ = score_values(critic, rollout, micro_batch_size=4)
    r32, _ = score_rewards(reward_model, rollout, micro_batch_size=4)
    modes: tuple[Bf16Mode, ...] = ("params", "autocast")
    for mode in modes:
        v16, rv = score_values(critic, rollout, micro_batch_size=4, precision="bf16",
                               bf16_mode=mode)
        r16, rr = score_rewards(reward_model, rollout, micro_batch_size=4, precision="bf16",
                                bf16_mode=mode)
        assert rv.output_dtype == rr.output_dtype == "bfloat16"
        assert 0 < valid_max(v16["values"], v32["values"], rollout.response_mask) < 0.5
        assert 0 < float((r16["scores"] - r32["scores"]).abs().max()) < 0.5


def test_record_check_raises_on_mismatch() -> None:
    good = ScoreRecord(
        role="policy", precision="fp32", bf16_mode=None, param_dtypes=("float32",),
        autocast_enabled=False, autocast_dtype=None, output_dtype="float32",
        attn_implementation="sdpa", device="cpu", micro_batch_size=1, micro_batches=1,
        extra_left_padding=0, extra_right_padding=0, temperature=1.0,
    )
    good.check()
    assert json.loads(json.dumps(good.to_dict()))["param_dtypes"] == ["float32"]
    cases = {
        "output_dtype": dataclasses.replace(good, output_dtype="bfloat16"),
        "autocast_enabled": dataclasses.replace(good, precision="bf16", bf16_mode="autocast",
                                                autocast_enabled=False, output_dtype="bfloat16"),
        "param_dtypes": dataclasses.replace(good, precision="bf16", bf16_mode="params",
                                            output_dtype="bfloat16"),
    }
    for field, record in cases.items():
        with pytest.raises(PrecisionMismatchError, match=f"{field}: expected"):
            record.check()


def test_a_pass_that_does_not_run_as_asked_is_refused(actor: Any,
                                                      rollout: Rollout) -> None:
    # a hook that silently makes the head emit BF16 under an FP32 request
    handle = actor.get_output_embeddings().register_forward_hook(
        lambda _m, _i, out: out.to(torch.bfloat16))
    try:
        with pytest.raises(PrecisionMismatchError, match="output_dtype: expected 'float32'"):
            score_policy(actor, rollout, temperature=T, micro_batch_size=4)
    finally:
        handle.remove()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        pytest.param({"precision": "bf16"}, ContractError, "bf16 needs", id="bf16-without-mode"),
        pytest.param({"precision": "fp16"}, ContractError, "'fp16'", id="unknown-precision"),
        pytest.param({"micro_batch_size": 0}, ValueError, "micro_batch_size", id="mbs-0"),
        pytest.param({"temperature": 0.0}, ValueError, "temperature", id="temperature-0"),
    ],
)
def test_bad_requests(actor: Any, rollout: Rollout, kwargs: dict[str, object],
                      error: type[Exception], message: str) -> None:
    args: dict[str, object] = {"temperature": T, "micro_batch_size": 4, **kwargs}
    with pytest.raises(error, match=message):
        score_policy(actor, rollout, **args)  # type: ignore[arg-type]


def test_bf16_mode_is_ignored_at_fp32(actor: Any, rollout: Rollout) -> None:
    plain = score_policy(actor, rollout, temperature=T, micro_batch_size=4)
    res = score_policy(actor, rollout, temperature=T, micro_batch_size=4, bf16_mode="params")
    assert res.record.bf16_mode is None
    assert res.record.param_dtypes == ("float32",)
    assert torch.equal(res.tensors["logprobs"], plain.tensors["logprobs"])


def test_non_fp32_master_is_refused(rollout: Rollout) -> None:
    bf16 = build(Qwen3ForCausalLM, 1234).to(torch.bfloat16)
    with pytest.raises(ValueError, match="FP32 parameters"):
        score_policy(bf16, rollout, temperature=T, micro_batch_size=4)
