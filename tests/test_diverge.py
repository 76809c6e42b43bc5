"""``qualify diverge``: the comparison rule on known tensors, usage errors, and real runs.

The real tests run the torch_tp harness (torchrun, gloo) on a copy of the session's shared
tiny reference (:func:`shared_artifacts.tiny_reference`): with the test-only fault
``layer1_mlp_scaled`` (decoder layer 1's MLP output x (1 + 1e-3)) ``qualify diverge`` must
name ``model.layers.1.mlp`` in the forward pass and nothing before it; without the fault it
must name nothing. The report page then shows the result.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from committed import committed_runs
from shared_artifacts import copy_tree, tiny_reference
from tiny_contracts import torch_tp_only

from qualify import schema
from qualify.candidate.stage import run_candidate_stage
from qualify.cli.main import main
from qualify.contract import Contract, load_contract
from qualify.diverge import compare
from qualify.diverge.capture import Capture
from qualify.evidence import store

REPO = Path(__file__).resolve().parents[1]
COMMITTED_RUN = committed_runs("tiny-qwen3")[-1]
"""The committed default run (the newest git tracks; ids are UTC timestamps)."""
CELL = "torch_tp-fp32-actor-tp2"


# --------------------------------------------------------------------------- the rule


def _frame() -> compare.Frame:
    # B = 2, P = 3, R = 2: row 0 has one left pad and one right pad; row 1 is full.
    am = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    return compare.Frame(attention_mask=am, response_mask=am[:, 3:], prompt_len=3)


def test_layer_names_split_into_layer_and_submodule() -> None:
    assert compare.layer_of("model.layers.3.mlp") == (3, "mlp")
    assert compare.layer_of("model.layers.12") == (12, "layer")
    assert compare.layer_of("model.layers.0.post_attention_layernorm") == \
        (0, "post_attention_layernorm")
    assert compare.layer_of("lm_head") == (None, "lm_head")
    assert compare.layer_of("model.embed_tokens") == (None, "model.embed_tokens")


def test_errors_count_valid_positions_only_and_bounds_follow_the_controls() -> None:
    frame = _frame()
    g = torch.Generator().manual_seed(0)
    ref_h = torch.randn(2, 5, 4, generator=g)       # a sequence-shaped output [B, T, F]
    ref_head = torch.randn(2, 5, 6, generator=g)    # the reference's head, [B, T, V]
    eng_h = ref_h.clone()
    eng_h[1, 2, 3] += 3e-3                           # valid position: counted
    eng_h[0, 0, :] += 100.0                          # left pad of row 0: ignored
    eng_head = ref_head[:, 2:4].clone()              # the engine's head on the window [B, R, V]
    eng_head[0, 0, 5] += 5e-3                        # response token 0 of row 0: valid
    eng_head[0, 1, :] += 100.0                       # right pad of row 0: ignored
    # A control with 2 extra left and 1 extra right pad columns, 1e-4 from the reference.
    ctrl_h = torch.cat([torch.full((2, 2, 4), 7.0), ref_h + 1e-4, torch.full((2, 1, 4), 7.0)],
                       1)
    ctrl_head = torch.cat([torch.zeros(2, 2, 6), ref_head, torch.zeros(2, 1, 6)], 1)
    names = ["model.layers.0", "lm_head"]
    ref = Capture(modules=names, fwd={"model.layers.0": ref_h, "lm_head": ref_head}, bwd={})
    ctrl = Capture(modules=names, fwd={"model.layers.0": ctrl_h, "lm_head": ctrl_head},
                   bwd={}, left_padding=2, right_padding=1)
    rule = compare.Rule(k=4.0, floor_forward=1e-3, floor_backward=1.0)
    rows = compare.compare({"fwd/model.layers.0": eng_h, "fwd/lm_head": eng_head}, names,
                           reference=ref, control_runs={"microbatch": ctrl}, frame=frame,
                           rule=rule)
    assert [(r["direction"], r["module"]) for r in rows] == \
        [("forward", "model.layers.0"), ("forward", "lm_head")]
    layer, head = rows
    assert layer["error"] == pytest.approx(3e-3, abs=1e-6)  # FP32 sums: an ulp of |x| ~ 2
    assert layer["where"] == [1, 2]
    assert layer["control_error"] == pytest.approx(1e-4, rel=1e-3)
    assert layer["bound"] == pytest.approx(4 * 1e-4 + 1e-3, rel=1e-3)
    assert layer["exceeds"]
    assert layer["margin"] == pytest.approx(3e-3 / 1.4e-3, rel=1e-3)
    assert head["error"] == pytest.approx(5e-3, abs=1e-6)
    assert head["where"] == [0, 0]
    assert (layer["frame"], head["frame"]) == ("seq", "window")
    assert head["control_error"] == 0.0
    assert head["bound"] == pytest.approx(1e-3)
    assert compare.first_diverged(rows) is layer


def test_non_finite_values_count_only_where_valid_and_then_exceed() -> None:
    """A NaN at a padded position is ignored (a product mask would spread it); a NaN or inf
    at a valid one is an infinite error that exceeds its bound and names the module; a
    module the probe lists but did not capture is refused, never skipped."""
    frame = _frame()
    ref_h = torch.zeros(2, 5, 4)
    names = ["model.layers.0", "model.layers.1"]
    ref = Capture(modules=names, fwd=dict.fromkeys(names, ref_h), bwd={})
    rule = compare.Rule(k=4.0, floor_forward=1e-3, floor_backward=1.0)
    pad_nan, valid_nan = ref_h.clone(), ref_h.clone()
    pad_nan[0, 0, 1] = float("nan")  # row 0's left pad
    valid_nan[1, 3, 0] = float("nan")
    rows = compare.compare({"fwd/model.layers.0": pad_nan, "fwd/model.layers.1": valid_nan},
                           names, reference=ref, control_runs={}, frame=frame, rule=rule)
    first, second = rows
    assert (first["error"], first["exceeds"]) == (0.0, False)
    assert second["error"] == math.inf
    assert second["exceeds"]
    assert second["where"] == [1, 3]
    assert compare.first_diverged(rows) is second
    doc = compare.document(cell={"id": "c"}, rows=rows, rule=rule, controls=[],
                           context={})
    assert doc["first"]["error"] == "inf"  # JSON has no infinity: written as a string
    assert doc["rows"][1]["margin"] == "inf"
    json.dumps(doc, allow_nan=False)
    with pytest.raises(ValueError, match=r"holds no fwd/model\.layers\.1"):
        compare.compare({"fwd/model.layers.0": ref_h}, names, reference=ref,
                        control_runs={}, frame=frame, rule=rule)
    with pytest.raises(ValueError, match="no module"):
        compare.compare({}, [], reference=ref, control_runs={}, frame=frame, rule=rule)


def test_the_first_forward_module_is_named_before_any_backward_one() -> None:
    rows = [{"direction": d, "module": m, "exceeds": e}
            for d, m, e in [("forward", "a", False), ("forward", "b", True),
                            ("forward", "c", True), ("backward", "c", True)]]
    assert compare.first_diverged(rows) == rows[1]
    assert compare.first_diverged([rows[0], rows[3]]) == rows[3]
    assert compare.first_diverged([rows[0]]) is None


# --------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize(("cell", "needle"), [
    ("fsdp2-fp32-actor-tp1", "does not declare diverge"),
    ("vllm-fp32-sampler-tp1", "trainer cells"),
    ("no-such-cell", "no cell 'no-such-cell'"),
])
def test_unsupported_or_unknown_cells_are_refused_in_one_line(
        cell: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"  # the committed run's run.json with an FSDP2 cell added
    run.mkdir()
    doc = json.loads((COMMITTED_RUN / "run.json").read_text(encoding="utf-8"))
    doc["cells"]["fsdp2-fp32-actor-tp1"] = {**doc["cells"]["torch_tp-fp32-actor-tp1"],
                                            "engine": "fsdp2"}
    (run / "run.json").write_text(json.dumps(doc), encoding="utf-8")
    rc = main(["diverge", str(run), cell, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_output_inside_the_sealed_run_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["diverge", str(COMMITTED_RUN), CELL, "--out", str(COMMITTED_RUN / "x")])
    assert rc == 2
    assert "inside the sealed run" in capsys.readouterr().err


# --------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def contract(tmp_path_factory: pytest.TempPathFactory) -> Contract:
    return load_contract(torch_tp_only(tmp_path_factory.mktemp("contracts")))


@pytest.fixture(scope="module")
def reference(contract: Contract, tmp_path_factory: pytest.TempPathFactory) -> Path:
    shared = tiny_reference(tmp_path_factory) / "references" / \
        f"{contract.name}-{contract.digest12}"
    return copy_tree(shared, tmp_path_factory.mktemp("refs") / shared.name)


def _run(contract: Contract, reference: Path, root: Path, faults: tuple[str, ...]) -> Path:
    run = run_candidate_stage(contract, reference=reference, root=root, quiet=True,
                              faults=faults, cells=[CELL])
    store.make_writable(root)
    return run


@pytest.mark.slow  # a real candidate stage and diverge run
def test_a_planted_layer_fault_is_named(contract: Contract, reference: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(contract, reference, tmp_path / "evidence", ("layer1_mlp_scaled",))
    out = tmp_path / "diverge"
    rc = main(["diverge", str(run), CELL, "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 1, printed
    doc = json.loads((out / "diverge.json").read_text(encoding="utf-8"))
    assert schema.first_error(doc, "diverge") is None
    assert doc["first"]["module"] == "model.layers.1.mlp", printed
    assert (doc["first"]["direction"], doc["first"]["layer"], doc["first"]["submodule"]) == \
        ("forward", 1, "mlp")
    assert "diverged: model.layers.1.mlp (layer 1 mlp, forward)" in printed
    forward = [r for r in doc["rows"] if r["direction"] == "forward"]
    named = [r["module"] for r in forward].index("model.layers.1.mlp")
    assert named > 0
    assert not any(r["exceeds"] for r in forward[:named])
    assert all(r["power"] for r in forward)
    assert doc["faults"] == ["layer1_mlp_scaled"]
    assert doc["round"] == 1
    # a TP 2 cell: its class's controls include the row-parallel re-partition
    assert set(doc["rule"]["controls"]) == {"attn_impl", "microbatch", "fp64", "row_split"}
    # The page of the run shows it when the result lies beside the run.
    from qualify.compare.html import write_html
    from qualify.compare.stage import compare_run

    compare_run(run)
    store.make_writable(tmp_path)
    beside = run.parent / f"{run.name}.diverge" / CELL
    beside.mkdir(parents=True)
    (beside / "diverge.json").write_text(json.dumps(doc), encoding="utf-8")
    page = write_html(run, tmp_path / "report.html").read_text(encoding="utf-8")
    assert 'id="diverge-title"' in page
    assert f'id="diverge-{CELL}"' in page
    assert "first diverging: <b>model.layers.1.mlp (forward)" in page


@pytest.mark.slow  # a real diverge run
def test_without_the_fault_nothing_diverges(contract: Contract, reference: Path,
                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Given as relative paths (the help's ``evidence/<contract>/<run-id>``), the run and
    ``--out`` are this directory's, though the launch runs in another."""
    run = _run(contract, reference, tmp_path / "evidence", ())
    out = tmp_path / "diverge"
    monkeypatch.chdir(tmp_path)
    rc = main(["diverge", str(run.relative_to(tmp_path)), CELL, "--out", "diverge"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    doc = json.loads((out / "diverge.json").read_text(encoding="utf-8"))
    assert doc["first"] is None, printed
    assert not doc["diverged"]
    modules = {r["module"] for r in doc["rows"]}
    assert {"model.embed_tokens", "model.layers.0.self_attn", "model.layers.1.mlp",
            "model.norm", "lm_head"} <= modules
    assert {r["direction"] for r in doc["rows"]} == {"forward", "backward"}
    assert "diverged: none" in printed


@pytest.fixture(scope="module")
def committed_models() -> Path:
    """The committed run's Actor directory, built here if this machine lacks it.

    ``diverge`` reloads the models the run's ``inputs/model.json`` names (absolute paths
    under the models cache). A fresh machine has none, and the old collection-time
    ``skipif`` skipped these tests on every clean CI machine; the models are built locally
    and deterministically from the contract, so :func:`qualify.models.bundle.prepare_models`
    makes the same ``<cache>/<digest12>`` directory again. Skips only where it builds
    another directory: another cache root (``$QUALIFY_CACHE``, another home) or a contract
    digest that changed since the run (which ``qualify audit`` reports as stale).
    """
    from qualify.models.bundle import prepare_models

    model = json.loads((COMMITTED_RUN / "inputs" / "model.json").read_text(encoding="utf-8"))
    actor = Path(model["actor_dir"])
    if not actor.is_dir():
        bundle = prepare_models(load_contract(REPO / "contracts" / "tiny-qwen3.toml"))
        if Path(bundle.actor_dir) != actor:
            pytest.skip(f"the committed run's models ({actor}) are not what this machine "
                        f"builds from contracts/tiny-qwen3.toml ({bundle.actor_dir}): another "
                        "cache root, or a contract changed since the run")
    return actor


@pytest.mark.slow
@pytest.mark.parametrize("cell", ["deepspeed-fp32-zero1-actor-tp2", "megatron-fp32-actor-tp2"])
def test_other_engines_layouts_match_hf_at_fp32(committed_models: Path, cell: str,
                                                tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """DeepSpeed AutoTP's and Megatron-Core's probes under HF names (Megatron: renamed,
    ``[S, B, F]`` transposed, vocab shards gathered and cut) match the HF reference: a
    passing FP32 cell of the committed run names nothing, with every module compared."""
    rc = main(["diverge", str(COMMITTED_RUN), cell, "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    doc = json.loads((tmp_path / "diverge.json").read_text(encoding="utf-8"))
    assert doc["first"] is None, printed
    assert len(doc["rows"]) == 2 * 13  # embedding, 2 layers x 5, final norm, head; twice
    assert all(r["power"] for r in doc["rows"])
