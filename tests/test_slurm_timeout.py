"""A real Slurm job ended by its time limit keeps its partial evidence, never sealed.

The job (``--time=1``, Slurm's least; its stage stops before the rollout) is submitted by
``tests/test_slurm.py`` as that module starts, so its minute or more passes while the suite
runs; this test is handed out last (``tests/conftest.py``) and finds it ended. Run alone, it
submits the job itself and waits for it (60-90 s).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from slurm_cluster import wait_job
from test_slurm import (
    _assert_partial_reference,
    _logs,
    _show,
    needs_slurm,
    submit_timeout_job,
    timeout_record,
)


@needs_slurm
def test_slurm_timeout_keeps_partial_evidence(tmp_path: Path,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    record = timeout_record(tmp_path_factory)
    if record.is_file():
        doc = json.loads(record.read_text())
        job, job_dir, t0 = doc["job"], Path(doc["dir"]), float(doc["t0"])
    else:
        job_dir, t0 = tmp_path, time.monotonic()
        job = submit_timeout_job(job_dir)
    ref = _show(wait_job(job, timeout_s=400, since=t0), "reference, --time=1")
    assert ref.state == "TIMEOUT", _logs(job_dir, job)
    assert "slow-qualify: stopped before rollout" in _logs(job_dir, job)
    _assert_partial_reference(job_dir / "refs", rollout=False)
