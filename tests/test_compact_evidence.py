"""Compact evidence: the contract's per-parameter sampling, and each tensor stored once.

- :class:`qualify.protocol.ParamSampling` from the contract's ``[evidence]`` section: the
  defaults keep the old indices and the old contracts' digests; invalid sizes are one-line
  contract errors; ``cell.json`` carries it to the harnesses.
- :mod:`qualify.sampling`: the exact / estimated summary and the sampled relative-L2 error
  bound, checked against a Monte-Carlo of the sampling itself.
- :mod:`qualify.evidence.tensor_index`: a launch's outputs split into cells, indexed, the
  launch copy dropped; ``check_run`` passes on that and names every tampering.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy as stn
from hypothesis import given, settings
from hypothesis import strategies as st

from qualify.candidate.launch import validate_cell
from qualify.contract import load_contract, loads_contract
from qualify.errors import ContractError, EvidenceIntegrityError
from qualify.evidence import store, tensor_index
from qualify.layout import TENSOR_INDEX_FILE
from qualify.protocol import (
    DEFAULT_SAMPLING,
    OUTPUTS_FILE,
    HarnessCell,
    ParamSampling,
    param_sample_indices,
)
from qualify.resources import contracts_dir
from qualify.sampling import rel_l2_halfwidth, sampling_summary, standard_error_factor

# --------------------------------------------------------------------------- sampling


def test_default_sampling_keeps_the_old_indices() -> None:
    """The default draws exactly what the protocol drew before it was configurable."""
    name, n = "model.embed_tokens.weight", 49152 * 576
    seed = int.from_bytes(hashlib.sha256(f"{name}:{n}".encode()).digest()[:8], "little")
    old = np.sort(np.random.default_rng(seed).choice(n, size=16_384, replace=False))
    got = param_sample_indices(name, n)
    assert got is not None
    np.testing.assert_array_equal(got, old)
    assert param_sample_indices(name, 32_768) is None


def test_contract_sampling_sets_threshold_and_size() -> None:
    s = ParamSampling(exact_elements=256, sample_elements=100)
    assert param_sample_indices("w", 256, s) is None
    idx = param_sample_indices("w", 257, s)
    assert idx is not None
    assert idx.shape == (100,)
    assert idx.dtype == np.int64
    assert len(set(idx.tolist())) == 100
    assert idx.min() >= 0
    assert idx.max() < 257
    assert np.all(np.diff(idx) > 0)
    again = param_sample_indices("w", 257, ParamSampling(exact_elements=256, sample_elements=100))
    np.testing.assert_array_equal(idx, again)


@settings(max_examples=30, deadline=None)
@given(vocab=st.integers(2, 400), width=st.integers(1, 80), sample=st.integers(1, 256),
       ids=st.lists(st.integers(0, 10_000), min_size=1, max_size=40),
       name=st.sampled_from(["model.embed_tokens.weight", "lm_head.weight",
                             "model.layers.0.mlp.up_proj.weight"]))
def test_token_rows_are_reported_whole(vocab: int, width: int, sample: int, ids: list[int],
                                       name: str) -> None:
    """A sampled vocab-indexed parameter reports every element of every batch token's row
    (so a difference confined to one row is seen), on top of the unchanged seeded sample;
    other parameters keep the sample alone; the SDK's sampling draws the same elements."""
    from qualify_harness import protocol as sdk_protocol

    numel = vocab * width
    ids = [i % vocab for i in ids]
    base = ParamSampling(exact_elements=max(sample, min(numel - 1, 256)) if numel > sample
                         else sample, sample_elements=sample)
    rows = base.with_rows(np.asarray(ids), vocab)
    assert rows.rows == tuple(sorted(set(ids)))
    old, got = base.indices(name, numel), rows.indices(name, numel)
    sdk = sdk_protocol.ParamSampling.from_dict(rows.to_dict()).indices(name, numel)
    assert ParamSampling.from_dict(rows.to_dict()) == rows
    if old is None:
        assert got is None
        assert sdk is None
        return
    assert got is not None
    assert sdk is not None
    assert got.tolist() == sdk.tolist()
    assert np.all(np.diff(got) > 0)
    assert got.dtype == np.int64
    assert set(old.tolist()) <= set(got.tolist())
    if name == "model.layers.0.mlp.up_proj.weight":
        assert got.tolist() == old.tolist()
    else:
        want = {i * width + j for i in ids for j in range(width)}
        assert want <= set(got.tolist())
        assert set(got.tolist()) == set(old.tolist()) | want


def test_rows_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(ValueError, match="rows"):
        ParamSampling().with_rows(np.asarray([3, 384]), 384)
    with pytest.raises(ValueError, match="rows"):
        ParamSampling(rows=(5, 2), vocab_size=384)


@pytest.mark.parametrize(("exact", "sample"), [(10, 11), (0, 0), (5, 0)])
def test_invalid_sampling_is_refused(exact: int, sample: int) -> None:
    with pytest.raises(ValueError, match="sample_elements"):
        ParamSampling(exact_elements=exact, sample_elements=sample)


def _tiny_text() -> str:
    return (contracts_dir() / "tiny-qwen3.toml").read_text("utf-8")


def _without_evidence(text: str) -> str:
    lines, out, skip = text.splitlines(), [], False
    for line in lines:
        if line.strip() == "[evidence]":
            skip = True
            continue
        if skip and line.startswith("["):
            skip = False
        if not skip:
            out.append(line)
    return "\n".join(out) + "\n"


def test_evidence_section_is_read_and_its_absence_keeps_the_digest() -> None:
    """Absent ``[evidence]``: the default sampling and the digest of the document as written."""
    tiny = load_contract(contracts_dir() / "tiny-qwen3.toml")
    assert tiny.evidence == ParamSampling(exact_elements=256, sample_elements=256)
    bare = loads_contract(_without_evidence(_tiny_text()))
    assert bare.evidence == DEFAULT_SAMPLING
    assert "evidence" not in bare.raw
    assert bare.digest != tiny.digest
    assert hashlib.sha256(json.dumps(bare.raw, sort_keys=True, separators=(",", ":"),
                                     ensure_ascii=False).encode()).hexdigest() == bare.digest


@pytest.mark.parametrize(("section", "match"), [
    ("[evidence]\nexact_param_elements = 10\nsampled_param_elements = 20\n",
     "evidence.sampled_param_elements: 20 exceeds"),
    ("[evidence]\nsampled_params = 20\n", "evidence"),
    ("[evidence]\nexact_param_elements = 0\n", "evidence"),
])
def test_bad_evidence_section_is_one_line(section: str, match: str) -> None:
    text = _without_evidence(_tiny_text()) + "\n" + section
    with pytest.raises(ContractError, match=match) as info:
        loads_contract(text)
    assert "\n" not in str(info.value)


def test_cell_json_carries_the_sampling() -> None:
    cell = HarnessCell(engine="torch_tp", precision="fp32", options={}, actor_tp=1,
                       critic_tp=0, rounds=2, seed=0, inputs_dir="i", output_dir="o",
                       param_sampling=ParamSampling(exact_elements=64, sample_elements=32))
    doc = cell.to_dict()
    assert doc["param_sampling"] == {"exact_elements": 64, "sample_elements": 32}
    validate_cell(doc)
    assert HarnessCell.from_dict(json.loads(json.dumps(doc))) == cell
    old = {k: v for k, v in doc.items() if k != "param_sampling"}
    assert HarnessCell.from_dict(old).param_sampling == DEFAULT_SAMPLING


def test_summary_says_which_parameters_are_exact() -> None:
    s = ParamSampling(exact_elements=64, sample_elements=16)
    out = sampling_summary(s, {"a": 64, "b": 4096, "c": 10}, {"a": 64, "b": 16, "z": 3})
    assert out["exact"] == ["a"]
    assert out["unknown"] == ["z"]
    assert out["sampled"]["b"]["numel"] == 4096
    assert out["sampled"]["b"]["stored"] == 16
    assert out["sampled"]["b"]["se_factor"] == pytest.approx(math.sqrt((1 - 16 / 4096) / 16))
    assert standard_error_factor(10, 10) == 0.0


def test_halfwidth_covers_the_sampling_error() -> None:
    """Monte-Carlo: sample 256 of 8192 elements many times; the 3-sigma half-width covers
    the distance between the sampled and the whole relative L2 error in nearly all draws."""
    rng = np.random.default_rng(7)
    n, k = 8192, 256
    b = rng.standard_normal(n)
    a = b + 1e-3 * rng.standard_normal(n) * (1 + np.abs(b))
    whole = np.linalg.norm(a - b) / np.linalg.norm(b)
    covered, widths = 0, []
    for _ in range(400):
        idx = rng.choice(n, size=k, replace=False)
        est = np.linalg.norm(a[idx] - b[idx]) / np.linalg.norm(b[idx])
        hw = rel_l2_halfwidth(a[idx], b[idx], n)
        widths.append(hw / whole)
        covered += int(abs(est - whole) <= hw)
    assert covered >= 0.97 * 400
    assert 0.05 < float(np.median(widths)) < 0.6  # informative, not vacuous
    assert rel_l2_halfwidth(a, b, n) == 0.0  # the whole parameter: exact
    assert rel_l2_halfwidth(b[:10], b[:10], n) == 0.0


# --------------------------------------------------------------------------- one copy


def _outputs(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"round1/actor/logprobs": rng.standard_normal((4, 5)).astype(np.float32),
            "round1/actor/grads/w": rng.standard_normal(16).astype(np.float32),
            "round1/actor/grad_norm": np.array(1.5, dtype=np.float32),
            "round1/critic/values": rng.standard_normal((4, 5)).astype(np.float32),
            "round1/critic/grads/w": rng.standard_normal(16).astype(np.float32)}


def _split(run: Path, roles: dict[str, str]) -> tuple[Path, dict[str, object]]:
    """A launch attempt with outputs, its index, the cells' shares, the launch copy dropped."""
    attempt = run / "launches" / "l" / "attempt-1"
    attempt.mkdir(parents=True)
    tensors = _outputs(np.random.default_rng(0))
    (attempt / OUTPUTS_FILE).write_bytes(stn.save(tensors))
    owners = {OUTPUTS_FILE: {k: roles[k.split("/")[1]] for k in tensors
                             if k.split("/")[1] in roles}}
    doc = tensor_index.build_index(attempt, owners)
    tensor_index.write_index(attempt, doc)
    for role, cell in roles.items():
        (run / cell).mkdir(parents=True)
        mine = {k: v for k, v in tensors.items() if k.split("/")[1] == role}
        (run / cell / OUTPUTS_FILE).write_bytes(stn.save(dict(reversed(mine.items()))))
    return attempt, doc


CELLS = {"actor": "cells/a/attempt-1", "critic": "cells/c/attempt-1"}


def _seal(attempt: Path) -> None:
    """Seal a launch attempt (what the stage does after the drop), then let the test edit it."""
    store.seal(attempt, kind="launch-attempt")
    store.make_writable(attempt)


def test_split_is_indexed_dropped_and_checks(tmp_path: Path) -> None:
    attempt, doc = _split(tmp_path, CELLS)
    assert tensor_index.drop_stored_copies(attempt, tmp_path, doc) == [OUTPUTS_FILE]
    assert not (attempt / OUTPUTS_FILE).exists()
    _seal(attempt)
    assert tensor_index.check_run(tmp_path) == []
    entry = json.loads((attempt / TENSOR_INDEX_FILE).read_text())["files"][OUTPUTS_FILE]
    assert entry["tensors"] == 5
    assert entry["unowned"] == []
    assert {c: s["tensors"] for c, s in entry["cells"].items()} == {CELLS["actor"]: 3,
                                                                     CELLS["critic"]: 2}


def test_a_launch_tensor_without_a_cell_keeps_the_file(tmp_path: Path) -> None:
    attempt, doc = _split(tmp_path, {"actor": CELLS["actor"]})
    assert tensor_index.drop_stored_copies(attempt, tmp_path, doc) == []
    assert (attempt / OUTPUTS_FILE).is_file()
    _seal(attempt)
    assert tensor_index.check_run(tmp_path) == []


def test_a_killed_launch_attempt_claims_nothing(tmp_path: Path) -> None:
    """Killed during the split: unsealed, its index names a cell attempt never written; the
    resumed run launched the cell again, so verify must not read that index."""
    attempt, _doc = _split(tmp_path, {"actor": CELLS["actor"]})
    (tmp_path / CELLS["actor"] / OUTPUTS_FILE).unlink()
    assert tensor_index.check_run(tmp_path) == []
    _seal(attempt)
    assert any("cannot index" in p for p in tensor_index.check_run(tmp_path))


def _rewrite(path: Path, edit: dict[str, np.ndarray | None]) -> None:
    t = dict(stn.load_file(str(path)))
    for k, v in edit.items():
        if v is None:
            del t[k]
        else:
            t[k] = v
    path.write_bytes(stn.save(t))


@pytest.mark.parametrize(("edit", "match"), [
    ({"round1/actor/grad_norm": np.array(1.25, dtype=np.float32)}, "not the 3 tensor"),
    ({"round1/actor/grads/w": np.zeros((4, 4), dtype=np.float32)}, "not the 3 tensor"),
    ({"round1/actor/extra": np.zeros(2, dtype=np.float32)}, "not the 3 tensor"),
    ({"round1/actor/grad_norm": None}, "not the 3 tensor"),
])
def test_a_tampered_cell_is_named(tmp_path: Path, edit: dict[str, np.ndarray | None],
                                  match: str) -> None:
    attempt, doc = _split(tmp_path, CELLS)
    tensor_index.drop_stored_copies(attempt, tmp_path, doc)
    _seal(attempt)
    _rewrite(tmp_path / CELLS["actor"] / OUTPUTS_FILE, edit)
    problems = tensor_index.check_run(tmp_path)
    assert any(match in p and CELLS["actor"] in p for p in problems), problems


def test_a_dropped_file_must_be_whole_in_its_cells(tmp_path: Path) -> None:
    attempt, doc = _split(tmp_path, CELLS)
    tensor_index.drop_stored_copies(attempt, tmp_path, doc)
    _seal(attempt)
    index = json.loads((attempt / TENSOR_INDEX_FILE).read_text())
    del index["files"][OUTPUTS_FILE]["cells"][CELLS["critic"]]  # a share forgotten
    (attempt / TENSOR_INDEX_FILE).write_text(json.dumps(index))
    problems = tensor_index.check_run(tmp_path)
    assert any("together are not the file" in p and "3 of 5" in p for p in problems), problems


def test_a_launch_file_edited_on_disk_is_named(tmp_path: Path) -> None:
    attempt, _doc = _split(tmp_path, CELLS)
    _seal(attempt)
    _rewrite(attempt / OUTPUTS_FILE, {"round1/actor/grad_norm": np.array(2.0, np.float32)})
    assert any("another sha256" in p for p in tensor_index.check_run(tmp_path))


def test_a_share_outside_cells_and_a_cell_claimed_twice(tmp_path: Path) -> None:
    attempt, _doc = _split(tmp_path, CELLS)
    index = json.loads((attempt / TENSOR_INDEX_FILE).read_text())
    share = index["files"][OUTPUTS_FILE]["cells"][CELLS["critic"]]
    index["files"][OUTPUTS_FILE]["cells"]["../../etc"] = share
    second = tmp_path / "launches" / "m" / "attempt-1"
    second.mkdir(parents=True)
    (second / TENSOR_INDEX_FILE).write_text(json.dumps(
        {"schema_version": 1, "files": {OUTPUTS_FILE: {
            "sha256": "0" * 64, "size": 1, "tensors": 2, "content": share["content"],
            "cells": {CELLS["critic"]: share}, "unowned": []}}}))
    (attempt / TENSOR_INDEX_FILE).write_text(json.dumps(index))
    _seal(attempt)
    _seal(second)
    problems = tensor_index.check_run(tmp_path)
    assert any("outside cells/" in p for p in problems), problems
    assert any(p.startswith(f"{CELLS['critic']}: a share of") for p in problems), problems


def test_a_malformed_index_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    attempt = tmp_path / "launches" / "l" / "attempt-1"
    attempt.mkdir(parents=True)
    (attempt / TENSOR_INDEX_FILE).write_text('{"schema_version": 1, "files": {"x": 3}}')
    _seal(attempt)
    (problem,) = tensor_index.check_run(tmp_path)
    assert "malformed" in problem


def test_tensor_digests_are_layout_independent(tmp_path: Path) -> None:
    t = _outputs(np.random.default_rng(1))
    (tmp_path / "a.safetensors").write_bytes(stn.save(t))
    (tmp_path / "b.safetensors").write_bytes(stn.save(dict(reversed(t.items())),
                                                      metadata={"engine": "x"}))
    da = tensor_index.tensor_digests(tmp_path / "a.safetensors")
    db = tensor_index.tensor_digests(tmp_path / "b.safetensors")
    assert da == db
    name = "round1/actor/grads/w"
    assert da[name]["sha256"] == hashlib.sha256(t[name].tobytes()).hexdigest()
    (tmp_path / "c.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(EvidenceIntegrityError, match="cannot index"):
        tensor_index.tensor_digests(tmp_path / "c.safetensors")


# --------------------------------------------------------------------------- the stage


def test_the_stage_splits_a_grouped_launch_once_and_keeps_a_partless_file(
        tmp_path: Path) -> None:
    """A grouped DeepSpeed launch's variants: each file indexed, split into its cells, then
    dropped; a variant whose Critic cell is not wanted keeps its file (its Critic tensors
    have no cell). The sealed launch attempt and cells pass ``check_run``; cells record
    which parameters are exact."""
    from qualify.candidate import stage
    from qualify.candidate.launch import LaunchResult
    from qualify.contract import cells_matching

    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    wanted = [c for c in cells_matching(contract, ["deepspeed-*-zero0-*-tp2",
                                                   "deepspeed-*-zero0-actor-tp1"])
              if not (c.precision == "bf16" and c.role == "critic")]
    launches = stage.plan_launches(contract, wanted, grouped_engines=["deepspeed"])
    lc = next(x for x in launches if x.topology == "a1c2")
    run = tmp_path / "run"
    attempt = store.new_attempt(run / "launches" / lc.launch_id)
    rng = np.random.default_rng(3)
    big = rng.standard_normal(300).astype(np.float32)  # sampled: 300 > 256 elements
    for part in lc.parts:
        (attempt / part.tag).mkdir()
        t = {f"round1/{role}/{m}": rng.standard_normal(4).astype(np.float32)
             for role in ("actor", "critic") for m in ("logprobs", "grad_norm")}
        t["round1/actor/grads/lm_head.weight"] = big[:256].copy()
        t["round1/actor/grads/model.norm.weight"] = big[:64].copy()
        (attempt / part.tag / OUTPUTS_FILE).write_bytes(stn.save(t))
        (attempt / part.tag / "outputs.json").write_text(json.dumps(
            {"engine": "deepspeed", "roles": {"actor": {"tp": 1}, "critic": {"tp": 2}}}))
    result = LaunchResult(status="OK", reason="", wall_s=1.0, returncode=0,
                          attempt_dir=attempt, cell_file=attempt / "cell.json",
                          launcher_log=attempt / "launcher.log", rank_logs=())
    cells = {c.cell_id: store.new_attempt(run / "cells" / c.cell_id) for c in lc.cells}
    numels = {"lm_head.weight": 384 * 64, "model.norm.weight": 64}
    for cell in lc.cells:
        status, _why = stage._split_outputs(result, attempt, lc, cell, cells[cell.cell_id],
                                            contract=contract, numels=numels)
        assert status == "COMPLETE"
    index = stage._index_launch(result, attempt, lc, cells, run)
    assert index is not None
    dropped = tensor_index.drop_stored_copies(attempt, run, index)
    store.seal(attempt, kind="launch-attempt")
    assert sorted(dropped) == [f"fp32-zero0/{OUTPUTS_FILE}"]  # bf16's critic has no cell
    assert (attempt / "bf16-zero0" / OUTPUTS_FILE).is_file()
    assert tensor_index.check_run(run) == []
    meta = json.loads((cells["deepspeed-fp32-zero0-actor-tp1"] / "outputs.json").read_text())
    assert meta["param_sampling"]["exact"] == ["model.norm.weight"]
    assert meta["param_sampling"]["sampled"]["lm_head.weight"]["numel"] == 384 * 64
    assert not (cells["deepspeed-fp32-zero0-actor-tp1"] / "logs").exists()
    store.make_writable(tmp_path)
