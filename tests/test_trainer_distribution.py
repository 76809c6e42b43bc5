"""An Actor trainer cell's own next-token distributions against the reference's sealed ones.

The reference seals, beside the FP32 ceilings, ``bounds_bf16 = k * max over the BF16
controls + floor`` (:mod:`qualify.reference.distribution`: HF at BF16 parameters, batched
``sdpa``, ``eager``, per sequence, KV-cache decode, each against the FP32 reference); the
comparator's ``trainer_distribution`` rows
(:func:`qualify.compare.distribution.trainer_distribution_rows`) judge an FP32 cell by the
FP32 ceilings and a BF16 cell by the BF16 ones. Classes of defect the rows must catch: a
temperature applied twice in the tempered kind, a top-k mask leaking into the raw kind, a
BF16 forward passed off as FP32; and what they must not do: pass a cell that recorded
nothing, or judge a BF16 cell against a reference sealed without BF16 ceilings.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from qualify.compare.distribution import trainer_distribution_rows
from qualify.distmetrics import STATISTICS, TOPK_STATISTICS, distribution_metrics, topk_of
from qualify.evidence import store
from qualify.reference import distribution as refdist

KINDS = ("raw", "tempered")
SAMPLER = "vllm-fp32-sampler-tp1"
COMMITTED = Path(__file__).resolve().parents[1] / "references" / "tiny-qwen3-9cd85d5fbd99"


def _hf_logprobs(actor: Path, roll: dict[str, torch.Tensor], dtype: torch.dtype,
                 temperature: float, attn: str = "sdpa") -> np.ndarray:
    """``[B, R, V]`` FP32 logprobs of an HF batched prefill in ``dtype`` with attention
    ``attn``, 0 where masked: computed here, apart from the reference stage's code."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(actor), torch_dtype=dtype,
                                                 attn_implementation=attn).eval()
    p, r = roll["prompts"].shape[1], roll["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=torch.cat([roll["prompts"], roll["responses"]], dim=1),
                       attention_mask=roll["attention_mask"],
                       position_ids=roll["position_ids"]).logits[:, p - 1:p + r - 1].float()
    lp = torch.log_softmax(logits.double() / temperature, dim=-1).float()
    return torch.where(roll["response_mask"].bool()[..., None], lp, 0.0).numpy()


@pytest.fixture(scope="module", params=["full", "topk"])
def sealed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Any]:
    """A tiny Qwen3's distributions sealed on the full or (a lowered MAX_VOCAB) top-k path,
    with the HF BF16 prefill's logprobs computed independently."""
    from harness_outputs import TINY, tiny_rollout
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from qualify.contract import load_contract
    from qualify.resources import contracts_dir

    tmp = tmp_path_factory.mktemp(f"dist-{request.param}")
    cfg = Qwen3Config(**TINY, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                      max_position_embeddings=64)
    torch.manual_seed(5)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp / "actor")
    roll = tiny_rollout([[1, 5, 6, 7], [1, 8, 9], [1, 10]], (5, 3, 4), 5,
                        torch.Generator().manual_seed(2))
    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "topk":  # the path a vocabulary above MAX_VOCAB takes
            mp.setattr(refdist, "MAX_VOCAB", TINY["vocab_size"] - 1)
        doc = refdist.seal_distribution(contract, tmp / "actor", roll, tmp)
    t = float(contract.sampling.temperature)
    return {"dir": tmp, "doc": doc, "roll": roll, "topk": request.param == "topk",
            "ref": store.load_tensors(tmp / refdist.DISTRIBUTION_FILE),
            "bf16": {kind: _hf_logprobs(tmp / "actor", roll, torch.bfloat16,
                                        1.0 if kind == "raw" else t) for kind in KINDS},
            "bf16_eager": {kind: _hf_logprobs(tmp / "actor", roll, torch.bfloat16,
                                              1.0 if kind == "raw" else t, attn="eager")
                           for kind in KINDS},
            "fp32": {kind: _hf_logprobs(tmp / "actor", roll, torch.float32,
                                        1.0 if kind == "raw" else t) for kind in KINDS},
            "temperature": t, "k": float(contract.bounds.k),
            "topk_k": int(contract.bounds.distribution_topk)}


def _cell_tensors(s: dict[str, Any], full: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An Actor cell's round-1 tensors of the shared contract from full ``[B, R, V]``
    logprobs per kind: the whole distributions, or their top-k and token logprobs."""
    if not s["topk"]:
        return {f"round1/actor/prefill_{kind}": full[kind] for kind in KINDS}
    out = {}
    tokens = s["roll"]["responses"].numpy()
    mask = s["roll"]["response_mask"].numpy() != 0
    for kind in KINDS:
        vals, ids = topk_of(full[kind], s["topk_k"])
        tok = np.take_along_axis(full[kind], tokens[..., None], axis=-1)[..., 0]
        out[f"round1/actor/prefill_{kind}_topk_logprobs"] = np.where(mask[..., None], vals, 0.0)
        out[f"round1/actor/prefill_{kind}_topk_ids"] = np.where(mask[..., None], ids, 0)
        out[f"round1/actor/prefill_{kind}_logprobs"] = np.where(mask, tok, 0.0)
    return out


def _rows(s: dict[str, Any], tensors: dict[str, np.ndarray], precision: str,
          ref_dir: Path | None = None) -> list[Any]:
    roll = s["roll"]
    return trainer_distribution_rows(
        cell=f"torch_tp-{precision}-actor-tp1", precision=precision, tensors=tensors,
        ref_dir=ref_dir or s["dir"], mask=roll["response_mask"].numpy(),
        responses=roll["responses"].numpy(), positions={})


def _lsm(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))).astype(np.float32)


def _metrics(s: dict[str, Any], full: dict[str, np.ndarray], kind: str) -> dict[str, Any]:
    """The statistics of ``full`` (``[B, R, V]`` logprobs per kind) against the sealed
    reference, on the fixture's path."""
    mask = s["roll"]["response_mask"].numpy()
    if not s["topk"]:
        return distribution_metrics(full[kind], s["ref"][kind], s["roll"]["responses"].numpy(),
                                    mask, clip_ratio=0.2)
    from qualify.distmetrics import topk_metrics

    mine, ref = _cell_tensors(s, full), s["ref"]
    return topk_metrics(mine[f"round1/actor/prefill_{kind}_topk_logprobs"],
                        mine[f"round1/actor/prefill_{kind}_topk_ids"],
                        ref[f"{kind}_topk_logprobs"], ref[f"{kind}_topk_ids"],
                        cand_token=mine[f"round1/actor/prefill_{kind}_logprobs"],
                        ref_token=ref[f"{kind}_token_logprobs"], mask=mask, clip_ratio=0.2)


def test_bf16_ceiling_is_k_times_the_largest_bf16_control_plus_the_floor(
        sealed: dict[str, Any]) -> None:
    """Each sealed ``bounds_bf16`` entry is ``k x`` the largest BF16 control's metric ``+``
    the floor; the ``bf16`` (batched ``sdpa``) and ``bf16_attn_impl`` (``eager``) controls
    equal HF BF16 prefills recomputed here; the FP32 ceilings stay ``k x`` the largest FP32
    control ``+`` the floor."""
    s, doc = sealed, sealed["doc"]
    stats = TOPK_STATISTICS if s["topk"] else STATISTICS
    assert doc["bf16_controls"] == ["bf16", "bf16_decode", "bf16_attn_impl", "bf16_batch"]
    for kind in KINDS:
        sdpa, eager = _metrics(s, s["bf16"], kind), _metrics(s, s["bf16_eager"], kind)
        controls = doc[kind]["controls"]
        bf16, fp32 = doc[kind]["bounds_bf16"], doc[kind]["bounds"]
        assert set(bf16) == set(stats)
        for st in stats:
            assert float(controls["bf16"][st]) == pytest.approx(float(sdpa[st]), rel=1e-9,
                                                                abs=1e-300), (kind, st)
            assert float(controls["bf16_attn_impl"][st]) == pytest.approx(
                float(eager[st]), rel=1e-9, abs=1e-300), (kind, st)
            per = {c: float(controls[c][st]) for c in doc["bf16_controls"]}
            worst = max(per.values())
            assert bf16[st]["bound"] == s["k"] * worst + refdist.FLOORS[st], (kind, st)
            assert per[bf16[st]["control"]] == worst
            assert bf16[st]["floor"] == refdist.FLOORS[st]
            worst32 = max(float(controls[c][st]) for c in refdist.FP32_CONTROLS)
            assert fp32[st]["bound"] == s["k"] * worst32 + refdist.FLOORS[st]
        # the BF16 ceiling is a different, wider one: a BF16 forward is not FP32 noise
        assert bf16["kl_ref_cand_max"]["bound"] > 10 * fp32["kl_ref_cand_max"]["bound"]


def test_own_distribution_passes_and_planted_faults_fail(sealed: dict[str, Any]) -> None:
    """The HF FP32 forward passes every row of an FP32 cell; a temperature applied twice
    (tempered) and a top-8 mask leaking into the raw kind fail their family only."""
    s = sealed
    t = s["temperature"]
    mask = s["roll"]["response_mask"].numpy() != 0
    clean = _cell_tensors(s, s["fp32"])
    rows = _rows(s, clean, "fp32")
    fams = ({"prefill_raw_topk", "prefill_tempered_topk"} if s["topk"]
            else {"prefill_raw", "prefill_tempered"})
    stats = TOPK_STATISTICS if s["topk"] else STATISTICS
    assert {r.family for r in rows} == fams
    assert len(rows) >= 2 * (len(stats) - 2)  # tv_upper_* rows only where they can fail
    assert {(r.klass, r.role, r.round) for r in rows} == {("trainer_distribution", "actor", 1)}
    assert all(r.verdict == "PASS" for r in rows), [r.reason for r in rows
                                                    if r.verdict != "PASS"]
    twice = dict(s["fp32"])
    twice["tempered"] = np.where(mask[..., None], _lsm(s["fp32"]["tempered"] / t), 0.0)
    leak = dict(s["fp32"])
    kth = np.sort(s["fp32"]["raw"], axis=-1)[..., -8][..., None]
    leak["raw"] = np.where(mask[..., None], _lsm(np.where(s["fp32"]["raw"] >= kth,
                                                          s["fp32"]["raw"], -np.inf)), 0.0)
    for bad, family in ((twice, "tempered"), (leak, "raw")):
        for precision in ("fp32", "bf16"):  # a fault beyond both ceilings
            got = _rows(s, _cell_tensors(s, bad), precision)
            failed = {r.family for r in got if r.verdict == "FAIL"}
            assert failed == {f"prefill_{family}" + ("_topk" if s["topk"] else "")}, \
                (precision, family)
            assert {r.statistic for r in got if r.verdict == "FAIL"} >= {"kl_ref_cand_max",
                                                                         "tv_max"}


def test_bf16_cells_are_judged_by_the_bf16_ceilings(sealed: dict[str, Any]) -> None:
    """The HF BF16 forward passes as a BF16 cell (``bounds_bf16``) and fails as an FP32 cell:
    the cell's precision picks the ceiling."""
    s = sealed
    bf16 = _cell_tensors(s, s["bf16"])
    as_bf16 = _rows(s, bf16, "bf16")
    assert {r.verdict for r in as_bf16} == {"PASS"}
    for r in as_bf16:
        key = r.family.removeprefix("prefill_").removesuffix("_topk")
        assert r.bound == s["doc"][key]["bounds_bf16"][r.statistic]["bound"]
    as_fp32 = _rows(s, bf16, "fp32")
    assert any(r.verdict == "FAIL" and r.statistic == "kl_ref_cand_max" for r in as_fp32)


def test_missing_tensors_and_old_references_are_not_run(sealed: dict[str, Any],
                                                        tmp_path: Path) -> None:
    """No tensors: NOT_RUN rows naming them; a reference without ``bounds_bf16``: a BF16
    cell's rows NOT_RUN naming it, an FP32 cell's judged; without distribution.json: none."""
    s = sealed
    rows = _rows(s, {}, "fp32")
    assert {r.verdict for r in rows} == {"NOT_RUN"}
    assert all("round1/actor/prefill_" in (r.reason or "") and
               "its harness records no full distributions" in (r.reason or "") for r in rows)
    old = tmp_path / "old"
    shutil.copytree(s["dir"], old, ignore=shutil.ignore_patterns("actor"))
    doc = json.loads((old / refdist.DISTRIBUTION_JSON).read_text())
    for kind in KINDS:
        del doc[kind]["bounds_bf16"]
    (old / refdist.DISTRIBUTION_JSON).write_text(json.dumps(doc))
    bf16 = _rows(s, _cell_tensors(s, s["bf16"]), "bf16", ref_dir=old)
    assert {r.verdict for r in bf16} == {"NOT_RUN"}
    assert all("bounds_bf16" in (r.reason or "") for r in bf16)
    fp32 = _rows(s, _cell_tensors(s, s["fp32"]), "fp32", ref_dir=old)
    assert {r.verdict for r in fp32} == {"PASS"}
    (old / refdist.DISTRIBUTION_JSON).unlink()
    assert _rows(s, _cell_tensors(s, s["fp32"]), "fp32", ref_dir=old) == []


def test_the_bf16_controls_are_counted_at_their_own_precision(
        sealed: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference counts its BF16 controls' top-1 ties by the BF16 rule at each control's
    own top logit, and says so (``bf16_controls_ties``), so a BF16 cell's count and its
    ceiling share one rule; the FP32 controls by the FP32 rule. Watched on a second seal of
    the fixture's model: every metrics call of a BF16 control gets ``precision="bf16"``, the
    kind's temperature and, for the batched ``bf16`` control, the top logit of an HF BF16
    prefill computed here; no FP32 control's call gets a precision."""
    from transformers import AutoModelForCausalLM

    from qualify.contract import load_contract
    from qualify.distmetrics import BF16_TIE_RULE
    from qualify.resources import contracts_dir

    s = sealed
    assert s["doc"]["bf16_controls_ties"] == BF16_TIE_RULE
    calls: list[dict[str, Any]] = []
    name = "topk_metrics" if s["topk"] else "distribution_metrics"
    real = getattr(refdist, name)

    def watched(*args: Any, **kw: Any) -> dict[str, Any]:
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(refdist, name, watched)
    if s["topk"]:
        monkeypatch.setattr(refdist, "MAX_VOCAB", s["doc"]["topk"]["k"])
    roll = s["roll"]
    refdist.seal_distribution(load_contract(contracts_dir() / "tiny-qwen3.toml"),
                              s["dir"] / "actor", roll, tmp_path)
    controls = list(refdist.FP32_CONTROLS) + list(refdist.INFO_CONTROLS)
    assert len(calls) == 2 * len(controls)  # per kind, in the stage's order
    model = AutoModelForCausalLM.from_pretrained(str(s["dir"] / "actor"),
                                                 torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").eval()
    p, r = roll["prompts"].shape[1], roll["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=torch.cat([roll["prompts"], roll["responses"]], dim=1),
                       attention_mask=roll["attention_mask"],
                       position_ids=roll["position_ids"]).logits[:, p - 1:p + r - 1].float()
    top = torch.where(roll["response_mask"].bool(), logits.amax(-1), 0.0).numpy()
    for i, kind in enumerate(KINDS):
        for j, control in enumerate(controls):
            kw = calls[i * len(controls) + j]
            if control not in refdist.BF16_CONTROLS:
                assert "precision" not in kw, control
                continue
            assert kw["precision"] == "bf16", control
            assert kw["temperature"] == (1.0 if kind == "raw" else s["temperature"])
            assert np.shape(kw["top_logit"]) == np.shape(top)
            if control == refdist.BF16_CONTROL:
                np.testing.assert_array_equal(kw["top_logit"], top)


def test_trainer_vs_sampler_pairs_on_both_paths(sealed: dict[str, Any]) -> None:
    """A BF16 trainer's prefill against an FP32 sampler's decode-path distributions (here the
    HF BF16 and FP32 forwards): the pair's TV is the one computed directly from the two whole
    distributions on the full path, and brackets it (lower <= true <= upper) on the top-k
    path; the TV ceiling is the sum of the two cells' sealed bounds (``tv_upper_max`` on the
    top-k path, none where that sum is 1 or more)."""
    from qualify.compare.distribution import trainer_vs_sampler

    s = sealed
    mask = s["roll"]["response_mask"].numpy() != 0
    trainer = _cell_tensors(s, s["bf16"])
    sampler = {n.replace("round1/actor/prefill_", "round1/sampler/decode_"): v
               for n, v in _cell_tensors(s, s["fp32"]).items()}
    pairs = trainer_vs_sampler(trainer="t", precision="bf16", sampler="s",
                               trainer_tensors=trainer, sampler_tensors=sampler,
                               ref_dir=s["dir"], mask=mask,
                               responses=s["roll"]["responses"].numpy())
    assert [p["kind"] for p in pairs] == list(KINDS)
    for p in pairs:
        kind = p["kind"]
        a, b = (np.exp(s[side][kind].astype(np.float64))[mask] for side in ("bf16", "fp32"))
        a, b = a / a.sum(-1, keepdims=True), b / b.sum(-1, keepdims=True)
        true_tv = float((0.5 * np.abs(a - b).sum(-1)).max())
        assert true_tv > 0  # the two forwards differ: the check below can fail
        doc = s["doc"][kind]
        if not s["topk"]:
            assert p["tv_max"] == pytest.approx(true_tv, rel=1e-9, abs=1e-12)
            assert p["tv_max_ceiling"] == (doc["bounds_bf16"]["tv_max"]["bound"]
                                           + doc["bounds"]["tv_max"]["bound"])
            continue
        assert p["k"] == s["topk_k"]
        assert p["tv_max"] <= true_tv * (1 + 1e-9) + 1e-12 <= p["tv_upper_max"] + 2e-12
        total = (doc["bounds_bf16"]["tv_upper_max"]["bound"]
                 + doc["bounds"]["tv_upper_max"]["bound"])
        assert p["tv_max_ceiling"] == (total if total < 1 else None)
    # a report sealed before the trainer_vs_sampler_topk section: no pairs on that path
    old = trainer_vs_sampler(trainer="t", precision="bf16", sampler="s",
                             trainer_tensors=trainer, sampler_tensors=sampler, ref_dir=s["dir"],
                             mask=mask, responses=s["roll"]["responses"].numpy(), topk=False)
    assert old == ([] if s["topk"] else pairs)
    # a pair without one side's tensors gives nothing
    assert trainer_vs_sampler(trainer="t", precision="bf16", sampler="s",
                              trainer_tensors=trainer, sampler_tensors={}, ref_dir=s["dir"],
                              mask=mask, responses=s["roll"]["responses"].numpy()) == []


def test_the_committed_reference_passes_its_own_distributions_at_both_precisions() -> None:
    """The committed tiny-qwen3 reference: its own sealed distributions pass as an FP32
    cell's and as a BF16 cell's, each against its own sealed ceilings, which it has for
    both kinds (the BF16 ones the wider)."""
    doc = json.loads((COMMITTED / refdist.DISTRIBUTION_JSON).read_text())
    ref = store.load_tensors(COMMITTED / refdist.DISTRIBUTION_FILE)
    roll = store.load_tensors(COMMITTED / "rollout.safetensors")
    tensors = {f"round1/actor/prefill_{kind}": np.asarray(ref[kind]) for kind in KINDS}
    common: dict[str, Any] = {"tensors": tensors, "ref_dir": COMMITTED,
                              "mask": np.asarray(roll["response_mask"]),
                              "responses": np.asarray(roll["responses"])}
    for precision, key in (("fp32", "bounds"), ("bf16", "bounds_bf16")):
        rows = trainer_distribution_rows(cell="c", precision=precision, **common)
        assert len(rows) == 2 * len(STATISTICS)
        assert {r.verdict for r in rows} == {"PASS"}
        for r in rows:
            assert r.bound == doc[r.family.removeprefix("prefill_")][key][r.statistic]["bound"]
    for kind in KINDS:
        assert (doc[kind]["bounds_bf16"]["kl_ref_cand_max"]["bound"]
                > doc[kind]["bounds"]["kl_ref_cand_max"]["bound"])


# --------------------------------------------------------------------------- the comparator


def test_compare_run_judges_actor_cells_only_and_keeps_their_positions(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``compare_run``: an FP32 and a BF16 Actor cell get ``trainer_distribution``
    rows under their own ceilings, the Critic none; a cell that records none is NOT_RUN
    unless the contract expects it (``matrix.expected_not_run``); ``report.json`` keeps the
    Actor cells' per-position values, and the plot data finds their rows; a report recomputed
    without the ``trainer_distribution`` section has none of the rows."""
    import tomllib

    import test_compare as tc

    from qualify.compare.plotdata import load_run, position_distributions
    from qualify.compare.verdicts import OPTIONAL_SECTIONS
    from qualify.contract import Contract

    rng = np.random.default_rng(7)
    logits = rng.normal(size=(tc.B, tc.R, 16)) * 3
    m = tc.MASK[..., None] != 0
    ref = {kind: np.where(m, _lsm(logits / (1.0 if kind == "raw" else 0.9)), 0.0)
           .astype(np.float32) for kind in KINDS}
    bf16 = {kind: np.where(m, _lsm(ref[kind] + rng.normal(size=logits.shape) * 1e-2), 0.0)
            .astype(np.float32) for kind in KINDS}
    tokens = np.zeros((tc.B, tc.R), dtype=np.int64)
    doc: dict[str, Any] = {"clip_ratio": 0.2}
    for kind in KINDS:
        got = distribution_metrics(bf16[kind], ref[kind], tokens, tc.MASK, clip_ratio=0.2)
        doc[kind] = {key: {s: {"bound": 4.0 * c + refdist.FLOORS[s], "control": name,
                               "control_error": c, "k": 4.0, "floor": refdist.FLOORS[s]}
                           for s in STATISTICS for c in [float(got[s]) if key == "bounds_bf16"
                                                         else 1e-12]}
                     for key, name in (("bounds", "decode"), ("bounds_bf16", "bf16"))}
    real_seal = store.seal

    def seal(directory: str | Path, *, kind: str) -> str:
        if kind == "reference":
            Path(directory, refdist.DISTRIBUTION_JSON).write_text(json.dumps(doc))
            store.save_tensors(Path(directory, refdist.DISTRIBUTION_FILE),
                               {k: torch.from_numpy(v) for k, v in ref.items()})
        return real_seal(directory, kind=kind)

    expected: list[dict[str, Any]] = []

    def make(required: list[str] | None = None) -> Contract:
        d = tomllib.loads(tc.torch_tp_only_text())
        d["matrix"]["required_cells"] = required
        if expected:
            d["matrix"]["expected_not_run"] = expected
        return Contract.from_dict(d)

    monkeypatch.setattr(store, "seal", seal)
    monkeypatch.setattr(tc, "make_contract", make)
    cells = [tc.TP1, tc.BF16_TP1, tc.CRITIC_TP1]

    def world(path: Path, sampler: dict[str, np.ndarray] | None = None) -> tc.World:
        w = tc.World(path, required=cells)
        w.add_cell(tc.TP1, outputs={**tc.actor(w), **{f"round1/actor/prefill_{k}":
                                                      ref[k] + np.float32(1e-7) * m
                                                      for k in KINDS}})
        w.add_cell(tc.BF16_TP1, outputs={**tc.actor(w, "bf16"), **{
            f"round1/actor/prefill_{k}": bf16[k] for k in KINDS}})
        w.add_cell(tc.CRITIC_TP1)
        w.add_cell(SAMPLER, outputs=sampler if sampler is not None else {
            f"round1/sampler/decode_{k}": ref[k] for k in KINDS})
        return w

    w = world(tmp_path / "a")
    report = w.compare()  # the sampler cell lacks its install evidence: judged apart
    assert {c: report.verdicts[c] for c in cells} == dict.fromkeys(cells, "PASS")
    fp32, bf = (tc.rows_of(report, c, "trainer_distribution") for c in cells[:2])
    assert len(fp32) == len(bf) == 2 * len(STATISTICS)
    assert not tc.rows_of(report, tc.CRITIC_TP1, "trainer_distribution")
    assert {r.bound for r in fp32 if r.statistic == "kl_ref_cand_max"} == {4e-12 + 1e-10}
    assert {r.bound for r in bf if r.statistic == "kl_ref_cand_max"} == {
        doc[k]["bounds_bf16"]["kl_ref_cand_max"]["bound"] for k in KINDS}
    written = json.loads((w.run_dir / "report.json").read_text())
    assert set(written["distribution_positions"]) == {tc.TP1, tc.BF16_TP1, SAMPLER}
    assert set(written["distribution_positions"][tc.TP1]) == {"prefill_raw", "prefill_tempered"}
    pairs = written["trainer_vs_sampler"]["pairs"]  # information: the direct pair metrics
    assert {(q["trainer"], q["kind"]) for q in pairs} == {(c, k) for c in cells[:2] for k in KINDS}
    for q in pairs:
        key = "bounds" if q["trainer"] == tc.TP1 else "bounds_bf16"
        kind = q["kind"]
        assert q["sampler"] == SAMPLER
        assert q["tv_max_ceiling"] == (doc[kind][key]["tv_max"]["bound"]
                                       + doc[kind]["bounds"]["tv_max"]["bound"])
        mine = (ref if q["trainer"] == tc.TP1 else bf16)[kind]
        assert q["tv_max"] == pytest.approx(0.5 * np.abs(np.exp(mine.astype(np.float64))
                                                         - np.exp(ref[kind])).sum(-1).max(),
                                            rel=1e-3, abs=1e-6)
        assert q["tv_max"] <= q["tv_max_ceiling"]  # both within their rows: the pair too
    md = (w.run_dir / "report.md").read_text()
    assert "## Trainer vs sampler distributions (information, no verdict)" in md
    assert "KL obeys no triangle inequality" in md
    drawn = position_distributions(load_run(w.run_dir), tc.TP1)  # what report.html draws
    assert [d.family for d in drawn] == ["prefill_raw", "prefill_tempered"]
    assert all(d.stored is not None and d.reproduces for d in drawn)
    again = tc.compare_run(w.run_dir, write=False,
                           sections=tuple(s for s in OPTIONAL_SECTIONS
                                          if s != "trainer_distribution"))
    assert not [r for r in again.rows if r.klass == "trainer_distribution"]
    assert "trainer_vs_sampler" not in again.to_dict()
    # a sampler tensor the metrics refuse costs its pairs, not the report (information only)
    bad = world(tmp_path / "b", sampler={f"round1/sampler/decode_{k}": ref[k][..., :-1].copy()
                                         for k in KINDS})
    bad.compare()
    written = json.loads((bad.run_dir / "report.json").read_text())
    assert written["trainer_vs_sampler"]["pairs"] == []
    assert {(e["trainer"], e["sampler"]) for e in written["trainer_vs_sampler"]["errors"]} == {
        (c, SAMPLER) for c in cells[:2]}
    assert all("shapes" in e["error"] for e in written["trainer_vs_sampler"]["errors"])
    assert "not measured (ValueError: shapes" in (bad.run_dir / "report.md").read_text()
    store.make_writable(tmp_path)

    for expect, verdict in (([], "NOT_RUN"), ([{"engine": "torch_tp", "family": f,
                                                 "round": 1, "reason": "records none"}
                                                for f in ("prefill_raw", "prefill_tempered")],
                                               "PASS")):
        expected[:] = expect
        w = tc.World(tmp_path / f"none-{verdict}", required=[tc.TP1])
        w.add_cell(tc.TP1)  # no prefill tensors
        report = w.compare(write=False)
        assert report.verdicts == {tc.TP1: verdict}
        rows = tc.rows_of(report, tc.TP1, "trainer_distribution")
        assert {r.verdict for r in rows} == {"NOT_RUN"}
        assert all((r.expected_not_run is not None) is bool(expect) for r in rows)


@pytest.mark.parametrize("name", ["tiny-qwen3-trl", "tiny-qwen3-trl-gspo", "tiny-qwen3-verl",
                                  "tiny-qwen3-verl-gspo"])
def test_adapter_contracts_expect_no_distributions(name: str) -> None:
    """The TRL and verl adapters record no distributions: against their committed reference
    (which seals them), every ``trainer_distribution`` row of their Actor cells is a NOT_RUN
    the contract expects, so a cell whose other rows pass still passes."""
    import dataclasses

    from qualify.compare.stage import expected_not_run
    from qualify.compare.verdicts import cell_verdict
    from qualify.contract import load_contract
    from qualify.resources import contracts_dir

    contract = load_contract(contracts_dir() / f"{name}.toml")
    (ref_dir,) = [p for p in COMMITTED.parent.glob(f"{name}-*")
                  if p.name.removeprefix(f"{name}-").isalnum()]
    roll = store.load_tensors(ref_dir / "rollout.safetensors")
    for cell in contract.matrix.cells():
        if cell.role != "actor":
            continue
        rows = trainer_distribution_rows(
            cell=cell.cell_id, precision=cell.precision, tensors={}, ref_dir=ref_dir,
            mask=np.asarray(roll["response_mask"]), responses=np.asarray(roll["responses"]))
        assert rows
        marked = expected_not_run(rows, cell.engine, contract.matrix.expected_not_run)
        assert all(r.verdict == "NOT_RUN" and r.expected_not_run for r in marked)
        passing = dataclasses.replace(marked[0], verdict="PASS", expected_not_run=None)
        assert cell_verdict([*marked, passing])[0] == "PASS"
