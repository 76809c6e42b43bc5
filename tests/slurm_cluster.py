"""A one-node Slurm on localhost for the ``slurm`` tests: start, stop, wait for jobs.

``python tests/slurm_cluster.py start|stop`` runs ``.ci/slurm-setup.sh`` (root only); it
writes the daemons' pids to ``$QUALIFY_SLURM_STATE/pids`` and ``stop`` ends them by pid.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from qualify.errors import UsageError
from qualify.pipeline.slurm import job_info

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / ".ci" / "slurm-setup.sh"
JOBS_LOG = Path(os.environ.get("QUALIFY_SLURM_STATE", "/tmp/qualify-slurm")) / "jobs.log"
"""Every job line the tests print is appended here too (pytest-xdist hides prints)."""
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"})


def controller_up() -> bool:
    """True if ``sbatch`` is on PATH and a controller answers ``scontrol ping``."""
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return False
    try:
        done = subprocess.run(["scontrol", "ping"], capture_output=True, text=True,
                              timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "UP" in done.stdout


def start() -> None:
    """Install (if needed) and start the one-node cluster; wait until the node is idle."""
    subprocess.run(["bash", str(SETUP)], check=True)


def stop() -> None:
    """Stop the daemons that :func:`start` started, by pid."""
    subprocess.run(["bash", str(SETUP), "stop"], check=True)


@dataclasses.dataclass(frozen=True, slots=True)
class JobEnd:
    """How a job ended, from ``scontrol show job``.

    Attributes:
        job_id: the Slurm job id.
        state: ``JobState`` (``COMPLETED``, ``FAILED``, ``TIMEOUT``, ``CANCELLED``...).
        reason: ``Reason`` (``DependencyNeverSatisfied``, ``NonZeroExitCode``, ...).
        exit_code: ``ExitCode`` (``status:signal``).
        run_time: ``RunTime`` as Slurm prints it.
        waited_s: seconds this process waited, from submission to the final state.
    """

    job_id: str
    state: str
    reason: str
    exit_code: str
    run_time: str
    waited_s: float

    def line(self, label: str) -> str:
        """One CI log line naming the job, its end state and its durations."""
        return (f"slurm job {self.job_id} ({label}): {self.state} reason={self.reason} "
                f"exit={self.exit_code} run_time={self.run_time} "
                f"waited={self.waited_s:.1f}s")

    def report(self, label: str) -> str:
        """Print :meth:`line` and append it to :data:`JOBS_LOG`; return it."""
        text = self.line(label)
        print(text, flush=True)
        try:
            JOBS_LOG.parent.mkdir(parents=True, exist_ok=True)
            with JOBS_LOG.open("a") as f:
                f.write(text + "\n")
        except OSError:
            pass
        return text


def wait_job(job_id: str, *, timeout_s: float, since: float | None = None,
             poll_s: float = 1.0) -> JobEnd:
    """Poll ``scontrol show job`` until the job is in a final state.

    Args:
        job_id: the job.
        timeout_s: give up after this many seconds.
        since: ``time.monotonic()`` of the submission (default: now).
        poll_s: seconds between polls.

    Returns:
        The job's end.

    Raises:
        TimeoutError: the job is not finished after ``timeout_s`` (its last state named).
    """
    t0 = time.monotonic() if since is None else since
    deadline = time.monotonic() + timeout_s
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        try:
            info = job_info(job_id)
        except UsageError:
            info = {}
        state = info.get("JobState", "")
        if state in FINAL_STATES:
            return JobEnd(job_id, state, info.get("Reason", ""), info.get("ExitCode", ""),
                          info.get("RunTime", ""), time.monotonic() - t0)
        time.sleep(poll_s)
    raise TimeoutError(f"slurm job {job_id}: still {info.get('JobState')} "
                       f"({info.get('Reason')}) after {timeout_s:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("start", "stop"):
        sys.exit("usage: python tests/slurm_cluster.py start|stop")
    start() if sys.argv[1] == "start" else stop()
