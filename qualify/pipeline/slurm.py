"""Slurm: render the stage job scripts, submit the two stages, read job states.

The committed scripts ``sbatch/qualify_reference.sbatch`` and
``sbatch/qualify_candidate.sbatch`` are the templates: :func:`render_script` replaces the
values of their ``#SBATCH`` header lines; :func:`submit` submits the reference job and the
candidate job with ``--dependency=afterok:<reference job id>`` (and
``--kill-on-invalid-dep=yes``, so a failed reference job cancels the candidate job instead
of leaving it pending). The candidate stage itself still verifies the sealed reference
(manifest digests, contract digest) before running anything.

``python -m qualify.pipeline.slurm jobinfo|refdir|name`` are the helpers the job scripts call inside
a job: write the job record (commit, Slurm job id, node list, GPU inventory) and refuse a
dirty source tree unless ``QUALIFY_ALLOW_DIRTY=1``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

from qualify.errors import DirtyTreeError, QualifyError, UsageError
from qualify.resources import sbatch_dir

Stage = Literal["reference", "candidate"]

STAGES: Final[tuple[Stage, ...]] = ("reference", "candidate")
SBATCH_DIR: Final = sbatch_dir()
"""The committed job scripts (a source checkout; not shipped in a wheel)."""

_HEADER_RE: Final = re.compile(r"^#SBATCH\s+--(?P<key>[a-z-]+)(?:=(?P<value>\S*))?\s*$")
_TIME_RE: Final = re.compile(r"^(\d+-\d{1,2}(:\d{2}){0,2}|\d+(:\d{2}){0,2})$")
_MEM_RE: Final = re.compile(r"^\d+[KMGT]?$")
_JOBID_RE: Final = re.compile(r"^(\d+)(;\S+)?$")
_CONTRACT_DEFAULT_RE: Final = re.compile(r'^QUALIFY_CONTRACT_DEFAULT=""', re.MULTILINE)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SbatchOptions:
    """Cluster options of one job; ``None`` keeps the committed script's value.

    Attributes:
        job_name: ``--job-name``.
        partition: ``--partition``.
        nodes: ``--nodes`` (>= 1).
        gpus_per_node: ``--gpus-per-node`` (>= 0).
        cpus_per_task: ``--cpus-per-task`` (>= 1).
        mem: ``--mem`` per node, e.g. ``512G`` (digits and an optional K/M/G/T unit).
        time: ``--time`` limit, ``MM``, ``HH:MM:SS`` or ``D-HH[:MM[:SS]]``.
        output: ``--output`` file pattern (``%x`` job name, ``%j`` job id).
        error: ``--error`` file pattern.
    """

    job_name: str | None = None
    partition: str | None = None
    nodes: int | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    time: str | None = None
    output: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        """Check every given value.

        Raises:
            UsageError: a value Slurm would reject, named with the bad value.
        """
        for name, low in (("nodes", 1), ("gpus_per_node", 0), ("cpus_per_task", 1)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < low):
                raise UsageError(f"--{name.replace('_', '-')}: {v!r} is not an integer "
                                 f">= {low}")
        if self.mem is not None and not _MEM_RE.match(self.mem):
            raise UsageError(f"--mem: {self.mem!r} is not a size like 512G")
        if self.time is not None and not _TIME_RE.match(self.time):
            raise UsageError(f"--time: {self.time!r} is not MM, HH:MM:SS or D-HH:MM:SS")
        for name in ("job_name", "partition", "output", "error"):
            v = getattr(self, name)
            if v is not None and (not v or any(c.isspace() for c in v)):
                raise UsageError(f"--{name.replace('_', '-')}: {v!r} is empty or has spaces")

    def to_args(self) -> list[str]:
        """The given options as ``sbatch`` command-line arguments (``--key=value``)."""
        return [f"--{k}={v}" for k, v in self.header_values().items()]

    def header_values(self) -> dict[str, str]:
        """The given options keyed by their ``#SBATCH`` long option name."""
        return {f.name.replace("_", "-"): str(getattr(self, f.name))
                for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


def template_path(stage: Stage) -> Path:
    """The committed job script of ``stage``.

    Raises:
        UsageError: unknown stage, or ``sbatch/`` is missing (not a source checkout).
    """
    if stage not in STAGES:
        raise UsageError(f"--stage: {stage!r} is not one of {', '.join(STAGES)}")
    path = SBATCH_DIR / f"qualify_{stage}.sbatch"
    if not path.is_file():
        raise UsageError(f"{path}: job script not found (sbatch/ ships with a source "
                         "checkout of qualify)")
    return path


def parse_header(text: str) -> dict[str, str]:
    """The ``#SBATCH --key=value`` lines of a job script, in order.

    Args:
        text: the script.

    Returns:
        ``{key: value}`` (value ``""`` for a flag without ``=``).
    """
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _HEADER_RE.match(line)
        if m:
            out[m.group("key")] = m.group("value") or ""
    return out


def render_script(stage: Stage, contract: str | Path | None,
                  options: SbatchOptions, *, template: str | None = None) -> str:
    """A ready job script: the committed one with header values replaced.

    Args:
        stage: ``reference`` or ``candidate``.
        contract: contract path baked in as the default argument (``None`` keeps none).
        options: header values to replace; an option the template lacks is added after
            its last ``#SBATCH`` line.
        template: script text (default: the committed script of ``stage``).

    Returns:
        The script text.

    Raises:
        UsageError: the template has no ``#SBATCH`` header.
    """
    text = template if template is not None else template_path(stage).read_text()
    values = options.header_values()
    lines = text.splitlines(keepends=True)
    last = -1
    for i, line in enumerate(lines):
        m = _HEADER_RE.match(line.rstrip("\n"))
        if not m:
            continue
        last = i
        key = m.group("key")
        if key in values:
            lines[i] = f"#SBATCH --{key}={values.pop(key)}\n"
    if last < 0:
        raise UsageError(f"{stage} job script: no #SBATCH header to render")
    lines[last + 1:last + 1] = [f"#SBATCH --{k}={v}\n" for k, v in values.items()]
    out = "".join(lines)
    if contract is not None:
        word = shell_word(contract)
        out = _CONTRACT_DEFAULT_RE.sub(lambda _m: f"QUALIFY_CONTRACT_DEFAULT={word}", out,
                                       count=1)
    return out


def shell_word(value: str | Path) -> str:
    r"""``value`` as one POSIX shell word that expands to exactly ``value``.

    Every text qualify renders for a shell (a job script's baked-in contract path, a
    command line it suggests) quotes each value through here: :func:`shlex.quote`, which
    single-quotes anything but ``[A-Za-z0-9@%+=:,./-]`` so backticks, ``$``, ``\``,
    quotes, ``;``, ``|``, globs and newlines stay literal.

    Raises:
        UsageError: ``value`` holds a NUL byte (no shell word can carry one).
    """
    text = str(value)
    if "\0" in text:
        raise UsageError(f"{text!r}: a NUL byte cannot be passed to a shell")
    return shlex.quote(text)


def parse_job_id(stdout: str) -> str:
    """The job id from ``sbatch --parsable`` output (``id`` or ``id;cluster``).

    Raises:
        UsageError: the output is not a job id.
    """
    lines = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    m = _JOBID_RE.match(lines[-1]) if lines else None
    if m is None:
        raise UsageError(f"sbatch: unexpected output {stdout.strip()!r} (expected a job id)")
    return m.group(1)


def sbatch_stage(stage: Stage, args: Sequence[str] = (), *,
                 options: SbatchOptions = SbatchOptions(), dependency: str | None = None,
                 sbatch: str = "sbatch", env: Mapping[str, str] | None = None,
                 cwd: Path | None = None) -> str:
    """Submit one stage's committed job script with ``sbatch --parsable``.

    Args:
        stage: ``reference`` or ``candidate``.
        args: the script's arguments (contract, ...).
        options: cluster options, passed as sbatch command-line overrides.
        dependency: an ``afterok`` job id; the job is killed if it can never run.
        sbatch: the ``sbatch`` executable.
        env: environment of ``sbatch`` (jobs inherit it; default: this process's).
        cwd: submission directory, where the job runs (default: this process's).

    Returns:
        The job id.

    Raises:
        UsageError: ``sbatch`` is not on PATH, fails, or prints no job id (one line).
    """
    exe = shutil.which(sbatch)
    if exe is None:
        raise UsageError(f"{sbatch}: not found on PATH (is this a Slurm submit host?)")
    cmd = [exe, "--parsable"]
    if dependency is not None:
        cmd += [f"--dependency=afterok:{dependency}", "--kill-on-invalid-dep=yes"]
    cmd += [*options.to_args(), str(template_path(stage)), *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(env) if env is not None else None, cwd=cwd,
                              timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"{sbatch}: {exc}") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise UsageError(f"sbatch failed: {why}")
    return parse_job_id(done.stdout)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Submission:
    """The two jobs of one ``qualify submit``.

    Attributes:
        reference_job: Slurm job id of the reference stage.
        candidate_job: Slurm job id of the candidate stage (``afterok`` on the first).
        reference_dir: the reference directory the candidate job will verify and use.
    """

    reference_job: str
    candidate_job: str
    reference_dir: Path


def submit(contract: Path, *, options: SbatchOptions = SbatchOptions(),
           candidate_options: SbatchOptions | None = None,
           cells: Sequence[str] | None = None, references: Path = Path("references"),
           evidence: Path = Path("evidence"), sbatch: str = "sbatch",
           env: Mapping[str, str] | None = None, cwd: Path | None = None) -> Submission:
    """Submit the reference job, then the candidate job depending on it (``afterok``).

    Args:
        contract: the contract TOML (loaded here to name the reference directory).
        options: cluster options of both jobs (sbatch command-line overrides).
        candidate_options: cluster options of the candidate job (default: ``options``).
        cells: cell globs for the candidate stage (``None`` = every cell).
        references: parent of reference directories, as the jobs see it.
        evidence: parent of evidence, as the jobs see it.
        sbatch: the ``sbatch`` executable.
        env: environment of ``sbatch`` (jobs inherit it; default: this process's).
        cwd: submission directory, where the jobs run (default: this process's).

    Returns:
        The job ids and the reference directory.

    Raises:
        UsageError: ``sbatch`` missing or failing, or bad options.
        ContractError: the contract does not load.
    """
    from qualify.contract import load_contract
    from qualify.layout import reference_dir_name

    c = load_contract(contract)
    ref_dir = references / reference_dir_name(c)
    base = dict(os.environ if env is None else env)
    base.update({"QUALIFY_REFERENCES": str(references), "QUALIFY_EVIDENCE": str(evidence)})
    ref_id = sbatch_stage("reference", [str(contract)], options=options, sbatch=sbatch,
                          env=base, cwd=cwd)
    cand_args = [str(contract), str(ref_dir)]
    if cells:
        cand_args += ["--", "--cells", *cells]
    cand_id = sbatch_stage("candidate", cand_args,
                           options=candidate_options if candidate_options is not None
                           else options, dependency=ref_id, sbatch=sbatch, env=base, cwd=cwd)
    return Submission(reference_job=ref_id, candidate_job=cand_id, reference_dir=ref_dir)


def job_info(job_id: str, *, scontrol: str = "scontrol") -> dict[str, str]:
    """``scontrol show job -o JOB`` as a dict (JobState, Reason, RunTime, ExitCode...).

    Raises:
        UsageError: ``scontrol`` missing, or the job is unknown to the controller.
    """
    exe = shutil.which(scontrol)
    if exe is None:
        raise UsageError(f"{scontrol}: not found on PATH")
    done = subprocess.run([exe, "show", "job", "-o", str(job_id)], capture_output=True,
                          text=True, timeout=60, check=False)
    if done.returncode != 0 or not done.stdout.strip():
        raise UsageError(f"scontrol show job {job_id}: {done.stderr.strip() or 'no output'}")
    out: dict[str, str] = {}
    for token in done.stdout.strip().splitlines()[0].split():
        key, sep, value = token.partition("=")
        if sep:
            out.setdefault(key, value)
    return out


def gpu_inventory() -> list[str]:
    """``nvidia-smi -L`` lines (one per GPU), or ``[]`` without ``nvidia-smi``."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        done = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [ln.strip() for ln in done.stdout.splitlines() if ln.strip()]


def job_record(*, stage: str, contract: str, repo: Path,
               environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What a stage job records about itself before running.

    Args:
        stage: ``reference`` or ``candidate``.
        contract: the contract path the job was given.
        repo: the qualify source tree (its commit and dirty flag are recorded).
        environ: environment to read ``SLURM_*`` from (default: ``os.environ``).

    Returns:
        JSON-ready dict: stage, contract, host, Slurm job id, node list, node count,
        partition, GPUs (``nvidia-smi -L``), git commit / branch / dirty, allow_dirty.

    Raises:
        DirtyTreeError: tracked files are modified and ``QUALIFY_ALLOW_DIRTY`` is not 1.
    """
    from qualify.evidence.environment import git_state
    from qualify.evidence.store import utc_now

    env = os.environ if environ is None else environ
    git = git_state(repo)
    allow = env.get("QUALIFY_ALLOW_DIRTY") == "1"
    if git.get("dirty") and not allow:
        raise DirtyTreeError(f"{repo}: source tree has modified tracked files (commit "
                             f"{str(git.get('commit'))[:12]}); commit them or set "
                             "QUALIFY_ALLOW_DIRTY=1")
    return {
        "schema_version": 1,
        "stage": stage,
        "contract": contract,
        "recorded": utc_now(),
        "host": socket.gethostname(),
        "slurm": {k: env.get(f"SLURM_{k.upper()}") for k in
                  ("job_id", "job_name", "job_nodelist", "nnodes", "job_partition",
                   "cluster_name", "gpus_on_node", "cpus_per_task", "submit_dir")},
        "gpus": gpu_inventory(),
        "git": git,
        "allow_dirty": allow,
    }


def _main(argv: Sequence[str] | None = None) -> int:
    """In-job helpers: ``jobinfo``, ``refdir``, ``name`` (see the job scripts)."""
    p = argparse.ArgumentParser(prog="python -m qualify.pipeline.slurm")
    sub = p.add_subparsers(dest="cmd", required=True)
    j = sub.add_parser("jobinfo", help="record the job; refuse a dirty source tree")
    j.add_argument("--stage", required=True, choices=STAGES)
    j.add_argument("--contract", required=True)
    j.add_argument("--repo", default=".", help="source tree (default: cwd)")
    j.add_argument("--out", required=True, help="JSON file to write")
    r = sub.add_parser("refdir", help="print the reference directory of a contract")
    r.add_argument("--contract", required=True)
    r.add_argument("--references", default="references")
    r.add_argument("--sealed", action="store_true", help="fail unless it is sealed")
    n = sub.add_parser("name", help="print the contract name")
    n.add_argument("--contract", required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "jobinfo":
            from qualify.evidence.store import atomic_write_json

            rec = job_record(stage=args.stage, contract=args.contract, repo=Path(args.repo))
            atomic_write_json(Path(args.out), rec)
            print(f"job record: {args.out}: commit {rec['git'].get('commit')} dirty "
                  f"{rec['git'].get('dirty')} gpus {len(rec['gpus'])}")
            return 0
        from qualify.contract import load_contract

        c = load_contract(Path(args.contract))
        if args.cmd == "name":
            print(c.name)
            return 0
        from qualify.evidence import store
        from qualify.layout import reference_dir_name

        d = Path(args.references) / reference_dir_name(c)
        if args.sealed and not store.is_sealed(d):
            return 1
        print(d)
        return 0
    except QualifyError as exc:
        print(f"qualify.pipeline.slurm: error: {exc}", file=sys.stderr)
        return int(exc.exit_code)


__all__ = ["STAGES", "DirtyTreeError", "SbatchOptions", "Submission", "gpu_inventory",
           "job_info", "job_record", "parse_header", "parse_job_id", "render_script",
           "sbatch_stage", "shell_word", "submit", "template_path"]

if __name__ == "__main__":
    sys.exit(_main())
