"""``python -m benchmarks`` end to end at a small size, and the comparator's bounded memory.

The suite builds synthetic sealed evidence in the real layout (:mod:`benchmarks.synthetic`)
and runs the real ``qualify compare`` and ``qualify verify`` on it in children; here at
20 MB (largest tensor 10 MB). The comparator streams tensors above
:data:`qualify.evidence.tensor_stream.LAZY_BYTES` in chunks: its memory growth stays below
the largest tensor, where loading the two files whole (and their FP64 copies and the power
check's null alternatives) takes many times it.
"""

from __future__ import annotations

import argparse
import json
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from benchmarks import evidence_cost
from benchmarks.__main__ import run_suite
from benchmarks.synthetic import COMMITTED_REFERENCE, COMMITTED_RUN, build
from qualify.compare.stage import compare_run
from qualify.evidence import store
from qualify.evidence.tensor_stream import LAZY_BYTES, LazyTensor, open_tensors
from qualify.statistics import CHUNK_ELEMENTS, l2_norm, max_rel_l2

pytestmark = pytest.mark.skipif(not (COMMITTED_RUN.is_dir() and COMMITTED_REFERENCE.is_dir()),
                                reason="the committed tiny-qwen3 evidence is not checked out")

COMPARATOR_COLUMNS = ["command", "MB", "wall_s", "cpu_s", "MB_per_s_wall", "MB_per_s_cpu",
                      "peak_rss_mb", "base_rss_mb", "largest_tensor_mb", "peak_over_largest",
                      "growth_over_largest"]
VERIFY_COLUMNS = ["command", "MB", "wall_s", "cpu_s", "MB_per_s_wall", "MB_per_s_cpu",
                  "peak_rss_mb"]
LAUNCH_COLUMNS = ["launch", "kind", "started", "cells", "wall_s", "compute_s", "fixed_s",
                  "fixed_per_cell_s", "setup_s", "wall_over_compute"]


def test_suite_end_to_end(tmp_path: Path) -> None:
    args = argparse.Namespace(size_gb=0.02, run=str(COMMITTED_RUN), quick=True,
                              workdir=str(tmp_path), keep=False)
    res = run_suite(args)
    comp, ver, launches = res["comparator"], res["verify"], res["launches"]
    assert list(comp.columns) == COMPARATOR_COLUMNS
    assert list(ver.columns) == VERIFY_COLUMNS
    assert list(launches.columns) == LAUNCH_COLUMNS
    row = comp.iloc[0]
    assert row["largest_tensor_mb"] == pytest.approx(10.0)
    assert row["MB"] > 2 * row["largest_tensor_mb"]
    for col in ("MB_per_s_wall", "MB_per_s_cpu", "peak_rss_mb", "base_rss_mb"):
        assert row[col] > 0, col
    assert row["peak_rss_mb"] >= row["base_rss_mb"]
    # streamed: the comparator grows by less than two largest tensors over its imports
    assert row["growth_over_largest"] <= 2.0, row.to_dict()
    assert (ver["MB_per_s_wall"] > 0).all()
    assert (ver["MB_per_s_cpu"] > 0).all()
    assert len(launches)
    assert (launches["wall_s"] > 0).all()
    assert (launches["fixed_s"] == launches["wall_s"] - launches["compute_s"]).all()
    assert set(res["stages"]["stage"]) >= {"trainer", "candidate (run.json)"}
    assert not (tmp_path / "synthetic").exists()  # removed without --keep
    # the result file (--out) keeps every table in its column order, and renders
    from benchmarks import results

    tables = {k: res[k] for k in ("comparator", "verify", "launches", "stages")}
    doc = results.result_document(command=["python", "-m", "benchmarks", "--size-gb", "0.02"],
                                  created="2026-12-05T00:00:00Z", run=str(COMMITTED_RUN),
                                  tables=tables, notes=res["notes"])
    results.write_result(tmp_path / "r.json", doc)
    back = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert list(back["tables"]["comparator"][0]) == COMPARATOR_COLUMNS
    assert back["tables"]["launches"][0]["wall_s"] == pytest.approx(launches["wall_s"].iloc[0])
    assert back["run"] == str(COMMITTED_RUN.relative_to(results.ROOT))
    assert back["machine"]["cpus"] >= 1
    page = results.render([back])
    assert "python -m benchmarks --size-gb 0.02" in page
    assert "| " + " | ".join(COMPARATOR_COLUMNS) + " |" in page


def test_stage_wall_is_the_elapsed_time_of_overlapping_launches() -> None:
    t = "2026-12-02T00:00:{:02d}.000000Z"
    launches = pd.DataFrame([  # trainer 0-10 s and 20-25 s; sampler 5-30 s beside them
        {"kind": "trainer", "started": t.format(0), "wall_s": 10.0},
        {"kind": "trainer", "started": t.format(20), "wall_s": 5.0},
        {"kind": "sampler", "started": t.format(5), "wall_s": 25.0}])
    assert evidence_cost._elapsed(launches[launches["kind"] == "trainer"]) == 15.0
    assert evidence_cost._elapsed(launches) == 30.0  # not the 40 s of the walls summed
    assert evidence_cost._elapsed(launches.assign(started="")) is None


def test_compare_memory_bounded_and_verdict(tmp_path: Path) -> None:
    """The traced allocations of a whole compare stay under the largest tensor (20 MB)."""
    syn = build(tmp_path / "s", size_bytes=40_000_000)
    tracemalloc.start()
    try:
        report = compare_run(syn.run, reference_dir=syn.reference, write=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < syn.largest_bytes, (peak, syn.largest_bytes)
    cell = next(c for c in report.cells if c.cell == "torch_tp-fp32-actor-tp1")
    assert cell.verdict == "PASS"
    grads = [r for r in report.rows if r.family == "grads" and r.round == 1
             and r.klass == "candidate_vs_hf"]
    assert grads
    assert grads[0].verdict == "PASS"
    assert grads[0].power is not None
    assert grads[0].power.has_power


def test_streamed_max_rel_l2_matches_in_memory(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    n = LAZY_BYTES // 4 + CHUNK_ELEMENTS // 3  # FP32 over the lazy size, a partial last chunk
    b = rng.standard_normal(n).astype(np.float32)
    a = b * (1 + 1e-3 * rng.standard_normal(n)).astype(np.float32)
    a[7] = b[7] + 5.0
    path = tmp_path / "t.safetensors"
    store.save_tensors(path, {"a": a, "b": b, "small": b[:10].copy()})
    t = open_tensors(path)
    assert isinstance(t["a"], LazyTensor)
    assert isinstance(t["small"], np.ndarray)
    np.testing.assert_array_equal(np.asarray(t["a"]), a)
    streamed = max_rel_l2({"p": t["a"]}, {"p": t["b"]})
    whole = max_rel_l2({"p": a.astype(np.float64)}, {"p": b.astype(np.float64)})
    d = a.astype(np.float64) - b.astype(np.float64)
    assert streamed.value == pytest.approx(float(np.linalg.norm(d) / np.linalg.norm(
        b.astype(np.float64))), rel=1e-12)
    assert streamed.value == pytest.approx(whole.value, rel=1e-12)
    assert streamed.max_abs == whole.max_abs
    assert streamed.max_rel == whole.max_rel
    assert l2_norm(t["b"]) == pytest.approx(float(np.linalg.norm(b.astype(np.float64))),
                                            rel=1e-12)
    bad = a.copy()
    bad[-1] = np.nan
    store.save_tensors(tmp_path / "bad.safetensors", {"a": bad})
    assert max_rel_l2({"p": open_tensors(tmp_path / "bad.safetensors")["a"]},
                      {"p": t["b"]}).value == float("inf")


def _cell(run: Path, cid: str, *, launch: str, variant: str | None,
          compute: float) -> dict[str, Any]:
    """One COMPLETE trainer cell ``<precision>-<role>-tp<n>`` of ``launch`` (wall 10 s): its
    ``result.json`` and ``outputs.json`` (``round1_s`` = ``compute``, ``load_s`` 0.25,
    the launch's ``init_s`` 0.5); its ``run.json`` entry is returned."""
    adir = run / "cells" / cid / "attempt-1"
    adir.mkdir(parents=True)
    result: dict[str, Any] = {"launch": launch, "wall_s": 10.0,
                              "started": "2026-12-05T00:00:00.000000Z"}
    if variant is not None:
        result["launch_variant"] = variant
    (adir / "result.json").write_text(json.dumps(result))
    (adir / "outputs.json").write_text(json.dumps({
        "role_timings": {"round1_s": compute, "load_s": 0.25}, "timings": {"init_s": 0.5}}))
    precision, role, _ = cid.split("-")
    return {"status": "COMPLETE", "attempt": f"cells/{cid}/attempt-1", "precision": precision,
            "options": {}, "role": role}


@pytest.mark.parametrize(("case", "want"), [("topologies", 7.0), ("alternating", 6.0),
                                            ("before-variants", 6.0)])
def test_a_launchs_compute_is_its_busiest_ranks(tmp_path: Path, case: str,
                                                want: float) -> None:
    """World size 3: the Actor on ranks ``[0, actor_tp)``, the Critic after.

    - ``topologies``: ``fp32-a2c1`` (Actor 3 s on ranks 0-1, Critic 1 s on rank 2), then
      ``fp32-a1c2`` (Actor 2 s on rank 0, Critic 4 s on ranks 1-2): rank 1 computes
      3 + 4 s. Grouping by precision alone counted 4 s (the slowest of the four cells).
    - ``alternating``: two variants of one topology, the slowest role alternating: the
      ranks compute 4, 4 and 6 s, and nothing says the Critic's 5 s did not run beside the
      Actor's 3 s, so 6 s, not 3 + 5.
    - ``before-variants``: the same cells without ``launch_variant`` (runs before commit
      6db5e59): the topology is the launch name's.

    The setup is the busiest rank's model load plus the launch's ``init_s`` once."""
    if case == "topologies":
        plan = [("fp32-actor-tp2", "fp32-a2c1", 3.0), ("fp32-critic-tp1", "fp32-a2c1", 1.0),
                ("fp32-actor-tp1", "fp32-a1c2", 2.0), ("fp32-critic-tp2", "fp32-a1c2", 4.0)]
    else:
        plan = [("fp32-actor-tp2", "fp32-a2c1", 3.0), ("fp32-critic-tp1", "fp32-a2c1", 1.0),
                ("bf16-actor-tp2", "bf16-a2c1", 1.0), ("bf16-critic-tp1", "bf16-a2c1", 5.0)]
    launch = "L-a2c1" if case == "before-variants" else "L-a2c1-a1c2"
    cells = {cid: _cell(tmp_path, cid, launch=launch, compute=c,
                        variant=None if case == "before-variants" else v)
             for cid, v, c in plan}
    (tmp_path / "run.json").write_text(json.dumps({"cells": cells}))
    row = evidence_cost.launch_table(tmp_path).iloc[0]
    assert row["cells"] == 4
    assert row["compute_s"] == pytest.approx(want)
    assert row["fixed_s"] == pytest.approx(10.0 - want)
    assert row["setup_s"] == pytest.approx(0.5 + 0.25 * 2)  # two cells on every rank


def test_launch_cost_pairs_each_mechanism_with_its_rounds_all_on_run() -> None:
    """``saved_s`` is (off - on) paired within a round, the ratio is off / on, and a run
    whose verdicts differ from its round's all-on run is flagged."""
    from benchmarks import launch_cost

    def row(config: str, rnd: int, wall: float, verdict: str = "PASS") -> dict[str, Any]:
        return {"config": config, "round": rnd, "wall_s": wall, "rc": 0, "env": "",
                "load_1m_at_start": 0.0, "verdicts": {"c": verdict}}

    runs = [row("all on", 1, 100.0), row("warm launcher", 1, 150.0), row("beside", 1, 90.0),
            row("all on", 2, 200.0), row("warm launcher", 2, 250.0, "FAIL")]
    table, runs_df, notes = launch_cost.summarize(runs, ["warm launcher", "beside"])
    got = table.set_index("mechanism")
    assert got.loc["warm launcher", "saved_s"] == pytest.approx(50.0)
    assert got.loc["warm launcher", "ratio_off_on"] == pytest.approx((1.5 + 1.25) / 2)
    assert not got.loc["warm launcher", "verdicts_same"]
    assert got.loc["beside", "saved_s"] == pytest.approx(-10.0)  # off: 90 s, on: 100 s
    assert got.loc["beside", "verdicts_same"]
    assert notes
    assert list(runs_df["same_verdicts"]) == [True, True, True, True, False]


def test_cpu_breakdown_names_every_forked_process_by_what_it_runs() -> None:
    """A process the fork server forked keeps the server's command line: a launcher is named
    by its launch attempt's engine (a plugin engine's too), the server by its interpreter."""
    from benchmarks.cpu_breakdown import kind_of

    server = "/v/bin/python -m qualify.candidate.forkserver 4 torch transformers"
    run = "/e/tiny-qwen3/20261207T141326Z/launches"
    assert kind_of(server, "python", "/work/main") == "fork server"
    assert kind_of(server, "candidate.warm", f"{run}/torch_tp-a2c1-a1c2/attempt-1") == \
        "torch_tp launch"
    assert kind_of(server, "candidate.warm", f"{run}/trl-a1c1/attempt-2") == "trl launch"
    assert kind_of(server, "vllm.harness", "/work/main") == "vllm sampler parent"
    assert kind_of(server, "other", "/work/main") == "forked: other"
    assert kind_of("/v/bin/python -m harnesses.deepspeed.harness c.json", "python") == \
        "deepspeed launch"
