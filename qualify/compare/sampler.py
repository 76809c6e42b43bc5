"""Comparison rows of a sampler cell (``vllm-fp32-sampler-tp{n}``).

The cells are run by :mod:`qualify.candidate.sampler_stage`.

:func:`sampler_rows` judges one COMPLETE sampler attempt and returns
:class:`qualify.compare.verdicts.Row` objects (the cell's verdict is their worst, as for every
cell):

- ``sampler_install``: the round-1 Actor weights were installed as version 1 with one
  acknowledgement per TP rank ``(rank, version, digest)``, every rank's installed shards
  equal to the expected per-rank digests, and still equal at the end of the run
  (``final.verified``).
- ``sampler_install`` / ``kernels``: every rank's GEMM kernels (linear layers, LM head)
  compute with the installed weights, not the previous version's (``kernel_probe``: on CPU
  vLLM computes with packed copies the digests cannot read; one stale kernel is a
  ``FAIL`` naming the rank and layer).
- ``sampler_cache``: the prefix-cache proof: ``num_cached_tokens`` of the first request
  after the update is 0 (error = that count, bound 0) and the same-version replay reused
  cached tokens (> 0; 0 means the proof could not show the cache was live: ``FAIL``).
- ``sampler_probe``: one row per rejection probe (:data:`PROBES`): ``PASS`` iff the probe
  was refused by its own check **and** the sampler stayed on its previous version; a probe
  that was not refused, or is missing from the evidence, is a ``FAIL``.
- ``sampler_vs_actor`` (round 2): the sampler's processed logprobs of the frozen rollout
  tokens with the installed weights (``round2/sampler/logprobs``) against the
  ``weights_from`` Actor cell's own ``round2/actor/logprobs`` on the same tokens (both
  ``log_softmax(logits / temperature)`` without truncation: like for like). With ``d`` the
  per-token difference over the valid tokens and ``b`` the sealed FP32
  ``candidate_vs_hf`` bound of ``round2/actor/logprobs`` (``bounds.json``; the comparator
  reads bounds only from there):

  * ``max_abs``, ``mean_abs``, ``p99_abs`` of ``|d|`` against ``b``;
  * ``token_mult_prob_error - 1`` (NeMo-RL's ``mean exp(|d|)``, minus its ideal 1)
    against ``exp(b) - 1`` and ``k3_kl`` (``mean exp(d) - d - 1``) against
    ``exp(b) - b - 1``: the values those statistics take when every ``|d| <= b``, so the
    sealed rule bounds them too (``exp(|d|)`` and ``exp(d) - d - 1 <= exp(|d|) - |d| - 1``
    are increasing in ``|d|``).

  The numbers come from :func:`qualify.compare.mismatch.field_mismatch` (FP64 numpy).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qualify.bounds import Bound, judge, lookup
from qualify.compare.mismatch import field_mismatch
from qualify.compare.rows import guarded
from qualify.compare.verdicts import FailureDetail, Row
from qualify.layout import OUTPUTS_META_FILE
from qualify.statistics import MetricKey

PROBES: Final = ("stale_version", "wrong_shard", "missing_ack", "duplicate_ack", "warm_cache",
                  "partial_install")
"""The rejection probes every sampler cell must show refused."""
SAMPLER_ROW_CLASSES: Final = ("sampler_install", "sampler_cache", "sampler_probe",
                              "sampler_vs_actor")
ROLE: Final = "sampler"
ACTOR_KEY: Final = MetricKey(round=2, role="actor", family="logprobs")
_EXP_MAX: Final = math.log(np.finfo(np.float64).max)
"""The largest bound whose ``exp`` is a finite FP64 number."""


def _row(cell: str, klass: str, family: str, statistic: str, *, error: float | None = None,
         bound: float | None = None, ok: bool, reason: str | None = None, where: str = "",
         round_: int | None = None, obtained: str = "", expected: str = "") -> Row:
    """A check row: ``PASS`` when ``ok``, else ``FAIL`` with a one-line detail table."""
    margin = None if error is None or bound is None else judge(error, bound)[1]
    if ok:
        return Row(cell=cell, klass=klass, bound_class=None, round=round_, role=ROLE,
                   family=family, statistic=statistic, error=error, bound=bound,
                   margin=margin, verdict="PASS", reason=None, where=where)
    detail = FailureDetail(mismatched=1, total=1, max_abs=error, max_rel=None,
                           columns=("item", "obtained", "expected"),
                           table=((where or family, obtained, expected),))
    return Row(cell=cell, klass=klass, bound_class=None, round=round_, role=ROLE,
               family=family, statistic=statistic, error=error, bound=bound, margin=margin,
               verdict="FAIL", reason=reason or f"{family}: check failed", where=where,
               detail=detail)


def _obj(x: Any) -> Mapping[str, Any]:
    """An ``outputs.json`` object field (``{}`` when absent or of another type)."""
    return x if isinstance(x, Mapping) else {}


def _list(x: Any) -> list[Any]:
    """An ``outputs.json`` array field (``[]`` when absent or of another type)."""
    return x if isinstance(x, list) else []


def _count(x: Any) -> int | None:
    """A JSON integer (``None`` for anything else, booleans included)."""
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _int(x: Any, default: int) -> int:
    """A JSON integer (``default`` for anything else, booleans included)."""
    n = _count(x)
    return default if n is None else n


def _float(x: Any) -> float:
    """A JSON number as a float (``nan`` for anything else, ``inf`` beyond FP64)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return math.nan
    try:
        return float(x)
    except OverflowError:  # an integer beyond FP64
        return math.copysign(math.inf, x)


def _install_row(cell: str, tp: int, meta: Mapping[str, Any]) -> Row:
    inst, final = _obj(meta.get("install")), _obj(meta.get("final"))
    acks = [_obj(a) for a in _list(inst.get("acks"))]
    ranks = sorted(_int(a.get("rank"), -1) for a in acks)
    problems = []
    if inst.get("accepted") is not True:
        problems.append(("install.accepted", repr(inst.get("accepted")),
                         f"True ({inst.get('reason')})"))
    if ranks != list(range(tp)):
        problems.append(("install.acks", f"ranks {ranks}", f"one per rank {list(range(tp))}"))
    if any(_int(a.get("version"), -1) != 1 for a in acks):
        problems.append(("install.acks.version", str([a.get("version") for a in acks]), "1"))
    if inst.get("expected_digest") != [a.get("digest") for a in sorted(
            acks, key=lambda a: _int(a.get("rank"), -1))]:
        problems.append(("install.acks.digest", "differs", "the expected per-rank digests"))
    if final.get("verified") is not True or final.get("version") != 1:
        problems.append(("final", f"version {final.get('version')}, verified "
                         f"{final.get('verified')} ({final.get('problem')})",
                         "version 1, verified"))
    if not problems:
        return _row(cell, "sampler_install", "install", "digest", ok=True,
                    where=f"{inst.get('tensors_verified')} tensors over {tp} ranks")
    item, got, want = problems[0]
    return _row(cell, "sampler_install", "install", "digest", ok=False, where=item,
                obtained=got, expected=want,
                reason=f"install: {item} is {got}, expected {want}"
                       + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))


def _kernel_row(cell: str, meta: Mapping[str, Any]) -> Row:
    """The GEMM kernels compute with the installed weights (``kernel_probe``)."""
    kp = meta.get("kernel_probe")
    if not isinstance(kp, Mapping) or not isinstance(kp.get("stale"), list):
        return _row(cell, "sampler_install", "kernels", "stale", ok=False,
                    where="kernel_probe", obtained="missing", expected="a kernel probe",
                    reason=f"kernel probe missing from {OUTPUTS_META_FILE}")
    stale = [str(x) for x in kp["stale"]]
    probed = _int(kp.get("layers_probed"), 0)
    if not stale and probed > 0:
        return _row(cell, "sampler_install", "kernels", "stale", error=0.0, ok=True,
                    where=f"{probed} GEMM kernels, worst rel err vs installed weights "
                          f"{_float(kp.get('worst_err_new', 0.0)):.3g}")
    if not stale:
        return _row(cell, "sampler_install", "kernels", "stale", error=0.0, ok=False,
                    where="kernel_probe", obtained="0 layers probed",
                    expected="every linear layer and the LM head",
                    reason="kernel probe: no GEMM kernel was probed")
    return _row(cell, "sampler_install", "kernels", "stale", error=float(len(stale)),
                bound=0.0, ok=False, where=stale[0], obtained=f"{len(stale)} stale",
                expected="0 stale",
                reason=f"install: {len(stale)} GEMM kernel(s) still compute with the previous "
                       f"version's weights after the update: {'; '.join(stale[:3])}"
                       + (f" (and {len(stale) - 3} more)" if len(stale) > 3 else ""))


def _cache_row(cell: str, meta: Mapping[str, Any]) -> Row:
    cp = _obj(meta.get("cache_proof"))
    raw = (cp.get("cached_tokens_first_after_update"), cp.get(
        "cached_tokens_same_version_replay"))
    first, replay = _count(raw[0]), _count(raw[1])
    if first is None or replay is None:
        return _row(cell, "sampler_cache", "prefix_cache", "cached_tokens", ok=False,
                    where="cache_proof", obtained=f"{raw[0]!r}, {raw[1]!r}",
                    expected="integers",
                    reason=f"cache proof missing from {OUTPUTS_META_FILE}")
    where = f"first after update {first}, same-version replay {replay}"
    if first != 0:
        return _row(cell, "sampler_cache", "prefix_cache", "cached_tokens", error=_float(first),
                    bound=0.0, ok=False, where=where, obtained=str(first), expected="0",
                    reason=f"prefix cache: the first request after the update was served "
                           f"{first} cached tokens (a cache that predates the update)")
    if replay <= 0:
        return _row(cell, "sampler_cache", "prefix_cache", "cached_tokens", error=0.0,
                    bound=0.0, ok=False, where=where, obtained=str(replay), expected="> 0",
                    reason="prefix cache: the same-version replay reused no cached tokens, "
                           "so the proof cannot show the reset did anything")
    return _row(cell, "sampler_cache", "prefix_cache", "cached_tokens", error=0.0, bound=0.0,
                ok=True, where=where)


def _probe_rows(cell: str, meta: Mapping[str, Any]) -> list[Row]:
    got = {p["name"]: p for p in _list(meta.get("probes"))
           if isinstance(p, Mapping) and isinstance(p.get("name"), str)}
    rows = []
    for name in PROBES:
        p = got.get(name)
        if p is None:
            rows.append(_row(cell, "sampler_probe", name, "rejected", ok=False, where=name,
                             obtained="absent", expected="refused",
                             reason=f"probe {name}: missing from {OUTPUTS_META_FILE}"))
            continue
        where = (f"{p.get('reason')} (version {p.get('version_before')} -> "
                 f"{p.get('version_after')})")
        if p.get("rejected") is True and p.get("stayed") is True:
            rows.append(_row(cell, "sampler_probe", name, "rejected", ok=True, where=where))
        elif p.get("rejected") is not True:
            rec = _obj(p.get("record"))
            rows.append(_row(cell, "sampler_probe", name, "rejected", ok=False, where=name,
                             obtained=f"accepted={rec.get('accepted')} check={rec.get('check')}",
                             expected=f"refused by {p.get('expected_check')}",
                             reason=f"probe {name} was not rejected by "
                                    f"{p.get('expected_check')} (check: {rec.get('check')}, "
                                    f"reason: {p.get('reason')})"))
        else:
            rows.append(_row(cell, "sampler_probe", name, "rejected", ok=False, where=where,
                             obtained=f"version {p.get('version_after')}",
                             expected=f"version {p.get('version_before')}, rollback verified",
                             reason=f"probe {name}: refused, but the sampler did not stay on "
                                    f"version {p.get('version_before')}"))
    return rows


def _vs_actor_rows(cell: str, tensors: Mapping[str, npt.NDArray[Any]], *,
                   actor: Mapping[str, npt.NDArray[Any]] | str, bounds: Sequence[Bound],
                   mask: npt.NDArray[Any], weights_from: str) -> list[Row]:
    stats = ("max_abs", "mean_abs", "p99_abs", "token_mult_prob_error-1", "k3_kl")
    base: dict[str, Any] = {"cell": cell, "klass": "sampler_vs_actor",
                            "bound_class": "candidate_vs_hf",
            "round": 2, "role": ROLE, "family": "logprobs"}
    if isinstance(actor, str):
        return [Row(**base, statistic=s, error=None, bound=None, margin=None,
                    verdict="NOT_RUN", where="",
                    reason=f"weights source {weights_from} has no round-2 logprobs: {actor}")
                for s in stats]
    b = lookup(list(bounds), precision="fp32", klass="candidate_vs_hf", key=ACTOR_KEY)
    mine = tensors.get(f"round2/{ROLE}/logprobs")
    theirs = actor.get(ACTOR_KEY.label)
    if b is None or mine is None or theirs is None:
        what = ("no sealed fp32 candidate_vs_hf bound for round2/actor/logprobs" if b is None
                else "round2/sampler/logprobs missing" if mine is None
                else f"{weights_from} has no round2/actor/logprobs")
        return [Row(**base, statistic=s, error=None, bound=None, margin=None, verdict="ERROR",
                    where="", reason=what) for s in stats]
    bound = b.bound
    if not (math.isfinite(bound) and 0 <= bound < _EXP_MAX):
        return [Row(**base, statistic=s, error=None, bound=None, margin=None, verdict="ERROR",
                    where="", reason=f"the sealed fp32 candidate_vs_hf bound of "
                                     f"round2/actor/logprobs is {bound!r}: no finite bound of "
                                     f"{s} follows from it (exp(bound) must be finite)")
                for s in stats]
    shapes = (np.shape(mine), np.shape(theirs), np.shape(mask))
    if len(shapes[0]) != 2 or len(set(shapes)) != 1:
        return [Row(**base, statistic=s, error=math.inf, bound=bound, margin=math.inf,
                    verdict="FAIL", where="shape",
                    reason=f"sampler vs actor round-2 logprobs: shapes differ or are not 2-D "
                           f"(sampler {shapes[0]}, {weights_from} {shapes[1]}, response mask "
                           f"{shapes[2]})",
                    detail=FailureDetail(mismatched=1, total=1, max_abs=math.inf,
                                         max_rel=None, columns=("item", "obtained", "expected"),
                                         table=(("shape", str(shapes[0]), str(shapes[1])),)))
                for s in stats]
    fm = field_mismatch(mine, theirs, mask, source=cell, precision="fp32",
                        logprobs_mode="processed", like_for_like=True)
    values = {"max_abs": (fm.max_abs, bound), "mean_abs": (fm.mean_abs, bound),
              "p99_abs": (fm.p99_abs, bound),
              "token_mult_prob_error-1": (
                  None if fm.token_mult_prob_error is None else fm.token_mult_prob_error - 1.0,
                  math.expm1(bound)),
              "k3_kl": (fm.k3_kl, math.expm1(bound) - bound)}
    rows = []
    for s in stats:
        err, bnd = values[s]
        e = math.inf if err is None or fm.n_nonfinite else float(err)
        verdict, margin = judge(e, bnd)
        where = f"{fm.worst} (n={fm.n_valid}, mean signed {fm.mean_signed})"
        detail = None
        reason = None
        if verdict == "FAIL":
            a, bb = np.asarray(mine, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
            idx = fm.worst.strip("()").split(",") if fm.worst.startswith("(") else []
            table: tuple[tuple[str | float | None, ...], ...] = ()
            if len(idx) == 2:
                i, j = int(idx[0]), int(idx[1])
                table = ((f"({i}, {j})", float(a[i, j]), float(bb[i, j]),
                          abs(float(a[i, j]) - float(bb[i, j]))),)
            detail = FailureDetail(mismatched=1, total=fm.n_valid, max_abs=fm.max_abs,
                                   max_rel=None,
                                   columns=("index", "obtained", "expected", "abs diff"),
                                   table=table)
            reason = (f"sampler vs actor round-2 logprobs: {s} {e:.6g} > bound {bnd:.6g} "
                      f"(sealed {b.klass} bound {bound:.6g} = {b.k} * {b.control_error:.3g} "
                      f"({b.control}) + {b.floor:.3g})")
        rows.append(Row(**base, statistic=s, error=e, bound=bnd, margin=margin,
                        verdict=verdict, reason=reason, where=where, detail=detail))
    return rows


def sampler_rows(*, cell: str, entry: Mapping[str, Any], tensors: Mapping[str, Any],
                 meta: Mapping[str, Any] | None, meta_problem: str,
                 actor: Mapping[str, npt.NDArray[Any]] | str, bounds: Sequence[Bound],
                 mask: npt.NDArray[Any]) -> list[Row]:
    """Every row of one COMPLETE sampler cell (module docstring).

    Args:
        cell: the sampler cell id.
        entry: its ``run.json`` entry (``tp``, ``weights_from``).
        tensors: its sealed ``outputs.safetensors`` (numpy).
        meta: its ``outputs.json`` (``None`` when unreadable).
        meta_problem: why ``meta`` is ``None``.
        actor: the ``weights_from`` cell's tensors, or why they are unavailable.
        bounds: the sealed bounds (``bounds.json``).
        mask: ``[B, R]`` response mask of the frozen rollout.

    Returns:
        The rows, in the order install, kernels, cache, probes, round 2; a check that
        cannot be built from ``meta`` is one ``ERROR`` row naming it
        (:func:`qualify.compare.rows.guarded`).
    """
    tp = _int(entry.get("tp", 1), 1)
    weights_from = str(entry.get("weights_from", ""))
    if meta is None:
        return [_row(cell, "sampler_install", "install", "digest", ok=False,
                     where=OUTPUTS_META_FILE, obtained=meta_problem, expected="readable JSON",
                     reason=f"{OUTPUTS_META_FILE}: {meta_problem}")]
    g: dict[str, Any] = {"cell": cell, "role": ROLE}
    here = "qualify.compare.sampler."
    rows = guarded(lambda: [_install_row(cell, tp, meta)], **g, builder=f"{here}_install_row",
                   klass="sampler_install", family="install")
    rows += guarded(lambda: [_kernel_row(cell, meta)], **g, builder=f"{here}_kernel_row",
                    klass="sampler_install", family="kernels")
    rows += guarded(lambda: [_cache_row(cell, meta)], **g, builder=f"{here}_cache_row",
                    klass="sampler_cache", family="prefix_cache")
    rows += guarded(lambda: _probe_rows(cell, meta), **g, builder=f"{here}_probe_rows",
                    klass="sampler_probe", family="probes")
    rows += guarded(lambda: _vs_actor_rows(cell, tensors, actor=actor, bounds=bounds,
                                           mask=mask, weights_from=weights_from),
                    **g, builder=f"{here}_vs_actor_rows", klass="sampler_vs_actor",
                    family="logprobs")
    return rows


def sampler_required(contract: Any) -> tuple[str, ...]:
    """Ids of the sampler cells the report requires (``sampler.required``, default true)."""
    s = getattr(contract, "sampler", None)
    return tuple(s.cell_ids()) if s is not None and s.required else ()
