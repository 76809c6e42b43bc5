"""The harness protocol: file names, tensor names and the computation every engine runs.

This module is the one place where the interface between qualify and an engine
harness is written down (docs/engine-guide.md). It holds names and types only, no
numerics, so the reference path and the harnesses share no numerical code. The names and
the per-parameter sampling a harness needs too (file and tensor names, :class:`ParamSampling`)
are defined once in the harness SDK (``qualify_harness.protocol``) and re-exported here.

Rollout layout (verl's convention; ``B`` sequences, ``P`` prompt length, ``R`` response length)
---------------------------------------------------------------------------------------------
``rollout.safetensors``:

- ``prompts`` ``[B, P]`` int64, **left**-padded with ``pad_token_id``.
- ``responses`` ``[B, R]`` int64, **right**-padded with ``pad_token_id``.
- ``attention_mask`` ``[B, P + R]`` int64, 1 on real prompt and response tokens.
- ``position_ids`` ``[B, P + R]`` int64, ``clamp(cumsum(attention_mask) - 1, min=0)``.
- ``response_mask`` ``[B, R]`` int64, 1 on response tokens that count in losses.
- ``behavior_logprobs`` ``[B, R]`` float32, the sampler's logprob of each sampled token
  (``logprobs_mode`` in ``rollout.json`` says which distribution).
- ``eos_terminated`` ``[B]`` int64, 1 if the response ended with EOS, 0 if cut by length.
- ``group_index`` ``[B]`` int64, index of the prompt a sample came from.

Per-token quantities at response position ``t`` are computed from the model output at
sequence position ``P - 1 + t`` (the state before token ``t`` was emitted): the
logprob of ``responses[:, t]`` and the critic value ``V(s_t)``.

Training inputs (``train_inputs.safetensors``, what an RL driver hands to its engines):
``advantages`` ``[B, R]`` float32 and ``returns`` ``[B, R]`` float32, computed by the
reference stage in FP64 from the HF FP32 scores. A harness gets the rollout, these
inputs, the model directories and the contract; never the reference scores.

The update every engine runs (per role, per round ``r = 1..rounds``)
-------------------------------------------------------------------
``N`` = number of valid response tokens in the whole batch (``response_mask.sum()``).
Micro-batches of ``micro_batch_size`` sequences; each micro-batch's loss is the **sum**
over its valid tokens of ``c[b, t] · x[b, t]``, with a per-token factor ``c`` whose
denominators are global, so the accumulated gradient does not depend on the partition
(micro-batches, or data-parallel ranks). Gradients accumulate in FP32.

Loss aggregation (the contract's ``algorithm.loss_agg_mode``, verl ``core_algos.agg_loss``'s
names; ``n_b`` = valid tokens of sequence ``b``, ``B'`` = sequences with ``n_b > 0``), for
every term below (policy, KL, entropy, value):

- ``token-mean`` (default): ``c = 1 / N``; "``Σ / N``" below.
- ``seq-mean-token-sum``: ``c = 1 / B'`` (Dr. GRPO, Liu et al. 2025, arXiv 2503.20783).
- ``seq-mean-token-mean``: ``c = 1 / (B' · n_b)`` (GRPO, Shao et al. 2024, arXiv
  2402.03300 eq. 3).

Written as ``Σ_{b,t} m · x · row_weight[b] / denominator`` with ``(row_weight,
denominator)`` = ``(1, N)``, ``(1, B')``, ``(1 / n_b, B')``; for ``token-mean`` the row
weight is exactly 1.

GRPO (``algorithm.name = "grpo"``): no critic; the advantages in ``train_inputs`` are
``(s_b - mean_g) / (std_g + grpo_eps)`` of each response's score within its prompt's group
(unbiased std; ``grpo_norm_by_std = false``: ``s_b - mean_g``, Dr. GRPO; verl
``compute_grpo_outcome_advantage``). The actor's losses are the PPO ones below.

Decoupled PPO (``algorithm.name = "decoupled_ppo"``; Hilton et al. 2022, arXiv 2110.00641;
AReaL ``realhf/impl/model/utils/ppo_functional.py::ppo_actor_loss_fn``): the proximal
policy is the engine's own round-1 logprobs ``old`` (as PPO's clip centre), the behavior
policy the rollout's ``behavior_logprobs``; each token's policy surrogate is multiplied by
the detached weight ``w = exp(old - behavior_logprobs)``, with ``behavior_weight_cap = C``:
``truncate``: ``min(w, C)``; ``filter``: ``w`` if ``w <= C`` else 0 (AReaL's
``behav_mask``). ``w`` is fixed by round 1 and used in every round. Each trainer reports
``loss_agg_mode`` and, for decoupled PPO, ``behavior_weight`` (per round: mean, min, max of
the uncapped ``w`` over valid tokens, ``fraction_capped`` = share above ``C``, ``tokens``)
under its role in ``outputs.json``.

Actor (policy ``π``, frozen reference policy ``π_ref``, estimator per contract):

- ``logprobs_r`` = teacher-forced logprobs of ``responses`` with the current weights:
  ``log_softmax(logits / temperature)`` with the contract's sampling temperature, as verl's
  actor does (``logits.div_(temperature)``), so that ratios refer to the sampling
  distribution; no top-k/top-p truncation.
- ``old_logprobs`` = ``logprobs_1`` (the engine's own, detached); ``ratio = exp(logprobs_r - old)``.
- ``policy`` loss = Σ max(-A·ratio, -A·clip(ratio, 1-ε, 1+ε)) / N (Schulman et al. 2017, eq. 7;
  decoupled PPO: each term times ``w``).
- ``kl`` loss = kl_loss_coef · Σ k(logprobs_r, ref_logprobs) / N with
  ``k3 = exp(ref - lp) - (ref - lp) - 1``, ``k1 = lp - ref``, ``k2 = (lp - ref)^2 / 2``
  (Schulman 2020, "Approximating KL divergence").
- ``entropy`` loss = -entropy_coef · Σ H_t / N, ``H_t`` the entropy of
  ``softmax(logits / temperature)``.
- ``total`` = policy + kl + entropy.

Critic (value head ``Linear(hidden, 1)`` on the backbone):

- ``values_r`` at response positions; ``old_values`` = ``values_1`` (detached).
- ``value`` loss = 0.5 · Σ max((V - G)^2, (old + clip(V - old, -δ, δ) - G)^2) / N.
- ``total`` = value.

Then for each role: ``grad_norm`` = global L2 norm of the FP32 gradients (before clipping,
each parameter counted once), ``clip_coef = min(1, max_grad_norm / (grad_norm + 1e-6))``
(``torch.nn.utils.clip_grad_norm_``), gradients scaled by ``clip_coef``, then one
``torch.optim.AdamW``-semantics step (decoupled weight decay, bias correction) on FP32
master weights with FP32 state.

Output tensor names (``outputs.safetensors`` of a harness, and the reference's own files)
------------------------------------------------------------------------------------
``round{r}/{role}/{metric}`` with metric one of ``logprobs`` ``[B, R]``, ``entropy`` ``[B, R]``,
``values`` ``[B, R]``, ``loss/{term}`` (0-d), ``grad_norm`` (0-d), ``clip_coef`` (0-d),
``grads/{hf_param_name}`` (FP32, HF layout, **before** clipping), ``exp_avg/{name}``,
``exp_avg_sq/{name}`` (after the step), ``updates/{name}`` (master after - before) — each
exact when the parameter has at most ``exact_elements`` elements (the contract's
:class:`ParamSampling`; default :data:`EXACT_PARAM_ELEMENTS`), otherwise the flattened
values at the seeded sample :func:`param_sample_indices` (``sample_elements``, the same
elements on every side, so relative L2 errors are estimated on a fixed sample),
and ``logprobs_padded`` / ``values_padded`` (the padding-invariance rerun, same shape as
``logprobs``); an Actor on the harness SDK may add round 1's ``prefill_*`` distributions
(:mod:`qualify_harness.distribution`; their top-k ids are int64). All floating tensors are
stored as float32 (or float64 for FP64 targets).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

# The names and the sampling the harness SDK shares with qualify, written once there.
from qualify_harness.protocol import (
    CELL_FILE,
    CONTRACT_FILE,
    EXACT_PARAM_ELEMENTS,
    EXTRA_RIGHT_PADDING,
    MODEL_FILE,
    OUTPUTS_FILE,
    OUTPUTS_META_FILE,
    PADDED_SUFFIX,
    ROLLOUT_FILE,
    ROLLOUT_KEYS,
    SAMPLED_PARAM_ELEMENTS,
    TRAIN_INPUT_KEYS,
    TRAIN_INPUTS_FILE,
    VOCAB_PARAMS,
    ParamSampling,
    tensor_name,
)

__all__ = [
    "ACTOR_LOSS_TERMS",
    "ACTOR_ROUND1_WEIGHTS",
    "CELL_FILE",
    "CONTRACT_FILE",
    "CRITIC_LOSS_TERMS",
    "DEFAULT_SAMPLING",
    "EXACT_PARAM_ELEMENTS",
    "EXTRA_RIGHT_PADDING",
    "HARNESS_SDK_MAJOR",
    "MODEL_FILE",
    "OUTPUTS_FILE",
    "OUTPUTS_META_FILE",
    "PADDED_SUFFIX",
    "PER_PARAM_METRICS",
    "PER_TOKEN_METRICS",
    "ROLLOUT_FILE",
    "ROLLOUT_KEYS",
    "ROLLOUT_META_FILE",
    "SAMPLED_PARAM_ELEMENTS",
    "SCALAR_METRICS",
    "TRAIN_INPUTS_FILE",
    "TRAIN_INPUT_KEYS",
    "VARIANT_EXTRA_KEYS",
    "VOCAB_PARAMS",
    "HarnessCell",
    "ParamSampling",
    "Verdict",
    "param_sample_indices",
    "parse_tensor_name",
    "tensor_name",
    "variant_dir",
    "variant_tag",
]

ROLLOUT_META_FILE: Final = "rollout.json"
ACTOR_ROUND1_WEIGHTS: Final = "actor_round1.safetensors"
"""The Actor's full HF-layout FP32 weights after its round-1 step (``export_weights``)."""

HARNESS_SDK_MAJOR: Final = 1
"""The harness SDK major version (``outputs.json`` ``sdk_version`` = ``MAJOR.MINOR``, written
by ``qualify_harness``) whose outputs this comparator reads; another major is refused."""

ACTOR_LOSS_TERMS: Final = ("policy", "kl", "entropy", "total")
CRITIC_LOSS_TERMS: Final = ("value", "total")

PER_TOKEN_METRICS: Final = {"actor": ("logprobs", "entropy"), "critic": ("values",)}
SCALAR_METRICS: Final = ("grad_norm", "clip_coef")
PER_PARAM_METRICS: Final = ("grads", "exp_avg", "exp_avg_sq", "updates")

Verdict = Literal["PASS", "FAIL", "NOT_RUN", "ERROR"]

DEFAULT_SAMPLING: Final = ParamSampling()
"""The sampling of a contract without an ``[evidence]`` section."""


def param_sample_indices(name: str, numel: int,
                         sampling: ParamSampling = DEFAULT_SAMPLING,
                         ) -> npt.NDArray[np.int64] | None:
    """Which flattened elements of a per-parameter tensor are reported.

    Args:
        name: the HF parameter name.
        numel: its number of elements.
        sampling: the contract's :class:`ParamSampling` (``Contract.evidence``, or
            ``HarnessCell.param_sampling`` in a harness).

    Returns:
        ``None`` when the tensor is reported exactly; otherwise the seeded sample
        (:meth:`ParamSampling.indices`).
    """
    return sampling.indices(name, numel)


def parse_tensor_name(name: str) -> tuple[int, str, str, str | None]:
    """Split a tensor name into ``(round, role, metric, param)``.

    Raises:
        ValueError: the name does not follow ``round{r}/{role}/{metric}[/{param}]`` with
            ``r`` a 1-based round in ASCII digits without a leading zero (``round0``,
            ``round01`` and ``round²`` are not rounds).
    """
    parts = name.split("/", 3)
    digits = parts[0][5:]
    if (len(parts) < 3 or not parts[0].startswith("round") or not digits.isascii()
            or not digits.isdigit() or digits.startswith("0")):
        raise ValueError(f"not a protocol tensor name: {name!r}")
    r, role, metric = int(parts[0][5:]), parts[1], parts[2]
    rest = parts[3] if len(parts) == 4 else None
    if metric == "loss":
        if rest is None:
            raise ValueError(f"loss tensor without a term: {name!r}")
        return r, role, f"loss/{rest}", None
    return r, role, metric, rest


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HarnessCell:
    """What a harness is told to run (``cell.json``).

    One launch runs one topology of one engine x precision x options: the Actor on ranks
    ``[0, actor_tp)`` and the Critic on ranks ``[actor_tp, actor_tp + critic_tp)``, each in
    its own TP process group. Either TP may be 0 when only one role runs.

    Attributes:
        engine: engine name.
        precision: ``fp32`` or ``bf16``.
        options: engine options (e.g. ``{"zero": 1}``).
        actor_tp: Actor TP size (0 = no actor).
        critic_tp: Critic TP size (0 = no critic).
        rounds: optimizer rounds.
        seed: seed for anything the engine randomises (dropout is off).
        inputs_dir: directory with rollout, train inputs, ``contract.json`` and ``model.json``.
        output_dir: where the harness writes ``outputs.*`` and rank logs.
        collective_timeout_s: timeout of every collective (a hang becomes an error).
        faults: names of deliberate faults to inject (test suite only; empty in real runs).
        variants: several ``{"precision": ..., "options": {...}}`` runs in one launch
            (process-group reuse: one ``torchrun``, one ``init_process_group``, fresh
            models per variant). A variant may also carry its own topology (``"actor_tp"``,
            ``"critic_tp"``, both or neither; every variant of a launch has the launch's
            world size ``actor_tp + critic_tp``): the harness then builds that topology's
            role groups inside the launch (issue #17), and may carry ``"export_weights"``
            (default: the cell's). Empty: the single variant ``precision`` / ``options``,
            written to ``output_dir``. Non-empty: variant ``v`` is written to
            ``output_dir /`` :func:`variant_dir` ``(v)``.
        export_weights: the Actor writes its full HF-layout weights after the round-1
            step to ``<output dir>/`` :data:`ACTOR_ROUND1_WEIGHTS` (the candidate stage asks
            only the contract's ``sampler.weights_from`` cell; the sampler installs them).
        param_sampling: how per-parameter families are stored (the contract's
            ``[evidence]`` section, :class:`ParamSampling`).
        probe: ``qualify diverge`` only: ``{"round": r, "dir": path}`` asks the harness to
            capture every probed module's output and output gradient in round ``r``
            (``harnesses/layer_probe.py``) into ``dir``; ``None`` (every normal cell, and
            then absent from ``cell.json``): no hooks.
        resume: resume cells only (:mod:`qualify.candidate.resume_stage`):
            ``{"phase": "save" | "load", "after_round": k, "dir": path}``. ``save``: run
            rounds ``1..k`` and write a checkpoint in the engine's own format to ``dir``;
            ``load``: a fresh launch loads it and runs rounds ``k + 1..rounds``, writing
            only those rounds' tensors and its role meta's ``resume`` record. ``None``
            (absent from ``cell.json``): an uninterrupted run.
    """

    engine: str
    precision: Literal["fp32", "bf16"]
    options: dict[str, int]
    actor_tp: int
    critic_tp: int
    rounds: int
    seed: int
    inputs_dir: str
    output_dir: str
    collective_timeout_s: float = 120.0
    faults: tuple[str, ...] = ()
    variants: tuple[dict[str, Any], ...] = ()
    export_weights: bool = False
    param_sampling: ParamSampling = DEFAULT_SAMPLING
    probe: dict[str, Any] | None = None
    resume: dict[str, Any] | None = None

    @property
    def world_size(self) -> int:
        """Total ranks of the launch."""
        return self.actor_tp + self.critic_tp

    def to_dict(self) -> dict[str, Any]:
        """JSON form of ``cell.json``."""
        d = dataclasses.asdict(self)
        d["faults"] = list(self.faults)
        d["variants"] = [{**{k: v[k] for k in VARIANT_EXTRA_KEYS if k in v},
                          "precision": v["precision"], "options": dict(v["options"])}
                         for v in self.variants]
        d["param_sampling"] = self.param_sampling.to_dict()
        if self.probe is None:
            del d["probe"]
        if self.resume is None:
            del d["resume"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HarnessCell:
        """Inverse of :meth:`to_dict`."""
        return cls(**{**d, "faults": tuple(d.get("faults", ())),
                      "variants": tuple(dict(v) for v in d.get("variants", ())),
                      "param_sampling": ParamSampling.from_dict(d.get("param_sampling"))})

    def variant_runs(self) -> list[tuple[str, dict[str, int], str]]:
        """What to run, in order: ``(precision, options, output subdirectory)``.

        The subdirectory is ``""`` for a single-variant cell (write to ``output_dir``),
        else :func:`variant_tag`.
        """
        if not self.variants:
            return [(self.precision, dict(self.options), "")]
        return [(str(v["precision"]), dict(v["options"]), variant_dir(v))
                for v in self.variants]

    def variant_cells(self) -> list[HarnessCell]:
        """Every variant as a single-variant cell, in launch order.

        Each has the variant's precision, options and topology (``actor_tp`` /
        ``critic_tp``, default the launch's), ``export_weights`` (default the launch's),
        ``output_dir /`` :func:`variant_dir` and no ``variants``; a cell without
        ``variants`` is its own one variant.

        Raises:
            ValueError: a variant's ``actor_tp + critic_tp`` is not the launch's world size
                (one process group cannot serve it).
        """
        if not self.variants:
            return [self]
        out: list[HarnessCell] = []
        for v in self.variants:
            a, c = int(v.get("actor_tp", self.actor_tp)), int(v.get("critic_tp", self.critic_tp))
            if a + c != self.world_size:
                raise ValueError(f"variant {variant_dir(v)}: actor_tp + critic_tp = {a + c}, "
                                 f"but the launch has {self.world_size} ranks")
            out.append(dataclasses.replace(
                self, precision=v["precision"], options=dict(v["options"]), actor_tp=a,
                critic_tp=c, export_weights=bool(v.get("export_weights", self.export_weights)),
                output_dir=str(Path(self.output_dir) / variant_dir(v)), variants=()))
        return out


VARIANT_EXTRA_KEYS: Final = ("actor_tp", "critic_tp", "export_weights")
"""Optional keys of a ``variants`` entry besides ``precision`` and ``options``."""


def variant_tag(precision: str, options: Mapping[str, int],
                topology: tuple[int, int] | None = None) -> str:
    """Output subdirectory of one variant of a grouped launch: ``bf16-zero1``, ``fp32-a1c2``.

    Args:
        precision: ``fp32`` or ``bf16``.
        options: engine options in contract order (``{"zero": 1}``).
        topology: ``(actor_tp, critic_tp)`` when the variant carries its own topology (a
            launch of several topologies): appended as ``-a{actor_tp}c{critic_tp}``.
    """
    tag = precision + "".join(f"-{k}{v}" for k, v in options.items())
    return tag if topology is None else f"{tag}-a{topology[0]}c{topology[1]}"


def variant_dir(variant: Mapping[str, Any]) -> str:
    """:func:`variant_tag` of one ``variants`` entry (its topology when it carries one)."""
    topo = ((int(variant.get("actor_tp", 0)), int(variant.get("critic_tp", 0)))
            if "actor_tp" in variant or "critic_tp" in variant else None)
    return variant_tag(str(variant["precision"]), variant["options"], topo)
