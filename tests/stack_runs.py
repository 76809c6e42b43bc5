"""Test support for the stack adapters (TRL, verl): their end-to-end runs, their masks.

``tests/test_trl.py`` and ``tests/test_verl.py`` each qualify their stack's contracts with
``qualify run CONTRACT --launcher ENGINE=VENV/bin/python``, as the adapter's README writes it,
against a throw-away signing key: :func:`venv_python` finds the venv, :func:`require_venv`
skips (or, under the stack's ``QUALIFY_REQUIRE_<ENGINE>=1``, fails) without it,
:func:`run_contracts` runs them (:func:`runs_fixture`: once per module); :func:`candidate_run`
reruns one contract's cells in-process against the reference made there (planted faults, or
no stack interpreter, which :func:`assert_not_run_naming_the_install_script` checks);
:func:`report` reads a report.
The adapters' fast tests (no stack imported) draw rollout response masks from
:func:`response_masks`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import strategies as st

from qualify.errors import ExitCode
from qualify.resources import contracts_dir, repo_root

__all__ = ["Runs", "assert_not_run_naming_the_install_script", "candidate_run", "report",
           "require_venv", "response_masks", "run_contracts", "runs_fixture", "venv_python"]

ROOT = repo_root()

Runs = dict[str, tuple[Path, Path, float]]
"""Contract name -> (its sealed reference, its run directory, wall seconds of the run)."""


def venv_python(engine: str) -> Path:
    """The stack's venv interpreter: ``$QUALIFY_<ENGINE>_VENV/bin/python``, by default
    ``.venv-<engine>`` of this checkout (what ``scripts/install_<engine>.sh`` builds)."""
    venv = os.environ.get(f"QUALIFY_{engine.upper()}_VENV", str(ROOT / f".venv-{engine}"))
    return Path(venv) / "bin" / "python"


def require_venv(engine: str, python: Path) -> None:
    """Skip the calling module when ``python`` is absent; fail it when CI requires the stack.

    Args:
        engine: the engine name (``trl``, ``verl``): ``QUALIFY_REQUIRE_<ENGINE>`` and
            ``scripts/install_<engine>.sh``.
        python: the venv's interpreter.
    """
    if python.is_file():
        return
    flag, script = f"QUALIFY_REQUIRE_{engine.upper()}", f"scripts/install_{engine}.sh"
    if os.environ.get(flag) == "1":
        pytest.fail(f"{flag}=1 but {python} is absent: run {script}", pytrace=False)
    pytest.skip(f"{python} absent ({script} builds it)", allow_module_level=True)


def _qualify(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qualify", *args], capture_output=True,
                          text=True, check=False, env=env, cwd=ROOT)


def run_contracts(engine: str, python: Path, contracts: Iterable[str], tmp: Path) -> Runs:
    """``qualify run`` each contract with ``--launcher ENGINE=<python, relative>``.

    The environment drops ``QUALIFY_LAUNCHER_<ENGINE>`` and signs with a new key under
    ``tmp``; references go to ``tmp/refs``, runs to ``tmp/ev``.

    Raises:
        AssertionError: the key is not made, or a run exits other than 0 or 1.
    """
    env = {k: v for k, v in os.environ.items() if k != f"QUALIFY_LAUNCHER_{engine.upper()}"}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", XDG_CONFIG_HOME=str(tmp / "config"),
               QUALIFY_SIGNING_KEY="", QUALIFY_SIGNING_KEY_FILE=str(tmp / "k.pem"))
    keygen = _qualify("keygen", "--private-key", str(tmp / "k.pem"), "--public-dir",
                      str(tmp / "keys"), env=env)
    assert keygen.returncode == 0, keygen.stderr
    out: Runs = {}
    for name in contracts:
        t0 = time.perf_counter()
        # the relative interpreter path, as the README writes it (resolved where qualify runs)
        proc = _qualify("run", str(contracts_dir() / f"{name}.toml"), "--launcher",
                        f"{engine}={os.path.relpath(python, ROOT)}", "--references",
                        str(tmp / "refs"), "--evidence", str(tmp / "ev"), "--quiet", env=env)
        wall = time.perf_counter() - t0
        assert proc.returncode in (ExitCode.OK, ExitCode.QUALIFICATION_FAILED), proc.stderr
        (ref,) = (tmp / "refs").glob(f"{name}-[0-9a-f]*")
        (run,) = (tmp / "ev" / name).glob("2*[0-9]Z")
        out[name] = (ref, run, wall)
    return out


def runs_fixture(engine: str, python: Path, contracts: Iterable[str]) -> Any:
    """A module-scoped ``runs`` fixture: :func:`run_contracts` of ``contracts``, once."""

    @pytest.fixture(scope="module")
    def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
        """contract name -> (its sealed reference, its run directory, wall seconds)."""
        return run_contracts(engine, python, contracts, tmp_path_factory.mktemp(engine))

    return runs


def report(run: Path) -> dict[str, Any]:
    """The run's ``report.json``."""
    doc: dict[str, Any] = json.loads((run / "report.json").read_text())
    return doc


def candidate_run(engine: str, python: Path | None, ref: Path, contract: str, tmp: Path,
                  monkeypatch: pytest.MonkeyPatch, *, faults: Sequence[str] = (),
                  cells: Sequence[str] | None = None) -> tuple[Path, dict[str, str]]:
    """Run ``cells`` of ``contract`` in-process against ``ref`` and compare them.

    ``python`` is the engine's interpreter (``None``: ``QUALIFY_LAUNCHER_<ENGINE>`` unset);
    the run goes under ``tmp``, left writable.

    Returns:
        The run directory and cell id -> verdict.
    """
    from qualify.candidate.stage import run_candidate_stage
    from qualify.compare.stage import compare_run
    from qualify.contract import load_contract
    from qualify.evidence import store

    name = f"QUALIFY_LAUNCHER_{engine.upper()}"
    if python is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, str(python))
    run = run_candidate_stage(load_contract(contracts_dir() / f"{contract}.toml"), reference=ref,
                              root=tmp, quiet=True, faults=tuple(faults),
                              cells=list(cells) if cells is not None else None)
    verdicts: dict[str, str] = dict(compare_run(run).verdicts)
    store.make_writable(tmp)
    return run, verdicts


def assert_not_run_naming_the_install_script(engine: str, ref: Path, contract: str,
                                             cells: Iterable[str], tmp: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the stack's interpreter, every one of ``cells`` is ``NOT_RUN`` naming
    ``scripts/install_<engine>.sh``."""
    run, verdicts = candidate_run(engine, None, ref, contract, tmp, monkeypatch)
    reasons = {c["cell"]: c["reason"] for c in report(run)["cells"]}
    for cell in cells:
        assert verdicts[cell] == "NOT_RUN", (cell, verdicts[cell])
        assert f"scripts/install_{engine}.sh" in reasons[cell], reasons[cell]


def _mask(r: int, rows: list[tuple[int, int]]) -> torch.Tensor:
    """``[len(rows), r]`` bool: row ``i`` is True on ``[lo, lo + n)`` (clipped at ``r``)."""
    m = torch.zeros((len(rows), r), dtype=torch.bool)
    for i, (lo, n) in enumerate(rows):
        m[i, lo:lo + n] = True
    return m


def response_masks() -> st.SearchStrategy[torch.Tensor]:
    """Rollout response masks ``[B, R]`` bool, ``B`` 1 to 5, ``R`` 1 to 6: each row one run
    of responses tokens (its start and length drawn, clipped at ``R``)."""
    return st.integers(1, 6).flatmap(lambda r: st.lists(
        st.tuples(st.integers(0, r - 1), st.integers(1, r)), min_size=1, max_size=5).map(
        lambda rows: _mask(r, rows)))
