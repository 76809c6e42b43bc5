"""``qualify gate --baseline``: what changed since the last accepted run of the same contract.

The gate judges the newest run alone. Beside its decision it shows, per contract, how that
run differs from the **last accepted run** (:func:`find_baseline`), with
:func:`qualify.compare.diff.diff_runs`: cells whose gate outcome or comparator verdict
changed, rows whose margin moved by more than :data:`~qualify.compare.diff.DEFAULT_FACTOR`,
new and vanished rows, and bounds that changed with the control that moved them.

The last accepted run (``--baseline auto``, the default):

- with ``--trust-from`` a **git ref**: the newest run of the same contract (``run.json``
  ``contract`` and ``started``, then the run id) present in the ref's tree at the evidence
  directory's path, i.e. what was merged. Its ``run.json`` and ``report.json`` and its
  reference's ``MANIFEST.json`` and ``bounds.json`` are read from git objects into a
  temporary directory (``git ls-tree`` / ``git cat-file``), nothing is checked out;
- otherwise: the newest other sealed run of the same contract under the evidence directory
  that is older than the gated run, whose sealed gate decision (``report.json`` ``gate``)
  is exit 0, and that verifies (:func:`qualify.evidence.verify.verify`, with the trust
  root's keys when ``--trust-from`` names a directory).

``--baseline RUN`` names the run; ``--baseline none`` shows nothing. The diff is
information: it never changes the gate's exit code, and a baseline that cannot be read is
reported as a line, never raised (whatever the error).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Final

from qualify.compare.diff import RunDiff, diff_runs
from qualify.display import markdown_cell, printable_lines
from qualify.errors import QualifyError
from qualify.evidence.discover import EvidenceDir, find_evidence
from qualify.evidence.statement import RUN_KIND
from qualify.jsonio import read_json
from qualify.layout import INCOMPLETE_INFIX, REPORT_JSON, RUN_FILE

if TYPE_CHECKING:
    from qualify.evidence.gate import ContractDecision, GateResult
    from qualify.evidence.trust import TrustRoot

__all__ = ["AUTO", "NONE", "Baseline", "baselines", "find_baseline"]

AUTO: Final = "auto"
NONE: Final = "none"
_MAX_BLOB_BYTES: Final = 256 * 1024 * 1024
"""Largest file read from a git ref (``report.json`` of a large contract is a few MiB)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Baseline:
    """One contract's last accepted run and what changed since.

    Attributes:
        contract: the contract name.
        label: the baseline as a person names it (a path, or ``REF:path``); ``None`` when
            no accepted run was found.
        why: why this run is the baseline, or why none was found.
        outcomes: ``{cell, outcome_a, outcome_b}`` for each cell whose gate outcome (the
            baseline's sealed decision, the gate's decision now) differs.
        diff: the run diff (``None`` without a baseline).
        judged: whether the gate judged the gated run's cells (``False``: it refused the run
            before, e.g. a signature by an untrusted key; ``outcomes`` is then empty, not
            every cell changed to no outcome).
    """

    contract: str
    label: str | None
    why: str
    outcomes: tuple[Mapping[str, Any], ...] = ()
    diff: RunDiff | None = None
    judged: bool = True

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``gate.schema.json`` ``baselines``)."""
        diff = None
        if self.diff is not None:
            diff = self.diff.to_dict()
            diff["run_a"] = self.label
        return {"contract": self.contract, "baseline": self.label, "why": self.why,
                "judged": self.judged, "outcomes": [dict(o) for o in self.outcomes],
                "diff": diff}

    def lines(self) -> list[str]:
        """The section for a person, one finding a line."""
        head = f"changed since the last accepted run [{self.contract}]:"
        if self.diff is None:
            return printable_lines([f"{head} no accepted run found ({self.why})"])
        changed = (str(len(self.outcomes)) if self.judged else
                   "not known (the gate refused the run before judging its cells)")
        out = [head, f"  baseline: {self.label} ({self.why})",
               f"  cells whose gate outcome changed: {changed}"]
        out += [f"    {o['cell']}: {o['outcome_a']} -> {o['outcome_b']}" for o in self.outcomes]
        out += [f"  {line}" for line in self.diff.lines()[1:]]
        return printable_lines(out)

    def markdown(self) -> str:
        """The section as Markdown (appended to ``--summary``)."""
        title = f"### Changed since the last accepted run: {markdown_cell(self.contract)}"
        if self.diff is None:
            return f"{title}\n\nNo accepted run found ({markdown_cell(self.why)}).\n"
        body = "\n".join(f"    {line}" for line in self.lines()[2:])
        return (f"{title}\n\nBaseline: `{markdown_cell(self.label)}` "
                f"({markdown_cell(self.why)}).\n\n{body}\n")


def _key(e: EvidenceDir) -> tuple[str, str]:
    return (e.date or "", e.path.name)


def _sealed_gate(run_dir: Path) -> Mapping[str, Any] | None:
    doc = read_json(run_dir / REPORT_JSON)
    gate = doc.get("gate") if isinstance(doc, Mapping) else None
    return gate if isinstance(gate, Mapping) else None


def _outcome_changes(baseline: Path, decision: ContractDecision) -> tuple[Mapping[str, Any], ...]:
    gate = _sealed_gate(baseline) or {}
    cells = gate.get("cells")
    was = {str(c.get("cell")): c.get("outcome") for c in
           (cells if isinstance(cells, list) else []) if isinstance(c, Mapping)}
    now = {c.cell: c.outcome for c in decision.cells}
    return tuple({"cell": cell, "outcome_a": was.get(cell), "outcome_b": now.get(cell)}
                 for cell in sorted(set(was) | set(now)) if was.get(cell) != now.get(cell))


def _local(decision: ContractDecision, evidence_dir: Path, keys: Path | None,
           reference_dir: str | Path | None) -> tuple[Path | None, str]:
    """The newest older, accepted, verifying run of the contract under ``evidence_dir``."""
    from qualify.evidence.verify import verify

    found = [e for e in find_evidence(evidence_dir)
             if e.kind == RUN_KIND and e.contract == decision.contract
             and e.state == "sealed" and not e.problems and e.superseded_by is None
             and INCOMPLETE_INFIX not in e.path.name]
    gated = next((e for e in found if decision.run_dir is not None
                  and e.path.resolve() == decision.run_dir.resolve()), None)
    if gated is None:
        return None, "the gated run is not among the sealed runs"
    older = sorted((e for e in found if _key(e) < _key(gated)), key=_key, reverse=True)
    refused: list[str] = []
    for e in older:
        try:
            gate = _sealed_gate(e.path)
        except QualifyError as exc:
            refused.append(f"{e.path.name}: {exc}")
            continue
        if gate is None or gate.get("exit_code") != 0:
            refused.append(f"{e.path.name}: sealed decision "
                           f"{'absent' if gate is None else gate.get('result')}")
            continue
        result = verify(e.path, trusted_keys_dir=keys, contract=decision.contract_path,
                        reference_dir=reference_dir)
        if not result.passed:
            refused.append(f"{e.path.name}: does not verify")
            continue
        skipped = f"; newer ones skipped: {'; '.join(refused)}" if refused else ""
        return e.path, (f"the newest older run of {decision.contract} under {evidence_dir} "
                        f"whose sealed gate decision is PASS and that verifies{skipped}")
    what = f"{len(older)} older run{'s' if len(older) != 1 else ''} of {decision.contract} " \
           f"under {evidence_dir}"
    return None, what + (f", none accepted: {'; '.join(refused)}" if refused else "")


def _extract(root: TrustRoot, oid: str, dest: Path) -> None:
    size = root.blob_size(oid)
    if size > _MAX_BLOB_BYTES:
        raise QualifyError(f"{dest.name}: {size} bytes in the ref, over {_MAX_BLOB_BYTES}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(root.read_blob(oid))


def _from_ref(decision: ContractDecision, evidence_dir: Path, root: TrustRoot,
              work: Path) -> tuple[Path | None, str, str | None]:
    """The newest run of the contract in the ref's tree, extracted under ``work``.

    Returns:
        ``(run directory under work, why, REF:path label)``; ``(None, why, None)`` if none.
    """
    assert root.repo is not None
    try:
        rel = PurePosixPath(evidence_dir.resolve().relative_to(root.repo.resolve()).as_posix())
    except ValueError:
        return None, f"{evidence_dir} is not inside the repository {root.repo}", None
    tree = root.tree()
    runs: list[tuple[tuple[str, str], PurePosixPath, Mapping[str, Any]]] = []
    for path, oid in tree.items():
        p = PurePosixPath(path)
        if p.name != RUN_FILE or (rel.parts and p.parts[:len(rel.parts)] != rel.parts) \
                or f"{p.parent}/{REPORT_JSON}" not in tree \
                or INCOMPLETE_INFIX in p.parent.name:
            continue
        _extract(root, oid, work / path)
        doc = read_json(work / path)
        if isinstance(doc, Mapping) and doc.get("contract") == decision.contract:
            runs.append(((str(doc.get("started") or ""), p.parent.name), p.parent, doc))
    if not runs:
        return None, f"no run of {decision.contract} in {root.spec}:{rel}", None
    _, run, doc = max(runs, key=lambda r: r[0])
    _extract(root, tree[f"{run}/{REPORT_JSON}"], work / str(run) / REPORT_JSON)
    ref = doc.get("reference")
    name = PurePosixPath(str(ref.get("path"))).name if isinstance(ref, Mapping) else ""
    for parent in (*run.parents,):
        base = f"{parent}/references/{name}" if str(parent) != "." else f"references/{name}"
        if name and f"{base}/bounds.json" in tree:
            for f in ("MANIFEST.json", "bounds.json"):
                if f"{base}/{f}" in tree:
                    _extract(root, tree[f"{base}/{f}"], work / base / f)
            break
    same = decision.run_dir is not None and run.name == decision.run_dir.name
    why = (f"the newest run of {decision.contract} in {root.spec} (commit "
           f"{str(root.commit)[:12]}): what was merged"
           + ("; it is the gated run: this change brings no new run" if same else ""))
    return work / str(run), why, f"{root.spec}:{run}"


def find_baseline(decision: ContractDecision, spec: str, *, evidence_dir: Path,
                  trust_root: TrustRoot, keys: str | Path | None,
                  reference_dir: str | Path | None, work: Path) -> Baseline:
    """The last accepted run of ``decision``'s contract and the diff to the gated run.

    Args:
        decision: the gate's decision for one contract (its run is run ``b``).
        spec: ``auto``, or a run directory (``none`` is the caller's: no call).
        evidence_dir: the gated evidence directory.
        trust_root: the gate's trust root (a git ref: the baseline is read from it).
        keys: the trusted keys directory of a local baseline's verification (``None``:
            the trust root's, else ``contracts/keys``).
        reference_dir: the runs' reference (``--reference``), if given.
        work: an empty temporary directory (a ref's files are extracted there).

    Returns:
        The :class:`Baseline`; a baseline that cannot be found or read is a
        :class:`Baseline` without a diff whose ``why`` says so.
    """
    judged = bool(decision.cells)  # False: the gate refused the run before its cells
    if decision.run_dir is None:
        return Baseline(contract=decision.contract, label=None, why="the gate chose no run",
                        judged=judged)
    label: str | None
    try:
        if spec != AUTO:
            run: Path | None = Path(spec)
            why, label = "given by --baseline", spec
        elif trust_root.kind == "git-ref":
            run, why, label = _from_ref(decision, evidence_dir, trust_root, work)
        else:
            if keys is None and trust_root.kind == "directory" and trust_root.directory:
                keys = trust_root.directory / "keys"
            run, why = _local(decision, evidence_dir, Path(keys) if keys else None,
                              reference_dir)
            label = str(run) if run is not None else None
        if run is None:
            return Baseline(contract=decision.contract, label=None, why=why, judged=judged)
        diff = diff_runs(run, decision.run_dir)
        return Baseline(contract=decision.contract, label=label, why=why,
                        outcomes=_outcome_changes(run, decision) if judged else (),
                        diff=diff, judged=judged)
    except Exception as exc:  # information only: nothing here may change the gate's exit
        return Baseline(contract=decision.contract, label=None,
                        why=f"the baseline could not be read: {type(exc).__name__}: {exc}",
                        judged=judged)


def baselines(result: GateResult, spec: str, *, keys: str | Path | None,
              reference_dir: str | Path | None) -> list[Baseline]:
    """:func:`find_baseline` for every contract of ``result`` (``[]`` for ``none``)."""
    if spec == NONE:
        return []
    try:
        with tempfile.TemporaryDirectory(prefix="qualify-baseline-") as tmp:
            out: Sequence[Baseline] = [
                find_baseline(d, spec, evidence_dir=result.evidence_dir,
                              trust_root=result.trust_root, keys=keys,
                              reference_dir=reference_dir, work=Path(tmp) / str(i))
                for i, d in enumerate(result.contracts)]
            return list(out)
    except OSError as exc:  # no temporary directory: said, never the gate's exit
        return [Baseline(contract=d.contract, label=None,
                         why=f"the baseline could not be read: {exc}") for d in result.contracts]
