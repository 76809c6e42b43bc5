"""The reference's next-token distributions on the frozen rollout, their controls and bounds.

Run by the reference stage (:func:`seal_distribution`, one call before sealing) for the
Actor's initial weights, the weights the rollout was sampled with. Writes, sealed with the
reference:

- ``distribution.safetensors``: ``raw`` ``[B, R, V]`` FP32, ``log_softmax(logits)`` of an
  HF FP32 ``sdpa`` batched prefill (teacher forcing) at every response position, and
  ``tempered`` ``[B, R, V]``, ``log_softmax(logits / T)`` (``T`` the contract's sampling
  temperature); 0 at masked positions;
- ``distribution.json``: the SDPA backends each HF execution dispatched to, read back
  (:func:`qualify_harness.routes.sdpa_recorder`); for each of ``raw`` / ``tempered``, the
  metrics of :mod:`qualify.distmetrics` of every control against that reference, and per statistic
  ``bound = k * max over the FP32 controls + floor`` (``k`` the contract's
  ``bounds.k``, the floors :data:`FLOORS`), the ceiling of every FP32 candidate (the
  sampler cells, the FP32 trainer cells); per statistic ``bounds_bf16 = k * max over the
  BF16 controls + floor`` (same floors, same entry fields, ``control`` the largest of
  :data:`BF16_CONTROLS`), the ceiling of a BF16 trainer cell: a BF16 execution is another
  precision, not noise of an FP32 one, so its ceiling comes from HF BF16 executions against
  the FP32 reference, as every BF16 bound does (docs/bound-rule.md), and a BF16 engine may
  take any of the executions the FP32 controls stand for, so each is measured at BF16 too;
  the ``decode_vs_prefill`` token-logprob bound of the sampler's own decode-vs-prefill row.
  A BF16 control's top-1 ties are counted at BF16 resolution at its own top logit, as a
  BF16 cell's are (``bf16_controls_ties``, :data:`qualify.distmetrics.BF16_TIE_RULE`); the
  FP32 controls' by the FP32 rule.
  A reference sealed by older code, or whose BF16 metric of a kind is not finite
  (``bounds_bf16_not_run`` then says so), has no ``bounds_bf16`` for it (its BF16 trainer rows
  are ``NOT_RUN``, :mod:`qualify.compare.distribution`).

Controls, each an HF execution of the same model and tokens that an engine may legitimately
take instead: ``decode`` (prompt prefill, then one token at a time against the KV cache,
``sdpa``, per sequence), ``attn_impl`` (``eager`` batched prefill), ``batch`` (each sequence
alone, no padding, ``sdpa``); for the BF16 ceilings only, ``bf16`` (BF16 parameters,
``sdpa`` batched prefill) and ``bf16_decode``, ``bf16_attn_impl``, ``bf16_batch`` (those
three at BF16 parameters).
Above a vocabulary of :data:`MAX_VOCAB` the distributions are sealed on the **top-k path**
(:func:`qualify.distmetrics.topk_metrics`; ``k`` the contract's ``bounds.distribution_topk``):
``distribution.safetensors`` holds, for each ``kind``, ``<kind>_topk_logprobs`` ``[B, R, k]``
FP32 (the reference's ``k`` largest logprobs, ordered by :func:`qualify.distmetrics.topk_of`),
``<kind>_topk_ids`` ``[B, R, k]`` int64, ``<kind>_token_logprobs`` ``[B, R]`` FP32 (the
response token's logprob) and ``<kind>_missing_mass`` ``[B, R]`` FP64 (``1 -`` the FP64 mass
of the top-k set: what the metrics cannot see); each control is reduced to its own top-k the
same way before its metrics are taken; ``distribution.json`` adds ``topk`` (``k``, why) and
per kind ``missing_mass`` (max and mean over valid positions). The statistics are
:data:`qualify.distmetrics.TOPK_STATISTICS`; the lumped KL and TV are lower bounds of the
true ones, ``tv_upper_*`` an upper bound (:mod:`qualify.distmetrics`). A reference sealed by
older code above :data:`MAX_VOCAB` holds ``distributions_not_run`` instead (no distributions).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch
from qualify_harness.routes import sdpa_recorder

from qualify.distmetrics import (
    BF16_TIE_RULE,
    KINDS,
    STATISTICS,
    TOPK_STATISTICS,
    distribution_metrics,
    topk_metrics,
    topk_of,
)
from qualify.layout import DISTRIBUTION_FILE, DISTRIBUTION_JSON

MAX_VOCAB: Final = 4096
"""Largest vocabulary whose full distributions are sealed (``[B, R, V]`` FP32 per kind)."""
FP32_CONTROLS: Final = ("decode", "attn_impl", "batch")
BF16_CONTROL: Final = "bf16"
"""HF, BF16 parameters, ``sdpa`` batched prefill: the BF16 execution of the reference."""
BF16_CONTROLS: Final = (BF16_CONTROL, *(f"bf16_{c}" for c in FP32_CONTROLS))
"""The controls of the BF16 ceilings (``bounds_bf16``): the reference's own execution and each
FP32 control's, at BF16 parameters (``bf16_decode``, ``bf16_attn_impl``, ``bf16_batch``),
each against the FP32 reference."""
INFO_CONTROLS: Final = BF16_CONTROLS
"""Controls measured beside the FP32 ones, outside the FP32 ceilings (``info_controls``)."""
FLOORS: Final = {"kl_ref_cand_max": 1e-10, "kl_ref_cand_mean": 1e-10, "kl_cand_ref_max": 1e-10,
                 "kl_cand_ref_mean": 1e-10, "tv_max": 1e-6, "tv_mean": 1e-6,
                 "top1_mismatch": 0.0, "topk_disagreement_mean": 0.0, "ratio_outside_2": 0.0,
                 "ratio_outside_clip": 0.0, "seq_max_kl_mean": 1e-10,
                 "tv_upper_max": 1e-6, "tv_upper_mean": 1e-6, "topk_set_disagreement_mean": 0.0}
"""Per-statistic floors: an FP32 logprob difference of the logprob floor (1e-5) at every
token gives a KL of about 0.5 * 1e-10 and a TV of order 1e-6; counts and fractions of
discrete events have no floor (a control that shows none bounds them at 0)."""
LOGPROB_FLOOR: Final = 1e-5
"""Floor of the token-logprob decode-vs-prefill bound (the contract's FP32 logprob floor)."""


def _model(actor_dir: Path, attn: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(actor_dir), torch_dtype=dtype,
                                                 attn_implementation=attn)
    return model.eval()


def _prefill(model: Any, roll: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, R, V]`` FP32 logits at the response positions of a batched prefill."""
    p = roll["prompts"].shape[1]
    r = roll["responses"].shape[1]
    ids = torch.cat([roll["prompts"], roll["responses"]], dim=1)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=roll["attention_mask"],
                    position_ids=roll["position_ids"]).logits
    # a compact copy: a view would keep the whole-sequence [B, P + R, V] logits alive
    return out[:, p - 1:p + r - 1].to(torch.float32, copy=True)


def _eager_prefill(actor_dir: Path, dtype: torch.dtype, roll: dict[str, torch.Tensor]
                   ) -> torch.Tensor:
    """:func:`_prefill` of a fresh ``eager`` model in ``dtype`` (freed on return)."""
    return _prefill(_model(actor_dir, "eager", dtype), roll)


def _sequences(roll: dict[str, torch.Tensor]) -> list[tuple[list[int], list[int]]]:
    p = roll["prompts"].shape[1]
    am, rm = roll["attention_mask"], roll["response_mask"]
    out = []
    for b in range(am.shape[0]):
        prompt = [int(t) for t, m in zip(roll["prompts"][b], am[b, :p], strict=True) if int(m)]
        resp = [int(t) for t, m in zip(roll["responses"][b], rm[b], strict=True) if int(m)]
        out.append((prompt, resp))
    return out


def _per_sequence(model: Any, roll: dict[str, torch.Tensor], *, decode: bool) -> torch.Tensor:
    """``[B, R, V]`` logits, each sequence alone: one prefill, or prefill + KV-cache decode."""
    b_n, r = roll["responses"].shape
    out: torch.Tensor | None = None
    with torch.no_grad():
        for b, (prompt, resp) in enumerate(_sequences(roll)):
            if not resp:
                continue
            if decode:
                step = model(input_ids=torch.tensor([prompt]), use_cache=True)
                rows, cache = [step.logits[0, -1]], step.past_key_values
                for t in range(len(resp) - 1):
                    step = model(input_ids=torch.tensor([[resp[t]]]), past_key_values=cache,
                                 use_cache=True)
                    rows.append(step.logits[0, -1])
                    cache = step.past_key_values
                logits = torch.stack(rows)
            else:
                full = model(input_ids=torch.tensor([prompt + resp[:-1]])).logits[0]
                logits = full[len(prompt) - 1:]
            if out is None:
                out = torch.zeros(b_n, r, logits.shape[-1])
            out[b, :len(resp)] = logits.float()
    assert out is not None
    return out


def _logprobs(logits: torch.Tensor, temperature: float, mask: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits.double() / temperature, dim=-1).float()
    return torch.where(mask.bool()[..., None], lp, 0.0)


def _topk(lp: torch.Tensor, tokens: Any, k: int) -> dict[str, Any]:
    """``topk_logprobs`` / ``topk_ids`` ``[B, R, k]`` and ``token_logprobs`` ``[B, R]``."""
    vals, ids = topk_of(lp.numpy(), k)
    tok = np.take_along_axis(lp.numpy(), np.asarray(tokens, dtype=np.int64)[..., None],
                             axis=-1)[..., 0]
    return {"topk_logprobs": vals, "topk_ids": ids, "token_logprobs": tok.astype(np.float32)}


def _tie_args(name: str, logits: torch.Tensor, temperature: float, mask: torch.Tensor
              ) -> dict[str, Any]:
    """The tie-rule arguments of control ``name``'s metrics (``{}``: the FP32 rule).

    A BF16 control (:data:`BF16_CONTROLS`) is counted at BF16 resolution at the magnitude of
    its own top raw logit per position (``logits`` ``[B, R, V]``, the control's BF16 logits
    held in FP32; ``[B, R]`` top logit, 0 at masked positions), ``temperature`` the divisor
    of the kind's logprobs; an FP32 control by the FP32 rule.
    """
    if name not in BF16_CONTROLS:
        return {}
    top = torch.where(mask.bool(), logits.float().amax(dim=-1), 0.0)
    return {"precision": "bf16", "top_logit": top.numpy(), "temperature": temperature}


def _missing_mass(logits: torch.Tensor, temperature: float, ids: Any) -> torch.Tensor:
    """``[B, R]`` FP64 mass outside the top-k ``ids`` of ``log_softmax(logits / T)``."""
    lp = torch.log_softmax(logits.double() / temperature, dim=-1)
    kept = torch.exp(torch.gather(lp, -1, torch.from_numpy(np.asarray(ids)))).sum(-1)
    return torch.clamp(1.0 - kept, min=0.0)


def seal_distribution(contract: Any, actor_dir: Path, roll: dict[str, torch.Tensor],
                      out: Path) -> dict[str, Any]:
    """Compute and write the module docstring's two files into ``out``; return the JSON.

    Args:
        contract: the contract (``sampling.temperature``, ``algorithm.clip_ratio``,
            ``bounds.k``).
        actor_dir: the Actor's initial HF directory.
        roll: the frozen rollout's tensors (``prompts``, ``responses``, ``attention_mask``,
            ``position_ids``, ``response_mask``).
        out: the unsealed reference directory.
    """
    from qualify.evidence import store

    temperature = float(contract.sampling.temperature)
    clip = float(contract.algorithm.clip_ratio)
    k = float(contract.bounds.k)
    mask = roll["response_mask"]
    doc: dict[str, Any] = {"schema_version": 1, "weights": "actor initial (round 1)",
                           "temperature": temperature, "clip_ratio": clip, "k": k,
                           "floors": dict(FLOORS), "fp32_controls": list(FP32_CONTROLS),
                           "info_controls": list(INFO_CONTROLS),
                           "bf16_controls": list(BF16_CONTROLS),
                           "bf16_controls_ties": BF16_TIE_RULE}
    from transformers import AutoConfig

    vocab = int(AutoConfig.from_pretrained(str(actor_dir)).vocab_size)
    full = vocab <= MAX_VOCAB
    topk = int(contract.bounds.distribution_topk)
    if not full:
        doc["topk"] = {"k": topk, "why": f"vocabulary {vocab} > {MAX_VOCAB}: the top-{topk} "
                                         f"logprobs of each position are sealed, not the "
                                         f"whole distribution"}
    runs: dict[str, torch.Tensor] = {}
    routes: dict[str, Any] = {}
    for prefix, dtype in (("", torch.float32), ("bf16_", torch.bfloat16)):
        # one model at a time: the sdpa model serves the prefill, decode and batch runs
        sdpa = _model(actor_dir, "sdpa", dtype)
        builds: list[tuple[str, Callable[[], torch.Tensor]]] = [
            ("reference" if not prefix else BF16_CONTROL, functools.partial(_prefill, sdpa, roll)),
            (f"{prefix}decode", functools.partial(_per_sequence, sdpa, roll, decode=True)),
            (f"{prefix}batch", functools.partial(_per_sequence, sdpa, roll, decode=False)),
            (f"{prefix}attn_impl", functools.partial(_eager_prefill, actor_dir, dtype, roll))]
        for name, build in builds:
            with sdpa_recorder() as seen:
                runs[name] = build()
            routes[name] = dict(seen) or {"no SDPA call (eager attention)": 0}
        del sdpa, builds
    doc["routes"] = {"torch": torch.__version__, "num_threads": torch.get_num_threads(),
                     "sdpa_backends": routes}
    tensors: dict[str, torch.Tensor] = {}
    toks_np, mask_np = roll["responses"].numpy(), mask.numpy()
    for kind in KINDS:
        t = 1.0 if kind == "raw" else temperature
        ref = _logprobs(runs["reference"], t, mask)
        section: dict[str, Any] = {"controls": {}, "bounds": {}, "bounds_bf16": {}}
        if full:
            tensors[kind] = ref.contiguous()
        else:
            ref_k = _topk(ref, toks_np, topk)
            tensors.update({f"{kind}_{n}": torch.from_numpy(a).contiguous()
                            for n, a in ref_k.items()})
            miss = _missing_mass(runs["reference"], t, ref_k["topk_ids"])
            tensors[f"{kind}_missing_mass"] = torch.where(mask.bool(), miss, 0.0).contiguous()
            valid = miss[mask.bool()]
            section["missing_mass"] = {"max": float(valid.max()) if valid.numel() else 0.0,
                                       "mean": float(valid.mean()) if valid.numel() else 0.0}
        for name in FP32_CONTROLS + INFO_CONTROLS:
            lp = _logprobs(runs[name], t, mask).numpy()
            ties = _tie_args(name, runs[name], t, mask)
            if full:
                got = distribution_metrics(lp, ref.numpy(), toks_np, mask_np, clip_ratio=clip,
                                           **ties)
            else:
                mine = _topk(torch.from_numpy(lp), toks_np, topk)
                got = topk_metrics(mine["topk_logprobs"], mine["topk_ids"],
                                   ref_k["topk_logprobs"], ref_k["topk_ids"],
                                   cand_token=mine["token_logprobs"],
                                   ref_token=ref_k["token_logprobs"], mask=mask_np,
                                   clip_ratio=clip, **ties)
            got.pop("seq_max_kl")
            section["controls"][name] = got
        for s in STATISTICS if full else TOPK_STATISTICS:
            per = {c: float(section["controls"][c][s]) for c in FP32_CONTROLS}
            control = max(per, key=per.__getitem__)
            worst = per[control]
            section["bounds"][s] = {"bound": k * worst + FLOORS[s], "control": control,
                                    "control_error": worst, "k": k, "floor": FLOORS[s]}
            per16 = {c: float(section["controls"][c][s]) for c in BF16_CONTROLS}
            control16 = max(per16, key=per16.__getitem__)
            bf16 = per16[control16]
            section["bounds_bf16"][s] = {"bound": k * bf16 + FLOORS[s], "control": control16,
                                         "control_error": bf16, "k": k, "floor": FLOORS[s]}
        if not all(math.isfinite(v["bound"]) for v in section["bounds_bf16"].values()):
            del section["bounds_bf16"]  # the BF16 rows are NOT_RUN, the FP32 ones stand
            section["bounds_bf16_not_run"] = "a BF16 control's metric is not finite: no bound"
        doc[kind] = section
    # The sampler's decode-vs-prefill token-logprob row: HF decode against HF prefill.
    m = mask.bool().numpy()
    toks = roll["responses"].numpy()
    ref_t = _logprobs(runs["reference"], temperature, mask).numpy()
    dec_t = _logprobs(runs["decode"], temperature, mask).numpy()
    idx = np.nonzero(m)
    d = np.abs(dec_t[idx[0], idx[1], toks[m]].astype(np.float64)
               - ref_t[idx[0], idx[1], toks[m]].astype(np.float64))
    worst = float(d.max()) if d.size else 0.0
    doc["decode_vs_prefill"] = {"statistic": "max_abs", "control": "decode",
                                "control_error": worst, "k": k, "floor": LOGPROB_FLOOR,
                                "bound": k * worst + LOGPROB_FLOOR,
                                "mean_abs": float(d.mean()) if d.size else 0.0}
    if not all(math.isfinite(v["bound"]) for kind in KINDS if kind in doc
               for v in doc[kind]["bounds"].values()):
        doc["not_run"] = "a control's metric is not finite: no bound"
    if tensors:
        store.save_tensors(out / DISTRIBUTION_FILE, tensors)
    store.atomic_write_json(out / DISTRIBUTION_JSON, doc)
    return doc
