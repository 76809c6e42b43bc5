"""HF <-> vLLM per-rank fused layout (pure torch, no vLLM): bitwise round trips at TP 2.

Shapes are non-square and every dimension differs (hidden 48, intermediate 80, 4 query
heads, 2 KV heads, head_dim 24, vocab 100 padded to 128), so a transposed, swapped or
mis-ordered slice changes a digest. Expected per-rank tensors are written out by hand
from the layout table of :mod:`harnesses.vllm.layout` (vLLM ``QKVParallelLinear``,
``MergedColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``).
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from torch import Tensor

from harnesses.vllm import layout
from qualify.errors import HarnessError

HIDDEN, INTER, H, K, D, V = 48, 80, 4, 2, 24, 100


def _hf(seed: int = 0, *, kv: int = K, tied: bool = False) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g)

    p = "model.layers.0."
    out = {
        "model.embed_tokens.weight": r(V, HIDDEN),
        f"{p}self_attn.q_proj.weight": r(H * D, HIDDEN),
        f"{p}self_attn.k_proj.weight": r(kv * D, HIDDEN),
        f"{p}self_attn.v_proj.weight": r(kv * D, HIDDEN),
        f"{p}self_attn.o_proj.weight": r(HIDDEN, H * D),
        f"{p}self_attn.q_norm.weight": r(D),
        f"{p}self_attn.k_norm.weight": r(D),
        f"{p}mlp.gate_proj.weight": r(INTER, HIDDEN),
        f"{p}mlp.up_proj.weight": r(INTER, HIDDEN),
        f"{p}mlp.down_proj.weight": r(HIDDEN, INTER),
        f"{p}input_layernorm.weight": r(HIDDEN),
        "model.norm.weight": r(HIDDEN),
    }
    if not tied:
        out["lm_head.weight"] = r(V, HIDDEN)
    return out


def _spec(kv: int = K, tied: bool = False) -> layout.LayoutSpec:
    return layout.LayoutSpec(num_heads=H, num_kv_heads=kv, head_dim=D, vocab_size=V,
                             tie_word_embeddings=tied)


def test_rank_shards_match_hand_written_layout_tp2() -> None:
    hf, spec = _hf(), _spec()
    p = "model.layers.0."
    q, k, v = (hf[f"{p}self_attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj"))
    gate, up = hf[f"{p}mlp.gate_proj.weight"], hf[f"{p}mlp.up_proj.weight"]
    for rank in (0, 1):
        got = layout.to_vllm_rank(hf, spec, 2, rank)
        qkv = got[f"{p}self_attn.qkv_proj.weight"]
        assert qkv.shape == ((H // 2 + 2 * (K // 2)) * D, HIDDEN)
        want_qkv = torch.cat([q[rank * 48:(rank + 1) * 48], k[rank * 24:(rank + 1) * 24],
                              v[rank * 24:(rank + 1) * 24]])
        assert torch.equal(qkv, want_qkv)
        want_gu = torch.cat([gate[rank * 40:(rank + 1) * 40], up[rank * 40:(rank + 1) * 40]])
        assert torch.equal(got[f"{p}mlp.gate_up_proj.weight"], want_gu)
        assert torch.equal(got[f"{p}mlp.down_proj.weight"],
                           hf[f"{p}mlp.down_proj.weight"][:, rank * 40:(rank + 1) * 40])
        assert torch.equal(got[f"{p}self_attn.o_proj.weight"],
                           hf[f"{p}self_attn.o_proj.weight"][:, rank * 48:(rank + 1) * 48])
        emb = got["model.embed_tokens.weight"]
        assert emb.shape == (64, HIDDEN)  # vocab 100 padded to 128, 64 rows per rank
        if rank == 0:
            assert torch.equal(emb, hf["model.embed_tokens.weight"][:64])
        else:
            assert torch.equal(emb[:36], hf["model.embed_tokens.weight"][64:])
            assert torch.count_nonzero(emb[36:]) == 0
        assert torch.equal(got["model.norm.weight"], hf["model.norm.weight"])
        assert f"{p}self_attn.q_proj.weight" not in got


@pytest.mark.parametrize(("tp", "kv", "tied"), [(1, K, False), (2, K, False), (2, 1, False),
                                                (4, 2, True), (2, K, True)])
def test_round_trip_is_bitwise(tp: int, kv: int, tied: bool) -> None:
    hf, spec = _hf(seed=tp + kv, kv=kv, tied=tied), _spec(kv, tied)
    ranks: list[Mapping[str, Tensor]] = [layout.to_vllm_rank(hf, spec, tp, r)
                                         for r in range(tp)]
    back = layout.from_vllm_ranks(ranks, spec, sorted(hf))
    assert sorted(back) == sorted(hf)
    for name, t in hf.items():
        assert back[name].dtype == t.dtype, name
        assert torch.equal(back[name], t), name


def test_replicated_kv_head_when_fewer_kv_heads_than_ranks() -> None:
    hf, spec = _hf(kv=1), _spec(kv=1)
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    for rank in (0, 1):
        qkv = layout.to_vllm_rank(hf, spec, 2, rank)["model.layers.0.self_attn.qkv_proj.weight"]
        assert torch.equal(qkv[48:72], k)  # the single KV head is on both ranks


def test_digests_change_with_one_element_and_per_rank() -> None:
    hf, spec = _hf(), _spec()
    base = layout.expected_digests(hf, spec, 2)
    assert base[0]["model.norm.weight"] == base[1]["model.norm.weight"]
    assert base[0]["model.embed_tokens.weight"] != base[1]["model.embed_tokens.weight"]
    hf2 = dict(hf)
    up = hf["model.layers.0.mlp.up_proj.weight"].clone()
    up[79, 47] = torch.nextafter(up[79, 47], torch.tensor(float("inf")))
    hf2["model.layers.0.mlp.up_proj.weight"] = up
    changed = layout.expected_digests(hf2, spec, 2)
    name = "model.layers.0.mlp.gate_up_proj.weight"
    assert changed[0][name] == base[0][name]  # row 79 of up lives on rank 1 only
    assert changed[1][name] != base[1][name]
    assert layout.digest_of_digests(changed[1]) != layout.digest_of_digests(base[1])
    # dtype and shape are part of the digest
    t = torch.zeros(2, 3)
    assert layout.tensor_digest(t) != layout.tensor_digest(t.double())
    assert layout.tensor_digest(t) != layout.tensor_digest(t.reshape(3, 2))


def test_bad_tp_and_missing_parts_are_errors() -> None:
    hf, spec = _hf(), _spec()
    with pytest.raises(HarnessError, match="does not divide num_heads"):
        layout.to_vllm_rank(hf, spec, 3, 0)
    del hf["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(HarnessError, match="gate_up needs"):
        layout.to_vllm_rank(hf, spec, 2, 0)


# --------------------------------------------------------------------------- sampler rows
# qualify.compare.sampler judges a sampler cell from its outputs.json (no vLLM needed).

import math  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from qualify.bounds import Bound  # noqa: E402
from qualify.compare.sampler import PROBES, sampler_rows  # noqa: E402
from qualify.statistics import MetricKey  # noqa: E402

BOUND = Bound(precision="fp32", klass="candidate_vs_hf",
              key=MetricKey(round=2, role="actor", family="logprobs"), statistic="max_abs",
              control_error=1e-6, control="attn_impl", floor=1e-5, k=4.0, bound=1.4e-5)


def _meta(**over: Any) -> dict[str, Any]:
    acks = [{"rank": r, "version": 1, "digest": f"d{r}"} for r in range(2)]
    meta: dict[str, Any] = {
        "install": {"accepted": True, "acks": acks, "expected_digest": ["d0", "d1"],
                    "tensors_verified": 38},
        "final": {"version": 1, "verified": True, "problem": None},
        "cache_proof": {"cached_tokens_first_after_update": 0,
                        "cached_tokens_same_version_replay": 32},
        "kernel_probe": {"version": 1, "previous_file": "/m/v0", "layers_probed": 9,
                        "changed": 9, "stale": [], "worst_err_new": 1e-7, "tolerance": 1e-3},
        "probes": [{"name": n, "rejected": True, "stayed": True, "reason": f"{n} refused",
                    "version_before": 1, "version_after": 1, "expected_check": n,
                    "record": {"accepted": False, "check": n}} for n in PROBES],
    }
    meta.update(over)
    return meta


def _rows(meta: dict[str, Any], sampler_lp: np.ndarray, actor_lp: np.ndarray) -> dict[str, Any]:
    mask = np.array([[1, 1, 0], [1, 0, 0]])
    rows = sampler_rows(cell="vllm-fp32-sampler-tp2", entry={"tp": 2, "weights_from": "a"},
                        tensors={"round2/sampler/logprobs": sampler_lp}, meta=meta,
                        meta_problem="", actor={"round2/actor/logprobs": actor_lp},
                        bounds=[BOUND], mask=mask)
    return {f"{r.klass}/{r.family}/{r.statistic}": r for r in rows}


ACTOR = np.array([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], dtype=np.float32)


def test_sampler_rows_pass_and_round2_statistics() -> None:
    got = ACTOR + np.array([[1e-6, -3e-6, 5.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    rows = _rows(_meta(), got, ACTOR)
    assert {r.verdict for r in rows.values()} == {"PASS"}
    assert len([k for k in rows if k.startswith("sampler_probe/")]) == 6
    assert "sampler_probe/partial_install/rejected" in rows
    mx = rows["sampler_vs_actor/logprobs/max_abs"]
    assert mx.error == pytest.approx(3e-6, rel=0.05)  # the masked 5.0 is never read
    assert mx.bound == 1.4e-5
    assert rows["sampler_vs_actor/logprobs/k3_kl"].bound == pytest.approx(
        math.expm1(1.4e-5) - 1.4e-5)


@pytest.mark.parametrize(("over", "key", "why"), [
    ({"cache_proof": {"cached_tokens_first_after_update": 32,
                      "cached_tokens_same_version_replay": 32}},
     "sampler_cache/prefix_cache/cached_tokens", "predates the update"),
    ({"cache_proof": {"cached_tokens_first_after_update": 0,
                      "cached_tokens_same_version_replay": 0}},
     "sampler_cache/prefix_cache/cached_tokens", "reused no cached tokens"),
    ({"probes": []}, "sampler_probe/warm_cache/rejected", "missing from outputs.json"),
    ({"probes": [{"name": n, "rejected": True, "stayed": True, "reason": "r",
                  "version_before": 1, "version_after": 1, "expected_check": n,
                  "record": {"accepted": False, "check": n}} for n in PROBES[:5]]},
     "sampler_probe/partial_install/rejected", "missing from outputs.json"),
    ({"install": {"accepted": True, "acks": [{"rank": 0, "version": 1, "digest": "d0"}],
                  "expected_digest": ["d0", "d1"]}},
     "sampler_install/install/digest", "one per rank [0, 1]"),
])
def test_sampler_rows_fail(over: dict[str, Any], key: str, why: str) -> None:
    rows = _rows(_meta(**over), ACTOR, ACTOR)
    assert rows[key].verdict == "FAIL"
    assert why in (rows[key].reason or "")
    assert rows[key].detail is not None


def test_probe_not_rejected_is_a_fail() -> None:
    meta = _meta()
    meta["probes"][1] = {**meta["probes"][1], "rejected": False,
                         "record": {"accepted": True, "check": None}}
    rows = _rows(meta, ACTOR, ACTOR)
    r = rows["sampler_probe/wrong_shard/rejected"]
    assert r.verdict == "FAIL"
    assert "was not rejected" in (r.reason or "")


def test_round2_over_bound_is_a_fail() -> None:
    got = ACTOR + np.array([[0.0, 1e-3, 0.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    rows = _rows(_meta(), got, ACTOR)
    r = rows["sampler_vs_actor/logprobs/max_abs"]
    assert r.verdict == "FAIL"
    assert r.where.startswith("(0, 1)")
    assert r.margin is not None
    assert r.margin > 1


# harnesses.vllm.weights.stale_kernels and the comparator's kernel row (no vLLM needed).

from harnesses.vllm.weights import KERNEL_TOL, stale_kernels  # noqa: E402


def _probe(rank: int, **layers: tuple[float, float, bool]) -> dict[str, Any]:
    return {"rank": rank, "layers": {n.replace("__", "."): {"err_new": a, "err_old": b,
                                                            "changed": c}
                                     for n, (a, b, c) in layers.items()}}


def test_stale_kernels_by_nearest_version() -> None:
    fresh = _probe(0, model__layers__0__qkv_proj=(1e-7, 2e-4, True),
                   lm_head=(2e-7, 2e-7, False))  # unchanged weights: equal errors are fine
    assert stale_kernels([fresh]) == []
    stale = _probe(1, lm_head=(2.4e-4, 1e-7, True))  # nearer the previous weights
    assert stale_kernels([fresh, stale]) == [
        "rank 1: lm_head (rel err vs new 0.00024, vs previous 1e-07)"]
    garbage = _probe(0, o_proj=(2 * KERNEL_TOL, 3.0, True))  # neither version
    assert [s.split(" (")[0] for s in stale_kernels([garbage])] == ["rank 0: o_proj"]


def test_sampler_kernel_row() -> None:
    rows = _rows(_meta(), ACTOR, ACTOR)
    assert rows["sampler_install/kernels/stale"].verdict == "PASS"
    bad = _meta(kernel_probe={"version": 1, "previous_file": "/v0", "layers_probed": 9,
                              "changed": 9, "stale": ["rank 0: lm_head (rel err vs new "
                                                      "0.00024, vs previous 1e-07)"],
                              "worst_err_new": 2.4e-4, "tolerance": KERNEL_TOL})
    row = _rows(bad, ACTOR, ACTOR)["sampler_install/kernels/stale"]
    assert row.verdict == "FAIL"
    assert row.reason is not None
    assert "1 GEMM kernel(s) still compute with the previous version's weights" in row.reason
    assert "rank 0: lm_head" in row.reason
    missing = _meta()
    del missing["kernel_probe"]
    assert _rows(missing, ACTOR, ACTOR)["sampler_install/kernels/stale"].verdict == "FAIL"


# --------------------------------------------------------------------------- partial install
# WeightSync's missing_tensor check runs before the engine is touched: no vLLM needed (the
# engine here is None, so any call into it would raise).

from pathlib import Path  # noqa: E402

from safetensors.torch import save_file  # noqa: E402

from harnesses.vllm import probes, weights  # noqa: E402


def test_partial_install_is_refused_before_the_engine(tmp_path: Path) -> None:
    base = tmp_path / "v0"
    base.mkdir()
    save_file(_hf(0), str(base / weights.WEIGHTS_FILE), metadata={"format": "pt"})
    payload = tmp_path / "v1.safetensors"
    save_file(_hf(1), str(payload), metadata={"format": "pt"})
    work = tmp_path / "work"
    work.mkdir()
    sync = weights.WeightSync(None, spec=_spec(), tp=2, workdir=work, base_dir=base,
                              proof=[5, 6])
    res = probes.run_probe(sync, "partial_install", payload)
    assert res.expected_check == "missing_tensor"
    assert res.rejected is True
    assert res.stayed is True
    assert res.version_before == res.version_after == 0
    assert res.reason == ("partial install: partial_install.safetensors lacks 1 tensor(s) of "
                          "the model: model.layers.0.mlp.down_proj.weight")
    assert res.record.acks == ()
    assert res.record.rollback is None
    assert sync.missing_tensors(payload) == []


def test_staged_copy_missing_a_tensor_is_refused(tmp_path: Path) -> None:
    """A complete payload whose staged copy (what vLLM loads) lost a tensor; refused after
    the proof prompt was served, before the reload."""
    from safetensors.torch import load_file

    base = tmp_path / "v0"
    base.mkdir()
    save_file(_hf(0), str(base / weights.WEIGHTS_FILE), metadata={"format": "pt"})
    payload = tmp_path / "v1.safetensors"
    save_file(_hf(1), str(payload), metadata={"format": "pt"})
    served: list[int] = []

    class _Engine:
        def generate(self, *a: Any, **k: Any) -> Any:
            served.append(1)
            out = type("O", (), {"num_cached_tokens": 0})()
            return [out]

    work = tmp_path / "work"
    work.mkdir()
    sync = weights.WeightSync(_Engine(), spec=_spec(), tp=1, workdir=work, base_dir=base,
                              proof=[5, 6])

    def drop(path: Path) -> None:
        sd = load_file(str(path))
        del sd["model.norm.weight"]
        save_file(sd, str(path), metadata={"format": "pt"})

    rec = sync.install(payload, 1, tamper=drop)
    assert rec.check == "missing_tensor"
    assert not rec.accepted
    assert "model.norm.weight" in (rec.reason or "")
    assert sync.version == 0
    assert served == [1]  # the proof prompt only; no reload (the engine has no collective_rpc)
