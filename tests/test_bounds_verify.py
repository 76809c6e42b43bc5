"""``qualify verify`` recomputes every sealed bound and checks the seal times (issue #43, 3).

A trusted key proves who sealed ``bounds.json``, not that its numbers are the contract's
rule applied to the sealed control errors. Every test here edits a copy of a sealed
reference the way an insider with a trusted key could (re-sealed, re-signed, the seal time
backdated so that the seal order still holds) or the way a careless one could (a list for a
document, an infinite bound, a row for a metric the rule does not produce), and requires
``verify`` to refuse it (exit code 3), naming the row and both values:

- the committed reference ``references/tiny-qwen3-<digest12>`` (real control errors of a
  real reference stage), copied, re-signed by a throw-away trusted key;
- the synthetic signed world of ``test_verify`` (its reference's bounds follow from its
  control errors by the rule), where the widened bound also makes a failing run pass once
  the run is compared, sealed and signed again;
- the pre-redesign fixture, whose hand-made bounds have no sealed control errors: refused as
  not recomputable, never taken on faith.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_verify import (
    FAIL_CELL,
    World,
    edit_json,
    new_key,
    resign_statement,
    run_cli,
    signed_world,
    world,
)

from qualify.contract import load_contract
from qualify.errors import BoundsMismatchError, ExitCode, SealOrderError
from qualify.evidence import sign as signing
from qualify.evidence import store
from qualify.evidence.bounds_check import COMPARED_FIELDS, TERMS, verify_bounds
from qualify.evidence.verify import verify
from qualify.reference.bound_inputs import recompute_bounds

__all__ = ["signed_world", "world"]  # shared fixtures

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "references" / (
    f"tiny-qwen3-{load_contract(ROOT / 'contracts' / 'tiny-qwen3.toml').digest12}")
PRE_REDESIGN = ROOT / "tests" / "fixtures" / "pre_redesign"
NUMBERS = ("bound", "control_error", "floor", "k", *TERMS)


def _row_name(row: dict[str, Any]) -> str:
    return f"round{row['round']}/{row['role']}/{row['family']} {row['precision']} {row['class']}"


@pytest.fixture(scope="module")
def committed_copy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A writable copy of the committed reference (shared: each test restores bounds.json)."""
    dest = tmp_path_factory.mktemp("committed-ref") / COMMITTED.name
    shutil.copytree(COMMITTED, dest)
    store.make_writable(dest)
    yield dest
    store.make_writable(dest.parent)


@pytest.fixture
def real_ref(tmp_path: Path) -> tuple[Path, Path, signing.SigningKey]:
    """A fresh copy of the committed reference, its contracts and a throw-away trusted key:
    ``(reference, keys directory, key)``."""
    ref = tmp_path / "references" / COMMITTED.name
    shutil.copytree(COMMITTED, ref)
    store.make_writable(ref)
    key = new_key("insider")
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / f"insider-{key.keyid[:16]}.pub").write_bytes(key.public_pem())
    return ref, keys, key


def reseal_backdated(ref: Path, key: signing.SigningKey, *, created: str | None = None,
                     kind: str = "reference") -> None:
    """Seal ``ref`` again, set the manifest's ``created`` (default: the original seal time,
    so that every run judged against it still starts after it), sign with ``key``."""
    when = created if created is not None else store.read_manifest(ref)["created"]
    store.make_writable(ref)
    (ref / store.MANIFEST_FILE).unlink()
    (ref / signing.ATTESTATION_FILE).unlink()
    store.seal(ref, kind=kind)
    store.make_writable(ref)
    edit_json(ref / store.MANIFEST_FILE, lambda m: m.update(created=when))
    signing.sign_directory(ref, key)


def widen(factor: float, where: Callable[[dict[str, Any]], bool]) -> Callable[
        [dict[str, Any]], None]:
    """An edit of ``bounds.json`` multiplying the bound of every row ``where`` selects."""
    def edit(doc: dict[str, Any]) -> None:
        hits = [b for b in doc["bounds"] if where(b)]
        assert hits
        for b in hits:
            b["bound"] *= factor
    return edit


def first_logprobs(b: dict[str, Any]) -> bool:
    return (b["round"], b["role"], b["family"], b["precision"], b["class"]) == \
        (1, "actor", "logprobs", "fp32", "candidate_vs_hf")


# --------------------------------------------------------------------------- the committed one


def test_committed_reference_bounds_recompute_exactly() -> None:
    """The truth: the rule applied again to the committed reference's sealed inputs gives
    its bounds.json bit for bit, every field of every row."""
    doc = json.loads((COMMITTED / "bounds.json").read_text())
    again = [b.to_dict() for b in recompute_bounds(COMMITTED)]
    assert again == doc["bounds"]
    assert len(again) == 315
    assert verify_bounds(COMMITTED).startswith("315 bounds of bounds.json recomputed")


def test_widened_bound_in_a_resigned_backdated_committed_reference_is_refused(
        real_ref: tuple[Path, Path, signing.SigningKey]) -> None:
    ref, keys, key = real_ref
    before = verify(ref, trusted_keys_dir=keys)  # not signed by the insider yet
    assert not before
    assert before.failed_steps[0].number == 2
    sealed = store.read_manifest(ref)["created"]
    edit_json(ref / "bounds.json", widen(1000.0, first_logprobs))
    reseal_backdated(ref, key)
    assert store.read_manifest(ref)["created"] == sealed  # backdated

    result = verify(ref, trusted_keys_dir=keys)
    assert not result
    assert result.exit_code == ExitCode.INTEGRITY_ERROR
    assert [s.number for s in result.failed_steps] == [9]
    err = result.first_error
    assert isinstance(err, BoundsMismatchError)
    detail = result.steps[8].detail
    assert "\n" not in detail
    assert detail.startswith("bounds.json: 1 of 315 sealed bounds are not the rule")
    assert "round1/actor/logprobs fp32 candidate_vs_hf: bound sealed " in detail
    doc = json.loads((COMMITTED / "bounds.json").read_text())
    (orig,) = [b for b in doc["bounds"] if first_logprobs(b)]
    assert f"recomputed {orig['bound']!r}" in detail
    assert f"sealed {orig['bound'] * 1000.0!r}" in detail

    code, text = run_cli(["verify", str(ref), "--keys", str(keys)])
    assert code == ExitCode.INTEGRITY_ERROR
    assert "[FAIL] 9. bounds and verdicts recomputed from sealed evidence: bounds.json: 1 of " \
        "315 sealed bounds" in text


@pytest.mark.parametrize("factor", [1000.0, 1.0 + 2.0 ** -52, 0.5])
def test_any_factor_on_every_row_is_refused(committed_copy: Path, factor: float) -> None:
    """Widened, moved by one ulp, or narrowed: all 315 rows named in the count."""
    path = committed_copy / "bounds.json"
    original = path.read_bytes()
    try:
        edit_json(path, widen(factor, lambda b: True))
        with pytest.raises(BoundsMismatchError, match=r"^bounds.json: 315 of 315 sealed "):
            verify_bounds(committed_copy)
    finally:
        path.write_bytes(original)
    verify_bounds(committed_copy)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_change_to_one_sealed_number_is_caught(committed_copy: Path,
                                                   data: st.DataObject) -> None:
    """Property: whatever row, whatever numeric field, whatever other value (finite or not,
    larger or smaller, by one ulp or by 1e300): verify refuses it and names the row."""
    path = committed_copy / "bounds.json"
    original = path.read_bytes()
    doc = json.loads(original)
    i = data.draw(st.integers(0, len(doc["bounds"]) - 1), label="row")
    field = data.draw(st.sampled_from(NUMBERS), label="field")
    old = doc["bounds"][i][field]
    new = data.draw(st.one_of(
        st.floats(allow_nan=False, allow_infinity=True),
        st.builds(math.nextafter, st.just(float(old)), st.sampled_from([-math.inf, math.inf])),
        st.builds(lambda f: float(old) * f, st.floats(0.0, 1e6, allow_nan=False)),
    ).filter(lambda x: x != old), label="new")
    doc["bounds"][i][field] = new
    try:  # infinities as the 1e999 literal a JSON reader turns into inf
        path.write_text(json.dumps(doc).replace("Infinity", "1e999"))
        with pytest.raises(BoundsMismatchError) as exc:
            verify_bounds(committed_copy)
    finally:
        path.write_bytes(original)
    msg = str(exc.value)
    assert "\n" not in msg
    # the row named, or the schema's minimum 0 naming the row, or (an infinity) the strict
    # reader refusing the whole file where it is read
    assert f"{_row_name(doc['bounds'][i])}: " in msg or f"bounds.{i}.{field}: " in msg or (
        math.isinf(new) and "overflows to infinity" in msg), msg


def _json_sub(pattern: str, new: str) -> Callable[[Path], None]:
    """Replace the first match of ``pattern`` in ``bounds.json``'s text (literals JSON
    writers refuse to write: ``NaN``, ``1e999``)."""
    def edit(ref: Path) -> None:
        path = ref / "bounds.json"
        text, n = re.subn(pattern, new, path.read_text(), count=1)
        assert n == 1
        path.write_text(text)
    return edit


def _doc(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda ref: edit_json(ref / "bounds.json", edit)


def _row(i: int, **fields: Any) -> Callable[[Path], None]:
    return _doc(lambda d: d["bounds"][i].update(fields))


def _extra_row(**fields: Any) -> Callable[[Path], None]:
    return _doc(lambda d: d["bounds"].append({**d["bounds"][0], **fields}))


def _drop_field(i: int, field: str) -> Callable[[Path], None]:
    return _doc(lambda d: d["bounds"][i].pop(field))


def _delete(name: str) -> Callable[[Path], None]:
    return lambda ref: (ref / name).unlink()


def _reference_json(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda ref: edit_json(ref / "reference.json", edit)


def _control_errors(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    return lambda ref: edit_json(ref / "control_errors.json", edit)


def _first_propagated(doc: dict[str, Any]) -> int:
    return next(i for i, b in enumerate(doc["bounds"]) if b["propagated"] > 0)


PROPAGATED_ROW = _first_propagated(json.loads((COMMITTED / "bounds.json").read_text()))

BAD_BOUNDS: list[tuple[str, Callable[[Path], None], str]] = [
    ("negative bound", _row(3, bound=-1e-3), r"schema bounds.schema.json"),
    ("negative k", _row(3, k=-4.0),
     r"bounds\.3\.k: -4\.0 is less than or equal to the minimum of 0"),
    ("a metric the rule does not produce", _extra_row(family="grads", round=7),
     r"round7/actor/grads bf16-autocast candidate_vs_hf: sealed, but the rule gives no bound here"),
    ("a made-up family", _extra_row(family="made_up"),
     r"round1/actor/made_up bf16-autocast candidate_vs_hf: sealed, but the rule gives no bound"),
    ("a row sealed twice", _extra_row(), r"round1/actor/clip_coef bf16-autocast candidate_vs_hf: "
                                         r"sealed twice"),
    ("a row removed", _doc(lambda d: d["bounds"].pop(0)),
     r"1 of 314 .*round1/actor/clip_coef bf16-autocast candidate_vs_hf: no sealed bound, the rule "
     r"gives 0\.00111"),
    ("the control renamed", _row(0, control="fp64"), r"control sealed 'fp64', recomputed "
                                                     r"'attn_impl'"),
    ("the floor lowered with the bound kept", _row(0, floor=0.0), r"floor sealed 0\.0"),
    ("k of the document", _doc(lambda d: d.update(k=40.0)), r"k 40\.0, contract.json says 4\.0"),
    ("lane of the document", _doc(lambda d: d.update(lane="deterministic")),
     r"lane 'deterministic', contract.json says 'approximate'"),
    ("a term dropped (as if sealed before it existed)", _drop_field(PROPAGATED_ROW, "propagated"),
     r"propagated absent \(sealed before the term existed: not recomputable from sealed "
     r"data\)"),
    ("control_errors.json deleted", _delete("control_errors.json"),
     r"315 sealed bounds not recomputable from sealed data: control_errors.json: missing"),
    ("update records removed", _reference_json(lambda d: d.pop("update_meta")),
     r"not recomputable from sealed data: reference.json: no update_meta"),
    ("an HF tensor file deleted", _delete("reference/hf-fp32.safetensors"),
     r"not recomputable from sealed data: reference/hf-fp32.safetensors"),
    ("a control error that is not a number",
     _control_errors(lambda d: d["fp32"]["fp64"]["round1/actor/logprobs"].update(value="0")),
     r"not recomputable from sealed data: control_errors.json: "
     r"fp32.fp64.round1/actor/logprobs.value: not a finite number"),
    ("a lane's control errors removed", _control_errors(lambda d: d.pop("bf16-autocast")),
     r"not recomputable from sealed data: control_errors.json: lanes"),
    ("a control run deleted", _delete("controls/attn_impl-fp32.safetensors"),
     r"control_errors.json: not recomputable from the sealed control and reference tensors: "
     r"controls/attn_impl-fp32.safetensors"),
    ("a control the contract names removed",
     _control_errors(lambda d: d["fp32"].pop("fp64")),
     r"not recomputable from sealed data: control_errors.json: controls \['fp64'\] not "
     r"measured at fp32"),
]


def test_a_widened_control_error_with_its_bounds_rederived_is_refused(
        real_ref: tuple[Path, Path, signing.SigningKey]) -> None:
    """The insider widens the control error behind a bound 1000x and derives bounds.json
    from the edited errors by the rule itself, so the bounds check alone passes; measuring
    the sealed control runs against the sealed reference again refuses it, naming the
    entry and both values."""
    ref, keys, key = real_ref
    doc = json.loads((COMMITTED / "bounds.json").read_text())
    (row,) = [b for b in doc["bounds"] if first_logprobs(b)]
    label = "round1/actor/logprobs"
    sealed = json.loads((COMMITTED / "control_errors.json").read_text())
    value = sealed["fp32"][row["control"]][label]["value"]
    edit_json(ref / "control_errors.json",
              lambda d: d["fp32"][row["control"]][label].update(value=value * 1000.0))
    again = [b.to_dict() for b in recompute_bounds(ref)]
    (wide,) = [b for b in again if first_logprobs(b)]
    assert wide["bound"] > 100 * row["bound"]  # the lie widens the bound
    edit_json(ref / "bounds.json", lambda d: d.update(bounds=again))
    reseal_backdated(ref, key)

    result = verify(ref, trusted_keys_dir=keys)
    assert [s.number for s in result.failed_steps] == [9], result.summary_lines()
    assert isinstance(result.first_error, BoundsMismatchError)
    detail = result.steps[8].detail
    assert "\n" not in detail
    assert detail.startswith("control_errors.json: 1 of "), detail
    assert f"fp32 {row['control']} {label}: value sealed {value * 1000.0!r}, recomputed " \
           f"{value!r}" in detail


@pytest.mark.parametrize(("text", "detail"), [
    ("[]", "bounds.json: not a JSON object (a JSON list)"),
    ('{"bounds": NaN}', "bounds.json: non-standard JSON constant NaN"),
], ids=["a list", "NaN"])
def test_bounds_json_that_is_no_json_object_is_refused_with_one_line(
        real_ref: tuple[Path, Path, signing.SigningKey], text: str, detail: str) -> None:
    """Refused where it is first read (step 6, its contract digest), step 9 skipped."""
    ref, keys, key = real_ref
    (ref / "bounds.json").write_text(text)
    reseal_backdated(ref, key)
    result = verify(ref, trusted_keys_dir=keys)
    assert result.exit_code == ExitCode.INTEGRITY_ERROR
    assert [s.number for s in result.failed_steps] == [6]
    assert detail in result.failed_steps[0].detail
    assert "\n" not in result.failed_steps[0].detail
    assert result.steps[8].status == "skipped"


#: Refused where bounds.json is first read (step 6: the strict JSON reader refuses a number
#: that overflows to infinity, the bounds schema a k outside (0, 100]), before step 9.
BAD_BOUNDS_READ: list[tuple[str, Callable[[Path], None], str]] = [
    ("an infinite bound (1e999)", _json_sub(r'"bound": [^,]+', '"bound": 1e999'),
     r"bounds\.json"),
    ("an infinite k (1e999)", _json_sub(r'"k": [^,]+', '"k": 1e999'), r"bounds\.json"),
]


@pytest.mark.parametrize(("edit", "message"), [(e, m) for _, e, m in BAD_BOUNDS_READ],
                         ids=[n for n, _, _ in BAD_BOUNDS_READ])
def test_unreadable_bounds_are_refused_at_step_6_with_one_line(
        real_ref: tuple[Path, Path, signing.SigningKey], edit: Callable[[Path], None],
        message: str) -> None:
    """Each edit, re-sealed and re-signed by a trusted key: verify exits 3 at step 6."""
    ref, keys, key = real_ref
    edit(ref)
    reseal_backdated(ref, key)
    result = verify(ref, trusted_keys_dir=keys)
    assert result.exit_code == ExitCode.INTEGRITY_ERROR
    assert [s.number for s in result.failed_steps] == [6], result.summary_lines()
    detail = result.failed_steps[0].detail
    assert re.search(message, detail), detail
    assert "\n" not in detail


@pytest.mark.parametrize(("edit", "message"), [(e, m) for _, e, m in BAD_BOUNDS],
                         ids=[n for n, _, _ in BAD_BOUNDS])
def test_bad_bounds_are_refused_with_one_line(real_ref: tuple[Path, Path, signing.SigningKey],
                                              edit: Callable[[Path], None],
                                              message: str) -> None:
    """Each edit, re-sealed and re-signed by a trusted key: verify exits 3 at step 9 with one
    line naming what is wrong."""
    ref, keys, key = real_ref
    edit(ref)
    reseal_backdated(ref, key)
    result = verify(ref, trusted_keys_dir=keys)
    assert result.exit_code == ExitCode.INTEGRITY_ERROR
    assert [s.number for s in result.failed_steps] == [9], result.summary_lines()
    assert isinstance(result.first_error, BoundsMismatchError)
    detail = result.steps[8].detail
    assert "\n" not in detail
    assert "Traceback" not in detail
    assert re.search(message, detail), detail


def test_compared_fields_are_every_field_but_the_identity() -> None:
    """A field added to the rows later is compared too (or this fails)."""
    row = json.loads((COMMITTED / "bounds.json").read_text())["bounds"][0]
    assert set(row) - {"precision", "class", "round", "role", "family"} == set(COMPARED_FIELDS)


# --------------------------------------------------------------------------- seal times


def _seal_case(name: str, ref: Path, key: signing.SigningKey) -> None:
    if name == "statement sealed is not the manifest's":
        resign_statement(ref, lambda s: s["predicate"].update(
            sealed="2026-01-01T00:00:00.000000Z"), key)
    elif name == "sealed after it was attested":
        resign_statement(ref, lambda s: s["predicate"].update(
            signed="2026-01-01T00:00:00.000000Z"), key)
    elif name == "backdated before reference.json was written":
        reseal_backdated(ref, key, created="2020-01-01T00:00:00.000000Z")
    else:
        raise AssertionError(name)


@pytest.mark.parametrize("case", ["statement sealed is not the manifest's",
                                  "sealed after it was attested",
                                  "backdated before reference.json was written"])
def test_inconsistent_seal_time_is_refused(real_ref: tuple[Path, Path, signing.SigningKey],
                                           case: str) -> None:
    ref, keys, key = real_ref
    reseal_backdated(ref, key)  # trusted, untouched otherwise
    assert verify(ref, trusted_keys_dir=keys)
    _seal_case(case, ref, key)
    result = verify(ref, trusted_keys_dir=keys)
    assert [s.number for s in result.failed_steps] == [8], result.summary_lines()
    assert isinstance(result.first_error, SealOrderError)
    assert result.steps[8].status == "skipped"  # no recomputation on an unordered seal


# --------------------------------------------------------------------------- a whole attack


def m_bound_widened_consistently(w: World) -> Path:
    """An insider widens the logprob bounds 1000x, re-seals the reference with its seal time
    backdated, and compares, seals and signs the failing run again: it now passes, every
    digest and time is consistent, only the bounds are not the rule's."""
    run = w.failing
    ref = w.reference
    edit_json(ref / "bounds.json", widen(1000.0, lambda b: (b["round"], b["role"], b["family"])
                                         == (1, "actor", "logprobs")))
    reseal_backdated(ref, w.key)
    store.make_writable(run)
    for name in (store.MANIFEST_FILE, signing.ATTESTATION_FILE, "report.json", "report.md",
                 "report.html"):
        (run / name).unlink(missing_ok=True)
    edit_json(run / "run.json", lambda d: d["reference"].update(
        manifest_digest=store.manifest_digest(ref)))
    from qualify.compare.stage import compare_run

    report = compare_run(run, reference_dir=ref, write=True)
    assert {c.cell: c.verdict for c in report.cells}[FAIL_CELL] == "PASS"  # the lie works
    signing.seal_and_sign(run, kind="candidate-run", key=w.key)
    return run


def test_widened_bound_that_makes_a_failing_run_pass_is_refused(world: World) -> None:
    """The attack of the issue, end to end: verify, and so gate and audit, refuse the run
    because its reference's bounds are not recomputed (step 7, the reference's step 9)."""
    run = m_bound_widened_consistently(world)
    result = world.verify(run)
    assert [s.number for s in result.failed_steps] == [7], result.summary_lines()
    detail = result.steps[6].detail
    assert "does not verify" in detail
    assert "step 9" in detail
    assert "round1/actor/logprobs fp32 candidate_vs_hf: bound sealed" in detail
    ref = world.verify(world.reference)
    assert [s.number for s in ref.failed_steps] == [9]
    # FP32 only: its three classes (candidate_vs_hf, candidate_vs_hf_tp, tp_vs_tp1)
    assert ref.steps[8].detail.startswith("bounds.json: 3 of ")
    code, _ = run_cli(["gate", str(run), "--keys", str(world.keys), "--contract",
                       str(world.contract)])
    assert code == ExitCode.INTEGRITY_ERROR


# --------------------------------------------------------------------------- old references


def test_hand_made_bounds_without_control_errors_are_not_taken_on_faith(tmp_path: Path) -> None:
    """The pre-redesign fixture's bounds were written by hand (control "hand-made", no
    ``control_errors.json``): verify says they cannot be recomputed and refuses them."""
    dest = tmp_path / "pre"
    shutil.copytree(PRE_REDESIGN, dest)
    (ref,) = (dest / "references").iterdir()
    result = verify(ref, trusted_keys_dir=dest / "keys", contracts_dir=dest / "contracts")
    assert result.exit_code == ExitCode.INTEGRITY_ERROR
    assert [s.number for s in result.failed_steps] == [9]
    assert result.steps[8].detail == (
        "bounds.json: 70 sealed bounds not recomputable from sealed data: "
        "control_errors.json: missing (the reference was sealed without it)")
