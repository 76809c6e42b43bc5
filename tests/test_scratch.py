"""qualify.scratch: large temporaries stay off a tmpfs, and a bad setting is refused early."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from qualify import scratch
from qualify.cli.main import main
from qualify.contract import default_contract_path, load_contract
from qualify.errors import UsageError
from qualify.reference.stage import run_reference_stage

TMPFS, EXT4 = 0x01021994, 0xEF53


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("stat") is None,
                    reason="statfs(2) and coreutils stat -f: Linux")
def test_the_type_is_what_statfs_says(tmp_path: Path) -> None:
    """Against coreutils' ``stat -f --format=%t`` (the same ``f_type``, in hex), on this
    test's directory, ``/proc`` (``PROC_SUPER_MAGIC``) and ``/dev/shm`` where present."""
    paths = [tmp_path, Path("/proc")] + ([Path("/dev/shm")] if Path("/dev/shm").is_dir() else [])
    for path in paths:
        want = int(subprocess.run(["stat", "-f", "--format=%t", str(path)], check=True,
                                  capture_output=True, text=True).stdout.strip(), 16)
        assert scratch.filesystem_magic(path) == want, path
    assert scratch.filesystem_magic(Path("/proc")) == 0x9FA0
    link = tmp_path / "to-proc"
    link.symlink_to("/proc")
    assert scratch.filesystem_magic(link) == 0x9FA0  # the link's target's file system
    assert scratch.filesystem_magic(tmp_path / "absent") is None


def test_a_temporary_directory_in_memory_gives_way_to_the_fallback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    temp, disk = tmp_path / "tmp", tmp_path / "disk"
    temp.mkdir()
    disk.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    env: dict[str, str] = {}
    in_memory = {temp}

    def magic(path: Path) -> int:
        return TMPFS if path in in_memory else EXT4

    assert scratch.scratch_root(env, magic=magic, fallback=disk) == disk
    in_memory.clear()  # the temporary directory on disk: it is kept
    assert scratch.scratch_root(env, magic=magic, fallback=disk) == temp
    assert capsys.readouterr().err == ""
    in_memory.update({temp, disk})  # both in memory: the temporary directory, noted once
    assert scratch.scratch_root(env, magic=magic, fallback=disk) == temp
    assert scratch.scratch_root(env, magic=magic, fallback=disk) == temp
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1, err
    assert scratch.SCRATCH_ENV in err[0]
    in_memory.discard(disk)  # no such fallback directory: the temporary directory, noted
    absent = tmp_path / "absent"
    assert scratch.scratch_root(env, magic=magic, fallback=absent) == temp
    assert str(absent) in capsys.readouterr().err
    # the setting wins, even in memory
    assert scratch.scratch_root({scratch.SCRATCH_ENV: str(temp)}, magic=magic,
                                fallback=disk) == temp


def test_a_bad_setting_is_refused_and_a_relative_one_made_absolute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    afile = tmp_path / "f"
    afile.write_text("x")
    unwritable = ["/proc"] if sys.platform.startswith("linux") else []  # even for root
    for bad in (str(tmp_path / "absent"), str(afile), f"{tmp_path}/a\nb", *unwritable):
        with pytest.raises(UsageError) as info:
            scratch.scratch_root({scratch.SCRATCH_ENV: bad})
        assert str(info.value) == f"{scratch.SCRATCH_ENV}={bad!r}: not an existing, " \
                                  "writable directory"
        assert "\n" not in str(info.value)
    assert scratch.check_setting({}) is None
    assert scratch.check_setting({scratch.SCRATCH_ENV: ""}) is None
    monkeypatch.chdir(tmp_path)
    assert scratch.check_setting({scratch.SCRATCH_ENV: "."}) == tmp_path
    assert scratch.check_setting({scratch.SCRATCH_ENV: str(tmp_path)}) == tmp_path


def test_the_reference_stage_refuses_it_before_writing(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """Before its first step (not at the clip-branch step, minutes later): nothing is
    written, and the command says so in one line with the usage exit code."""
    absent = str(tmp_path / "absent")
    monkeypatch.setenv(scratch.SCRATCH_ENV, absent)
    refs = tmp_path / "refs"
    with pytest.raises(UsageError):
        run_reference_stage(load_contract(default_contract_path()), root=refs, quiet=True)
    assert not refs.exists()
    assert main(["reference", "--out", str(refs), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"qualify: error: {scratch.SCRATCH_ENV}={absent!r}: not an existing, "
                   "writable directory"], err
    assert not refs.exists()
