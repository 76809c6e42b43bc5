"""test_verify's signed evidence world with fresh ``sources.json`` in every run.

The runs of :func:`test_verify.build_world` predate ``sources.json`` (the gate calls them
STALE: "sources not recorded"). :func:`freshen` records the sources of a frozen snapshot of
the code (``<root>/code/``: ``qualify/`` and ``harnesses/`` ``*.py``, so other work in the
checkout cannot make them stale mid-test), then seals and signs each run again with the
world's trusted key, as the candidate stage + ``qualify compare`` would have. Gate and
staleness tests compare against ``<root>/code`` (``--sources-root``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_verify import World, signed_world

from qualify.contract import load_contract
from qualify.evidence import sign as signing
from qualify.evidence import store
from qualify.evidence.sources import write_sources
from qualify.resources import repo_root

__all__ = ["code_root", "code_snapshot", "fresh", "fresh_world", "freshen", "signed_world"]

_FRESH: dict[str, World] = {}


def code_root(w: World) -> Path:
    """The frozen code snapshot of a world (``<root>/code``)."""
    return w.root / "code"


def code_snapshot(dest: Path) -> Path:
    """Copy every ``qualify/**/*.py``, ``harnesses/**/*.py`` and ``sdk/**/*.py`` of this
    checkout to ``dest``."""
    src = repo_root()
    for top in ("qualify", "harnesses", "sdk"):
        for p in (src / top).rglob("*.py"):
            if "__pycache__" in p.parts:
                continue
            target = dest / p.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, target)
    return dest


def freshen(w: World, runs: list[Path] | None = None) -> World:
    """Record ``sources.json`` (from :func:`code_root`) in ``runs`` (default: every run of
    the world), then re-seal and re-sign each with the world's key."""
    contract = load_contract(w.contract)
    if not code_root(w).is_dir():
        code_snapshot(code_root(w))
    for run in runs if runs is not None else [w.old, w.good, w.failing]:
        store.make_writable(run)
        (run / store.MANIFEST_FILE).unlink()
        (run / signing.ATTESTATION_FILE).unlink()
        write_sources(run, contract=contract, root=code_root(w))
        signing.seal_and_sign(run, kind="candidate-run", key=w.key)
    return w


@pytest.fixture(scope="session")
def fresh_world(signed_world: World, tmp_path_factory: pytest.TempPathFactory) -> World:
    """A read-only fresh copy of the signed world, built once per session."""
    if "fresh" not in _FRESH:
        _FRESH["fresh"] = freshen(signed_world.copy(tmp_path_factory.mktemp("fresh") / "w"))
    return _FRESH["fresh"]


@pytest.fixture
def fresh(fresh_world: World, tmp_path: Path) -> Iterator[World]:
    """A writable copy of the fresh world for one test."""
    w = fresh_world.copy(tmp_path / "world")
    yield w
    store.make_writable(tmp_path)
