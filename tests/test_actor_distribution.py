"""The Actor's own next-token distributions the harness SDK records (issue #48 item 2).

- :func:`qualify_harness.distribution.distribution_tensors`: the full path is
  ``log_softmax`` of the logits in FP64 rounded to FP32 (raw and tempered), 0 at masked
  positions; the top-k
  path (forced on a small vocabulary) orders equal logprobs by the smaller id, exactly as
  :func:`qualify.distmetrics.topk_of` does, and gives the response token's logprob; the
  path switches at the reference side's own limit, decided once (:func:`qualify_harness
  .distribution.use_topk`, which the driver's record and meta follow); both paths give the
  top raw logit per position ``[b, R]``, the engine's own value;
- :func:`qualify_harness.run_actor` records them at the initial weights for an engine with
  :meth:`~qualify_harness.Engine.response_logits`, and says ``not_recorded`` (no tensors)
  for one without it and for a resumed launch that skips round 1;
- an engine with :meth:`~qualify_harness.Engine.response_logits` and no
  ``logprobs_and_entropy`` of its own scores by the SDK log-softmax of its logits, bitwise;
- the conformance check accepts int64 ``*_ids`` tensors and only those.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import qualify_harness as sdk
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from qualify_harness import distribution as sdk_dist
from qualify_harness import losses
from qualify_harness.driver import RESUMED_WITHOUT_ROUND1
from qualify_harness.protocol import DEFAULT_DISTRIBUTION_TOPK, FULL_DISTRIBUTION_MAX_VOCAB

from qualify.candidate.conformance import _tensor_findings
from qualify.contract import load_contract
from qualify.distmetrics import topk_of
from qualify.reference.distribution import MAX_VOCAB
from qualify.resources import contracts_dir


def test_the_paths_switch_where_the_reference_switches() -> None:
    assert FULL_DISTRIBUTION_MAX_VOCAB == MAX_VOCAB
    assert sdk_dist.metric_names(MAX_VOCAB) == ("prefill_raw", "prefill_tempered")
    assert sdk_dist.metric_names(MAX_VOCAB + 1) == tuple(
        f"prefill_{kind}_{part}" for kind in ("raw", "tempered")
        for part in ("topk_logprobs", "topk_ids", "logprobs"))
    got = sdk_dist.distribution_tensors(torch.randn(1, 2, MAX_VOCAB + 1),
                                        torch.tensor([[3, MAX_VOCAB]]),
                                        torch.tensor([[True, True]]), temperature=0.5, k=5)
    assert tuple(got) == (*sdk_dist.metric_names(MAX_VOCAB + 1), sdk_dist.TOP_LOGIT)
    assert sdk_dist.TOP_LOGIT == "prefill_top_logit"
    assert [sdk_dist.use_topk(v) for v in (MAX_VOCAB, MAX_VOCAB + 1)] == [False, True]
    assert [sdk_dist.use_topk(MAX_VOCAB + 1, t) for t in (False, True)] == [False, True]


@pytest.mark.parametrize("path", sorted(contracts_dir().glob("*.toml")), ids=lambda p: p.stem)
def test_recipe_reads_the_topk_width_as_qualify_does(path: Path) -> None:
    c = load_contract(path)
    assert sdk.Recipe.from_contract(c.to_dict()).distribution_topk == \
        c.bounds.distribution_topk
    doc = c.to_dict()
    doc.get("bounds", {}).pop("distribution_topk", None)
    assert sdk.Recipe.from_contract(doc).distribution_topk == DEFAULT_DISTRIBUTION_TOPK == 64


def _case(draw: Any, ties: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, r_len, vocab = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(2, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: most rows hold equal logits
        logits = torch.randint(-2, 3, (b, r_len, vocab), generator=g).float() * 1.5
    else:
        logits = torch.randn(b, r_len, vocab, generator=g) * 4
    responses = torch.randint(0, vocab, (b, r_len), generator=g)
    mask = torch.rand(b, r_len, generator=g) < 0.7
    return logits, responses, mask


@settings(max_examples=40, deadline=None)
@given(data=st.data(), temperature=st.floats(0.25, 2.0), bf16=st.booleans())
def test_full_path_is_the_fp64_log_softmax_rounded_and_zero_where_masked(
        data: st.DataObject, temperature: float, bf16: bool) -> None:
    logits, responses, mask = _case(data.draw, ties=False)
    if bf16:
        logits = logits.bfloat16()
    got = sdk_dist.distribution_tensors(logits, responses, mask, temperature=temperature, k=3)
    assert set(got) == {"prefill_raw", "prefill_tempered", "prefill_top_logit"}
    top = got["prefill_top_logit"]
    assert top.dtype == torch.float32
    assert top.shape == mask.shape
    assert torch.all(top[~mask] == 0)
    assert torch.equal(top[mask], logits.float().max(dim=-1).values[mask])  # exact, raw
    for name, z in (("prefill_raw", logits.double()),
                    ("prefill_tempered", logits.double() / temperature)):
        t = got[name]
        assert t.dtype == torch.float32
        assert t.shape == logits.shape
        assert torch.all(t[~mask] == 0)
        # the contract's formula itself (FP64 log-softmax, rounded once): bitwise
        assert torch.equal(t[mask], torch.log_softmax(z, dim=-1).float()[mask])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), temperature=st.floats(0.25, 2.0), ties=st.booleans())
def test_topk_path_orders_ties_by_id_and_gives_the_token_logprob(
        data: st.DataObject, temperature: float, ties: bool) -> None:
    logits, responses, mask = _case(data.draw, ties=ties)
    k = data.draw(st.integers(1, logits.shape[-1]))
    got = sdk_dist.distribution_tensors(logits, responses, mask, temperature=temperature,
                                        k=k, topk=True)
    assert tuple(got) == (*sdk_dist.metric_names(2, topk=True), sdk_dist.TOP_LOGIT)
    assert torch.equal(got[sdk_dist.TOP_LOGIT],
                       torch.where(mask, logits.max(dim=-1).values, 0.0))
    for kind, z in (("raw", logits.double()), ("tempered", logits.double() / temperature)):
        lp = torch.log_softmax(z, dim=-1).float()
        vals, ids = topk_of(lp.numpy(), k)
        top_lp, top_ids = got[f"prefill_{kind}_topk_logprobs"], got[f"prefill_{kind}_topk_ids"]
        token = got[f"prefill_{kind}_logprobs"]
        assert top_ids.dtype == torch.int64
        assert top_lp.dtype == token.dtype == torch.float32
        m = mask.numpy()
        np.testing.assert_array_equal(top_ids.numpy()[m], ids[m])
        np.testing.assert_array_equal(top_lp.numpy()[m], vals[m])
        np.testing.assert_array_equal(token.numpy()[m],
                                      lp.gather(-1, responses[..., None])[..., 0].numpy()[m])
        assert not top_lp[~mask].any()
        assert not top_ids[~mask].any()
        assert not token[~mask].any()


def test_bad_arguments_are_refused() -> None:
    logits, responses, mask = torch.zeros(1, 2, 5), torch.zeros(1, 2, dtype=torch.long), \
        torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"k = 6 is not in \[1, V = 5\]"):
        sdk_dist.distribution_tensors(logits, responses, mask, temperature=1.0, k=6, topk=True)
    with pytest.raises(ValueError, match="disagree"):
        sdk_dist.distribution_tensors(logits, responses[:, :1], mask, temperature=1.0, k=1)
    with pytest.raises(ValueError, match=r"temperature 0\.0 is not > 0"):
        sdk_dist.distribution_tensors(logits, responses, mask, temperature=0.0, k=1)


# --------------------------------------------------------------------------- run_actor

V, H, P, R = 11, 6, 3, 4


class _TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(V, H)
        self.head = torch.nn.Linear(H, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.tanh(self.embed(ids)).cumsum(1))
        return out


def _window(model: Any, batch: sdk.Batch) -> torch.Tensor:
    out: torch.Tensor = model(batch.input_ids)[:, batch.prompt_len - 1:][:, :batch.response_len]
    return out


class _NoLogits(sdk.TorchOptimEngine):
    """An engine without :meth:`response_logits` (the SDK's default raises)."""

    def __init__(self, model: torch.nn.Module, temperature: float) -> None:
        self.model, self.temperature, self.device = model, temperature, torch.device("cpu")
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1.0)

    def logprobs_and_entropy(self, model: Any, batch: sdk.Batch) -> tuple[Any, Any]:
        return losses.logprobs_and_entropy(_window(model, batch), batch.responses,
                                           self.temperature)

    def check_replicas(self) -> tuple[dict[str, bool], dict[str, float]]:
        return {}, {}


class _WithLogits(_NoLogits):
    def response_logits(self, model: Any, batch: sdk.Batch) -> torch.Tensor:
        return _window(model, batch)


def _batch(b: int = 5) -> sdk.Batch:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, V, (b, P + R), generator=g)
    mask = torch.rand(b, R, generator=g) < 0.75
    return sdk.Batch(input_ids=ids, attention_mask=torch.ones_like(ids),
                     position_ids=torch.arange(P + R).expand(b, -1), responses=ids[:, P:],
                     mask=mask, advantages=torch.randn(b, R, generator=g),
                     returns=torch.randn(b, R, generator=g), prompt_len=P,
                     behavior_logprobs=torch.zeros(b, R))


RECIPE = sdk.Recipe(algorithm="ppo", rounds=2, micro_batch_size=2, clip_ratio=0.2,
                    actor_lr=1e-2, critic_lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                    weight_decay=0.0, max_grad_norm=1.0, temperature=0.7)


def _run(engine_cls: type[_NoLogits], rounds: list[int], recipe: sdk.Recipe = RECIPE
         ) -> tuple[dict[str, Any], sdk.Recorder, torch.Tensor]:
    torch.manual_seed(0)
    model, batch = _TinyLM(), _batch()
    with torch.no_grad():
        initial = _window(copy.deepcopy(model), batch)  # the weights before any step
    ref = copy.deepcopy(model).requires_grad_(False)
    rec = sdk.Recorder(role="actor", writer=True)
    state = {"old_logprobs": torch.zeros(5, R), "w_behav": torch.ones(5, R),
             "w_raw": torch.ones(5, R)}
    meta = sdk.run_actor(engine_cls(model, recipe.temperature), model, ref, batch, recipe,
                         rec=rec, rounds=rounds,
                         restore=None if 1 in rounds else (lambda: state))
    return meta, rec, initial


def test_run_actor_records_the_initial_weights_distributions() -> None:
    meta, rec, initial = _run(_WithLogits, [1, 2])
    assert meta["distribution"] == {"path": "full", "k": None, "vocab": V}
    mask = _batch().mask
    for name, z in (("prefill_raw", initial.double()),
                    ("prefill_tempered", initial.double() / RECIPE.temperature)):
        got = rec.tensors[f"round1/actor/{name}"]
        assert got.shape == (5, R, V)  # 3 micro-batches (2, 2, 1 rows) assembled in order
        torch.testing.assert_close(got[mask], torch.log_softmax(z, -1).float()[mask], rtol=0,
                                   atol=0)
        assert not got[~mask].any()
    assert torch.equal(rec.tensors["round1/actor/prefill_top_logit"],
                       torch.where(mask, initial.max(dim=-1).values, 0.0))
    assert not any(n.startswith("round2/actor/prefill") for n in rec.tensors)


def test_the_path_is_decided_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``use_topk`` forced on the run's small vocabulary: the driver records the top-k tensors
    and says so in its meta, the names ``metric_names`` (and conformance) expect."""
    monkeypatch.setattr(sdk_dist, "use_topk", lambda vocab, topk=None: True)
    meta, rec, _ = _run(_WithLogits, [1, 2], dataclasses.replace(RECIPE, distribution_topk=5))
    assert meta["distribution"] == {"path": "topk", "k": 5, "vocab": V}
    got = {n.removeprefix("round1/actor/") for n in rec.tensors if "prefill" in n}
    assert got == {*sdk_dist.metric_names(V), sdk_dist.TOP_LOGIT}
    assert "prefill_raw_topk_ids" in got


def test_the_default_logprobs_and_entropy_is_the_sdk_log_softmax_of_the_logits() -> None:
    """An engine with ``response_logits`` and no ``logprobs_and_entropy`` of its own scores
    by the SDK's single-device log-softmax at its ``temperature``, bitwise; one with neither
    raises ``NotImplementedError``."""

    class _Default(_WithLogits):
        logprobs_and_entropy = sdk.Engine.logprobs_and_entropy

    torch.manual_seed(0)
    model, batch = _TinyLM(), _batch()
    engine = _Default(model, RECIPE.temperature)
    with torch.no_grad():
        lp, ent = engine.logprobs_and_entropy(model, batch)
        want_lp, want_ent = losses.logprobs_and_entropy(_window(model, batch), batch.responses,
                                                        RECIPE.temperature)
    assert torch.equal(lp, want_lp)
    assert torch.equal(ent, want_ent)

    class _Neither(_NoLogits):
        logprobs_and_entropy = sdk.Engine.logprobs_and_entropy

    with pytest.raises(NotImplementedError, match="does not implement response_logits"):
        _Neither(model, RECIPE.temperature).logprobs_and_entropy(model, batch)


def test_an_engine_without_response_logits_records_none_and_says_why() -> None:
    meta, rec, _ = _run(_NoLogits, [1, 2])
    assert meta["distribution"] == {
        "not_recorded": "_NoLogits does not implement response_logits"}
    assert not [n for n in rec.tensors if "prefill" in n]
    assert "round1/actor/logprobs" in rec.tensors  # the rest of the role is recorded


def test_a_resumed_launch_without_round_1_records_none() -> None:
    meta, rec, _ = _run(_WithLogits, [2])
    assert meta["distribution"] == {"not_recorded": RESUMED_WITHOUT_ROUND1}
    assert not [n for n in rec.tensors if "prefill" in n]


def test_recorder_keeps_token_ids_int64_and_conformance_accepts_only_int64_ids() -> None:
    rec = sdk.Recorder(role="actor", writer=True)
    rec.put(1, "prefill_raw_topk_ids", torch.tensor([[[70000, 3]]], dtype=torch.int32))
    rec.put(1, "prefill_raw", torch.ones(1, 1, 2, dtype=torch.float64))
    assert rec.tensors["round1/actor/prefill_raw_topk_ids"].dtype == torch.int64
    assert rec.tensors["round1/actor/prefill_raw"].dtype == torch.float32
    meta = {"tensors": {"count": 3}}
    header = {"round1/actor/prefill_raw_topk_ids": {"dtype": "I64"},
              "round1/actor/prefill_raw": {"dtype": "F32"},
              "round1/actor/prefill_raw_logprobs": {"dtype": "F32"}}
    assert _tensor_findings(header, meta) == []
    bad = {"round1/actor/prefill_raw_topk_ids": {"dtype": "F32"},
           "round1/actor/prefill_raw": {"dtype": "I64"},
           "round1/actor/prefill_raw_logprobs": {"dtype": "F32"}}
    assert [str(f) for f in _tensor_findings(bad, meta)] == [
        "outputs.safetensors round1/actor/prefill_raw: dtype I64, expected F32 (or F64)",
        "outputs.safetensors round1/actor/prefill_raw_topk_ids: dtype F32, expected I64 "
        "(token ids)"]


def test_every_side_switches_to_the_top_k_path_at_one_vocabulary() -> None:
    """The reference, the SDK engines and the vLLM sampler each decide the full or top-k path
    by vocabulary; the comparator judges a cell only on the path its reference sealed, so the
    three limits must be one."""
    from qualify_harness.protocol import FULL_DISTRIBUTION_MAX_VOCAB

    from harnesses.vllm import decode
    from qualify.reference import distribution as refdist

    assert refdist.MAX_VOCAB == FULL_DISTRIBUTION_MAX_VOCAB == decode.MAX_FULL_VOCAB
