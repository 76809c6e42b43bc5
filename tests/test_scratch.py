"""qualify.scratch: large temporaries stay off a tmpfs, and a bad setting is refused early."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from qualify import scratch
from qualify.cli.main import main
from qualify.contract import default_contract_path, load_contract
from qualify.errors import UsageError
from qualify.reference.stage import run_reference_stage

MOUNTINFO = "\n".join([
    "22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw",
    "23 22 0:21 / /tmp rw,nosuid shared:2 - tmpfs tmpfs rw,size=1024k",
    r"24 23 252:2 / /tmp/on\040disk rw shared:3 - xfs /dev/vdb rw",
    "25 22 0:40 / /data rw shared:4 - nfs4 server:/data rw",
    "26 22 0:41 / /data rw shared:5 - ramfs ramfs rw",  # mounted over /data: it wins
    "not a mountinfo line",
    "27 22 0:42 / /half rw shared:6 -",  # no type after the separator
])


@pytest.mark.parametrize(("path", "want"), [
    ("/", "ext4"), ("/work/x", "ext4"), ("/tmp", "tmpfs"), ("/tmp/a/b", "tmpfs"),
    ("/tmpfoo", "ext4"), ("/tmp/on disk/f", "xfs"), ("/tmp/on diskette", "tmpfs"),
    ("/data/z", "ramfs"), ("/half/x", "ext4")])
def test_the_type_is_the_longest_mount_point_holding_the_path(path: str, want: str) -> None:
    assert scratch.filesystem_type(Path(path), MOUNTINFO) == want


def test_no_line_holds_the_path() -> None:
    assert scratch.filesystem_type(Path("/x"), "garbage\n") is None
    assert scratch.filesystem_type(Path("/x"), "") is None


def _mounts(memory: Path, disk: Path) -> str:
    """``memory`` on a tmpfs and ``disk`` on ext4 (both resolved, as the module looks up)."""
    return "\n".join([f"1 0 0:1 / {disk.resolve()} rw - ext4 /dev/a rw",
                      f"2 0 0:2 / {memory.resolve()} rw - tmpfs tmpfs rw"])


def test_a_temporary_directory_in_memory_gives_way_to_the_fallback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    temp, disk = tmp_path / "tmp", tmp_path / "disk"
    temp.mkdir()
    disk.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    env: dict[str, str] = {}
    assert scratch.scratch_root(env, mountinfo=_mounts(temp, disk), fallback=disk) == disk
    # the temporary directory on disk: it is kept
    assert scratch.scratch_root(env, mountinfo=_mounts(tmp_path / "other", tmp_path),
                                fallback=disk) == temp
    # both in memory: the temporary directory, with a note naming the setting
    both = _mounts(temp, disk) + f"\n3 0 0:3 / {disk.resolve()} rw - tmpfs tmpfs rw"
    assert scratch.scratch_root(env, mountinfo=both, fallback=disk) == temp
    assert scratch.SCRATCH_ENV in capsys.readouterr().err
    # no such fallback directory: the temporary directory, noted
    assert scratch.scratch_root(env, mountinfo=_mounts(temp, disk),
                                fallback=tmp_path / "absent") == temp
    # the setting wins, even in memory
    assert scratch.scratch_root({scratch.SCRATCH_ENV: str(temp)},
                                mountinfo=_mounts(temp, disk), fallback=disk) == temp


def test_a_bad_setting_is_refused(tmp_path: Path) -> None:
    afile = tmp_path / "f"
    afile.write_text("x")
    for bad in (tmp_path / "absent", afile):
        with pytest.raises(UsageError, match=f"{scratch.SCRATCH_ENV}={bad}: not an existing"):
            scratch.scratch_root({scratch.SCRATCH_ENV: str(bad)}, mountinfo="")
    assert scratch.check_setting({}) is None
    assert scratch.check_setting({scratch.SCRATCH_ENV: str(tmp_path)}) == tmp_path


def test_the_reference_stage_refuses_it_before_writing(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """Before its first step (not at the clip-branch step, minutes later): nothing is
    written, and the command says so in one line with the usage exit code."""
    monkeypatch.setenv(scratch.SCRATCH_ENV, str(tmp_path / "absent"))
    refs = tmp_path / "refs"
    with pytest.raises(UsageError):
        run_reference_stage(load_contract(default_contract_path()), root=refs, quiet=True)
    assert not refs.exists()
    assert main(["reference", "--out", str(refs), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"qualify: error: {scratch.SCRATCH_ENV}={tmp_path / 'absent'}: not an existing, "
                   "writable directory"], err
    assert not refs.exists()
