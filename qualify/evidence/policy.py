"""Gate policies: which cells a contract's gate requires, which known failures it expects.

A policy is committed beside the contracts as ``contracts/gates/<contract-name>.toml``
(schema ``contracts/schema/gate-policy.schema.json``, unknown keys refused)::

    schema_version = 1
    contract = "tiny-qwen3"
    required = ["*"]                      # optional; default: matrix.required_cells, else all

    [[expected_failures]]                 # strict, as pytest's xfail(strict=True)
    cells = "deepspeed-bf16-zero0-*"
    families = ["logprobs", "entropy"]    # the metric families allowed (expected) to FAIL
    rounds = [2]                          # optional: only in these rounds (default: any)
    roles = ["actor"]                     # optional: only of these roles (default: any)
    max_margin = 3.1                      # required, > 1: the largest margin accepted
    reason = "..."
    upstream = "harnesses/deepspeed/README.md#<section heading>"   # or a bug report URL

    [[allowed_not_run]]
    cells = "megatron-*"
    reason = "..."

:func:`evaluate` is a pure function of a verified ``report.json``, the policy and the
stale cells (:func:`qualify.evidence.sources.stale_cells`). Each cell gets one outcome:

- ``PASS``: the report's verdict is ``PASS`` and no expected failure names the cell;
- ``XFAIL``: ``FAIL``, every ``FAIL`` row covered by an entry matching the cell
  (:meth:`ExpectedFailure.miss`: its family, round and role named by the entry, its margin
  at most the entry's ``max_margin``), and any ``NOT_RUN`` row allowed (an ``ERROR`` row is
  never expected);
- ``FAIL``: any other ``FAIL`` or ``ERROR``; a cell with expected failures whose failing row
  no entry covers says "fails outside the expected families: F: <row> ..." when no entry
  names the row's family, else "regressed beyond the expected failure: <row> <why>" (the
  causally first such row: margin X > max_margin Y, or its round or role not expected);
- ``NOT_RUN``: not run (allowed when an ``allowed_not_run`` glob or ``--allow-not-run``
  glob matches);
- ``XPASS``: an expected failure names the cell and it passes, or its expected families
  ran and passed while other rows were NOT_RUN ("expected failure now passes: update the
  policy");
- ``STALE``: a source file the cell executed changed since the run (takes precedence).

The gate passes (exit 0) when every required cell is ``PASS``, ``XFAIL`` or an allowed
``NOT_RUN``; otherwise exit 1 with the offending cells named.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from qualify.compare.rootcause import causal_order
from qualify.compare.sampler import PROBES
from qualify.contract import Contract, canonical_json, sha256_hex
from qualify.distmetrics import FAMILIES
from qualify.errors import ContractError, ExitCode
from qualify.layout import GATES_DIR
from qualify.resources import contracts_dir
from qualify.schema import first_error
from qualify.statistics import FAMILY_STATISTIC
from qualify.userfiles import read_input_bytes

__all__ = [
    "KNOWN_FAMILIES",
    "OUTCOMES",
    "POLICY_SCHEMA",
    "AllowedNotRun",
    "CellOutcome",
    "ExpectedFailure",
    "Policy",
    "PolicyEvaluation",
    "all_cells",
    "default_policy",
    "evaluate",
    "find_policy",
    "load_policy",
    "parse_policy",
    "policy_digest",
    "policy_document",
    "policy_for",
    "policy_from_document",
    "row_label",
    "row_margin",
    "uncovered",
]

POLICY_SCHEMA: Final = "gate-policy"
OUTCOMES: Final = ("PASS", "XFAIL", "FAIL", "NOT_RUN", "STALE", "XPASS")
"""Cell outcomes of the gate, in the summary table's column order."""
SAMPLER_FAMILIES: Final = ("install", "kernels", "prefix_cache", *PROBES)
"""Row families of a sampler cell (:mod:`qualify.compare.sampler`: install, kernel and cache
checks, then its rejection probes)."""
KNOWN_FAMILIES: Final = (*FAMILY_STATISTIC, "dtypes", "replica", *SAMPLER_FAMILIES,
                         *FAMILIES)
"""Every row family a report holds: the metric families of
:data:`qualify.statistics.FAMILY_STATISTIC`, the ``dtypes`` and ``replica`` checks, the
sampler probes and the distribution families."""


def row_margin(row: Mapping[str, Any]) -> float | None:
    """A report row's ``margin`` as a float (``"inf"`` / ``"nan"`` strings parsed), or ``None``.

    ``None`` for a check without a margin (``dtypes``, ``replica``, the sampler's install
    checks and probes: pass or fail, no error / bound); anything unparsable is ``nan``.
    """
    m = row.get("margin")
    if m is None:
        return None
    if isinstance(m, bool):
        return math.nan
    if isinstance(m, int | float):
        return float(m)
    try:
        return float(str(m))
    except ValueError:
        return math.nan


def row_label(row: Mapping[str, Any]) -> str:
    """``round2/actor/grads (candidate_vs_hf)``: a row's metric and comparison class."""
    metric = row.get("metric") or f"{row.get('role')}/{row.get('family')}"
    klass = row.get("class")
    return f"{metric} ({klass})" if klass else str(metric)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExpectedFailure:
    """A known failure: matching cells may FAIL in the quantities it names, up to a ceiling.

    Attributes:
        cells: cell-id glob (``fnmatch``).
        families: row families expected to fail.
        max_margin: the largest margin (error / sealed bound, dimensionless) a failing row
            it covers may have; ``> 1``. A row without a margin (a ``dtypes`` / ``replica``
            check, a sampler probe) is covered by family, round and role alone.
        rounds: the rounds whose rows it covers (``None``: any); a row of no round (a
            whole-run check such as ``dtypes``) is covered whatever the rounds.
        roles: the roles (``actor``, ``critic``, ``sampler``) whose rows it covers
            (``None``: any).
        reason: why (for a person).
        upstream: a bug report URL or ``<file>.md#<section heading>``.
        index: its position in the policy's ``expected_failures`` (messages).
    """

    cells: str
    families: tuple[str, ...]
    max_margin: float
    reason: str
    upstream: str
    rounds: tuple[int, ...] | None = None
    roles: tuple[str, ...] | None = None
    index: int = 0

    @property
    def name(self) -> str:
        """``expected_failures.<index>`` (the policy field)."""
        return f"expected_failures.{self.index}"

    def miss(self, row: Mapping[str, Any]) -> str | None:
        """Why this entry does not cover the failing ``row`` (``None``: it covers it).

        Checked in order: family, round, role, margin. A margin that is not a finite number
        (an infinite or NaN error) is beyond every ceiling.
        """
        fam, rnd, role = row.get("family"), row.get("round"), row.get("role")
        if fam not in self.families:
            return f"family {fam} not expected"
        if self.rounds is not None and isinstance(rnd, int) and rnd not in self.rounds:
            return f"round {rnd} not expected (rounds {list(self.rounds)})"
        if self.roles is not None and role not in self.roles:
            return f"role {role} not expected (roles {list(self.roles)})"
        m = row_margin(row)
        if m is not None and not (math.isfinite(m) and m <= self.max_margin):
            return f"margin {m:.4g} > max_margin {self.max_margin:g}"
        return None

    def to_dict(self) -> dict[str, Any]:
        """JSON form (the policy file's keys; ``rounds`` / ``roles`` only when set)."""
        out: dict[str, Any] = {"cells": self.cells, "families": list(self.families)}
        if self.rounds is not None:
            out["rounds"] = list(self.rounds)
        if self.roles is not None:
            out["roles"] = list(self.roles)
        return {**out, "max_margin": self.max_margin, "reason": self.reason,
                "upstream": self.upstream}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AllowedNotRun:
    """Cells matching ``cells`` may be ``NOT_RUN`` (wholly or in some rows).

    Attributes:
        cells: cell-id glob.
        reason: why.
        upstream: optional pointer (URL or README section).
    """

    cells: str
    reason: str
    upstream: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"cells": self.cells, "reason": self.reason, "upstream": self.upstream}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Policy:
    """A contract's gate policy (validated against the contract's cells).

    Attributes:
        contract: contract name.
        path: the policy file (``None``: the default policy, no file).
        digest: hex sha256 of the canonical JSON of the parsed document (``None``: default);
            comments and layout of the TOML do not change it.
        required: required cell ids, in matrix order.
        expected_failures: the known failures.
        allowed_not_run: the NOT_RUN allowances.
        document: the parsed document the policy was read from (``None``: default), which
            a report embeds with the decision it sealed (:mod:`qualify.evidence.decision`).
    """

    contract: str
    path: Path | None
    digest: str | None
    required: tuple[str, ...]
    expected_failures: tuple[ExpectedFailure, ...] = ()
    allowed_not_run: tuple[AllowedNotRun, ...] = ()
    document: Mapping[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form (for the gate decision)."""
        return {"path": str(self.path) if self.path else None, "digest": self.digest,
                "required": list(self.required),
                "expected_failures": [e.to_dict() for e in self.expected_failures],
                "allowed_not_run": [a.to_dict() for a in self.allowed_not_run]}


def all_cells(contract: Contract) -> list[str]:
    """Every cell id of the contract: the matrix's cells, then the sampler's."""
    ids = [c.cell_id for c in contract.matrix.cells()]
    if contract.sampler is not None:
        ids += contract.sampler.cell_ids()
    return ids


def _default_required(contract: Contract) -> tuple[str, ...]:
    if contract.matrix.required_cells is not None:
        return tuple(contract.matrix.required_cells)
    return tuple(all_cells(contract))


def default_policy(contract: Contract) -> Policy:
    """The policy of a contract without a policy file: required cells, nothing expected."""
    return Policy(contract=contract.name, path=None, digest=None,
                  required=_default_required(contract))


def find_policy(contract: Contract) -> Path | None:
    """The gate policy file of a contract: ``<its directory>/gates/<name>.toml``.

    ``contracts/gates/`` for a contract loaded from text (the embedded default). Only
    beside the contract file: a contract elsewhere that reuses a committed contract's name
    (a test's or a user's variant, with its own matrix) is not gated by that policy.

    Returns:
        The policy file, or ``None`` when there is none.
    """
    d = contract.path.parent if contract.path is not None else contracts_dir()
    p = d / GATES_DIR / f"{contract.name}.toml"
    return p if p.is_file() else None


def _matches(glob: str, ids: Sequence[str]) -> list[str]:
    return [c for c in ids if fnmatch.fnmatchcase(c, glob)]


def load_policy(path: str | Path, contract: Contract) -> Policy:
    """Read, validate and resolve a policy file against ``contract``.

    Args:
        path: the policy TOML.
        contract: the contract it gates.

    Returns:
        The :class:`Policy`.

    Raises:
        ContractError: (exit 2) one line naming the file and field: unreadable or
            malformed TOML, a schema violation (unknown key, wrong type), another contract's
            name, a glob matching no cell of the contract, an unknown family, a glob listed
            twice, or a glob both in ``required`` and ``allowed_not_run``.
    """
    p = Path(path)
    try:
        text = read_input_bytes(p, what="gate policy", error=ContractError).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ContractError(f"{p}: cannot read the gate policy: {exc}") from None
    return parse_policy(text, contract, path=p)


def policy_document(text: str, *, path: Path | str) -> dict[str, Any]:
    """The parsed TOML of a policy (not yet validated), for :attr:`Policy.digest`.

    Raises:
        ContractError: not valid TOML (one line naming ``path``).
    """
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ContractError(f"{path}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ContractError(f"{path}: invalid TOML: nested too deeply for the parser") from None


def policy_digest(doc: Mapping[str, Any]) -> str:
    """:attr:`Policy.digest` of a parsed policy document (comments and layout ignored)."""
    return sha256_hex(canonical_json(doc))


def parse_policy(text: str, contract: Contract, *, path: Path) -> Policy:
    """Validate and resolve a policy's TOML text against ``contract`` (:func:`load_policy`).

    Args:
        text: the policy TOML.
        contract: the contract it gates.
        path: where the text came from (messages and :attr:`Policy.path`; a file, or a git
            ``REF:path`` label).

    Raises:
        ContractError: as :func:`load_policy`.
    """
    return policy_from_document(policy_document(text, path=path), contract, path=path)


def _overlap(a: Sequence[Any] | None, b: Sequence[Any] | None) -> bool:
    return a is None or b is None or bool(set(a) & set(b))


def policy_from_document(doc: Any, contract: Contract, *, path: Path | str) -> Policy:
    """Validate and resolve a parsed policy document against ``contract``.

    The document as :func:`policy_document` parses it, or as a report embeds it
    (``report.json`` ``gate.policy.document``).

    Raises:
        ContractError: as :func:`load_policy`; an expected failure without ``max_margin``
            (a policy written before ceilings) is refused with the one line that says what
            to add.
    """
    p = Path(path)
    for i, e in enumerate(doc.get("expected_failures", []) if isinstance(doc, Mapping) else []):
        if isinstance(e, Mapping) and "max_margin" not in e:
            raise ContractError(
                f"{p}: expected_failures.{i}.max_margin: missing: an expected failure "
                "names the largest margin it accepts (a number > 1: the measured margin "
                "times a stated factor, contracts/gates/README.md)")
    problem = first_error(doc, POLICY_SCHEMA)
    if problem is not None:
        raise ContractError(f"{p}: {problem} (schema {POLICY_SCHEMA}.schema.json)")
    if doc["contract"] != contract.name:
        raise ContractError(f"{p}: contract: {doc['contract']!r} is not the gated contract "
                            f"{contract.name!r}")
    ids = all_cells(contract)

    def cells_of(glob: str, field: str) -> list[str]:
        hit = _matches(glob, ids)
        if not hit:
            raise ContractError(f"{p}: {field}: {glob!r} matches no cell of contract "
                                f"{contract.name} ({len(ids)} cells, e.g. {ids[0]})")
        return hit

    if "required" in doc:
        req: set[str] = set()
        for i, g in enumerate(doc["required"]):
            req.update(cells_of(g, f"required.{i}"))
        required = tuple(c for c in ids if c in req)
    else:
        required = _default_required(contract)
    xfails: list[ExpectedFailure] = []
    for i, e in enumerate(doc.get("expected_failures", [])):
        field = f"expected_failures.{i}"
        cells_of(e["cells"], f"{field}.cells")
        for j, fam in enumerate(e["families"]):
            if fam not in KNOWN_FAMILIES:
                raise ContractError(f"{p}: {field}.families.{j}: unknown family {fam!r} "
                                    f"(known: {', '.join(KNOWN_FAMILIES)})")
        rounds = tuple(e["rounds"]) if "rounds" in e else None
        if rounds is not None and max(rounds) > contract.algorithm.rounds:
            raise ContractError(f"{p}: {field}.rounds: round {max(rounds)} beyond the "
                                f"contract's {contract.algorithm.rounds} rounds")
        x = ExpectedFailure(cells=e["cells"], families=tuple(e["families"]),
                            max_margin=float(e["max_margin"]), rounds=rounds,
                            roles=tuple(e["roles"]) if "roles" in e else None,
                            reason=e["reason"], upstream=e["upstream"], index=i)
        twin = next((o for o in xfails if o.cells == x.cells and _overlap(o.families, x.families)
                     and _overlap(o.rounds, x.rounds) and _overlap(o.roles, x.roles)), None)
        if twin is not None:
            raise ContractError(f"{p}: {field}.cells: {x.cells!r} is listed twice in "
                                f"expected_failures with overlapping families, rounds and "
                                f"roles ({twin.name}); merge the entries or split the "
                                "quantities")
        xfails.append(x)
    allowed: list[AllowedNotRun] = []
    seen: set[str] = set()
    for i, a in enumerate(doc.get("allowed_not_run", [])):
        field = f"allowed_not_run.{i}"
        cells_of(a["cells"], f"{field}.cells")
        if a["cells"] in seen:
            raise ContractError(f"{p}: {field}.cells: {a['cells']!r} is listed twice in "
                                "allowed_not_run")
        if a["cells"] in doc.get("required", []):
            raise ContractError(f"{p}: {field}.cells: {a['cells']!r} is also listed in "
                                "required: a cell cannot be both required to run and allowed "
                                "not to run by the same entry; keep one")
        seen.add(a["cells"])
        allowed.append(AllowedNotRun(cells=a["cells"], reason=a["reason"],
                                     upstream=a.get("upstream")))
    return Policy(contract=contract.name, path=p, digest=policy_digest(doc),
                  required=required, expected_failures=tuple(xfails),
                  allowed_not_run=tuple(allowed), document=doc)


def policy_for(contract: Contract, path: str | Path | None = None) -> Policy:
    """The policy of ``contract``: ``path`` if given, else :func:`find_policy`, else default.

    Raises:
        ContractError: the policy file is invalid (see :func:`load_policy`).
    """
    found = Path(path) if path is not None else find_policy(contract)
    return default_policy(contract) if found is None else load_policy(found, contract)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CellOutcome:
    """One cell as the policy sees it.

    Attributes:
        cell: cell id.
        engine: its engine (``""`` when the report does not say).
        required: whether the policy requires it.
        verdict: the verified report's verdict (``NOT_RUN`` when absent).
        outcome: one of :data:`OUTCOMES`.
        ok: this outcome lets the gate pass (``PASS``, ``XFAIL``, allowed ``NOT_RUN``).
        reason: for a person: the report's reason, the expectation's, or the problem.
        allowed_not_run: the glob allowing NOT_RUN rows or the cell (``None``: none).
        expected: the matching expected failures.
        first: the causally first failing row of the outcome (``family``, ``round``,
            ``statistic``, ``metric``, ``margin``; :mod:`qualify.compare.rootcause` order),
            ``None`` if none.
        stale_files: the changed source files (STALE only).
        expected_not_run: ``"<metric>: <reason> (expected by the contract: <why>)"`` of each
            ``NOT_RUN`` row the contract expects (``matrix.expected_not_run``); such rows
            need no allowance.
    """

    cell: str
    engine: str
    required: bool
    verdict: str
    outcome: str
    ok: bool
    reason: str | None
    allowed_not_run: str | None = None
    expected: tuple[ExpectedFailure, ...] = ()
    first: Mapping[str, Any] | None = None
    stale_files: tuple[str, ...] = ()
    expected_not_run: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``gate.schema.json`` ``$defs.cell``; ``expected_not_run`` when any)."""
        return {"cell": self.cell, "engine": self.engine, "required": self.required,
                "verdict": self.verdict, "outcome": self.outcome, "ok": self.ok,
                "reason": self.reason, "allowed_not_run": self.allowed_not_run,
                "expected": [e.to_dict() for e in self.expected],
                "first": dict(self.first) if self.first is not None else None,
                "stale_files": list(self.stale_files),
                **({"expected_not_run": list(self.expected_not_run)}
                   if self.expected_not_run else {})}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PolicyEvaluation:
    """Every cell's outcome and the gate's code for one contract.

    Attributes:
        cells: outcomes of every cell of the contract (and of the report), matrix order.
    """

    cells: tuple[CellOutcome, ...]

    @property
    def offending(self) -> tuple[CellOutcome, ...]:
        """Required cells whose outcome fails the gate."""
        return tuple(c for c in self.cells if c.required and not c.ok)

    @property
    def exit_code(self) -> ExitCode:
        """``OK`` when no required cell offends, else ``QUALIFICATION_FAILED``."""
        return ExitCode.QUALIFICATION_FAILED if self.offending else ExitCode.OK

    def counts(self, *, required_only: bool = True) -> dict[str, int]:
        """Cells per outcome (:data:`OUTCOMES` order)."""
        out = dict.fromkeys(OUTCOMES, 0)
        for c in self.cells:
            if c.required or not required_only:
                out[c.outcome] += 1
        return out


def _first(rows: Sequence[Mapping[str, Any]], families: set[str] | None = None,
           verdicts: tuple[str, ...] = ("FAIL", "ERROR")) -> dict[str, Any] | None:
    """The causally first row of ``verdicts`` (and of ``families`` when given).

    The order of :func:`qualify.compare.rootcause.causal_order`, so the summary's "first
    failing" is the quantity the root-cause line names, not the first row in file order.
    """
    for r in causal_order(rows):
        if r.get("verdict") in verdicts and (families is None or r.get("family") in families):
            return {k: r.get(k) for k in ("family", "round", "statistic", "metric", "margin",
                                          "verdict")}
    return None


def uncovered(rows: Sequence[Mapping[str, Any]], xf: Sequence[ExpectedFailure],
              ) -> list[tuple[Mapping[str, Any], str]]:
    """The ``FAIL`` rows no entry of ``xf`` covers, causally ordered, each with why.

    The why is the first matching entry's :meth:`ExpectedFailure.miss` (an entry naming the
    row's family first, so "margin X > max_margin Y" is preferred over "family F not
    expected" when some entry expects the family).
    """
    out: list[tuple[Mapping[str, Any], str]] = []
    for r in causal_order(rows):
        if r.get("verdict") != "FAIL":
            continue
        misses = [e.miss(r) for e in xf]
        if any(m is None for m in misses):
            continue
        named = [m for e, m in zip(xf, misses, strict=True) if r.get("family") in e.families]
        out.append((r, str((named or misses or ["no expected failure"])[0])))
    return out


def _judge(*, verdict: str, reason: str | None, rows: Sequence[Mapping[str, Any]],
           xf: Sequence[ExpectedFailure], nr: str | None, policy: Policy,
           ) -> tuple[str, bool, str | None, dict[str, Any] | None]:
    """``(outcome, ok, reason, first failing row)`` of a fresh (not stale) cell."""
    families = {f for e in xf for f in e.families}
    failing = {str(r.get("family")) for r in rows if r.get("verdict") == "FAIL"}
    beyond = uncovered(rows, xf) if xf else []
    rows_not_run = any(r.get("verdict") == "NOT_RUN" and not r.get("expected_not_run")
                       for r in rows)  # a row the contract expects not run needs no allowance
    out: tuple[str, bool, str | None, dict[str, Any] | None]
    if verdict == "ERROR" or any(r.get("verdict") == "ERROR" for r in rows):
        out = ("FAIL", False, reason, _first(rows, verdicts=("ERROR",)))
    elif verdict == "FAIL" and not xf:
        out = ("FAIL", False, reason, _first(rows))
    elif verdict == "FAIL" and beyond:
        outside = [(r, w) for r, w in beyond if r.get("family") not in families]
        row, why = (outside or beyond)[0]
        more = f" (and {len(beyond) - 1} more rows)" if len(beyond) > 1 else ""
        head = ("fails outside the expected families: "
                f"{', '.join(sorted({str(r.get('family')) for r, _ in outside}))}: "
                if outside else "regressed beyond the expected failure: ")
        out = ("FAIL", False, f"{head}{row_label(row)} {why}{more}", _first([row]))
    elif verdict == "FAIL" and rows_not_run and nr is None:
        out = ("NOT_RUN", False, "fails as expected, but some rows are NOT_RUN without an "
               "allowance", _first(rows, failing))
    elif verdict == "FAIL":
        out = ("XFAIL", True, "; ".join(f"{e.reason} ({e.upstream})" for e in _distinct(xf)),
               _first(rows, failing))
    elif verdict == "NOT_RUN" and xf and any(
            r.get("verdict") == "PASS" and r.get("family") in families for r in rows):
        out = ("XPASS", False, "expected failure now passes: update the policy "
               f"({policy.path}: {', '.join(_globs(xf))}; its families ran and "
               "passed, the other rows NOT_RUN)", None)
    elif verdict == "NOT_RUN":
        out = ("NOT_RUN", nr is not None, reason, None)
    elif xf:
        out = ("XPASS", False, "expected failure now passes: update the policy "
               f"({policy.path}: {', '.join(_globs(xf))})", None)
    elif rows_not_run and nr is None:
        out = ("NOT_RUN", False, "some rows are NOT_RUN without an allowance", None)
    else:
        out = ("PASS", True, None, None)
    return out


def _distinct(xf: Sequence[ExpectedFailure]) -> list[ExpectedFailure]:
    """``xf`` with one entry per ``(reason, upstream)`` (entries split by quantity)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for e in xf:
        if (e.reason, e.upstream) not in seen:
            seen.add((e.reason, e.upstream))
            out.append(e)
    return out


def _globs(xf: Sequence[ExpectedFailure]) -> list[str]:
    return list(dict.fromkeys(e.cells for e in xf))


def _outcome(cid: str, entry: Mapping[str, Any] | None, rows: Sequence[Mapping[str, Any]], *,
             policy: Policy, allow: Sequence[str],
             stale: Mapping[str, Sequence[str]]) -> CellOutcome:
    verdict = str(entry.get("verdict")) if entry else "NOT_RUN"
    reason = (entry.get("reason") if entry else "absent from the report") or None
    engine = (str(entry.get("engine") or "") if entry else "") or cid.split("-", 1)[0]
    xf = tuple(e for e in policy.expected_failures if fnmatch.fnmatchcase(cid, e.cells))
    nr = next((a.cells for a in policy.allowed_not_run if fnmatch.fnmatchcase(cid, a.cells)),
              None) or next((g for g in allow if fnmatch.fnmatchcase(cid, g)), None)
    kw: dict[str, Any] = {"cell": cid, "engine": engine, "required": cid in policy.required,
                          "verdict": verdict, "allowed_not_run": nr, "expected": xf,
                          "expected_not_run": tuple(
                              f"{r.get('metric')}: {r.get('reason')} (expected by the contract: "
                              f"{r.get('expected_not_run')})" for r in rows
                              if r.get("verdict") == "NOT_RUN" and r.get("expected_not_run"))}
    if cid in stale:
        files = tuple(stale[cid])
        more = f" (and {len(files) - 5} more)" if len(files) > 5 else ""
        return CellOutcome(**kw, outcome="STALE", ok=False, stale_files=files,
                           reason="stale: " + ", ".join(files[:5]) + more)
    outcome, ok, why, first = _judge(verdict=verdict, reason=reason, rows=rows, xf=xf, nr=nr,
                                     policy=policy)
    return CellOutcome(**kw, outcome=outcome, ok=ok, reason=why, first=first)


def evaluate(report: Mapping[str, Any], policy: Policy, *, allow_not_run: Sequence[str] = (),
             stale: Mapping[str, Sequence[str]] | None = None,
             cells: Sequence[str] | None = None) -> PolicyEvaluation:
    """Each cell's outcome under ``policy`` (a pure function; see the module docstring).

    Args:
        report: a verified ``report.json`` document (``cells``: per-cell verdicts;
            ``rows``: per-row ``cell`` / ``family`` / ``verdict`` / ``round`` /
            ``statistic`` / ``margin``, margin = error / bound, dimensionless).
        policy: the contract's policy.
        allow_not_run: extra NOT_RUN globs (``qualify gate --allow-not-run``).
        stale: cell id -> changed source files (:func:`qualify.evidence.sources.stale_cells`).
        cells: every cell id to judge, in order (default: the policy's required cells, then
            the report's other cells).

    Returns:
        The :class:`PolicyEvaluation`.
    """
    by_id = {str(c.get("cell")): c for c in report.get("cells", []) if isinstance(c, Mapping)}
    rows_of: dict[str, list[Mapping[str, Any]]] = {}
    for r in report.get("rows", []):
        if isinstance(r, Mapping):
            rows_of.setdefault(str(r.get("cell")), []).append(r)
    ids = list(cells) if cells is not None else list(policy.required)
    ids += [c for c in by_id if c not in ids]
    return PolicyEvaluation(cells=tuple(
        _outcome(cid, by_id.get(cid), rows_of.get(cid, []), policy=policy, allow=allow_not_run,
                 stale=stale or {})
        for cid in ids))
