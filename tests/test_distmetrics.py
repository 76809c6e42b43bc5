"""Full-distribution metrics (qualify.distmetrics) and the decode-path rows built on them.

Invariants (hypothesis): a distribution against itself measures zero on every statistic; the
two KL directions swap with the arguments; masked positions do not count. Classes of defect
the rows must catch: a temperature applied twice on decode positions only (every position
after the first), a top-k mask leaking into the untruncated logprobs; a top-1 swap within the
candidate's FP32 resolution is a tie, beyond it a mismatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from qualify.compare.distribution import distribution_rows
from qualify.distmetrics import STATISTICS, distribution_metrics, tie_resolution
from qualify.reference.distribution import FLOORS

B, R, V = 3, 5, 40
T = 0.9


def _logits(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 3.0, (B, R, V))


def _lsm(x: np.ndarray, t: float = 1.0) -> np.ndarray:
    return torch.log_softmax(torch.from_numpy(x / t), dim=-1).numpy()


def _case(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    g = np.random.default_rng(seed + 1)
    tokens = g.integers(0, V, (B, R))
    mask = np.ones((B, R), dtype=np.int64)
    mask[1, 3:] = 0
    return _logits(seed), tokens, mask


@settings(max_examples=8, deadline=None)
@given(st.integers(0, 10_000))
def test_self_is_zero_and_directions_swap(seed: int) -> None:
    logits, tokens, mask = _case(seed)
    a, b = _lsm(logits), _lsm(logits + np.random.default_rng(seed).normal(0, 0.3, logits.shape))
    same = distribution_metrics(a, a, tokens, mask, clip_ratio=0.2)
    for s in STATISTICS:
        assert same[s] == pytest.approx(0.0, abs=1e-12), s
    ab = distribution_metrics(a, b, tokens, mask, clip_ratio=0.2)
    ba = distribution_metrics(b, a, tokens, mask, clip_ratio=0.2)
    assert ab["kl_ref_cand_max"] == pytest.approx(ba["kl_cand_ref_max"], rel=1e-12)
    assert ab["tv_mean"] == pytest.approx(ba["tv_mean"], rel=1e-12)
    assert ab["kl_ref_cand_mean"] > 0


@settings(max_examples=5, deadline=None)
@given(st.integers(0, 10_000))
def test_masked_positions_do_not_count(seed: int) -> None:
    logits, tokens, mask = _case(seed)
    a = _lsm(logits)
    b = a.copy()
    b[1, 3:] = _lsm(np.random.default_rng(seed).normal(0, 5, (R - 3, V)))  # masked out
    got = distribution_metrics(b, a, tokens, mask, clip_ratio=0.2)
    assert got["kl_ref_cand_max"] == pytest.approx(0.0, abs=1e-12)
    assert got["n_valid"] == int(mask.sum())


def test_near_tie_is_not_a_mismatch() -> None:
    logits, tokens, mask = _case(3)
    logits[0, 0, :2] = [10.0, 10.0]  # two leading tokens at equal logits
    ref = _lsm(logits)
    cand = ref.copy()
    gap = float(tie_resolution(np.array([cand[0, 0, 0]]))[0])
    cand[0, 0, 1] += gap / 2  # the candidate prefers token 1 by less than its resolution
    got = distribution_metrics(cand, ref, tokens, mask, clip_ratio=0.2)
    assert (got["top1_mismatch"], got["top1_ties"]) == (0.0, 1)
    cand[0, 0, 1] += 1e-3  # now well beyond it
    got = distribution_metrics(cand, ref, tokens, mask, clip_ratio=0.2)
    assert (got["top1_mismatch"], got["top1_ties"]) == (1.0, 0)


def _sealed(tmp: Path, ref: np.ndarray, *, control: float) -> Path:
    """A minimal sealed-reference stand-in: distribution.{json,safetensors}."""
    bounds = {s: {"bound": 4.0 * control + FLOORS[s], "control": "decode",
                  "control_error": control, "k": 4.0, "floor": FLOORS[s]} for s in STATISTICS}
    doc = {"clip_ratio": 0.2, "raw": {"bounds": bounds}, "tempered": {"bounds": bounds},
           "decode_vs_prefill": {"bound": 2e-5, "control": "decode"}}
    (tmp / "distribution.json").write_text(json.dumps(doc))
    save_file({"raw": torch.from_numpy(ref).float(), "tempered": torch.from_numpy(ref).float()},
              str(tmp / "distribution.safetensors"))
    return tmp


@pytest.mark.parametrize("fault", ["double_temperature_decode", "topk_mask_leak"])
def test_planted_sampler_faults_fail_the_distribution_rows(tmp_path: Path, fault: str) -> None:
    logits, tokens, mask = _case(11)
    ref = _lsm(logits, T)
    clean = ref + np.float32(1e-7)  # FP32-level noise of a conforming engine
    bad = clean.copy()
    if fault == "double_temperature_decode":
        bad[:, 1:] = _lsm(logits[:, 1:], T * T)  # decode steps only; position 0 is prefill
    else:
        kth = np.sort(logits, axis=-1)[..., -8][..., None]
        bad = _lsm(np.where(logits >= kth, logits, -np.inf), T)
    ref_dir = _sealed(tmp_path, ref, control=1e-12)
    prefill = {"round2/sampler/logprobs": np.zeros((B, R)),
               "round2/sampler/decode_logprobs": np.zeros((B, R))}
    for cand, ok in ((clean, True), (bad, False)):
        rows = distribution_rows(cell="vllm-fp32-sampler-tp1", tensors={
            "round1/sampler/decode_raw": clean, "round1/sampler/decode_tempered": cand,
            **prefill}, ref_dir=ref_dir, mask=mask, responses=tokens)
        tempered = [r for r in rows if r.family == "decode_tempered"]
        assert len(tempered) == len(STATISTICS)
        assert all(r.verdict == "PASS" for r in rows if r.family != "decode_tempered")
        failed = {r.statistic for r in tempered if r.verdict == "FAIL"}
        if ok:
            assert not failed
        else:
            assert {"kl_ref_cand_max", "tv_max", "seq_max_kl_mean"} <= failed


def test_reference_without_distribution_gives_no_rows(tmp_path: Path) -> None:
    _, tokens, mask = _case(5)
    assert distribution_rows(cell="c", tensors={}, ref_dir=tmp_path, mask=mask,
                             responses=tokens) == []


def test_like_for_like_clip_band_and_routes(tmp_path: Path) -> None:
    """The decode pair is like for like (no tail when the trainer agrees); routes are read
    from each cell's outputs.json, and a harness that records none is named as such."""
    from qualify.compare.distribution import cell_routes, decode_clip_band

    logits, tokens, mask = _case(2)
    lp = np.take_along_axis(_lsm(logits, T), tokens[..., None], axis=-1)[..., 0]
    tensors = {"round1/sampler/decode_tempered_logprobs": lp}
    same, shifted = decode_clip_band(
        sources=[("hf-fp32", "fp32", lp), ("shifted", "fp32", lp + 0.5)], cell="s",
        tensors=tensors, mask=mask, clip_ratio=0.2)
    assert same["fraction_outside"] == 0.0
    assert shifted["fraction_outside"] == 1.0
    assert decode_clip_band(sources=[("hf-fp32", "fp32", lp)], cell="s", tensors={},
                            mask=mask, clip_ratio=0.2) == []
    _sealed(tmp_path, _lsm(logits), control=0.0)
    routes = cell_routes({"a": {"routes": {"attention_backends": ["CPU_ATTN"]}}, "b": {},
                          "c": None}, tmp_path)
    assert routes == {"a": {"attention_backends": ["CPU_ATTN"]},
                      "b": "not recorded by this harness", "c": "not recorded by this harness"}


@pytest.mark.slow
def test_large_vocabulary_seals_the_topk_path(tmp_path: Path) -> None:
    """Above MAX_VOCAB: the reference seals each kind's top-k (``bounds.distribution_topk``)
    with every control's metrics and a finite bound per top-k statistic; a sampler that
    returns the reference's own top-k passes every row, one whose raw logprobs carry a top-8
    mask fails the raw rows, and the decode-vs-prefill row is judged as before."""
    from harness_outputs import TINY, tiny_rollout
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from qualify.contract import load_contract
    from qualify.distmetrics import TOPK_STATISTICS
    from qualify.evidence import store
    from qualify.reference.distribution import MAX_VOCAB, seal_distribution
    from qualify.resources import contracts_dir

    cfg = Qwen3Config(**{**TINY, "vocab_size": MAX_VOCAB + 4}, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, max_position_embeddings=64)
    torch.manual_seed(3)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "actor")
    roll = tiny_rollout([[5, 6, 7], [8, 9]], (4, 2), 4, torch.Generator().manual_seed(1))
    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    k = contract.bounds.distribution_topk
    doc = seal_distribution(contract, tmp_path / "actor", roll, tmp_path)
    assert doc["topk"]["k"] == k
    assert "distributions_not_run" not in doc
    ref = store.load_tensors(tmp_path / "distribution.safetensors")
    mask, tokens = roll["response_mask"].numpy(), roll["responses"].numpy()
    for kind in ("raw", "tempered"):
        assert ref[f"{kind}_topk_logprobs"].shape == (*tokens.shape, k)
        assert ref[f"{kind}_topk_ids"].dtype == np.int64
        assert set(doc[kind]["controls"]) == {"decode", "attn_impl", "batch", "bf16",
                                              "bf16_decode", "bf16_attn_impl", "bf16_batch"}
        for s in TOPK_STATISTICS:
            assert np.isfinite(doc[kind]["bounds"][s]["bound"]), (kind, s)
        assert 0.0 < doc[kind]["missing_mass"]["max"] <= 1.0
    b = doc["decode_vs_prefill"]["bound"]
    assert 1e-5 <= b < 1e-3
    lp = np.where(mask != 0, -1.0, 0.0)

    def sampler(leak: bool, shift: float) -> dict[str, np.ndarray]:
        out = {"round2/sampler/logprobs": lp, "round2/sampler/decode_logprobs": lp + shift}
        for kind in ("raw", "tempered"):
            vals = ref[f"{kind}_topk_logprobs"].astype(np.float64)
            if leak and kind == "raw":  # the sampling top-8 mask leaks into raw logprobs
                kept = vals[..., :8]
                vals = np.concatenate([kept - np.log(np.exp(kept).sum(-1, keepdims=True)),
                                       np.full(vals[..., 8:].shape, -np.inf)], axis=-1)
            out[f"round1/sampler/decode_{kind}_topk_logprobs"] = vals
            out[f"round1/sampler/decode_{kind}_topk_ids"] = ref[f"{kind}_topk_ids"]
            out[f"round1/sampler/decode_{kind}_logprobs"] = ref[f"{kind}_token_logprobs"]
        return out

    for leak, shift, verdict in ((False, 0.0, "PASS"), (False, 2 * b, "FAIL"),
                                 (True, 0.0, "PASS")):
        rows = distribution_rows(cell="c", tensors=sampler(leak, shift), ref_dir=tmp_path,
                                 mask=mask, responses=tokens)
        dvp = [r.verdict for r in rows if r.klass == "sampler_decode_vs_prefill"]
        assert dvp == [verdict]
        dist = [r for r in rows if r.klass == "sampler_distribution"]
        assert {r.family for r in dist} == {"decode_raw_topk", "decode_tempered_topk"}
        failed = {(r.family, r.statistic) for r in dist if r.verdict != "PASS"}
        if leak:
            assert {("decode_raw_topk", "kl_ref_cand_max"), ("decode_raw_topk", "tv_max")} \
                <= failed
            assert not any(f == "decode_tempered_topk" for f, _ in failed)
        else:
            assert not failed
