"""Test support for the stack adapters (TRL, verl): their end-to-end runs, their masks.

``tests/test_trl.py`` and ``tests/test_verl.py`` each qualify their stack's contracts with
``qualify run CONTRACT --launcher ENGINE=VENV/bin/python``, as the adapter's README writes it,
against a throw-away signing key: :func:`require_venv` skips (or, under the stack's
``QUALIFY_REQUIRE_<ENGINE>=1``, fails) without the venv, :func:`run_contracts` runs them.
The adapters' fast tests (no stack imported) draw rollout response masks from
:func:`response_masks`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from hypothesis import strategies as st

from qualify.errors import ExitCode
from qualify.resources import contracts_dir, repo_root

__all__ = ["Runs", "require_venv", "response_masks", "run_contracts"]

ROOT = repo_root()

Runs = dict[str, tuple[Path, Path, float]]
"""Contract name -> (its sealed reference, its run directory, wall seconds of the run)."""


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
