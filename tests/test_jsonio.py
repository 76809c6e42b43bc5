"""Tests of qualify.jsonio: the one bounded, strict JSON reader for evidence.

A named dataset of hostile files (python-tuf ``run_sub_tests_with_dataset`` style): each is
refused with an :class:`~qualify.errors.EvidenceIntegrityError` (exit code 3) that names
the file, before anything large is read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from qualify import jsonio
from qualify.errors import EvidenceIntegrityError, ExitCode


def _symlink_to_dev_zero(p: Path) -> None:
    p.symlink_to("/dev/zero")


def _symlink_to_good_file(p: Path) -> None:
    target = p.parent / "real.json"
    target.write_text('{"ok": true}')
    p.symlink_to(target)


def _fifo(p: Path) -> None:
    os.mkfifo(p)  # opening it for reading would block forever without O_NONBLOCK


def _directory(p: Path) -> None:
    p.mkdir()


def _oversized(p: Path) -> None:
    p.write_bytes(b'{"pad": "' + b"x" * 200 + b'"}')


def _duplicate_top(p: Path) -> None:
    p.write_text('{"kind": "reference", "kind": "candidate-run"}')


def _duplicate_nested(p: Path) -> None:
    p.write_text('{"files": {"a": {"sha256": "00", "sha256": "11"}}}')


def _nan(p: Path) -> None:
    p.write_text('{"margin": NaN}')


def _deep(p: Path) -> None:
    p.write_text("[" * 100_000 + "]" * 100_000)


def _not_utf8(p: Path) -> None:
    p.write_bytes(b'{"a": "\xff"}')


def _not_json(p: Path) -> None:
    p.write_text('{"a": ')


HOSTILE: dict[str, tuple[Callable[[Path], None], str]] = {
    "symlink to /dev/zero": (_symlink_to_dev_zero, "symbolic link"),
    "symlink to a good file": (_symlink_to_good_file, "symbolic link"),
    "fifo": (_fifo, "not a regular file"),
    "directory": (_directory, "not a regular file"),
    "over the size limit": (_oversized, "over the 100-byte limit"),
    "duplicate key": (_duplicate_top, "duplicate key 'kind'"),
    "duplicate key nested": (_duplicate_nested, "duplicate key 'sha256'"),
    "NaN literal": (_nan, "non-standard JSON constant NaN"),
    "nested too deep": (_deep, "nested too deep"),
    "not UTF-8": (_not_utf8, "not UTF-8"),
    "not JSON": (_not_json, "not JSON"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_file_is_refused_naming_it(tmp_path: Path, case: str) -> None:
    make, words = HOSTILE[case]
    path = tmp_path / "run.json"
    make(path)
    t0 = time.perf_counter()
    with pytest.raises(EvidenceIntegrityError) as info:
        jsonio.read_json(path, max_bytes=100 if case == "over the size limit" else None)
    assert time.perf_counter() - t0 < 5.0  # refused, never read to the end
    assert str(path) in str(info.value)
    assert words in str(info.value)
    assert info.value.exit_code == ExitCode.INTEGRITY_ERROR


def test_device_file_itself_is_refused() -> None:
    with pytest.raises(EvidenceIntegrityError, match="not a regular file"):
        jsonio.read_json("/dev/zero")


def test_missing_file_is_named() -> None:
    with pytest.raises(EvidenceIntegrityError, match=r"nowhere\.json: missing"):
        jsonio.read_json("/nonexistent/nowhere.json")
    with pytest.raises(FileNotFoundError):
        jsonio.read_bytes("/nonexistent/nowhere.json")


def test_what_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text('{"a": 1, "a": 2}')
    with pytest.raises(EvidenceIntegrityError, match=r"^run-2/report.json: duplicate key"):
        jsonio.read_json(tmp_path / "x.json", what="run-2/report.json")


def test_valid_documents_read_back_exactly(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    path.write_text('{"rows": [{"margin": 0.1, "error": 1.2345678901234567e-07}], '
                    '"n": 3, "ok": true, "none": null, "inf": "inf"}')
    doc = jsonio.read_json(path)
    assert doc == {"rows": [{"margin": 0.1, "error": 1.2345678901234567e-07}], "n": 3,
                   "ok": True, "none": None, "inf": "inf"}
    limit = len(path.read_bytes())
    assert jsonio.read_json(path, max_bytes=limit) == doc  # the limit is inclusive
    with pytest.raises(EvidenceIntegrityError, match="over the"):
        jsonio.read_json(path, max_bytes=limit - 1)


def test_limits_by_kind() -> None:
    assert jsonio.limit_for("run/report.json") == jsonio.MAX_REPORT_BYTES
    assert jsonio.limit_for("ref/bounds.json") == jsonio.MAX_REPORT_BYTES
    assert jsonio.limit_for("run/MANIFEST.json") == jsonio.MAX_LISTING_BYTES
    assert jsonio.limit_for("run/attestation.dsse.json") == jsonio.MAX_LISTING_BYTES
    for name in ("run.json", "reference.json", "result.json", "INCOMPLETE"):
        assert jsonio.limit_for(name) == jsonio.MAX_RECORD_BYTES
    assert jsonio.MAX_RECORD_BYTES < jsonio.MAX_LISTING_BYTES < jsonio.MAX_REPORT_BYTES


def test_default_limit_applies(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    with path.open("wb") as f:
        f.write(b'{"pad": "')
        f.truncate(jsonio.MAX_RECORD_BYTES + 1)  # sparse: no data written
    with pytest.raises(EvidenceIntegrityError, match=f"over the {jsonio.MAX_RECORD_BYTES}"):
        jsonio.read_json(path)


def test_loads_strict_refuses_duplicates_in_bytes() -> None:
    assert jsonio.loads_strict(b'{"a": [1, {"b": 2}]}', what="payload") == {"a": [1, {"b": 2}]}
    with pytest.raises(EvidenceIntegrityError, match="payload: duplicate key 'b'"):
        jsonio.loads_strict(b'{"a": [1, {"b": 2, "b": 3}]}', what="payload")
