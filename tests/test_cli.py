"""The command-line surface: pinned subcommands and options, and one-line user errors."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from qualify.cli.main import build_parser
from qualify.errors import ExitCode
from qualify.resources import contracts_dir, repo_root

# Changing the CLI is a user-visible change: update this table on purpose.
EXPECTED = {
    "validate": ["contract"],
    "reference": ["contract", "--out", "--new", "--quiet", "--no-plan-check"],
    "candidate": ["contract", "--reference", "--out", "--cells", "--run-id", "--quiet",
                  "--launcher"],
    "compare": ["run_dir", "--reference", "--no-seal"],
    "run": ["contract", "--references", "--evidence", "--cells", "--run-id", "--quiet",
            "--launcher", "--junit-xml", "--summary"],
    "plan": ["contract", "--devices", "--device-memory", "--host-memory", "--cores", "--json"],
    "sweep": ["contract", "--out", "--variants", "--offsets", "--move", "--policy", "--factor",
              "--coverage", "--cells", "--include", "--report-only", "--write-policy",
              "--summary-dir"],
    "report": ["run_dir", "--html", "--contract", "--policy"],
    "diff": ["run_a", "run_b", "--factor", "--min-margin", "--json"],
    "diverge": ["run_dir", "cell", "--round", "--out", "--baseline", "--launcher"],
    "engines": ["--json"],
    "harness": ["harness_command"],
    "keygen": ["--name", "--private-key", "--public-dir"],
    "sign": ["dir", "--key", "--reference", "--keys"],
    "verify": ["path", "--keys", "--contract", "--contracts-dir", "--reference", "--json",
               "--trust-from"],
    "gate": ["evidence_dir", "--contract", "--allow-not-run", "--policy", "--sources-root",
             "--json", "--junit-xml", "--summary", "--reference", "--trust-from", "--baseline",
             "--keys"],
    "audit": ["dirs", "--format", "--output", "--junit-xml", "--contracts-dir",
              "--sources-root", "--keys", "--trust-from"],
    "sbatch": ["sbatch_command"],
    "submit": ["contract", "--partition", "--nodes", "--gpus-per-node", "--cpus-per-task",
               "--mem", "--time", "--job-name", "--cells", "--references", "--evidence",
               "--sbatch"],
}


def test_stage_commands_take_run_s_names_for_their_parents() -> None:
    """``qualify reference --references`` and ``qualify candidate --evidence`` are the same
    option as their ``--out``, so one spelling works for a stage and for ``qualify run``."""
    parser = build_parser()
    for argv in (["reference", "--out", "R"], ["reference", "--references", "R"],
                 ["candidate", "--reference", "X", "--out", "R"],
                 ["candidate", "--reference", "X", "--evidence", "R"]):
        assert parser.parse_args(argv).out == "R", argv
    assert parser.parse_args(["reference"]).out == "references"
    assert parser.parse_args(["candidate", "--reference", "X"]).out == "evidence"


def _surface() -> dict[str, list[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for name, p in sub.choices.items():
        opts = []
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            opts.append(a.option_strings[0] if a.option_strings else a.dest)
        out[name] = opts
    return out


def test_cli_surface_is_pinned() -> None:
    assert _surface() == EXPECTED


def _qualify(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qualify", *args], capture_output=True,
                          text=True, check=False, cwd=cwd)


def _one_line_error(proc: subprocess.CompletedProcess[str], code: ExitCode, text: str) -> None:
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("qualify: error: ")
    assert text in lines[0], lines[0]


def _hf_dir_contract(tmp_path: Path, model: str) -> Path:
    text = (contracts_dir() / "tiny-qwen3.toml").read_text()
    doc = tomllib.loads(text)
    start = text.index("[model]")
    end = text.index("[roles]")
    new_model = f'[model]\nsource = "hf-dir"\npath = "{tmp_path / "hf"}"\n{model}\n'
    out = tmp_path / "c.toml"
    out.write_text(text[:start] + new_model + text[end:])
    assert doc["model"]["source"] == "tiny-qwen3"
    return out


@pytest.mark.parametrize(("case", "model", "text"), [
    ("missing_model_dir", "", "model.path"),
    ("manifest_digest_mismatch", '[model.manifest.files]\n"model.safetensors" = "' + "12" * 32
     + '"\n', 'model.manifest.files["model.safetensors"]'),
])
def test_model_errors_exit_two_with_one_line(case: str, model: str, text: str,
                                             tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """In-process (``main``, as the console script calls it): a child interpreter would
    spend its time importing torch and transformers before the check; the entry point's
    exit status and stderr in a child are test_missing_reference_dir_and_bad_usage's."""
    contract = _hf_dir_contract(tmp_path, model)
    if case == "manifest_digest_mismatch":
        (tmp_path / "hf").mkdir()
        (tmp_path / "hf" / "model.safetensors").write_bytes(b"not the expected weights")
        (tmp_path / "hf" / "config.json").write_text("{}")
    proc = _in_process(capsys, "reference", str(contract), "--out", str(tmp_path / "refs"),
                       "--quiet")
    _one_line_error(proc, ExitCode.USAGE_ERROR, text)


def _in_process(capsys: pytest.CaptureFixture[str], *args: str
                ) -> subprocess.CompletedProcess[str]:
    """``qualify ARGS`` through :func:`qualify.cli.main.main`: its exit code and output."""
    from qualify.cli.main import main

    capsys.readouterr()
    code = main(list(args))
    out = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out.out, out.err)


def test_missing_reference_dir_and_bad_usage(tmp_path: Path) -> None:
    proc = _qualify("candidate", "--reference", str(tmp_path / "nope"), "--out",
                    str(tmp_path / "ev"), "--quiet")
    _one_line_error(proc, ExitCode.USAGE_ERROR, "reference directory not found")
    proc = _qualify("frobnicate")
    assert proc.returncode == ExitCode.USAGE_ERROR
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(("argv", "text"), [
    (["verify", "RUN", "--contract", "T/nope.toml"], "T/nope.toml: contract file not found"),
    (["verify", "RUN", "--contract", "T/bad.toml"], "'name' is a required property"),
    (["verify", "RUN", "--keys", "T/nokeys"],
     "T/nokeys: trusted-keys directory: no such file or directory"),
    (["verify", "RUN", "--reference", "T/noref"], "T/noref: --reference: no such file"),
    (["verify", "RUN", "--contracts-dir", "T/nodir"], "T/nodir: --contracts-dir: no such"),
    (["sign", "T/nope-dir"], "T/nope-dir: evidence directory: no such file or directory"),
    (["sign", "RUN", "--keys", "T/nokeys"], "T/nokeys: trusted-keys directory: no such"),
    (["gate", "RUN", "--contract", "contracts/tiny-qwen3.toml", "--keys", "T/nokeys"],
     "T/nokeys: trusted-keys directory: no such"),
    (["report", "T/nope-dir"], "T/nope-dir: run directory: no such directory")])
def test_bad_options_of_the_evidence_commands_are_usage_errors(argv: list[str], text: str,
                                                               tmp_path: Path) -> None:
    """A missing or malformed file the user named is exit 2 in one line (found by a new
    user: these exited 3, an integrity error, or signed first and complained after)."""
    (tmp_path / "bad.toml").write_text('schema_version = "x"\n')
    run = sorted((repo_root() / "evidence" / "tiny-qwen3").glob("*T*Z"))[-1]
    argv = [str(run) if a == "RUN" else a.replace("T/", f"{tmp_path}/") for a in argv]
    proc = _qualify(*argv, cwd=repo_root())
    _one_line_error(proc, ExitCode.USAGE_ERROR, text.replace("T/", f"{tmp_path}/"))


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    proc = _qualify("--debug", "validate", str(tmp_path / "nope.toml"))
    assert proc.returncode == ExitCode.USAGE_ERROR
    assert "Traceback" in proc.stderr


@pytest.mark.parametrize("argv", [
    ["validate"], ["gate", "evidence", "--contract", "contracts/tiny-qwen3.toml"]])
def test_a_closed_stdout_pipe_is_a_quiet_exit_141_not_a_traceback(argv: list[str]) -> None:
    """``qualify validate | head -0``: the reader is gone before qualify writes a byte.
    ``gate`` prints through rich, whose own handler exits 1 (a failing verdict's code)."""
    with subprocess.Popen([sys.executable, "-m", "qualify", *argv], cwd=repo_root(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        proc.stdout.close()  # no reader: the first write raises EPIPE (BrokenPipeError)
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=120)
    assert code == 141, err
    assert "Traceback" not in err
    assert "BrokenPipeError" not in err


def test_the_console_script_runs_exit_handlers_and_flushes_before_it_exits() -> None:
    """``console`` ends with ``os._exit``: every line is out, and so is what an ``atexit``
    handler printed after it, unterminated, into a block-buffered pipe."""
    code = ("import atexit\n"
            "atexit.register(lambda: print('handler ran', end=''))\n"
            "from qualify.cli.main import console\n"
            "console(['validate', 'contracts/tiny-qwen3.toml'])\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=repo_root(), capture_output=True,
                          text=True, timeout=120, check=False, env=env)
    assert proc.returncode == ExitCode.OK, proc.stderr
    assert proc.stdout.endswith("(sampler: torch_tp-fp32-actor-tp2's round-1 weights)\n"
                                "handler ran")


class _Gone(io.StringIO):
    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def _console_exit(monkeypatch: pytest.MonkeyPatch, *, returns: int, threads: int = 1,
                  stdout: io.StringIO | None = None) -> tuple[int, list[int]]:
    """Run ``console`` on a ``main`` that returns ``returns``: (exit code, os._exit calls)."""
    import atexit
    import threading

    import qualify.cli.main as cli_main

    exits: list[int] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(cli_main, "main", lambda argv=None: returns)
    if stdout is not None:
        monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(threading, "active_count", lambda: threads)
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: None)  # not pytest's own handlers
    monkeypatch.setattr(cli_main.os, "_exit", fake_exit)
    with pytest.raises(SystemExit) as ended:
        cli_main.console([])
    return int(ended.value.code or 0), exits


def test_the_console_script_exits_141_when_its_last_flush_finds_no_reader(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A command that succeeded, its output buffered, then the reader left: exit as a
    writer killed by SIGPIPE; a failing command keeps its own code."""
    assert _console_exit(monkeypatch, returns=0, stdout=_Gone()) == (141, [141])
    assert _console_exit(monkeypatch, returns=1, stdout=_Gone()) == (1, [1])


def test_the_console_script_exits_normally_while_another_thread_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread alive: ``sys.exit`` (which joins it), never ``os._exit``."""
    assert _console_exit(monkeypatch, returns=3, threads=2) == (3, [])
    assert _console_exit(monkeypatch, returns=0, threads=1) == (0, [0])


def test_a_broken_pipe_that_is_not_stdout_is_an_internal_error(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A child's or a socket's EPIPE is a bug to report, not "the reader went away"."""
    import qualify.cli.main as cli_main

    def broken(args: argparse.Namespace) -> ExitCode:
        raise BrokenPipeError(32, "Broken pipe (a child process)")

    monkeypatch.setattr(cli_main, "_cmd_validate", broken)
    assert cli_main.main(["validate"]) == ExitCode.INTERNAL_ERROR
    err = capsys.readouterr().err
    assert "BrokenPipeError (not stdout)" in err
    assert "Traceback" in err


def test_validate_lists_every_cell_the_run_has(capsys: pytest.CaptureFixture[str]) -> None:
    """The trainer matrix and the sampler cells: the 42 cells of the default run (a new
    user counted 40 and looked for the two vLLM cells)."""
    from qualify.cli.main import main

    assert main(["validate"]) == ExitCode.OK
    cells = [ln.split()[1] for ln in capsys.readouterr().out.splitlines()
             if ln.startswith("  cell ")]
    assert len(cells) == 42
    assert cells[-2:] == ["vllm-fp32-sampler-tp1", "vllm-fp32-sampler-tp2"]
