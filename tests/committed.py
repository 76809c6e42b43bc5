"""The committed evidence of the repository, as git tracks it.

A clone where README command 1 (``qualify run``) has run holds a second, local run under
``evidence/tiny-qwen3/`` beside the committed one (signed by a local key, not the project
key). Tests about *the committed* evidence therefore select runs by what git tracks, not by
globbing the directory; outside a git checkout (an unpacked sdist) every run directory
counts, as before.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent


def committed_runs(contract: str = "tiny-qwen3") -> list[Path]:
    """The run directories under ``evidence/<contract>/`` whose ``run.json`` git tracks.

    Returns:
        The run directories, sorted by name (run ids are UTC timestamps).
    """
    base = ROOT / "evidence" / contract
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z", "--", f"evidence/{contract}"],
            capture_output=True, check=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return sorted(p.parent for p in base.glob("*/run.json"))
    names = {Path(f).parts[2] for f in out.split("\0")
             if f and len(Path(f).parts) == 4 and Path(f).name == "run.json"}
    return sorted(base / n for n in names)


def committed_evidence_copy(dest: Path, contract: str = "tiny-qwen3") -> Path:
    """Copy the committed runs of ``contract`` (only those) into ``dest/<contract>/``.

    Returns:
        ``dest``, an evidence root a gate or audit can read with no local run in it.
    """
    for run in committed_runs(contract):
        shutil.copytree(run, dest / contract / run.name)
    return dest
