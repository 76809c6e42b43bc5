"""The conformance check of a harness: one cell of a tiny contract, every output problem named.

``qualify harness check ENGINE`` (and the pytest fixture :mod:`qualify.testing`) runs one
FP32 cell of an engine (Actor TP 1 + Critic TP 1, the roles the contract trains; each
option at its first default value) on the inputs of a sealed reference of a small contract
(default: the embedded ``tiny-qwen3`` and its committed reference under ``references/``),
with the launcher a real run uses (:func:`qualify.candidate.launch.launch_engine`, the
engine's own interpreter included), and lists every problem of its outputs, one
:class:`Finding` each:

- ``outputs.json``: every violation of ``outputs.schema.json`` (not only the first);
- ``outputs.safetensors``: a name that is not ``round{r}/{role}/{metric}``, a tensor that
  is not F32 / F64 (``..._ids``: not I64), a tensor count that is not ``tensors.count``;
- per role, what the comparator reads (:mod:`qualify.compare.rows`, run here on the cell's
  own share of the outputs, as :mod:`qualify.candidate.stage` splits it): each tensor the
  reference holds for that role at FP32 (the expected set of ``candidate_vs_hf``) missing
  or of another shape; the padding rerun :data:`qualify.compare.rows.PADDING_REQUIRED`;
  every item :func:`~qualify.compare.rows.dtype_row`, :func:`~qualify.compare.rows
  .replica_row` and :func:`~qualify.compare.rows.lr_rows` find missing or wrong; the Actor's
  distribution tensors its ``outputs.json`` says it recorded (optional otherwise), with the
  ``vocab`` it claims equal to the model's ``config.vocab_size`` (:func:`model_vocab`).

Nothing here is a second list of required outputs: the items come from the schema, the
reference's tensor set and the comparator's own row builders. Numerical agreement is not
judged (a value within its bound is ``qualify run``'s question).
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from qualify.errors import UsageError
from qualify.protocol import (
    CELL_FILE,
    CONTRACT_FILE,
    MODEL_FILE,
    OUTPUTS_FILE,
    OUTPUTS_META_FILE,
    PADDED_SUFFIX,
    HarnessCell,
    parse_tensor_name,
)

__all__ = ["CheckResult", "Finding", "check_engine", "check_outputs_dir", "find_reference",
           "model_vocab"]

FLOAT_DTYPES: Final = frozenset({"F32", "F64"})
"""safetensors dtypes a floating tensor may have (:mod:`qualify.protocol`)."""
PRECISION: Final = "fp32"
ID_SUFFIX: Final = "_ids"
"""Tensors named ``..._ids`` hold token ids, int64 (the Actor distributions' top-k ids)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """One problem of a harness's outputs.

    Attributes:
        where: the file and the item (``outputs.json roles.actor.dtypes.grads``,
            ``outputs.safetensors round1/actor/logprobs_padded``, ``launch``).
        problem: what is wrong (``missing``, ``shape [4, 7], expected [4, 8]``, ...).
    """

    where: str
    problem: str

    def __str__(self) -> str:
        return f"{self.where}: {self.problem}"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
    """The outcome of a conformance check (true when nothing is wrong).

    Attributes:
        engine: the engine checked.
        attempt_dir: the launch attempt (``cell.json``, outputs, logs).
        findings: every problem, in file order.
        versions: what the harness declared: ``outputs.json`` ``schema_version`` and the
            harness SDK / protocol version fields it wrote (``not declared`` otherwise).
        wall_s: the launch's wall-clock seconds.
    """

    engine: str
    attempt_dir: Path
    findings: tuple[Finding, ...]
    versions: Mapping[str, str]
    wall_s: float

    def __bool__(self) -> bool:
        return not self.findings


def find_reference(contract: Any, reference: Path | None) -> Path:
    """The sealed reference to take the inputs from: ``reference``, or the committed one.

    Raises:
        UsageError: ``reference`` is not a directory, or no reference of the contract is
            under ``references/`` of the code root.
    """
    from qualify.layout import reference_dir_name
    from qualify.resources import repo_root

    if reference is not None:
        if not (reference / "reference.json").is_file():
            raise UsageError(f"{reference}: not a reference directory (no reference.json)")
        return reference
    found = repo_root() / "references" / reference_dir_name(contract)
    if not (found / "reference.json").is_file():
        raise UsageError(f"{found}: no sealed reference of contract {contract.name!r}; run "
                         f"`qualify reference` first or pass --reference DIR")
    return found


def _schema_findings(meta: Any) -> list[Finding]:
    import jsonschema

    from qualify import schema

    out = []
    for top in sorted(schema.validator("outputs").iter_errors(meta),
                      key=lambda e: [str(p) for p in e.absolute_path]):
        e = jsonschema.exceptions.best_match([top])  # into anyOf / oneOf: the closest branch
        message = (" or ".join(dict.fromkeys(c.message for c in e.context)) if e.context
                   else e.message)  # an anyOf whose branches tie: each branch's own message
        message = message if len(message) <= 200 else message[:197] + "..."
        out.append(Finding(where=f"{OUTPUTS_META_FILE} "
                                 f"{'.'.join(str(p) for p in e.absolute_path) or '(top level)'}",
                           problem=message))
    return out


def _header(path: Path) -> dict[str, Any]:
    from qualify.candidate.launch import read_safetensors_header

    return read_safetensors_header(path)


def _tensor_findings(header: Mapping[str, Any], meta: Mapping[str, Any]) -> list[Finding]:
    out = []
    count = meta.get("tensors", {}).get("count") if isinstance(meta.get("tensors"), dict) \
        else None
    if isinstance(count, int) and count != len(header):
        out.append(Finding(where=f"{OUTPUTS_META_FILE} tensors.count",
                           problem=f"{count}, but {OUTPUTS_FILE} holds {len(header)} tensors"))
    for name in sorted(header):
        try:
            parse_tensor_name(name)
        except ValueError as exc:
            out.append(Finding(where=f"{OUTPUTS_FILE} {name}", problem=str(exc)))
        dtype = str(header[name].get("dtype", ""))
        if name.endswith(ID_SUFFIX):  # token ids (qualify_harness.distribution's top-k)
            if dtype != "I64":
                out.append(Finding(where=f"{OUTPUTS_FILE} {name}",
                                   problem=f"dtype {dtype}, expected I64 (token ids)"))
        elif dtype not in FLOAT_DTYPES:
            out.append(Finding(where=f"{OUTPUTS_FILE} {name}",
                               problem=f"dtype {dtype}, expected F32 (or F64)"))
    return out


def _one_number(name: str, shape: Sequence[int]) -> bool:
    """Whether the comparator reads tensor ``name`` as one number.

    A scalar family or a loss term: :func:`qualify.statistics.measure`'s rule, on its own
    keying of the name (:func:`qualify.statistics.group_tensors`).
    """
    import numpy as np

    from qualify.statistics import FAMILY_STATISTIC, group_tensors

    (key,) = group_tensors({name: np.zeros(shape, dtype=np.float32)})
    return key.family == "losses" or FAMILY_STATISTIC.get(key.family) == "abs"


def _role_findings(role: str, *, header: Mapping[str, Any], meta: Mapping[str, Any],
                   expected: Mapping[str, Any], sealed_lr: Mapping[str, Any] | None,
                   rounds: int, vocab_size: int | None) -> list[Finding]:
    """What the comparator's row builders find missing or wrong for one role."""
    from qualify.compare.rows import PADDING_REQUIRED, dtype_row, lr_rows, replica_row

    out = []
    mine = {k: v for k, v in header.items() if k.split("/")[1:2] == [role]}
    for name in sorted(expected):
        r, _, _, _ = parse_tensor_name(name)
        if r > rounds:
            continue
        want = list(expected[name].get("shape", []))
        if name not in mine:
            out.append(Finding(where=f"{OUTPUTS_FILE} {name}", problem="missing"))
            continue
        got = list(mine[name].get("shape", []))
        if _one_number(name, want):  # the comparator reads one number, of any shape
            if math.prod(got) != 1:
                out.append(Finding(where=f"{OUTPUTS_FILE} {name}",
                                   problem=f"shape {got}, expected one number"))
        elif got != want:
            out.append(Finding(where=f"{OUTPUTS_FILE} {name}",
                               problem=f"shape {got}, expected {want}"))
    out += _distribution_findings(role, mine, meta, vocab_size)
    need = PADDING_REQUIRED.get(role)
    if need is not None and not any(k.endswith(f"/{role}/{need}{PADDED_SUFFIX}") for k in mine):
        out.append(Finding(where=f"{OUTPUTS_FILE} round<r>/{role}/{need}{PADDED_SUFFIX}",
                           problem="missing (the padding-invariance rerun)"))
    cell = f"check-{role}"
    rows = [dtype_row(cell, role, meta, "", precision=PRECISION),
            replica_row(cell, role, meta, ""),
            *lr_rows(cell, role, meta, "", sealed_lr)]
    for row in rows:
        if row.verdict == "PASS":
            continue
        if row.family == "lr":
            if row.where == "(missing)":
                out.append(Finding(where=f"{OUTPUTS_META_FILE} roles.{role}.lr.round{row.round}",
                                   problem="missing"))
            continue  # a wrong lr value is a numerical finding, not a conformance one
        section = "dtypes" if row.family == "dtypes" else "replica_consistency"
        table = row.detail.table if row.detail is not None else ((row.where, "?", "?"),)
        for item, obtained, wanted in table:
            where = str(item) if str(item).startswith(section) else f"{section}.{item}"
            out.append(Finding(where=f"{OUTPUTS_META_FILE} roles.{role}.{where}",
                               problem=f"{obtained}, expected {wanted}"))
    return out


def _distribution_findings(role: str, mine: Mapping[str, Any], meta: Mapping[str, Any],
                           vocab_size: int | None) -> list[Finding]:
    """The Actor's distribution tensors its role meta says it recorded, each missing named.

    Recording them is optional (``distribution.not_recorded``: the comparator's
    ``trainer_distribution`` rows are then ``NOT_RUN``); a meta that says ``path`` ``full``
    or ``topk`` promises every tensor of :func:`qualify_harness.distribution.metric_names`
    under ``round1/actor/``, full ones ``[B, R, V]`` with ``[B, R]`` the role's round-1
    logprobs' shape, and a ``vocab`` equal to the model's ``vocab_size`` (when known: the
    distributions cover the model's whole vocabulary, a padded one cut). The optional top
    logit (:data:`qualify_harness.distribution.TOP_LOGIT`), when present, is ``[B, R]``.
    """
    from qualify_harness.distribution import TOP_LOGIT, metric_names, use_topk

    dist = meta.get("distribution")
    if role != "actor" or not isinstance(dist, dict) or dist.get("path") not in ("full", "topk"):
        return []
    vocab = dist.get("vocab")
    where_vocab = f"{OUTPUTS_META_FILE} roles.actor.distribution.vocab"
    if not isinstance(vocab, int) or vocab < 1:
        return [Finding(where=where_vocab, problem=f"{vocab!r}, expected a positive integer")]
    out = []
    if vocab_size is not None and vocab != vocab_size:
        out.append(Finding(where=where_vocab, problem=f"{vocab}, expected the model's "
                                                      f"vocab_size {vocab_size}"))
    path = "topk" if use_topk(vocab_size if vocab_size is not None else vocab) else "full"
    if dist["path"] != path:  # the reference seals the same switch's path: the rows need it
        out.append(Finding(where=f"{OUTPUTS_META_FILE} roles.actor.distribution.path",
                           problem=f"{dist['path']!r}, expected {path!r} for a vocabulary of "
                                   f"{vocab_size if vocab_size is not None else vocab}"))
    base = list((mine.get("round1/actor/logprobs") or {}).get("shape", []))
    top = mine.get(f"round1/actor/{TOP_LOGIT}")
    if top is not None and base and list(top.get("shape", [])) != base:
        out.append(Finding(where=f"{OUTPUTS_FILE} round1/actor/{TOP_LOGIT}",
                           problem=f"shape {list(top.get('shape', []))}, expected {base}"))
    for metric in metric_names(vocab, topk=dist["path"] == "topk"):
        name = f"round1/actor/{metric}"
        if name not in mine:
            out.append(Finding(where=f"{OUTPUTS_FILE} {name}",
                               problem=f"missing (outputs.json says distribution "
                                       f"path {dist['path']})"))
            continue
        got = list(mine[name].get("shape", []))
        want = [*base, vocab_size if vocab_size is not None else vocab]
        if dist["path"] == "full" and base and got != want:
            out.append(Finding(where=f"{OUTPUTS_FILE} {name}",
                               problem=f"shape {got}, expected {want}"))
    return out


def model_vocab(output_dir: Path, reference: Path) -> int | None:
    """The ``vocab_size`` of the Actor model the cell ran, or ``None`` when unknown.

    From the launch's own inputs (``cell.json`` ``inputs_dir`` -> ``model.json``
    ``actor_dir`` -> ``config.json``) when ``output_dir`` holds a ``cell.json``, else the
    reference's ``contract.json`` ``model.config.vocab_size`` (a built model's config).
    """
    def read(path: Path) -> Any:
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    cell = read(output_dir / CELL_FILE)
    if isinstance(cell, dict) and isinstance(cell.get("inputs_dir"), str):
        model = read(Path(cell["inputs_dir"]) / MODEL_FILE)
        if isinstance(model, dict) and isinstance(model.get("actor_dir"), str):
            config = read(Path(model["actor_dir"]) / "config.json")
            if isinstance(config, dict) and isinstance(config.get("vocab_size"), int):
                return int(config["vocab_size"])
    contract = read(reference / CONTRACT_FILE)
    config = (contract.get("model") or {}).get("config") if isinstance(contract, dict) else None
    vocab = config.get("vocab_size") if isinstance(config, dict) else None
    return vocab if isinstance(vocab, int) else None


def check_outputs_dir(output_dir: Path, *, roles: Sequence[str], rounds: int,
                      reference: Path) -> tuple[list[Finding], dict[str, str]]:
    """Every problem of the outputs in ``output_dir`` (see the module doc), and the versions.

    Args:
        output_dir: where the harness wrote ``outputs.json`` / ``outputs.safetensors``.
        roles: the roles the cell trained.
        rounds: the cell's rounds.
        reference: the sealed reference the inputs came from (its FP32 HF tensors are the
            expected set; its ``update_meta`` the sealed lr).
    """
    from qualify.compare.stage import _update_meta
    from qualify.layout import HF_REFERENCE_DIR, hf_tensors_file

    meta_path, tensors_path = output_dir / OUTPUTS_META_FILE, output_dir / OUTPUTS_FILE
    findings: list[Finding] = []
    meta: Any = None
    if not meta_path.is_file():
        findings.append(Finding(where=OUTPUTS_META_FILE, problem="missing"))
    else:
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            findings.append(Finding(where=OUTPUTS_META_FILE, problem=f"not readable JSON: {exc}"))
    if meta is not None:
        findings += _schema_findings(meta)
    meta = meta if isinstance(meta, dict) else {}
    header: dict[str, Any] = {}
    if not tensors_path.is_file():
        findings.append(Finding(where=OUTPUTS_FILE, problem="missing"))
    else:
        header = _header(tensors_path)
        findings += _tensor_findings(header, meta)
    if not meta or not header:  # nothing to check item by item: the missing file says it
        return findings, _versions(meta)
    expected_all = _header(reference / HF_REFERENCE_DIR / hf_tensors_file(PRECISION))
    lr_meta = _update_meta(reference).get(f"hf-{PRECISION}", {})
    role_metas = meta.get("roles") if isinstance(meta.get("roles"), dict) else {}
    vocab_size = model_vocab(output_dir, reference)
    for role in roles:
        role_meta = {**{k: v for k, v in meta.items() if k != "roles"},
                     **(role_metas.get(role) or {})}  # as the candidate stage splits it
        expected = {k: v for k, v in expected_all.items() if k.split("/")[1:2] == [role]}
        sealed = (lr_meta.get(role) or {}).get("lr") if isinstance(lr_meta, dict) else None
        findings += _role_findings(role, header=header, meta=role_meta, expected=expected,
                                   sealed_lr=sealed if isinstance(sealed, dict) else None,
                                   rounds=rounds, vocab_size=vocab_size)
    return findings, _versions(meta)


def _versions(meta: Mapping[str, Any]) -> dict[str, str]:
    from qualify import schema

    want = schema.load_schema("outputs")["properties"]["schema_version"]
    out = {"outputs.json schema_version": f"{meta.get('schema_version', 'missing')} "
                                          f"(qualify reads {want.get('const', want)})"}
    sources: list[tuple[str, Mapping[str, Any]]] = [("", meta)]
    if isinstance(meta.get("versions"), dict):
        sources.append(("versions.", meta["versions"]))
    for prefix, doc in sources:
        for key in sorted(doc):
            if any(w in key for w in ("sdk", "protocol", "harness")) and not isinstance(
                    doc[key], dict | list):
                out[prefix + key] = str(doc[key])
    if len(out) == 1:
        out["harness SDK / protocol version"] = "not declared"
    return out


def check_engine(engine: str, *, contract_path: Path | None = None,
                 reference: Path | None = None, out: Path | None = None,
                 timeout_s: float = 600.0) -> CheckResult:
    """Run one FP32 TP 1 cell of ``engine`` and check its outputs (module doc).

    Args:
        engine: a registered trainer engine.
        contract_path: the contract (default: the embedded ``tiny-qwen3``).
        reference: its sealed reference (default: the committed one, :func:`find_reference`).
        out: where the launch attempt goes (default: a new temporary directory, kept).
        timeout_s: wall-clock limit of the launch.

    Raises:
        UsageError: an unknown engine or one that is not a trainer, no reference, or an
            engine that cannot run here (its ``NOT_RUN`` reason).
    """
    from qualify.candidate.launch import launch_engine
    from qualify.candidate.stage import _stage_inputs
    from qualify.contract import default_contract_path, load_contract
    from qualify.registry import get_engine, has_cuda
    from qualify.sampling import rollout_sampling

    spec = get_engine(engine)
    if spec.kind != "trainer":
        raise UsageError(f"engine {engine!r} is a {spec.kind}; the check runs trainer harnesses")
    cuda = has_cuda()
    why = spec.unavailable_reason(cuda_available=cuda)
    if why is not None:
        raise UsageError(why)
    contract = load_contract(contract_path or default_contract_path())
    ref = find_reference(contract, reference)
    root = out if out is not None else Path(tempfile.mkdtemp(prefix=f"qualify-check-{engine}-"))
    root.mkdir(parents=True, exist_ok=True)
    inputs = _stage_inputs(contract, ref, root)
    roles = list(contract.matrix.roles)
    attempt = root / "launch" / "attempt-1"
    n = 1
    while attempt.exists():
        n += 1
        attempt = root / "launch" / f"attempt-{n}"
    cell = HarnessCell(
        param_sampling=rollout_sampling(contract.evidence, inputs), engine=engine,
        precision=PRECISION,
        options={o.key: o.default[0] for o in spec.options},
        actor_tp=1 if "actor" in roles else 0, critic_tp=1 if "critic" in roles else 0,
        rounds=contract.algorithm.rounds, seed=contract.sampling.seed,
        inputs_dir=str(inputs.resolve()), output_dir=str(attempt.resolve()),
        collective_timeout_s=min(120.0, timeout_s))
    result = launch_engine(cell, engine=spec, attempt_dir=attempt, timeout_s=timeout_s,
                           cuda=cuda)
    findings: list[Finding] = []
    if result.returncode != 0:
        first = (result.reason.splitlines() or ["?"])[0]
        findings.append(Finding(where="launch", problem=f"{first} (logs: {attempt / 'logs'})"))
    found, versions = check_outputs_dir(attempt, roles=roles, rounds=cell.rounds,
                                        reference=ref)
    findings += found
    return CheckResult(engine=engine, attempt_dir=attempt, findings=tuple(findings),
                       versions=versions, wall_s=result.wall_s)
