"""``qualify harness check``: every missing, mis-shaped or mis-typed output named, one line each.

The complete outputs (the committed torch_tp FP32 TP 1 cells joined back into one launch's
outputs) conform; any subset of what the comparator reads, dropped, is named item by item
(hypothesis over the subsets); and a deliberately incomplete harness, registered as an
engine and launched by the real launcher, fails the CLI check with exit 1 naming each.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from qualify_harness import SDK_VERSION
from qualify_harness.distribution import TOP_LOGIT
from safetensors.numpy import save_file

from qualify.candidate.conformance import check_outputs_dir, find_reference
from qualify.contract import default_contract_path, load_contract
from qualify.errors import ExitCode
from qualify.resources import repo_root

FIXTURES = Path(__file__).parent / "fixtures" / "plugin_harnesses"
sys.path.insert(0, str(FIXTURES))
incomplete_harness = importlib.import_module("incomplete_harness")  # a harness, no package

REFERENCE = find_reference(load_contract(default_contract_path()), None)
ROUNDS = load_contract(default_contract_path()).algorithm.rounds

# what the comparator reads beyond the schema (qualify/compare/rows.py), as drop specs
# with the finding's expected location
META_DROPS = {
    "meta:actor:dtypes.grads": "outputs.json roles.actor.dtypes.grads",
    "meta:critic:dtypes.optimizer_state": "outputs.json roles.critic.dtypes.optimizer_state",
    "meta:actor:dtypes.grad_reduction": "outputs.json roles.actor.dtypes.grad_reduction",
    "meta:critic:replica_consistency": "outputs.json roles.critic.replica_consistency",
    "meta:actor:lr.round2": "outputs.json roles.actor.lr.round2",
    "meta:critic:lr.round1": "outputs.json roles.critic.lr.round1",
}


def _write(out: Path, drops: list[str]) -> Path:
    meta, tensors = incomplete_harness.launch_outputs()
    incomplete_harness.drop(meta, tensors, drops)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(out / "outputs.safetensors"))
    (out / "outputs.json").write_text(json.dumps(meta))
    return out


def _findings(out: Path) -> list[str]:
    found, _ = check_outputs_dir(out, roles=("actor", "critic"), rounds=ROUNDS,
                                 reference=REFERENCE)
    return [str(f) for f in found]


def test_the_complete_outputs_conform(tmp_path: Path) -> None:
    """The check passes real complete outputs: it does not fail everything."""
    assert _findings(_write(tmp_path, [])) == []


_TENSORS = sorted(incomplete_harness.launch_outputs()[1])
# recorded, but optional: without it the comparator counts BF16 ties by the stricter FP32
# rule (qualify/compare/distribution.py), so its absence is no finding
_OPTIONAL = {f"round1/actor/{TOP_LOGIT}"}
assert set(_TENSORS) >= _OPTIONAL


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=st.lists(st.sampled_from(_TENSORS), max_size=4, unique=True),
       metas=st.lists(st.sampled_from(sorted(META_DROPS)), max_size=3, unique=True))
@example(tensors=["round1/actor/prefill_raw"], metas=[])  # optional, but promised by the meta
@example(tensors=[f"round1/actor/{TOP_LOGIT}"], metas=[])  # optional, and promised by nothing
def test_every_dropped_output_is_named(tmp_path_factory: pytest.TempPathFactory,
                                       tensors: list[str], metas: list[str]) -> None:
    """Any subset of the tensors and of the meta items the comparator reads, dropped: each is
    a finding of its own naming it, except the optional top logit, which is never named;
    nothing is reported when nothing required was dropped."""
    out = _write(tmp_path_factory.mktemp("drop"), [f"tensor:{t}" for t in tensors] + metas)
    found = _findings(out)
    wheres = [f.split(": ", 1)[0] for f in found]
    for name in tensors:
        if name in _OPTIONAL:
            assert not any(w.endswith(name) for w in wheres), (name, found)
            continue
        padded = name.endswith("_padded") and not any(
            t.endswith(name.split("/", 1)[1]) for t in _TENSORS if t not in tensors)
        assert f"outputs.safetensors {name}" in wheres or padded, (name, found)
    for spec in metas:
        assert any(w.startswith(META_DROPS[spec]) for w in wheres), (spec, found)
    assert bool(found) == bool(set(tensors) - _OPTIONAL or metas)


def test_mis_shaped_and_mis_typed_tensors_are_named(tmp_path: Path) -> None:
    name = "round1/actor/logprobs"
    found = _findings(_write(tmp_path, [f"reshape:{name}", "int:round1/critic/values"]))
    assert any(f.startswith(f"outputs.safetensors {name}: shape [1,") for f in found), found
    assert "outputs.safetensors round1/critic/values: dtype I64, expected F32 (or F64)" \
        in found, found


def _padded_vocab(out: Path, vocab: int) -> Path:
    """The committed outputs with the Actor's full distributions widened to ``vocab`` (a
    padded vocabulary left uncut) and the meta claiming it: consistent with each other."""
    meta, tensors = incomplete_harness.launch_outputs()
    assert meta["roles"]["actor"]["distribution"]["path"] == "full"
    for kind in ("raw", "tempered"):
        t = tensors[f"round1/actor/prefill_{kind}"]
        tensors[f"round1/actor/prefill_{kind}"] = np.concatenate(
            [t, np.full((*t.shape[:2], vocab - t.shape[2]), -np.inf, dtype=t.dtype)], axis=2)
    meta["roles"]["actor"]["distribution"]["vocab"] = vocab
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(out / "outputs.safetensors"))
    (out / "outputs.json").write_text(json.dumps(meta))
    return out


def test_a_distribution_vocab_other_than_the_models_is_named(tmp_path: Path) -> None:
    """A meta's ``distribution.vocab`` (and a full tensor's last dim) must be the model's
    ``vocab_size``: from the reference's contract here (384), and from the launch's own
    model (``cell.json`` -> inputs ``model.json`` -> ``config.json``) when the outputs sit
    in a launch attempt. A mis-shaped top logit is named too."""
    model = json.loads((REFERENCE / "contract.json").read_text())["model"]["config"]
    assert model["vocab_size"] == 384
    found = _findings(_padded_vocab(tmp_path / "padded", 400))
    b, r = incomplete_harness.launch_outputs()[1]["round1/actor/logprobs"].shape
    assert found == [
        "outputs.json roles.actor.distribution.vocab: 400, expected the model's vocab_size 384",
        *(f"outputs.safetensors round1/actor/prefill_{kind}: shape [{b}, {r}, 400], expected "
          f"[{b}, {r}, 384]" for kind in ("raw", "tempered"))]
    # the launch's own model decides when the attempt says which inputs it ran
    out = _write(tmp_path / "launch", [])
    inputs, actor = tmp_path / "inputs", tmp_path / "actor"
    actor.mkdir()
    (actor / "config.json").write_text(json.dumps({"vocab_size": 500}))
    inputs.mkdir()
    (inputs / "model.json").write_text(json.dumps({"actor_dir": str(actor)}))
    (out / "cell.json").write_text(json.dumps({"inputs_dir": str(inputs)}))
    found = _findings(out)
    assert "outputs.json roles.actor.distribution.vocab: 384, expected the model's " \
        "vocab_size 500" in found, found
    # the optional top logit: absent is fine (above), present must be [B, R]
    meta, tensors = incomplete_harness.launch_outputs()
    base = tensors["round1/actor/logprobs"].shape
    tensors["round1/actor/prefill_top_logit"] = np.zeros((*base, 2), dtype=np.float32)
    meta["tensors"]["count"] = len(tensors)
    top = tmp_path / "top"
    top.mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(top / "outputs.safetensors"))
    (top / "outputs.json").write_text(json.dumps(meta))
    assert _findings(top) == [f"outputs.safetensors round1/actor/prefill_top_logit: shape "
                              f"{[*base, 2]}, expected {list(base)}"]
    # the path follows the vocabulary (the reference seals the same switch's path)
    meta, tensors = incomplete_harness.launch_outputs()
    meta["roles"]["actor"]["distribution"]["path"] = "topk"
    wrong = tmp_path / "path"
    wrong.mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(wrong / "outputs.safetensors"))
    (wrong / "outputs.json").write_text(json.dumps(meta))
    assert "outputs.json roles.actor.distribution.path: 'topk', expected 'full' for a " \
        "vocabulary of 384" in _findings(wrong)


@pytest.mark.slow
def test_an_incomplete_harness_fails_the_cli_check_naming_each_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A test engine registered like a plugin and launched by the real launcher."""
    from qualify import registry
    from qualify.cli.main import main

    drops = ["tensor:round1/actor/logprobs_padded", "tensor:round2/critic/values",
             "meta:actor:dtypes", "meta:critic:lr.round2"]
    monkeypatch.setenv("INCOMPLETE_DROPS", json.dumps(drops))
    monkeypatch.setenv("PYTHONPATH", str(FIXTURES))
    spec = registry.EngineSpec(name="incomplete", entry="incomplete_harness:main",
                               source="tests")
    registry.register_engine(spec)
    try:
        rc = main(["harness", "check", "incomplete", "--out", str(tmp_path / "chk")])
    finally:
        registry.ENGINES.reset()
    out = capsys.readouterr().out
    assert rc == ExitCode.QUALIFICATION_FAILED, out
    lines = out.splitlines()
    assert "outputs.safetensors round2/critic/values: missing" in lines
    assert any(x.startswith("outputs.safetensors round<r>/actor/logprobs_padded: missing")
               for x in lines), out
    assert any(x.startswith("outputs.json roles.actor.dtypes: missing") for x in lines), out
    assert "outputs.json roles.critic.lr.round2: missing" in lines
    served = incomplete_harness.launch_outputs()[0]["sdk_version"]  # the committed outputs'
    assert f"sdk_version: {served}" in lines  # what the outputs declare, printed
    assert served.split(".")[0] == SDK_VERSION.split(".")[0]  # a version this SDK's qualify reads
    assert lines[-1].startswith("harness check incomplete: ")
    assert repo_root() / "references" in REFERENCE.parents


def test_the_pytest_helper_fails_naming_every_finding(tmp_path: Path) -> None:
    """``qualify.testing.assert_conforms``: silent on a conforming result, else one
    AssertionError whose lines are the findings."""
    from qualify.candidate.conformance import CheckResult, Finding
    from qualify.testing import assert_conforms

    ok = CheckResult(engine="e", attempt_dir=tmp_path, findings=(), versions={}, wall_s=0.0)
    assert_conforms(ok)
    bad = CheckResult(engine="e", attempt_dir=tmp_path, wall_s=0.0,
                      versions={"harness SDK / protocol version": "not declared"},
                      findings=(Finding(where="outputs.json roles.actor.dtypes",
                                        problem="missing"),
                                Finding(where="outputs.safetensors round1/actor/logprobs",
                                        problem="missing")))
    with pytest.raises(AssertionError) as info:
        assert_conforms(bad)
    lines = str(info.value).splitlines()
    assert lines[0].startswith("harness check e: 2 problem(s)")
    assert lines[2:] == ["outputs.json roles.actor.dtypes: missing",
                         "outputs.safetensors round1/actor/logprobs: missing"]
