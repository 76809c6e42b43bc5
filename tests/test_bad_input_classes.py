"""Bad input by class: every case one line on stderr, a distinct exit code, no traceback.

Where :mod:`tests.test_bad_inputs` holds a corpus of bad *contracts*, this module holds
the classes around them, each as a named corpus run through the real CLI in-process
(:func:`qualify.cli.main.main`):

- ``DEST``: every command that writes, pointed at a file where a directory belongs (or the
  reverse), below a file, or at a directory nobody may write (``/sys``); a run or an
  attempt named as ``--reference``.
- ``ENV``: a bad value of every environment variable qualify reads
  (:data:`qualify.settings.SETTINGS`), for a command that reads it; nothing is written.
- ``USER_FILES``: a contract, gate policy, prompts file or signing key that is a FIFO, a
  link to ``/dev/zero``, a directory or over its size cap.
- ``FULL_DISK``: every light command that writes a file, with the disk full (``fsync``
  raising ``ENOSPC``): exit 2, the destination not created.

Then the classes that are not one-line errors: every printed file name is escaped
(:func:`qualify.display.printable`: a name holding a newline forges no ``[ok]`` line),
every directory walk of ``audit`` / ``verify`` / ``gate`` meets special files (a plain
file, a FIFO, a socket, links) without a traceback or a hang, and every value baked into
a job script stays one literal shell word.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
import pytest
from committed import committed_runs
from hypothesis import given, settings

from qualify.cli.main import main
from qualify.contract import default_contract_path
from qualify.display import printable
from qualify.errors import ExitCode
from qualify.pipeline.slurm import STAGES, SbatchOptions, Stage, render_script
from qualify.resources import repo_root
from qualify.settings import NOT_READ, SETTINGS
from qualify.userfiles import MAX_INPUT_BYTES

ROOT = repo_root()
RUN = committed_runs()[-1]
CELL = "torch_tp-fp32-actor-tp1"
CONTRACT = str(default_contract_path())
UNWRITABLE = Path("/sys")
"""A directory no process may create a file in (sysfs), root included: a read-only
evidence directory that ``chmod`` cannot give a root test user."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad invocation and what its one line must name.

    Attributes:
        id: the case's name.
        argv: the command line; ``T/`` is the case's temporary directory.
        names: substrings of the error line (``T/`` replaced too).
        env: environment variables set for the case.
        code: the exit code.
        untouched: a path (``T/`` replaced) that must not exist afterwards.
    """

    id: str
    argv: tuple[str, ...]
    names: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    code: ExitCode = ExitCode.USAGE_ERROR
    untouched: str | None = None


def _c(id_: str, argv: str, *names: str, env: dict[str, str] | None = None,
       untouched: str | None = None) -> Case:
    return Case(id_, tuple(argv.split()), names, tuple((env or {}).items()),
                untouched=untouched)


ATTEMPT = f"{RUN}/cells/{CELL}/attempt-1"

DEST = [
    _c("candidate-reference-is-a-run", f"candidate --reference {RUN} --out T/ev",
       str(RUN), "not a reference directory", untouched="T/ev"),
    _c("candidate-reference-is-an-attempt", f"candidate --reference {ATTEMPT} --out T/ev",
       "attempt-1", "not a reference directory", untouched="T/ev"),
    _c("candidate-out-is-a-file", f"candidate --reference {RUN} --out T/file",
       "T/file", "--out", "not a directory"),
    _c("candidate-out-below-a-file", f"candidate --reference {RUN} --out T/file/ev",
       "T/file/ev", "--out", "not a directory"),
    _c("candidate-out-unwritable", f"candidate --reference {RUN} --out /sys/ev",
       "/sys/ev", "--out", "cannot write"),
    _c("reference-out-is-a-file", "reference --out T/file", "T/file", "--out"),
    _c("reference-out-unwritable", "reference --out /sys/refs", "/sys/refs", "--out"),
    _c("run-evidence-is-a-file", "run --evidence T/file --references T/refs",
       "T/file", "--evidence", untouched="T/refs"),
    _c("run-references-below-a-file", "run --references T/file/r --evidence T/ev",
       "T/file/r", "--references", untouched="T/ev"),
    _c("diverge-out-is-a-file", f"diverge {RUN} {CELL} --out T/file", "T/file", "--out"),
    _c("keygen-private-key-below-a-file", "keygen --private-key T/file/k.pem --public-dir T",
       "--private-key", "not a directory"),
    _c("keygen-private-key-is-a-dir", "keygen --private-key T/dir --public-dir T",
       "T/dir", "--private-key", "is a directory"),
    _c("keygen-private-key-unwritable", "keygen --private-key /sys/k.pem --public-dir T",
       "/sys", "--private-key", "cannot write"),
    _c("keygen-public-dir-is-a-file", "keygen --private-key T/k.pem --public-dir T/file",
       "T/file", "--public-dir", untouched="T/k.pem"),
    _c("verify-json-below-a-file", "verify T/dir --json T/file/v.json", "--json"),
    _c("verify-json-unwritable", "verify T/dir --json /sys/v.json", "/sys/v.json", "--json"),
    _c("gate-json-unwritable", f"gate T/dir --contract {CONTRACT} --json /sys/g.json",
       "/sys/g.json", "--json"),
    _c("audit-output-unwritable", "audit T/dir --output /sys/a.txt", "/sys/a.txt",
       "--output"),
    _c("report-html-is-a-dir", f"report {RUN} --html T/dir", "T/dir", "--html"),
    _c("report-html-unwritable", f"report {RUN} --html /sys/r.html", "/sys/r.html",
       "--html"),
    _c("sbatch-render-output-is-a-dir", f"sbatch render {CONTRACT} --stage reference "
       "-o T/dir", "T/dir", "--output"),
    _c("sbatch-render-output-unwritable", f"sbatch render {CONTRACT} --stage reference "
       "-o /sys/job.sh", "/sys/job.sh", "--output"),
    _c("sign-unwritable-dir", "sign /sys", "/sys", "cannot write"),
    _c("verify-not-evidence", "verify T/dir", "T/dir", "not a reference or run directory"),
    _c("report-not-a-run", "report T/dir", "T/dir", "not a candidate run"),
    _c("diff-not-a-run", f"diff T/dir {RUN}", "T/dir", "not a candidate run"),
]

_NO_KEY = {"QUALIFY_SIGNING_KEY": "", "QUALIFY_SIGNING_KEY_FILE": ""}
_CANDIDATE = f"candidate --reference {RUN} --out T/ev"
ENV = [
    _c(f"{var}={value or 'EMPTY'}-{argv.split()[0]}", argv, var, env={**extra, var: value},
       untouched="T/ev")
    for var, value, argv, extra in [
        ("QUALIFY_CACHE", "T/file", _CANDIDATE, {}),
        ("QUALIFY_CACHE", "relative/cache", "reference --out T/ev", {}),
        ("QUALIFY_CACHE", "T/file/cache", _CANDIDATE, {}),
        ("XDG_CONFIG_HOME", "T/file", "sign T/dir", _NO_KEY),
        ("XDG_CONFIG_HOME", "T/file/sub", "compare T/dir", _NO_KEY),
        ("XDG_CONFIG_HOME", "relative", "reference --out T/ev", _NO_KEY),
        ("QUALIFY_SCRATCH_DIR", "T/file", "reference --out T/ev", {}),
        ("QUALIFY_SCRATCH_DIR", "T/absent", "reference --out T/ev", {}),
        ("QUALIFY_JOBS", "0", _CANDIDATE, {}),
        ("QUALIFY_JOBS", "two", "run --evidence T/ev", {}),
        ("QUALIFY_AHEAD", "yes", _CANDIDATE, {}),
        ("QUALIFY_AHEAD", "2", "run --evidence T/ev", {}),
        ("QUALIFY_FORKSERVER", "yes", _CANDIDATE, {}),
        ("QUALIFY_FORKSERVER", "2", "run --evidence T/ev", {}),
        ("QUALIFY_LAUNCHER", "fork", _CANDIDATE, {}),
        ("QUALIFY_RDZV_ENDPOINT", "", _CANDIDATE, {"QUALIFY_LAUNCHER": "srun"}),
        ("QUALIFY_RDZV_ENDPOINT", "", "run --evidence T/ev", {"QUALIFY_NNODES": "2"}),
        ("QUALIFY_RDZV_ENDPOINT", "node1", _CANDIDATE, {"QUALIFY_LAUNCHER": "srun"}),
        ("QUALIFY_RDZV_ENDPOINT", "node1:99999", _CANDIDATE, {"QUALIFY_NNODES": "2"}),
        ("QUALIFY_RDZV_ENDPOINT", ":29500", _CANDIDATE, {"QUALIFY_LAUNCHER": "srun"}),
        ("QUALIFY_NNODES", "0", _CANDIDATE, {}),
        ("QUALIFY_NNODES", "two", f"diverge {RUN} {CELL} --out T/ev", {}),
        ("QUALIFY_DEVICE", "gpu", _CANDIDATE, {}),
        ("QUALIFY_LAUNCHER_TORCH_TP", "T/absent/python", _CANDIDATE, {}),
        ("QUALIFY_LAUNCHER_TORCH_TP", "'unbalanced", "run --evidence T/ev", {}),
        ("QUALIFY_SIGNING_KEY", "not a PEM key", "compare T/dir", {}),
        ("QUALIFY_SIGNING_KEY", "-----BEGIN PRIVATE KEY-----\nAAAA\n", "sign T/dir", {}),
        ("QUALIFY_SIGNING_KEY_FILE", "T/absent.pem", "reference --out T/ev", {}),
        ("QUALIFY_SIGNING_KEY_FILE", "T/dir", "compare T/dir", {}),
        ("QUALIFY_SIGNING_KEY_FILE", "T/fifo", "sign T/dir", {}),
        ("QUALIFY_SIGNING_KEY_FILE", "T/big", "run --evidence T/ev", {}),
        ("QUALIFY_CRASH_AT", "explode", "validate", {}),
        ("QUALIFY_CRASH_AT", "write:relative/path", "audit T/dir", {}),
        ("QUALIFY_ALLOW_DIRTY", "yes", f"submit {CONTRACT}", {}),
        ("QUALIFY_ALLOW_DIRTY", "true", f"submit {CONTRACT}", {}),
        ("QUALIFY_DEVICE", "CUDA", "run --evidence T/ev", {}),
        ("QUALIFY_JOBS", "-1", _CANDIDATE, {}),
        ("QUALIFY_NNODES", "1.5", "run --evidence T/ev", {}),
        ("QUALIFY_LAUNCHER", "torchrun ", "run --evidence T/ev", {}),
        ("QUALIFY_LAUNCHER_TORCH_TP", "T/dir", _CANDIDATE, {}),
        ("QUALIFY_SCRATCH_DIR", "relative/scratch", "reference --out T/ev", {}),
        ("QUALIFY_REFERENCE_DEVICES", "gpu", "reference --out T/ev", {}),
        ("QUALIFY_REFERENCE_DEVICES", "cpu,cuda:0", "run --evidence T/ev", {}),
        ("QUALIFY_REFERENCE_DEVICE_MEMORY", "0", "reference --out T/ev", {}),
        ("QUALIFY_REFERENCE_DEVICE_MEMORY", "12GB", "plan", {}),
        ("QUALIFY_VLLM_EXECUTOR", "spawn", "run --evidence T/ev", {}),
    ]
]

USER_FILES = [
    _c("contract-fifo", "validate T/fifo", "T/fifo", "not a regular file"),
    _c("contract-dev-zero", "validate T/zero.toml", "T/zero.toml", "not a regular file"),
    _c("contract-over-cap", "validate T/big", "T/big", str(MAX_INPUT_BYTES)),
    _c("contract-is-a-dir", "validate T/dir", "T/dir", "is a directory"),
    Case("contract-name-with-newline", ("validate", "T/evil\nline.toml"),
         ("T/evil\\nline.toml", "not valid TOML")),
    _c("policy-fifo", f"gate T/dir --contract {CONTRACT} --policy T/fifo", "T/fifo",
       "gate policy"),
    _c("policy-over-cap", f"gate T/dir --contract {CONTRACT} --policy T/big", "T/big",
       str(MAX_INPUT_BYTES)),
    _c("signing-key-fifo", "sign T/dir --key T/fifo", "T/fifo", "signing key"),
    _c("signing-key-over-cap", "sign T/dir --key T/big", "T/big", "signing key"),
    _c("prompts-file-fifo", "validate T/prompts-fifo.toml", "prompts.file", "T/fifo"),
]


def _full_disk_cases() -> list[Case]:
    return [
        _c("full-disk-verify-json", f"verify {RUN} --json T/out.json",
           "No space left on device", untouched="T/out.json"),
        _c("full-disk-gate-json", f"gate T/dir --contract {CONTRACT} --json T/out.json",
           "No space left on device", untouched="T/out.json"),
        _c("full-disk-audit-output", "audit T/dir --output T/out.txt",
           "No space left on device", untouched="T/out.txt"),
        _c("full-disk-keygen", "keygen --private-key T/k.pem --public-dir T/dir",
           "No space left on device", untouched="T/k.pem"),
        _c("full-disk-sbatch-render", f"sbatch render {CONTRACT} --stage reference "
           "-o T/out.sh", "No space left on device", untouched="T/out.sh"),
    ]


FULL_DISK = _full_disk_cases()

VALUES = [
    _c("plan-cores-zero", "plan --cores 0", "--cores 0", "1 or more"),
    _c("plan-cores-negative", "plan --cores -2", "--cores -2", "1 or more"),
    _c("plan-devices-negative", "plan --devices -1", "--devices -1", "0 (host only) or more"),
]
"""Option values out of their range (numbers the parser accepts as numbers)."""
ALL = DEST + ENV + USER_FILES + FULL_DISK + VALUES


def _world(t: Path) -> None:
    """The inputs every case may name under ``T/``."""
    (t / "file").write_text("x")
    (t / "dir").mkdir()
    os.mkfifo(t / "fifo")
    (t / "zero.toml").symlink_to("/dev/zero")
    with (t / "big").open("wb") as f:  # sparse: costs no disk
        f.truncate(MAX_INPUT_BYTES + 1)
    text = Path(CONTRACT).read_text(encoding="utf-8")
    start, end = text.index("[prompts]"), text.index("[sampling]")
    (t / "prompts-fifo.toml").write_text(
        text[:start] + f'[prompts]\nfile = "fifo"\nsha256 = "{"0" * 64}"\n\n' + text[end:],
        encoding="utf-8")


@contextlib.contextmanager
def _deadline(seconds: int) -> Iterator[None]:
    """Fail (not hang) a case whose command blocks, e.g. reading a FIFO."""
    def boom(signum: int, frame: object) -> None:
        raise TimeoutError(f"blocked for {seconds} s")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _run(case: Case, tmp: Path, monkeypatch: pytest.MonkeyPatch,
         capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    def sub(s: str) -> str:
        return s.replace("T/", f"{tmp}/")
    for k, v in case.env:
        monkeypatch.setenv(k, sub(v))
    with _deadline(60):
        rc = main([sub(a) for a in case.argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _one_line(rc: int, out: str, err: str, case: Case, tmp: Path) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err + out, err
    assert rc == case.code, err
    assert len(lines) == 1, err
    assert lines[0].startswith("qualify: error: "), err
    for name in case.names:
        assert name.replace("T/", f"{tmp}/") in lines[0], (name, lines[0])
    assert lines[0].isprintable(), lines[0]
    if case.untouched is not None:
        assert not os.path.lexists(case.untouched.replace("T/", f"{tmp}/")), lines[0]


@pytest.mark.parametrize("case", DEST + ENV + USER_FILES + VALUES, ids=lambda c: c.id)
def test_bad_input_is_one_line_with_its_exit_code(
        case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _world(tmp_path)
    if case.id == "contract-name-with-newline":
        (tmp_path / "evil\nline.toml").write_bytes(b"name = [")
    rc, out, err = _run(case, tmp_path, monkeypatch, capsys)
    _one_line(rc, out, err, case, tmp_path)


@pytest.mark.parametrize("case", FULL_DISK, ids=lambda c: c.id)
def test_a_full_disk_is_one_line_exit_2_and_leaves_no_file(
        case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Every write fsyncs before its rename: a full disk surfaces there, the temporary
    file is removed and the destination never appears."""
    _world(tmp_path)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    rc, out, err = _run(case, tmp_path, monkeypatch, capsys)
    _one_line(rc, out, err, case, tmp_path)


def test_corpus_covers_every_setting_and_is_counted() -> None:
    """Every variable of :data:`qualify.settings.SETTINGS` has a bad value in ``ENV``;
    the corpus has its size (the count is reported, never shrunk)."""
    tested = {k for c in ENV for k, v in c.env if v or k == "QUALIFY_RDZV_ENDPOINT"}
    assert {s.name for s in SETTINGS if "<" not in s.name} <= tested
    assert all(any(t.startswith(s.name.split("<")[0]) for t in tested)  # a family
               for s in SETTINGS if "<" in s.name)
    assert len({c.id for c in ALL}) == len(ALL) >= 70


_READ = re.compile(r"""(?:environ|env|e)\.get\(\s*["']([A-Z][A-Z0-9_]+)["']|"""
                   r"""getenv\(\s*["']([A-Z][A-Z0-9_]+)["']|"""
                   r"""environ\[\s*["']([A-Z][A-Z0-9_]+)["']\]""")
_EXTERNAL = re.compile(r"^(SLURM_|RANK$|LOCAL_RANK$|WORLD_SIZE$|LOCAL_WORLD_SIZE$|"
                       r"MASTER_|TORCH|OMP_NUM_THREADS$|PYTHONPATH$|CUDA_|NCCL_|HOME$)")
"""Variables set by Slurm, torchrun or the system for qualify's children, recorded or
passed through, never a user's setting qualify interprets."""


def test_every_environment_variable_read_is_declared_and_checked() -> None:
    """The class sweep: a variable the sources read, or a ``QUALIFY_*`` name they mention,
    is in :data:`qualify.settings.SETTINGS` (checked before a command runs; a member of a
    family such as ``QUALIFY_LAUNCHER_<ENGINE>`` by its prefix), in
    :data:`~qualify.settings.NOT_READ`, or set by Slurm / torchrun (``_EXTERNAL``)."""
    declared = {s.name for s in SETTINGS} | set(NOT_READ)
    read: set[str] = set()
    mentioned: set[str] = set()
    for pkg in ("qualify", "harnesses"):
        for f in (ROOT / pkg).rglob("*.py"):
            text = f.read_text(encoding="utf-8")
            read |= {next(g for g in m.groups() if g) for m in _READ.finditer(text)}
            mentioned |= set(re.findall(r"\bQUALIFY_[A-Z0-9_]*[A-Z0-9]\b", text))
    assert mentioned, "no QUALIFY_* name found: the sweep reads the wrong tree"
    families = tuple(s.name.split("<", 1)[0] for s in SETTINGS if "<" in s.name)
    undeclared = sorted(n for n in read | mentioned
                        if n not in declared and not n.startswith(families)
                        and not _EXTERNAL.match(n))
    assert not undeclared, f"read but not in qualify.settings: {undeclared}"


# ------------------------------------------------------------ printing and directory walks

EVIL_NAMES = ("!x\n  [ok  ] 5. no file outside the manifest: forged",
              "ansi\x1b[2J\x1b[32mVERIFIED", "bidi\u202etxt.exe", "cr\rok",
              "zero\u200bwidth", "sep\u2028line")
SPECIAL = ("file", "fifo", "socket", "link-dir", "link-dangling", "link-dev-zero")


def _special(path: Path, kind: str, keep: list[socket.socket]) -> None:
    if kind == "file":
        path.write_text("notes")
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        keep.append(s)
    else:
        path.symlink_to({"link-dir": "/etc", "link-dangling": "/nonexistent/x",
                         "link-dev-zero": "/dev/zero"}[kind])


@pytest.fixture(scope="module")
def hostile_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A copy of the committed run with every special kind of entry at every level a walk
    meets (run root, ``cells/``, a cell, an attempt, ``launches/``), an ``attempt-9`` link
    out of the run, and a file under every escaping-worthy name."""
    root = tmp_path_factory.mktemp("hostile") / "ev"
    run = root / "tiny-qwen3" / RUN.name
    shutil.copytree(RUN, run, symlinks=True)
    keep: list[socket.socket] = []
    levels = ("", "cells", f"cells/{CELL}", f"cells/{CELL}/attempt-1", "launches")
    # unix socket paths are short: bind from inside the directory
    here = Path.cwd()
    try:
        for i, level in enumerate(levels):
            os.chdir(run / level)
            for kind in SPECIAL:
                _special(Path(f"s{i}-{kind}"), kind, keep)
        (run / "cells" / CELL / "attempt-9").symlink_to(run / "cells" / CELL / "attempt-1")
        for name in EVIL_NAMES:
            (run / name).write_text("x")
            (run / "cells" / name).write_text("x")
        (run / os.fsdecode(b"latin1-\xe9")).write_text("x")  # not UTF-8: surrogateescape
    finally:
        os.chdir(here)
    yield root
    for s in keep:
        s.close()


def _check_output(out: str, err: str) -> None:
    assert "Traceback" not in err, err
    for line in (out + err).splitlines():
        assert line.isprintable(), repr(line)
    assert not any(re.match(r"\s*\[ok\s*\] 5\. no file outside", ln)
                   for ln in out.splitlines()), out


@pytest.mark.parametrize("command", ["audit", "audit-md", "verify", "gate"])
def test_walks_meet_special_files_and_print_escaped_names(
        command: str, hostile_tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each command walks the hostile run: exit 3 (integrity), no traceback, no hang, every
    output line printable; ``verify`` prints exactly its nine steps, the forged name's
    newline escaped on step 5's line."""
    run = hostile_tree / "tiny-qwen3" / RUN.name
    argv = {"audit": ["audit", str(hostile_tree)],
            "audit-md": ["audit", str(hostile_tree), "--format", "md"],
            "verify": ["verify", str(run)],
            "gate": ["gate", str(hostile_tree), "--contract", CONTRACT]}[command]
    with _deadline(120):
        rc = main(argv)
    cap = capsys.readouterr()
    _check_output(cap.out, cap.err)
    assert rc == ExitCode.INTEGRITY_ERROR, cap.err
    if command == "verify":
        steps = [ln for ln in cap.out.splitlines() if re.match(r"  \[(ok  |FAIL|skip|n/a )\]", ln)]
        assert [int(ln.split("]")[1].split(".")[0]) for ln in steps] == list(range(1, 10))
        step5 = steps[4]
        assert "FAIL" in step5
        assert "!x\\n  [ok  ] 5." in step5
        assert "ansi\\x1b[2J" in step5


@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
@settings(max_examples=200, deadline=None)
def test_printable_is_one_printable_line_and_identity_on_plain_text(text: str) -> None:
    out = printable(text)
    assert out.isprintable()
    assert "\n" not in out
    out.encode("utf-8")
    if text.isprintable():
        assert out == text


_BASH = shutil.which("bash")


def _baked(script: str) -> str:
    """The ``QUALIFY_CONTRACT_DEFAULT=...`` assignment of a rendered script (it may span
    lines: a quoted newline), up to the template's comment."""
    start = script.index("QUALIFY_CONTRACT_DEFAULT=")
    return script[start:script.index("   # `qualify sbatch render`", start)]


def _expand(assignment: str) -> bytes:
    assert _BASH is not None
    done = subprocess.run([_BASH, "-c", assignment + '\nprintf %s "$QUALIFY_CONTRACT_DEFAULT"'],
                          capture_output=True, check=False, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(_BASH is None, reason="no bash")
@given(st.text(alphabet=st.characters(exclude_characters="\x00", codec="utf-8"),
               min_size=1, max_size=30))
@settings(max_examples=40, deadline=None)
def test_a_rendered_contract_path_is_one_literal_shell_word(path: str) -> None:
    """Any path (backticks, ``$(...)``, quotes, newlines, globs) baked into a job script
    expands to itself in bash."""
    assert _expand(_baked(render_script("reference", path, SbatchOptions()))) == \
        path.encode("utf-8")


@pytest.mark.skipif(_BASH is None, reason="no bash")
@pytest.mark.parametrize("stage", STAGES)
def test_a_hostile_contract_path_runs_nothing_in_either_job_script(stage: Stage,
                                                                   tmp_path: Path) -> None:
    """The issue's case: backticks and ``$(...)`` in the path, evaluated by bash the way the
    job script does, create nothing; the whole script still parses."""
    for path in (f"a`touch {tmp_path}/pwned`.toml", f"$(touch {tmp_path}/pwned).toml",
                 "a'b\"c\\d\n$HOME.toml"):
        script = render_script(stage, path, SbatchOptions())
        assert _expand(_baked(script)) == path.encode("utf-8")
        assert _BASH is not None
        done = subprocess.run([_BASH, "-n"], input=script.encode(), capture_output=True,
                              check=False, timeout=30)
        assert done.returncode == 0, done.stderr
    assert not (tmp_path / "pwned").exists()
