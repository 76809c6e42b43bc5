"""qualify.layout.resolve_reference: which sealed reference a candidate run's checks read.

Fake reference directories (a ``MANIFEST.json`` each, named by its sha256 in ``run.json``):
a copy beside the evidence wins over the absolute path the run was made under, the
recorded path serves when no copy is beside, then a directory of the recorded name, and
nothing found is a ``ReferenceDataError``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from qualify.errors import ReferenceDataError
from qualify.layout import resolve_reference


def _reference(path: Path, manifest: str) -> str:
    path.mkdir(parents=True)
    (path / "MANIFEST.json").write_text(manifest)
    return hashlib.sha256(manifest.encode()).hexdigest()


def _run(tmp_path: Path, path: Path, digest: str) -> tuple[Path, dict[str, object]]:
    run_dir = tmp_path / "checkout" / "evidence" / "tiny" / "run1"
    run_dir.mkdir(parents=True)
    return run_dir, {"reference": {"path": str(path), "manifest_digest": digest}}


def test_a_copy_beside_the_evidence_wins_over_the_recorded_path(tmp_path: Path) -> None:
    # the run was made in another checkout, which still holds the reference (re-signed
    # there, say): this checkout's own copy, same manifest, is the one to check
    elsewhere = tmp_path / "other" / "references" / "tiny-abc"
    digest = _reference(elsewhere, '{"files": 1}')
    run_dir, run = _run(tmp_path, elsewhere, digest)
    own = tmp_path / "checkout" / "references" / "tiny-abc"
    _reference(own, '{"files": 1}')
    assert resolve_reference(run_dir, run) == own
    assert resolve_reference(run_dir, run, given=elsewhere) == elsewhere


def test_the_recorded_path_serves_when_nothing_is_beside(tmp_path: Path) -> None:
    elsewhere = tmp_path / "other" / "references" / "tiny-abc"
    digest = _reference(elsewhere, '{"files": 1}')
    run_dir, run = _run(tmp_path, elsewhere, digest)
    assert resolve_reference(run_dir, run) == elsewhere.resolve()
    # a directory beside with another manifest is not it
    _reference(tmp_path / "checkout" / "references" / "tiny-xyz", '{"files": 2}')
    assert resolve_reference(run_dir, run) == elsewhere.resolve()


def test_a_directory_of_the_recorded_name_is_the_last_resort(tmp_path: Path) -> None:
    gone = tmp_path / "gone" / "references" / "tiny-abc"
    run_dir, run = _run(tmp_path, gone, "0" * 64)
    own = tmp_path / "checkout" / "references" / "tiny-abc"
    _reference(own, '{"edited": true}')
    assert resolve_reference(run_dir, run) == own


def test_nothing_found_is_an_error(tmp_path: Path) -> None:
    run_dir, run = _run(tmp_path, tmp_path / "gone" / "tiny-abc", "0" * 64)
    with pytest.raises(ReferenceDataError, match="not found"):
        resolve_reference(run_dir, run)
