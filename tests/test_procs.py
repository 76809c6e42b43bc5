"""qualify.procs.run with real children: normal and failing exits, a timeout that ends a tree."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from qualify import procs

# The child forks a grandchild that ignores SIGTERM (unless told "term"), records both pids
# and sleeps.
TREE = textwrap.dedent('''
    import os, signal, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    pid = os.fork()
    if pid == 0:
        if sys.argv[2:] != ["term"]:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (out / "grandchild").write_text(str(os.getpid()))
        time.sleep(120)
        os._exit(0)
    (out / "child").write_text(str(os.getpid()))
    print("started", flush=True)
    time.sleep(120)
''')


def _gone(pid: int) -> bool:
    """The process ended (a zombie waiting for init to reap it has ended too)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_for(path: Path, timeout_s: float = 5.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not path.is_file() or not path.read_text():
        assert time.monotonic() < deadline, f"{path.name} never started"
        time.sleep(0.02)
    return int(path.read_text())


@pytest.mark.parametrize("new_session", [True, False])
def test_timeout_ends_the_whole_tree(tmp_path: Path, new_session: bool) -> None:
    t0 = time.monotonic()
    res = procs.run([sys.executable, "-c", TREE, str(tmp_path)], timeout_s=1.0,
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, new_session=new_session,
                    grace_s=0.5)
    assert res.timed_out
    assert res.returncode is None
    assert not res
    assert res.stdout == b"started\n"
    pids = [_wait_for(tmp_path / "child"), _wait_for(tmp_path / "grandchild")]
    deadline = time.monotonic() + 3
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if not _gone(p)] == [], "the tree survived the timeout"
    assert res.pid == pids[0]
    # SIGTERM, 0.5 s grace (the grandchild ignores it), SIGKILL: well under the limits
    assert 1.0 <= res.wall_s < 1.0 + 2 * 0.5 + 2.0
    assert time.monotonic() - t0 < 6


def test_interrupted_wait_ends_the_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt (any exception) in the waiting parent ends the tree, then re-raises."""
    real = subprocess.Popen.communicate

    def interrupted(self: subprocess.Popen[bytes], input: bytes | None = None,
                    timeout: float | None = None) -> tuple[bytes | None, bytes | None]:
        if timeout == 30:
            _wait_for(tmp_path / "grandchild")
            raise KeyboardInterrupt
        return real(self, input, timeout)

    monkeypatch.setattr(subprocess.Popen, "communicate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        procs.run([sys.executable, "-c", TREE, str(tmp_path)], timeout_s=30, grace_s=0.5,
                  stdout=subprocess.DEVNULL)
    pids = [_wait_for(tmp_path / "child"), _wait_for(tmp_path / "grandchild")]
    deadline = time.monotonic() + 3
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if not _gone(p)] == []


def test_normal_exit_captures_output_and_env(tmp_path: Path) -> None:
    code = "import os, sys; print(os.environ['Q'], os.getcwd()); print('err', file=sys.stderr)"
    res = procs.run([sys.executable, "-c", code], timeout_s=30, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, env={"Q": "hello", "PATH": "/usr/bin:/bin"},
                    cwd=tmp_path)
    assert res.returncode == 0
    assert res
    assert not res.timed_out
    assert res.stdout == f"hello {tmp_path.resolve()}\n".encode()
    assert res.stderr == b"err\n"
    assert res.wall_s >= 0


def test_nonzero_exit_to_files(tmp_path: Path) -> None:
    log = tmp_path / "log"
    with log.open("wb") as fh:
        res = procs.run([sys.executable, "-c", "import sys; print('out'); "
                         "print('bad', file=sys.stderr); sys.exit(3)"], timeout_s=30,
                        stdout=fh, stderr=subprocess.STDOUT)
    assert res.returncode == 3
    assert not res.timed_out
    assert not res
    assert res.stdout is None
    assert res.stderr is None
    assert sorted(log.read_text().split()) == ["bad", "out"]


def test_a_reason_names_the_signal_that_killed_the_process() -> None:
    """A real child killed by SIGKILL: its return code reads as the signal, by name."""
    res = procs.run([sys.executable, "-c", "import os, signal; "
                     "os.kill(os.getpid(), signal.SIGKILL)"], timeout_s=30)
    assert res.returncode == -9
    assert procs.exit_text(res.returncode) == "was killed by SIGKILL (signal 9)"
    assert procs.exit_text(3) == "exited with code 3"
    assert procs.exit_text(0) == "exited with code 0"
    assert procs.exit_text(-200) == "was killed by signal 200"


@pytest.mark.parametrize(("kw", "match"), [({"timeout_s": 0}, "timeout_s must be > 0"),
                                           ({"timeout_s": 1, "grace_s": -1}, "grace_s")])
def test_bad_limits(kw: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        procs.run([sys.executable, "-c", "pass"], **kw)  # type: ignore[arg-type]


def test_vllm_capture_timeout_ends_the_engine_tree(tmp_path: Path) -> None:
    """The rollout backend's capture child runs through procs: a hung tree is ended whole.

    A stand-in interpreter runs :data:`TREE` instead of ``harnesses.vllm.capture``: a child
    with an engine worker (which here heeds SIGTERM, so the test does not wait out the
    backend's grace period; ``subprocess.run`` would have left it running).
    """
    from harnesses.vllm.rollout import VllmRolloutBackend
    from qualify.contract import SamplingSpec
    from qualify.errors import HarnessError

    (tmp_path / "tree.py").write_text(TREE)
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "tree.py"}" '
                    f'"{tmp_path}" term\n')
    fake.chmod(0o755)
    spec = SamplingSpec(engine="vllm", temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4,
                        samples_per_prompt=1, seed=0, logprobs_mode="processed")
    backend = VllmRolloutBackend(tmp_path, timeout_s=1.0, python=str(fake))
    with pytest.raises(HarnessError, match=r"timed out after 1.0 s \(process tree ended\)"
                                           r"(.|\n)*started"):
        backend.sample([[1, 2]], spec, pad_token_id=0, eos_token_id=1)
    pids = [_wait_for(tmp_path / "child"), _wait_for(tmp_path / "grandchild")]
    deadline = time.monotonic() + 3
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if not _gone(p)] == [], "the capture tree survived the timeout"
