"""qualify.privatedirs with real children: the directory is gone however the child ended.

Each child binds a Unix socket in the directory its variable names (what vLLM does with
``VLLM_RPC_BASE_PATH``), then ends: ``os._exit``, killed by a signal, or its tree ended by
:func:`qualify.procs.run` on a timeout. A variable the user set is left alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from qualify import procs
from qualify.privatedirs import host_tag, private_dirs, sweep

VAR = "QUALIFY_TEST_SOCKET_DIR"
PREFIX = "qualify-test-ipc-"

# Binds ``$VAR/<uuid4>`` as vLLM's get_open_zmq_ipc_path does, then ends as argv[1] says.
CHILD = textwrap.dedent(f'''
    import os, signal, socket, sys, time, uuid
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(os.environ[{VAR!r}], str(uuid.uuid4())))
    print(os.environ[{VAR!r}], flush=True)
    how = sys.argv[1]
    if how == "exit":
        os._exit(3)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
''')


def _run(how: str, timeout_s: float = 60.0) -> tuple[procs.ProcResult, Path]:
    with private_dirs({VAR: PREFIX}) as dirs:
        directory = Path(dirs[VAR])
        assert directory.is_dir()
        assert directory.parent == Path(tempfile.gettempdir())
        assert directory.name.startswith(PREFIX)
        assert directory.stat().st_mode & 0o777 == 0o700
        ran = procs.run([sys.executable, "-c", CHILD, how], timeout_s=timeout_s,
                        stdout=subprocess.PIPE, env={**os.environ, **dirs}, grace_s=0.5)
        assert ran.stdout is not None
        assert ran.stdout.decode().strip() == str(directory)
        assert len(list(directory.iterdir())) == 1  # the socket the child left
    return ran, directory


@pytest.mark.parametrize(("how", "returncode"), [("exit", 3), ("kill", -9)])
def test_the_directory_is_removed_after_the_child_ends(how: str, returncode: int) -> None:
    ran, directory = _run(how)
    assert ran.returncode == returncode
    assert not directory.exists()


def test_the_directory_is_removed_after_a_timeout_ends_the_tree() -> None:
    ran, directory = _run("sleep", timeout_s=1.0)
    assert ran.timed_out
    assert not directory.exists()


def _fail_inside(made: list[Path]) -> None:
    with private_dirs({VAR: PREFIX}) as dirs:
        made.append(Path(dirs[VAR]))
        raise RuntimeError("launch failed")


def test_the_directory_is_removed_when_the_block_raises() -> None:
    made: list[Path] = []
    with pytest.raises(RuntimeError, match="launch failed"):
        _fail_inside(made)
    (directory,) = made
    assert not directory.exists()


def test_a_variable_the_user_set_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "keep").write_text("the user's")
    env = {VAR: str(tmp_path), "OTHER": "x"}
    with private_dirs({VAR: PREFIX, "QUALIFY_TEST_OTHER_DIR": PREFIX}, env) as dirs:
        assert list(dirs) == ["QUALIFY_TEST_OTHER_DIR"]
        made = Path(dirs["QUALIFY_TEST_OTHER_DIR"])
        assert made.is_dir()
    assert not made.exists()
    assert (tmp_path / "keep").read_text() == "the user's"
    with private_dirs({VAR: PREFIX}, env) as dirs:
        assert dirs == {}
    assert tmp_path.is_dir()


# A starting process killed inside the block (kill -9 of qualify): its finally never runs.
KILLED_MAKER = textwrap.dedent(f'''
    import os, signal
    from qualify.privatedirs import host_tag, private_dirs, sweep
    with private_dirs({{{VAR!r}: {PREFIX!r}}}, env={{}}) as dirs:
        print(dirs[{VAR!r}], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
''')


def test_what_a_killed_maker_left_is_removed_by_the_next_block() -> None:
    """The maker's pid is in the name: the next :func:`private_dirs` of the prefix removes
    the directory of a maker that is gone, and leaves those of makers still running (this
    process's own, made in an enclosing block)."""
    ran = subprocess.run([sys.executable, "-c", KILLED_MAKER], stdout=subprocess.PIPE,
                         check=False)
    assert ran.returncode == -9
    left = Path(ran.stdout.decode().strip())
    assert left.is_dir()  # what the kill left
    assert left.name.startswith(PREFIX)
    with private_dirs({VAR: PREFIX}, env={}) as outer:
        mine = Path(outer[VAR])
        assert mine.name.startswith(f"{PREFIX}{host_tag()}-{os.getpid()}-")
        assert not left.exists()  # swept on entry
        with private_dirs({VAR: PREFIX}, env={}) as inner:
            assert mine.is_dir()  # a running maker's directory stays
            assert Path(inner[VAR]) != mine
    assert not mine.exists()


def test_the_sweep_takes_only_dead_makers_directories_of_this_host(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only this user's ``<prefix><tag>-<pid>-...`` directories of a dead pid go: not one of
    a live pid, of another host's or container's tag (its pids are not ours to judge), of
    another name, a symbolic link to a directory or a plain file; odd names (a non-ASCII
    digit, a pid no kernel takes) are left without an error."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          stdout=subprocess.PIPE, check=True).stdout.decode().strip()
    tag = host_tag()
    assert len(tag) == 8
    assert int(tag, 16) >= 0
    gone = tmp_path / f"{PREFIX}{tag}-{dead}-dir"
    kept = [tmp_path / f"{PREFIX}{tag}-{os.getpid()}-live",  # this process: running
            tmp_path / f"{PREFIX}00000000-{dead}-other-host" if tag != "00000000"
            else tmp_path / f"{PREFIX}11111111-{dead}-other-host",
            tmp_path / f"{PREFIX}{dead}-old-format",
            tmp_path / f"{PREFIX}{tag}-nopid-{dead}",
            tmp_path / f"{PREFIX}{tag}-\u00b2-x",
            tmp_path / f"{PREFIX}{tag}-99999999999999999999-x"]
    for d in (gone, *kept):
        d.mkdir()
        (d / "socket-like").write_text("x")
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / f"{PREFIX}{tag}-{dead}-link"
    link.symlink_to(target)
    plain = tmp_path / f"{PREFIX}{tag}-{dead}-file"
    plain.write_text("x")
    assert sweep(PREFIX) == [str(gone)]
    assert not gone.exists()
    assert all((d / "socket-like").is_file() for d in kept)
    assert link.is_symlink()
    assert target.is_dir()
    assert plain.is_file()
    # the block sweeps before it makes its own, and names it with the tag and its pid
    gone.mkdir()
    with private_dirs({VAR: PREFIX}, env={}) as dirs:
        assert not gone.exists()
        assert Path(dirs[VAR]).name.startswith(f"{PREFIX}{tag}-{os.getpid()}-")
