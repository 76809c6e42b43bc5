"""A corpus of inputs each stage must refuse at its entry, before anything runs on them.

Four classes, each generated or listed as a parametrized corpus and run in-process:

- every integer leaf of the default contract given as a float (``rounds = 2.0``) or a
  bool, found by walking the contract document (the class: JSON Schema's ``integer``
  counts ``2.0``; :mod:`qualify.schema` does not); and every schema's integer
  ``const`` / ``enum`` typed ``integer``;
- prompts the stages crash on: a float id, a prompt too long for the model's positions
  minus ``max_new_tokens``, a prompts-file id at or above ``vocab_size``, a duplicate key,
  ``NaN`` or an overflowing number in a prompts JSONL line (``qualify validate``);
- a re-sealed reference whose ``reference.json``, ``contract.json`` or ``bounds.json`` is
  off its schema or of another contract (``qualify candidate``: nothing launched, no run
  directory made; ``qualify compare``: no report);
- a ``run.json`` off its schema (``qualify compare``: no report).

Each CLI case: exit 2, exactly one line on stderr starting ``qualify: error:``, naming the
file and the field, no traceback.
"""

from __future__ import annotations

import copy
import hashlib
import json
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from qualify.bounds import Bound, MetricKey, bounds_document
from qualify.cli.main import main
from qualify.contract import Contract, default_contract_path, load_contract
from qualify.errors import ContractError
from qualify.evidence import store
from qualify.resources import contracts_dir
from qualify.schema import STRICT_VALIDATOR

BASE_TEXT = default_contract_path().read_text(encoding="utf-8")
BASE_DOC = tomllib.loads(BASE_TEXT)
SCHEMAS = sorted((contracts_dir() / "schema").glob("*.schema.json"))


def _check_one_line(rc: int, err: str, out: str, names: tuple[str, ...]) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err + out
    assert rc == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("qualify: error: "), err
    for name in names:
        assert name in lines[0], (name, lines[0])


# --------------------------------------------------------------------------- integers


def _integer_leaves(doc: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _integer_leaves(v, (*path, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _integer_leaves(v, (*path, i))
    elif isinstance(doc, int) and not isinstance(doc, bool):
        yield path


INTEGER_LEAVES = [p for p in _integer_leaves(BASE_DOC) if p[:3] != ("model", "manifest", "config")]
"""Every integer of the default contract; ``model.manifest.config`` is excluded: an open map of
expected config values of any JSON type, compared by equality with the model's config."""


def _set(doc: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    node: Any = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


@pytest.mark.parametrize("kind", ["float", "bool"])
@pytest.mark.parametrize("path", INTEGER_LEAVES, ids=_dotted)
def test_every_integer_field_refuses_a_float_or_bool(path: tuple[Any, ...], kind: str) -> None:
    value: Any = BASE_DOC
    for key in path:
        value = value[key]
    bad = float(value) if kind == "float" else bool(value)
    with pytest.raises(ContractError) as exc:
        Contract.from_dict(_set(BASE_DOC, path, bad))
    assert _dotted(path) in str(exc.value), str(exc.value)


def test_the_integer_corpus_covers_the_fields_that_crashed() -> None:
    names = {_dotted(p) for p in INTEGER_LEAVES}
    assert {"algorithm.rounds", "schema_version", "sampling.max_new_tokens",
            "prompts.token_ids.0.0", "algorithm.micro_batch_size"} <= names
    assert len(INTEGER_LEAVES) >= 30


def _int_consts(node: Any, where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        values = ([node["const"]] if "const" in node else []) + list(node.get("enum", []))
        if any(isinstance(v, int) and not isinstance(v, bool) for v in values):
            yield where, node
        for k, v in node.items():
            yield from _int_consts(v, f"{where}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _int_consts(v, f"{where}/{i}")


@pytest.mark.parametrize("path", SCHEMAS, ids=lambda p: p.name)
def test_every_integer_const_or_enum_is_typed_integer(path: Path) -> None:
    """``{"const": 1}`` alone accepts ``1.0``; ``"type": "integer"`` (strict) does not."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    untyped = [w for w, n in _int_consts(doc)
               if "integer" not in ([n.get("type")] if isinstance(n.get("type"), str)
                                    else n.get("type", []))]
    assert not untyped, untyped
    version = doc.get("properties", {}).get("schema_version")
    if version is not None:  # strict: the supported version only, as a JSON integer
        check = STRICT_VALIDATOR(version)
        assert check.is_valid(1)
        assert not any(check.is_valid(v) for v in (1.0, True, 99, "1", None))


# --------------------------------------------------------------------------- prompts


def _sub(old: str, new: str) -> Callable[[str, Path], str]:
    def edit(text: str, _d: Path) -> str:
        assert old in text, old
        return text.replace(old, new, 1)
    return edit


def _prompts_file(lines: bytes) -> Callable[[str, Path], str]:
    def edit(text: str, d: Path) -> str:
        (d / "prompts.jsonl").write_bytes(lines)
        digest = hashlib.sha256(lines).hexdigest()
        start, end = text.index("[prompts]"), text.index("[sampling]")
        return (text[:start] + f'[prompts]\nfile = "prompts.jsonl"\nsha256 = "{digest}"\n\n'
                + text[end:])
    return edit


LONG = ", ".join(["5"] * 119)  # 119 + max_new_tokens 10 > max_position_embeddings 128
PROMPT_CASES: dict[str, tuple[Callable[[str, Path], str], tuple[str, ...]]] = {
    "rounds-float": (_sub("rounds = 2", "rounds = 2.0"), ("algorithm.rounds", "integer")),
    "max-new-tokens-float": (_sub("max_new_tokens = 10", "max_new_tokens = 10.0"),
                             ("max_new_tokens",)),
    "prompt-id-float": (_sub("[1, 90, 12],", "[1, 90.0, 12],"), ("prompts.token_ids",)),
    "prompt-too-long": (_sub("[1, 90, 12],", f"[{LONG}],"),
                        ("prompts.token_ids[1]", "119 tokens", "max_position_embeddings 128")),
    "prompt-id-at-vocab": (_sub("[1, 90, 12],", "[1, 384, 12],"),
                           ("prompts.token_ids[1]", "vocab_size 384")),
    "file-id-at-vocab": (_prompts_file(b'{"token_ids": [1, 2]}\n{"token_ids": [384]}\n'),
                         ("prompts.jsonl", "prompt[1]", "vocab_size 384")),
    "file-id-far-above-vocab": (_prompts_file(b'{"token_ids": [99999999999]}\n'),
                                ("prompts.jsonl", "vocab_size")),
    "file-prompt-too-long": (_prompts_file(b'{"token_ids": [' + LONG.encode() + b"]}\n"),
                             ("prompts.jsonl", "max_position_embeddings")),
    "file-float-id": (_prompts_file(b'{"token_ids": [1, 2.0]}\n'), ("prompts.jsonl", "line 1")),
    "file-duplicate-key": (_prompts_file(b'{"token_ids": [1], "token_ids": [2]}\n'),
                           ("prompts.jsonl", "line 1", "duplicate key")),
    "file-duplicate-text-key": (_prompts_file(b'{"text": "a", "text": "b"}\n'),
                                ("prompts.jsonl", "line 1", "duplicate key")),
    "file-nan": (_prompts_file(b'{"token_ids": [1], "w": NaN}\n'),
                 ("prompts.jsonl", "line 1", "NaN")),
    "file-overflow": (_prompts_file(b'{"token_ids": [1], "w": 1e400}\n'),
                      ("prompts.jsonl", "line 1", "infinity")),
}


@pytest.mark.parametrize("case", sorted(PROMPT_CASES))
def test_validate_refuses_what_the_stages_crash_on(case: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    edit, names = PROMPT_CASES[case]
    path = tmp_path / "bad.toml"
    path.write_text(edit(BASE_TEXT, tmp_path), encoding="utf-8")
    rc = main(["validate", str(path)])
    cap = capsys.readouterr()
    _check_one_line(rc, cap.err, cap.out, ("bad.toml", *names))


def test_a_prompt_that_just_fits_is_accepted(tmp_path: Path) -> None:
    """118 tokens + max_new_tokens 10 = 128 positions: the boundary is accepted."""
    path = tmp_path / "ok.toml"
    path.write_text(BASE_TEXT.replace("[1, 90, 12],", "[" + ", ".join(["5"] * 118) + "],"),
                    encoding="utf-8")
    assert load_contract(path).prompts.token_ids is not None


# --------------------------------------------------------------------------- a reference

CONTRACT = load_contract(default_contract_path())
OTHER = Contract.from_dict(_set(BASE_DOC, ("algorithm", "rounds"), 1) | {
    "optimizer": {**BASE_DOC["optimizer"], "total_steps": 1}})


def _reference_docs() -> dict[str, Any]:
    bound = Bound(precision="fp32", klass="candidate_vs_hf",
                  key=MetricKey(round=1, role="actor", family="logprobs"), statistic="max_abs",
                  control_error=1e-6, control="attn_impl", floor=1e-5, k=4.0, bound=1.4e-5)
    return {
        "reference.json": {"schema_version": 1, "contract": CONTRACT.name,
                           "contract_digest": CONTRACT.digest,
                           "created": "2025-01-01T00:00:00Z"},
        "contract.json": CONTRACT.to_dict(),
        "bounds.json": bounds_document(CONTRACT, [bound]),
    }


def _edit(name: str, fn: Callable[[Any], Any]) -> Callable[[dict[str, Any]], None]:
    def apply(docs: dict[str, Any]) -> None:
        docs[name] = fn(docs[name])
    return apply


def _text(name: str, text: str) -> Callable[[dict[str, Any]], None]:
    def apply(docs: dict[str, Any]) -> None:
        docs[name] = text
    return apply


def _bound_field(field: str, value: Any) -> Callable[[Any], Any]:
    def fn(doc: Any) -> Any:
        doc["bounds"][0][field] = value
        return doc
    return fn


REFERENCE_CASES: dict[str, tuple[Callable[[dict[str, Any]], None], tuple[str, ...]]] = {
    "bounds-a-list": (_edit("bounds.json", lambda d: d["bounds"]), ("bounds.json",)),
    "bounds-nan": (_text("bounds.json", json.dumps(_bound_field("bound", float("nan"))(
        _reference_docs()["bounds.json"]))), ("bounds.json", "NaN")),
    "bounds-overflow": (_text("bounds.json", json.dumps(_reference_docs()["bounds.json"])
                              .replace('"bound": 1.4e-05', '"bound": 1e400')),
                        ("bounds.json", "infinity")),
    "bounds-negative": (_edit("bounds.json", _bound_field("bound", -1.0)),
                        ("bounds.json", "bounds.0.bound")),
    "bounds-string": (_edit("bounds.json", _bound_field("bound", "1e-5")),
                      ("bounds.json", "bounds.0.bound")),
    "bounds-negative-floor": (_edit("bounds.json", _bound_field("floor", -1e-5)),
                              ("bounds.json", "bounds.0.floor")),
    "bounds-negative-control-error": (_edit("bounds.json", _bound_field("control_error", -1.0)),
                                      ("bounds.json", "control_error")),
    "bounds-zero-k": (_edit("bounds.json", _bound_field("k", 0.0)), ("bounds.json", "k")),
    "bounds-float-round": (_edit("bounds.json", _bound_field("round", 1.0)),
                           ("bounds.json", "round")),
    "bounds-schema-version": (_edit("bounds.json", lambda d: d | {"schema_version": 99}),
                              ("bounds.json", "schema_version")),
    "bounds-other-contract": (_edit("bounds.json",
                                    lambda d: d | {"contract_digest": OTHER.digest}),
                              ("bounds.json", "contract_digest")),
    "bounds-duplicate-key": (_text("bounds.json", json.dumps(_reference_docs()["bounds.json"])
                                   .replace('"lane": ', '"lane": "approximate", "lane": ')),
                             ("bounds.json", "duplicate key")),
    "contract-of-another": (_edit("contract.json", lambda _d: OTHER.to_dict()),
                            ("contract.json", "another contract")),
    "contract-invalid": (_edit("contract.json", lambda d: d | {"colour": 1}),
                         ("contract.json", "colour")),
    "contract-a-list": (_edit("contract.json", lambda d: [d]), ("contract.json",)),
    "reference-no-digest": (_edit("reference.json",
                                  lambda d: {k: v for k, v in d.items()
                                             if k != "contract_digest"}),
                            ("reference.json", "contract_digest")),
    "reference-other-digest": (_edit("reference.json",
                                     lambda d: d | {"contract_digest": OTHER.digest}),
                               ("reference.json", "contract_digest")),
    "reference-schema-version": (_edit("reference.json", lambda d: d | {"schema_version": 99}),
                                 ("reference.json", "schema_version")),
    "reference-created-not-a-time": (_edit("reference.json", lambda d: d | {"created": "today"}),
                                     ("reference.json", "created")),
    "reference-a-list": (_edit("reference.json", lambda d: [d]), ("reference.json",)),
    "reference-missing": (lambda docs: docs.pop("reference.json"), ("reference.json",)),
    "bounds-missing": (lambda docs: docs.pop("bounds.json"), ("bounds.json",)),
}


def _sealed_reference(tmp: Path, edit: Callable[[dict[str, Any]], None] | None) -> Path:
    """A re-sealed reference directory holding the (edited) three binding documents."""
    ref = tmp / "references" / f"{CONTRACT.name}-{CONTRACT.digest12}"
    ref.mkdir(parents=True)
    docs = _reference_docs()
    if edit is not None:
        edit(docs)
    for name, doc in docs.items():
        (ref / name).write_text(doc if isinstance(doc, str) else json.dumps(doc))
    store.seal(ref, kind="reference")
    return ref


@pytest.mark.parametrize("case", sorted(REFERENCE_CASES))
def test_candidate_refuses_a_bad_reference_before_launching(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    edit, names = REFERENCE_CASES[case]
    ref = _sealed_reference(tmp_path, edit)
    out = tmp_path / "evidence"
    rc = main(["candidate", str(default_contract_path()), "--reference", str(ref),
               "--out", str(out)])
    cap = capsys.readouterr()
    _check_one_line(rc, cap.err, cap.out, names)
    assert not out.exists()  # refused before a run directory was made


def _run_doc(ref: Path) -> dict[str, Any]:
    return {"schema_version": 1, "contract": CONTRACT.name, "contract_digest": CONTRACT.digest,
            "reference": {"path": str(ref), "manifest_digest": store.manifest_digest(ref),
                          "sealed": "2025-01-01T00:00:00Z"},
            "run_id": "run-1", "started": "2025-01-02T00:00:00Z", "faults": [],
            "cells": {"torch_tp-fp32-actor-tp1": {
                "engine": "torch_tp", "precision": "fp32", "options": {}, "role": "actor",
                "tp": 1, "status": "NOT_RUN", "reason": "x", "attempt": None}}}


@pytest.mark.parametrize("case", sorted(k for k in REFERENCE_CASES
                                        if not k.startswith("reference-other")))
def test_compare_refuses_a_bad_reference(case: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    edit, names = REFERENCE_CASES[case]
    ref = _sealed_reference(tmp_path, edit)
    run = tmp_path / "evidence" / CONTRACT.name / "run-1"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(_run_doc(ref)))
    rc = main(["compare", str(run), "--no-seal"])
    cap = capsys.readouterr()
    _check_one_line(rc, cap.err, cap.out, names)
    assert not (run / "report.json").exists()


def _cell(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        doc["cells"]["torch_tp-fp32-actor-tp1"][field] = value
    return apply


def _top(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        doc[field] = value
    return apply


RUN_CASES: dict[str, tuple[Callable[[dict[str, Any]], None], tuple[str, ...]]] = {
    "schema-version-99": (_top("schema_version", 99), ("schema_version",)),
    "schema-version-float": (_top("schema_version", 1.0), ("schema_version",)),
    "started-not-a-time": (_top("started", "yesterday"), ("started",)),
    "finished-not-a-time": (_top("finished", "soon"), ("finished",)),
    "run-id-a-path": (_top("run_id", "../x"), ("run_id",)),
    "contract-digest-short": (_top("contract_digest", "abc"), ("contract_digest",)),
    "contract-name-bad": (_top("contract", "Tiny Qwen"), ("contract",)),
    "sealed-not-a-time": (lambda d: d["reference"].update(sealed="then"), ("reference.sealed",)),
    "manifest-digest-bad": (lambda d: d["reference"].update(manifest_digest="x"),
                            ("manifest_digest",)),
    "engine-unknown": (_cell("engine", "torchtp"), ("engine", "torchtp", "torch_tp")),
    "engine-bad-form": (_cell("engine", "Torch TP"), ("engine",)),
    "precision-unknown": (_cell("precision", "fp16"), ("precision",)),
    "role-unknown": (_cell("role", "judge"), ("role",)),
    "tp-float": (_cell("tp", 1.0), ("tp",)),
    "tp-zero": (_cell("tp", 0), ("tp",)),
    "option-float": (_cell("options", {"zero": 1.0}), ("options",)),
    "cell-id-bad": (lambda d: d["cells"].update({"../../x": {"status": "NOT_RUN"}}), ("cells",)),
    "faults-not-a-list": (_top("faults", "all"), ("faults",)),
}


@pytest.mark.parametrize("case", sorted(RUN_CASES))
def test_compare_refuses_a_run_json_off_its_schema(case: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    edit, names = RUN_CASES[case]
    ref = _sealed_reference(tmp_path, None)
    run = tmp_path / "evidence" / CONTRACT.name / "run-1"
    run.mkdir(parents=True)
    doc = _run_doc(ref)
    edit(doc)
    (run / "run.json").write_text(json.dumps(doc))
    rc = main(["compare", str(run), "--no-seal"])
    cap = capsys.readouterr()
    _check_one_line(rc, cap.err, cap.out, ("run.json", *names))
    assert not (run / "report.json").exists()


def test_the_good_reference_and_run_pass_these_checks(tmp_path: Path) -> None:
    """The corpus's unedited documents pass every check above (each case is the edit)."""
    from qualify.layout import RunDocument
    from qualify.reference.documents import load_sealed_reference

    ref = _sealed_reference(tmp_path, None)
    assert load_sealed_reference(ref, CONTRACT)["contract_digest"] == CONTRACT.digest
    assert RunDocument.from_dict(_run_doc(ref)).run_id == "run-1"


def test_corpus_count() -> None:
    """The size of this corpus (reported): every parametrized case above."""
    n = (2 * len(INTEGER_LEAVES) + len(SCHEMAS) + len(PROMPT_CASES) + 2 * len(REFERENCE_CASES)
         - 2 + len(RUN_CASES))
    print(f"{n} cases")
    assert n >= 150
