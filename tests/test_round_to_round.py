"""Tests of the bound rule's round-to-round term (qualify.reference.round_to_round).

The case that motivated it (seed variant 6 of ``contracts/tiny-qwen3.toml``, issue #49,
``docs/findings.md``): ``megatron-bf16-actor-tp2`` failed one round-2 Actor logprob, token
``(2, 0)``, error 0.1274 against the bound 0.11275 (``4 x`` the ``attn_impl`` control's
0.025687 plus the floor 0.01), while its round-1 logprob there was 0.0171 from the reference,
half the lane's largest round-1 control error (0.033663). That token's round-2 logprob
responds to its own round-1 value: perturbing it alone by +0.0171 / -0.0174 moved it by
+0.093 / -0.188 (``scripts/repro/round1_token_amplification.py``). The figures below are
those sealed and measured values; the toy updates have responses known in closed form.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qualify.bounds import Bound, compute_bounds, judge, lookup
from qualify.compare.rows import compare_rows
from qualify.compare.verdicts import Row
from qualify.contract import Contract, default_contract_path, load_contract
from qualify.errors import BoundsMismatchError, ReferenceDataError
from qualify.evidence import store
from qualify.evidence.bounds_check import verify_bounds
from qualify.evidence.tensors import load_tensors, save_tensors
from qualify.reference import round_to_round
from qualify.reference.bound_inputs import (
    recompute_bounds,
    round_to_round_from_document,
    with_token_responses,
)
from qualify.reference.update import _offset_targets, _token_logprobs_entropy
from qualify.resources import repo_root
from qualify.statistics import ErrorMeasure, MetricKey

CONTRACT = load_contract(default_contract_path())
LANE = "bf16-castmasters"
R1, R2 = (MetricKey(round=r, role="actor", family="logprobs") for r in (1, 2))


def _err(value: float) -> ErrorMeasure:
    return ErrorMeasure(value=value, where="(0, 0)", mismatched=0, total=1, max_abs=value,
                        max_rel=0.0)


def _toy_actor(mask: torch.Tensor, p: torch.Tensor, temperature: float,
               gain: torch.Tensor, flip: tuple[int, int]) -> round_to_round.UpdateFn:
    """A toy update whose round-2 logprob at each token is ``gain`` times its own round-1
    logprob change (``offset (1 - p) / T``, what a target-logit offset does to first
    order) plus 0.5 times the others' (the update is shared), and whose round-2 entropy at
    ``flip`` drops by 0.25 when that change is negative and no other token moved (a sign
    flip of the first Adam step that other tokens' gradients can cancel, as on variant 12)."""
    base2 = torch.arange(mask.numel(), dtype=torch.float32).reshape(mask.shape) * -0.1
    ent2 = torch.full(mask.shape, 3.0)

    def update(role: str, rounds: int, offsets: Mapping[int, torch.Tensor] | None,
               ) -> dict[str, torch.Tensor]:
        assert role == "actor"
        assert rounds >= 2
        change = torch.zeros(mask.shape, dtype=torch.float64)
        if offsets is not None:
            assert set(offsets) == {1}
            change = offsets[1] * (1.0 - p.double()) / temperature
        ent = ent2.clone()
        others = change.clone()
        others[flip] = 0.0
        if change[flip] < 0 and not bool(others.any()):
            ent[flip] -= 0.25
        cross = 0.5 * (change.sum() - change)
        return {"round2/actor/logprobs": base2 + (gain.double() * change + cross).float(),
                "round2/actor/entropy": ent}
    return update


def test_the_term_is_each_tokens_own_response_at_the_largest_control_error() -> None:
    """Known answer: 2 sequences, 3 columns, token (1, 2) padding; the largest self gain
    is 6.0 at (0, 1), so the logprob term is 6 e (the cross term moves only the other
    tokens); the entropy term is the flip, 0.25 at (1, 0), reached only by the negative
    perturbation of that token alone (perturbing its column, (0, 0) too, misses it);
    2 x 5 perturbed updates, one per valid token and sign."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    p = torch.tensor([[0.5, 0.2, 0.9], [0.1, 0.3, 0.99]])
    gain = torch.tensor([[1.0, 6.0, 2.0], [0.5, 3.0, 100.0]])  # (1, 2) is padding
    e, temperature = 0.03, 0.7
    got = round_to_round.measure(
        _toy_actor(mask, p, temperature, gain, (1, 0)), roles=["actor"], rounds=2,
        sizes={(1, "actor"): e}, mask=mask, logprobs={1: p.log()}, temperature=temperature)
    lp = got[MetricKey(round=2, role="actor", family="logprobs")]
    ent = got[MetricKey(round=2, role="actor", family="entropy")]
    assert lp.value == pytest.approx(6.0 * e, rel=1e-6)
    assert lp.where == "(0, 1)"
    assert (lp.perturbation, lp.runs) == (e, 10)
    assert ent.value == pytest.approx(0.25)
    assert ent.where == "(1, 0)"
    # Each token's own response, 0 at padding; the value is the largest entry.
    assert lp.tokens.dtype == torch.float64
    np.testing.assert_allclose(lp.tokens.numpy(), np.array([[1.0, 6.0, 2.0],
                                                             [0.5, 3.0, 0.0]]) * e, rtol=1e-5)
    assert float(lp.tokens.max()) == lp.value
    assert ent.tokens.tolist() == [[0.0, 0.0, 0.0], [0.25, 0.0, 0.0]]


def test_a_target_near_certainty_is_perturbed_by_at_most_the_size() -> None:
    """Where ``p > 15/16`` the logit offset is capped (``1 - p >= 1/16``): the first-order
    logprob change is ``e (1 - p) * 16 < e`` there, never more than ``e``."""
    mask = torch.tensor([[1]])
    p = torch.tensor([[0.99]])
    got = round_to_round.measure(
        _toy_actor(mask, p, 1.0, torch.tensor([[1.0]]), (0, 0)), roles=["actor"], rounds=2,
        sizes={(1, "actor"): 0.04}, mask=mask, logprobs={1: p.log()}, temperature=1.0)
    assert got[R2].value == pytest.approx(0.04 * 0.01 * 16, rel=1e-5)


@settings(max_examples=15, deadline=None)
@given(st.floats(-30, 0.0), st.floats(1e-4, 0.05), st.floats(0.3, 1.5))
def test_the_target_logit_offset_moves_the_logprob_by_the_size(logp: float, e: float,
                                                               temperature: float) -> None:
    """The offset the term applies, through the update's own logprob formula, moves the
    target's logprob by ``e`` to first order (``p <= 15/16``; a 3-token vocabulary whose
    target has logprob ``logp`` at temperature ``T``): the scaled offset is
    ``u = e / (1 - p)`` and ``log sigmoid`` has curvature at most 1/4, so the change is
    within ``u^2 / 8`` of ``e``."""
    p = min(math.exp(logp), 0.9)
    rest = (1.0 - p) / 2
    logits = torch.tensor([[[math.log(p), math.log(rest), math.log(rest)]]],
                          dtype=torch.float64) * temperature
    tokens = torch.tensor([[0]])
    offs = round_to_round._offsets("actor", 1.0, e, (0, 0), shape=(1, 1),
                                   logprobs=torch.tensor([[math.log(p)]]),
                                   temperature=temperature)
    before, _ = _token_logprobs_entropy(logits, tokens, temperature)
    after, _ = _token_logprobs_entropy(_offset_targets(logits, tokens, offs), tokens,
                                       temperature)
    u = e / (1.0 - p)
    assert abs(float(after - before) - e) <= u * u / 8 + 1e-12


def test_no_control_error_runs_nothing() -> None:
    def update(*_: object) -> dict[str, torch.Tensor]:
        raise AssertionError("no perturbed update expected")
    got = round_to_round.measure(update, roles=["critic"], rounds=3, sizes={},
                                 mask=torch.ones(1, 2), logprobs={}, temperature=1.0)
    assert {k.label: r.value for k, r in got.items()} == {"round2/critic/values": 0.0,
                                                           "round3/critic/values": 0.0}


def test_the_size_is_the_largest_control_error_of_the_perturbed_round() -> None:
    errors = {"attn_impl": {R1: _err(0.0337), R2: _err(0.9)},
              "row_split": {R1: _err(0.0336)}, "microbatch": {}}
    assert round_to_round.perturbation_size(errors, errors, 1, "actor") == 0.0337
    assert round_to_round.perturbation_size(errors, ["row_split"], 1, "actor") == 0.0336
    assert round_to_round.perturbation_size(errors, errors, 1, "critic") == 0.0


def _bounds(r2r: float | None) -> tuple[float, float]:
    """Variant 6's sealed round-1 / round-2 BF16 Actor logprob control errors, bounded."""
    errors = {LANE: {name: {R1: _err(0.033663), R2: _err(0.025687)}
                     for name in ("attn_impl", "microbatch", "row_split")}}
    terms = None if r2r is None else {LANE: {R2: np.array([[r2r, 0.0]])}}
    bounds = compute_bounds(CONTRACT, errors, round_to_round=terms)
    got = [lookup(bounds, precision=LANE, klass=c, key=k)
           for c in ("candidate_vs_hf_tp", "tp_vs_tp1") for k in (R1, R2)]
    assert all(b is not None for b in got)
    r1, r2 = (b.widest for b in got[:2] if b is not None)
    assert [b.widest for b in got[2:] if b is not None] == [r1, r2]  # the same in each class
    return r1, r2


def test_variant6_false_alarm_is_removed_and_the_term_keeps_its_k() -> None:
    """Old rule: 0.1274 > 0.11275 at (2, 0) FAILs. With the term the measured response of
    that token to the lane's largest round-1 control error (the figure this change
    measured on the variant, 0.29878) enters the max of that token's bound (the widest
    token bound) and takes ``k``; round 1 is unchanged. An error of ``k + 1`` times the
    response still FAILs."""
    r1_old, r2_old = _bounds(None)
    assert judge(0.12740016, r2_old)[0] == "FAIL"
    r1_new, r2_new = _bounds(0.29878)
    assert r1_new == r1_old
    assert r2_new == pytest.approx(4.0 * 0.29878 + 0.01)
    assert judge(0.12740016, r2_new)[0] == "PASS"
    assert judge(5.0 * 0.29878, r2_new)[0] == "FAIL"
    # A response below the control error changes nothing.
    assert _bounds(0.01)[1] == r2_old


def test_the_sealed_document_round_trips_and_bad_entries_are_refused() -> None:
    key = MetricKey(round=2, role="critic", family="values")
    doc = round_to_round.round_to_round_document(
        {LANE: {key: round_to_round.Response(value=0.25, where="(1, 0)", perturbation=0.03,
                                             runs=6, tokens=torch.zeros(2, 2))}})
    assert round_to_round_from_document(doc) == {LANE: {key: 0.25}}
    for bad in ({LANE: {"round1/actor/logprobs": {"value": 0.1}}},
                {LANE: {"round2/actor/grads": {"value": 0.1}}},
                {LANE: {"round2/actor/logprobs": {"value": -1.0}}},
                {LANE: {"round2/actor/logprobs": {"value": "nan"}}}, [1]):
        with pytest.raises(ReferenceDataError, match=r"round_to_round\.json"):
            round_to_round_from_document(bad)


COMMITTED_REF = repo_root() / "references" / (
    f"tiny-qwen3-{load_contract(repo_root() / 'contracts' / 'tiny-qwen3.toml').digest12}")


def _seal_responses(ref: Path, tokens: np.ndarray, label: str = "round2/actor/logprobs",
                    ) -> None:
    """Write ``round_to_round.json`` and ``round_to_round.safetensors`` holding ``tokens``
    as the ``LANE`` responses of ``label``."""
    (ref / "round_to_round.json").write_text(json.dumps(
        {LANE: {label: {"value": float(tokens.max()), "where": "(2, 0)",
                        "perturbation": 0.03, "runs": 84}}}))
    save_tensors(ref / "round_to_round.safetensors", {f"{LANE}/{label}": tokens})


def _unsealed_copy(tmp_path: Path) -> Path:
    """A writable copy of the committed reference without its seal (its inputs edited) and
    without its round-to-round term: its sealed responses removed, its contract's
    ``[bounds] round_to_round`` off, and ``bounds.json`` the rule's bounds without the term
    (the reference the same contract with the term off would have sealed)."""
    ref = Path(shutil.copytree(COMMITTED_REF, tmp_path / "ref"))
    store.make_writable(ref)
    (ref / store.MANIFEST_FILE).unlink()
    for name in ("round_to_round.json", "round_to_round.safetensors"):
        (ref / name).unlink()
    doc = json.loads((ref / "contract.json").read_text())
    doc["bounds"]["round_to_round"] = False
    (ref / "contract.json").write_text(json.dumps(doc))
    bounds = json.loads((ref / "bounds.json").read_text())
    bounds["contract_digest"] = Contract.from_dict(doc, path=ref / "contract.json").digest
    bounds["bounds"] = [b.to_dict() for b in recompute_bounds(ref)]
    (ref / "bounds.json").write_text(json.dumps(bounds))
    return ref


def _mask(ref: Path) -> np.ndarray:
    return np.asarray(load_tensors(ref / "rollout.safetensors")["response_mask"]).astype(bool)


def test_a_sealed_term_is_recomputed_and_a_contract_that_asks_for_it_needs_it(
        tmp_path: Path) -> None:
    """``recompute_bounds`` (verify's step 9) reads the sealed responses: they leave every
    row's ``bound`` as it was, and set ``round_to_round`` (the largest response) and the
    per-token responses of exactly the round-2 rows they name, whose widest token bound is
    ``k x max(...)`` bit for bit; a contract with ``[bounds] round_to_round`` whose
    reference lacks the files is refused."""
    ref = _unsealed_copy(tmp_path)
    before = {(b.precision, b.klass, b.key.label): b for b in recompute_bounds(ref)}
    on = dataclasses.replace(CONTRACT, bounds=dataclasses.replace(CONTRACT.bounds,
                                                                  round_to_round=True))
    on_ref = dataclasses.replace(Contract.from_dict(json.loads(
        (ref / "contract.json").read_text()), path=ref / "contract.json"),
        bounds=on.bounds)
    with pytest.raises(ReferenceDataError, match=r"round_to_round\.json: missing"):
        recompute_bounds(ref, on_ref)
    tokens = np.where(_mask(ref), 0.01, 0.0)
    tokens[2, 0] = 0.5
    _seal_responses(ref, tokens)
    after = {(b.precision, b.klass, b.key.label): b for b in recompute_bounds(ref, on_ref)}
    assert after.keys() == before.keys()
    changed = {k for k in after if after[k].to_dict() != before[k].to_dict()}
    assert changed == {(LANE, c, "round2/actor/logprobs")
                       for c in ("candidate_vs_hf", "tp_vs_tp1", "candidate_vs_hf_tp")}
    for k in changed:
        b = after[k]
        assert b.round_to_round == 0.5
        assert b.bound == before[k].bound
        assert b.widest == b.k * max(b.control_error, b.resolution, b.propagated, 0.5) + \
            b.quantum + b.floor
        assert b.widest > b.bound
        assert b.tokens is not None
        assert np.array_equal(b.tokens, tokens)


# --------------------------------------------------------------------------- per-token bounds

KEY2 = MetricKey(round=2, role="actor", family="logprobs")


def _per_token_bound(tokens: np.ndarray, control_error: float = 0.02) -> list[Bound]:
    """The sealed bounds of one lane whose round-2 Actor logprobs have ``tokens``."""
    errors = {LANE: {n: {R1: _err(control_error), KEY2: _err(control_error)}
                     for n in ("attn_impl", "microbatch", "row_split")}}
    return compute_bounds(CONTRACT, errors, round_to_round={LANE: {KEY2: tokens}})


def _row(bounds: list[Bound], obtained: np.ndarray, expected: np.ndarray,
         mask: np.ndarray) -> Row:
    (row,) = compare_rows(cell="c", klass="tp_vs_tp1", precision=LANE, bounds=bounds,
                          obtained={KEY2.label: obtained}, expected={KEY2.label: expected},
                          mask=mask)
    return row


def test_a_token_with_a_large_response_gets_its_own_bound_its_neighbour_the_base() -> None:
    """Known answer: token (0, 1) responds 0.3, its neighbours not at all. Its bound is
    ``k x 0.3 + floor``; the others keep the row's bound (``k x 0.02 + floor``) bit for bit.
    An error of 0.5 at (0, 1) passes there (margin 0.5 / 1.21); the same error at (0, 0)
    fails, and so does an error just over the base bound at the neighbour (1, 0) while
    (0, 1) carries a larger one that its own bound covers: the row names (1, 0)."""
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    tokens = np.zeros((2, 3))
    tokens[0, 1] = 0.3
    bounds = _per_token_bound(tokens)
    b = lookup(bounds, precision=LANE, klass="tp_vs_tp1", key=KEY2)
    assert b is not None
    base = b.k * 0.02 + b.floor
    assert b.bound == base
    tb = b.token_bounds()
    assert tb is not None
    assert tb[0, 1] == b.k * 0.3 + b.floor == b.widest
    assert all(tb[i] == base for i in np.ndindex(2, 3) if i != (0, 1))
    expected = np.full((2, 3), -1.0)

    ok = expected.copy()
    ok[0, 1] += 0.5
    row = _row(bounds, ok, expected, mask)
    assert row.verdict == "PASS"
    assert row.error == pytest.approx(0.5)
    assert row.bound == tb[0, 1]
    assert row.where.startswith("(0, 1) [per-token bound")
    assert "response 0.3 " in row.where

    bad = expected.copy()
    bad[0, 0] += 0.5
    row = _row(bounds, bad, expected, mask)
    assert (row.verdict, row.bound, row.where.split(" [")[0]) == ("FAIL", base, "(0, 0)")

    near = expected.copy()
    near[0, 1] += 1.0
    near[1, 0] += base * 1.01
    row = _row(bounds, near, expected, mask)
    assert row.verdict == "FAIL"
    assert row.where.split(" [")[0] == "(1, 0)"
    assert row.bound == base
    assert row.margin == pytest.approx(1.01)
    assert row.reason is not None
    assert "per-token bound" in row.reason

    # The same row without responses: the one bound as ever.
    flat = _per_token_bound(np.zeros((2, 3)))
    plain = lookup(flat, precision=LANE, klass="tp_vs_tp1", key=KEY2)
    assert plain is not None
    assert plain.tokens is None
    assert plain.bound == base
    assert _row(flat, ok, expected, mask).verdict == "FAIL"


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_a_per_token_row_is_its_worst_margin_token(seed: int) -> None:
    """For any errors and responses: the row's margin is its error / its bound, that bound
    is the bound of the token it names, the margin is the largest over the valid tokens
    of ``|diff| / b_t``, and the row passes iff every valid token is within its bound."""
    rng = np.random.default_rng(seed)
    shape = (3, 4)
    mask = rng.random(shape) < 0.8
    mask[0, 0] = True
    tokens = np.where(rng.random(shape) < 0.5, rng.random(shape) * 0.2, 0.0) * mask
    tokens[0, 0] = 0.1
    expected = rng.normal(size=shape)
    obtained = expected + rng.normal(size=shape) * rng.choice([0.01, 0.1, 0.5])
    bounds = _per_token_bound(tokens)
    b = lookup(bounds, precision=LANE, klass="tp_vs_tp1", key=KEY2)
    assert b is not None
    tb = b.token_bounds()
    assert tb is not None
    row = _row(bounds, obtained, expected, mask.astype(int))
    diff = np.abs(obtained - expected)
    margins = np.where(mask, diff / tb, 0.0)
    idx = tuple(int(x) for x in row.where.split(" [")[0].strip("()").split(","))
    assert row.bound == tb[idx]
    assert row.error == diff[idx]
    assert row.margin == diff[idx] / tb[idx]
    assert row.margin == margins.max()
    assert (row.verdict == "PASS") == bool(np.all(diff[mask] <= tb[mask]))


def test_a_tampered_per_token_file_is_refused_by_verify(tmp_path: Path) -> None:
    """verify's step 9 reads the per-token responses: sealed with a consistent
    ``bounds.json`` they verify; a response raised above the sealed largest, one at a
    padding token, a negative one or a missing tensor is refused, naming the file."""
    ref = _unsealed_copy(tmp_path)
    mask = _mask(ref)
    tokens = np.where(mask, 0.01, 0.0)
    tokens[2, 0] = 0.5
    _seal_responses(ref, tokens)
    doc = json.loads((ref / "bounds.json").read_text())
    doc["bounds"] = [b.to_dict() for b in recompute_bounds(ref)]
    (ref / "bounds.json").write_text(json.dumps(doc))
    assert verify_bounds(ref).endswith("equal")
    label = f"{LANE}/round2/actor/logprobs"
    pad = tuple(int(i) for i in np.argwhere(~mask)[0])
    for at, value in (((2, 0), 0.9), (pad, 0.001), ((2, 0), -0.001)):  # raised, pad, < 0
        bad = tokens.copy()
        bad[at] = value
        save_tensors(ref / "round_to_round.safetensors", {label: bad})
        with pytest.raises(BoundsMismatchError, match=r"round_to_round\.safetensors"):
            verify_bounds(ref)
    save_tensors(ref / "round_to_round.safetensors", {"other": tokens})
    with pytest.raises(BoundsMismatchError, match=r"round_to_round\.safetensors"):
        verify_bounds(ref)
    # The comparator reads them with the same checks.
    bounds = [Bound.from_dict(x) for x in doc["bounds"]]
    with pytest.raises(ReferenceDataError, match=r"round_to_round\.safetensors"):
        with_token_responses(bounds, ref)
    save_tensors(ref / "round_to_round.safetensors", {label: tokens})
    got = with_token_responses(bounds, ref)
    assert sum(b.tokens is not None for b in got) == 3
