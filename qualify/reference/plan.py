"""``qualify plan``: what the reference stage and the candidate launches need, before they run.

A formula over the model's config, no run and no fit. Every term is named after what the
reference code holds at that step (:mod:`qualify.reference.update`,
:mod:`qualify.reference.sensitivity`, :mod:`qualify.reference.branches`), and the peak of a
step is the sum of the terms alive together there:

- ``weights``: the FP32 master (FP64 in the ``fp64`` control), ``4 P`` (``8 P``) bytes;
- ``grads``: its ``.grad``, the same size;
- ``adamw``: ``exp_avg`` and ``exp_avg_sq`` (``torch.optim.AdamW``, state in the master's
  dtype), ``2 x`` the weights, alive from round 1's step on;
- ``sensitivity_copy``: :meth:`~qualify.reference.sensitivity.LossSensitivity.grad_norm`'s
  ``saved`` copy of the parameters, one model in the master's dtype, in every round after
  the backward (so with round 2 the AdamW moments are alive beside it);
- ``bf16_work``: the BF16 working copy of the ``bf16`` lanes (``2 P``;
  :meth:`~qualify.reference.update._Precision.refresh`), its BF16 ``.grad`` (``2 P``) until
  ``collect_grads`` folds it into the master;
- ``autocast_cache``: torch's autocast keeps a BF16 cast of each weight for the region
  (``2 P``) in the ``bf16-autocast`` lanes;
- ``activations``: what autograd saves for one micro-batch (the per-token, per-layer element
  count of :func:`activation_elements`), plus ``logits``: the head's output at the response
  positions in ``LOGIT_COPIES`` FP32 copies (logits, ``z / T``, ``log_softmax``, softmax and
  the entropy's product);
- ``jt``: a clip-branch token's FP32 ``J_t``, one model; two are alive while the next is
  computed (the generator's tuple still holds the last one), so ``8 P``;
- ``jt_kept``: the fp64 Gram's whole ``J_t`` (at most :data:`qualify.reference.gram.
  FULL_BUDGET_BYTES` per lane, role and round: above it the stage spills factors to disk);
- ``gram_block``: the factored Gram's block of rebuilt ``J_t`` rows (:data:`GRAM_BLOCK_BYTES`);
- ``checkpoint_map``: a model file mapped while it is read (``roles.load_*``: safetensors
  maps the FP32 checkpoint, whose pages count as resident while mapped), one model;
- ``interpreter``: the process before any model, :data:`INTERPRETER_BYTES`.

Host-only execution (``devices = 0``, what the stage does today) puts every term on the host.
With devices, the plan of docs/scale.md section 3: weights, gradients, activations, the BF16
copy and ``J_t`` on the devices, whole layers per device (:func:`place_layers`); the AdamW
moments on the host (the chunked host AdamW); the sensitivity copy on the host.

Time: ``FLOPs / throughput`` with ``FLOPs = 2 P`` per token for a forward and ``6 P`` for
a forward and backward (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", eq.
2.1), the throughputs of :data:`THROUGHPUT` (their sources beside them). An estimate of order
only: the CPU's GEMM efficiency on the stage's small matrices is far below peak.

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from qualify.contract import Contract
from qualify.errors import ContractError, UsageError
from qualify.protocol import VOCAB_PARAMS

__all__ = ["INTERPRETER_BYTES", "DoesNotFitError", "Machine", "ModelShape", "Plan", "Step",
           "activation_elements", "build_plan", "check_fits", "machine_defaults", "model_shape",
           "place_layers", "plan_launches", "plan_reference"]

GB: Final = 10**9

INTERPRETER_BYTES: Final = 514 * 10**6
"""The stage's process before any model: Python, torch, transformers, every module of
``qualify.reference`` and ``qualify.evidence`` imported, and a 2-layer Qwen3 of 160 K
parameters run forward and backward in FP32, under BF16 autocast and with BF16 parameters
(the kernels' code and pools): ``VmRSS`` 501,556 KiB on the 2-core AMD EPYC CI machine
(docs/scale.md, "The memory model"; measured apart from the runs it is validated against)."""

LOGIT_COPIES: Final = 5
"""FP32 ``[b, R, V]`` tensors alive at once in :func:`qualify.reference.update.
_token_logprobs_entropy` and its backward (logits, ``z``, ``log_softmax``, ``softmax``,
``p * log p``)."""

THROUGHPUT: Final[Mapping[str, float]] = {
    # FLOP/s per CPU core: the best of 5 torch.mm of two 2048 x 2048 matrices on one thread of
    # the 2-core AMD EPYC CI machine (torch.set_num_threads(1)), measured while other jobs
    # held the load average near 20, so lower bounds: FP32 1.1e10, BF16 1.9e10 (this CPU has
    # BF16 units; one without them runs the stage's BF16 passes about 5x slower than FP32,
    # docs/scale.md section 5), FP64 3.8e9.
    "cpu-fp32": 1.1e10, "cpu-bf16": 1.9e10, "cpu-fp64": 3.8e9,
    # FLOP/s per device, NVIDIA H100/H200 SXM datasheet dense peaks at half: FP32 without
    # TF32 67 TFLOPS, FP64 tensor core 67 TFLOPS, BF16 989 TFLOPS.
    "gpu-fp32": 3.35e13, "gpu-bf16": 4.9e14, "gpu-fp64": 3.35e13,
}

CHECKPOINT_READ_BYTES_PER_S: Final = 1.0e9
"""Reading a model into FP32 (``roles.load_*``: safetensors read, dtype conversion): 1 GB/s,
an order for a local disk; loading dominates the device plan's time (docs/scale.md section
3)."""

HOST_ADAMW_BYTES_PER_S: Final = 2.0e10
"""The chunked host AdamW's memory traffic (one parameter read and written with its two
moments and gradient, ~28 bytes per FP32 element): 20 GB/s, a fraction of a server socket's
bandwidth (docs/scale.md section 3)."""


class DoesNotFitError(UsageError):
    """The contract's reference stage or a launch needs more memory than the machine has.

    Exit 2 (``USAGE_ERROR``): the input (contract plus the machine it is asked to run on)
    cannot be run; nothing was judged (not 1), nothing is corrupt (not 3), no defect (not 4).
    """


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A Llama / Qwen3 decoder's sizes (Hugging Face config field names).

    ``qk_norm``: Qwen3's per-head RMSNorm of queries and keys (``2 head_dim`` per layer).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool

    @property
    def qk_norm(self) -> bool:
        """Whether the layers norm queries and keys per head (Qwen3)."""
        return self.model_type == "qwen3"

    def layer_params(self) -> list[tuple[str, int]]:
        """One decoder layer's parameters: ``(name, numel)`` (Hugging Face names)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        out = [("self_attn.q_proj.weight", h * q), ("self_attn.k_proj.weight", h * kv),
               ("self_attn.v_proj.weight", h * kv), ("self_attn.o_proj.weight", q * h)]
        if self.qk_norm:
            out += [("self_attn.q_norm.weight", d), ("self_attn.k_norm.weight", d)]
        return [*out, ("mlp.gate_proj.weight", h * i), ("mlp.up_proj.weight", h * i),
                ("mlp.down_proj.weight", i * h), ("input_layernorm.weight", h),
                ("post_attention_layernorm.weight", h)]

    def params(self, role: str) -> list[tuple[str, int]]:
        """``(name, numel)`` of every trainable parameter of ``role``.

        ``actor``: embedding, layers, final norm, ``lm_head`` unless tied. ``critic``: the
        same backbone and ``*ForTokenClassification``'s one-label ``score`` with its bias
        (``hidden + 1``); ``reward``: ``*ForSequenceClassification``'s, without a bias.
        """
        h = self.hidden_size
        out = [("model.embed_tokens.weight", self.vocab_size * h)]
        for n in range(self.num_hidden_layers):
            out += [(f"model.layers.{n}.{k}", v) for k, v in self.layer_params()]
        out.append(("model.norm.weight", h))
        if role == "actor":
            if not self.tie_word_embeddings:
                out.append(("lm_head.weight", self.vocab_size * h))
        elif role == "critic":
            out += [("score.weight", h), ("score.bias", 1)]
        else:
            out.append(("score.weight", h))
        return out

    def count(self, role: str) -> int:
        """The number of trainable parameters of ``role`` (:meth:`params`)."""
        return sum(n for _, n in self.params(role))


_SHAPE_FIELDS: Final = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads")


def model_shape(contract: Contract) -> ModelShape:
    """The decoder's sizes from the contract: ``model.config`` over ``model.manifest.config``.

    ``model.source = "tiny-qwen3"`` is a Qwen3; otherwise ``model_type`` (``llama`` or
    ``qwen3``) must be pinned. ``head_dim`` defaults to ``hidden / heads``.

    Raises:
        ContractError: a needed field is absent, naming the contract and the field.
    """
    m = contract.model
    fields: dict[str, Any] = m.known_config
    where = f"{contract.path}: " if contract.path else ""
    model_type = "qwen3" if m.source == "tiny-qwen3" else fields.get("model_type")
    if model_type not in ("llama", "qwen3"):
        raise ContractError(f"{where}model.manifest.config.model_type: qualify plan knows "
                            f"'llama' and 'qwen3' decoders (got {model_type!r})")
    for f in _SHAPE_FIELDS:
        if not isinstance(fields.get(f), int):
            raise ContractError(f"{where}model.manifest.config.{f}: needed by qualify plan "
                                "(an integer)")
    heads = int(fields["num_attention_heads"])
    return ModelShape(
        model_type=str(model_type), vocab_size=int(fields["vocab_size"]),
        hidden_size=int(fields["hidden_size"]),
        intermediate_size=int(fields["intermediate_size"]),
        num_hidden_layers=int(fields["num_hidden_layers"]), num_attention_heads=heads,
        num_key_value_heads=int(fields["num_key_value_heads"]),
        head_dim=int(fields.get("head_dim") or int(fields["hidden_size"]) // heads),
        tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)))


def activation_elements(shape: ModelShape, *, eager: bool = False, positions: int = 0) -> int:
    """Elements autograd saves per token and layer of a Llama / Qwen3 decoder layer.

    Input RMSNorm: its input and output (``2 h``); q, k, v projections (their shared input
    counted once): q and k before and after the rotary embedding (``2 (H d + KV d)``, and
    with Qwen3's q/k norms their inputs ``H d + KV d``), v (``KV d``); SDPA: q and the
    repeated k, v (``3 H d``) and its output (``H d``), the output projection's contiguous
    input (``H d``); post-attention RMSNorm ``2 h``; the MLP: gate, up, SiLU(gate) and the
    down projection's input (``4 I``). Eager attention adds the probabilities and their
    softmax input, ``2 H positions`` per token.
    """
    h, i, d = shape.hidden_size, shape.intermediate_size, shape.head_dim
    q, kv = shape.num_attention_heads * d, shape.num_key_value_heads * d
    n = 2 * h + 2 * (q + kv) + kv + 5 * q + 2 * h + 4 * i
    if shape.qk_norm:
        n += q + kv
    if eager:
        n += 2 * shape.num_attention_heads * positions
    return n


@dataclasses.dataclass(frozen=True)
class Machine:
    """Where the stage runs.

    ``devices`` accelerators of ``device_bytes`` each (0: host only), ``host_bytes`` of
    memory and ``cores`` CPU cores.
    """

    devices: int
    device_bytes: int
    host_bytes: int
    cores: int
    device_kind: str = "gpu"


def machine_defaults() -> Machine:
    """This machine.

    CUDA devices and the smallest one's memory when torch sees any, the host's ``MemTotal``
    (``/proc/meminfo``) and its usable cores (``os.sched_getaffinity``).
    """
    host = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                host = int(line.split()[1]) * 1024
    except OSError:
        host = 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
    devices, dev_bytes = 0, 0
    try:
        import torch

        if torch.cuda.is_available():
            devices = torch.cuda.device_count()
            dev_bytes = min(torch.cuda.get_device_properties(i).total_memory
                            for i in range(devices))
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return Machine(devices=devices, device_bytes=dev_bytes, host_bytes=host, cores=cores)


@dataclasses.dataclass(frozen=True)
class Step:
    """One planned step: peak bytes per device and on the host, bytes written, seconds.

    ``terms``: the named terms of the host (or, with devices, of the fullest device) peak.
    """

    name: str
    kind: str
    device_peak: int
    host_peak: int
    written: int
    seconds: float
    terms: Mapping[str, int]
    processes: int = 1
    phase: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The step as JSON (``qualify plan --json``)."""
        return {"step": self.name, "kind": self.kind, "device_peak_bytes": self.device_peak,
                "host_peak_bytes": self.host_peak, "bytes_written": self.written,
                "seconds": round(self.seconds, 1), "processes": self.processes,
                "peak_phase": self.phase, "terms": dict(self.terms)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The whole plan: the machine, the model's parameter counts, the steps."""

    contract: str
    machine: Machine
    params: Mapping[str, int]
    steps: Sequence[Step]
    cost_model: str

    def shortfall(self, kind: str | None = None) -> str | None:
        """The first step that does not fit, as one line; ``None`` when all fit.

        Args:
            kind: only steps of this kind (``reference`` or ``launch``); default any.
        """
        m = self.machine
        for s in self.steps:
            if kind is not None and s.kind != kind:
                continue
            if s.host_peak > m.host_bytes:
                return (f"{s.name}: needs {s.host_peak / GB:.1f} GB of host memory, the "
                        f"machine has {m.host_bytes / GB:.1f} GB (short by "
                        f"{(s.host_peak - m.host_bytes) / GB:.1f} GB)")
            if m.devices and s.kind == "launch" and s.processes > m.devices:
                return (f"{s.name}: needs {s.processes} devices, one per rank; the machine "
                        f"has {m.devices}")
            if m.devices and s.device_peak > m.device_bytes:
                return (f"{s.name}: needs {s.device_peak / GB:.1f} GB on a device, each of "
                        f"the {m.devices} has {m.device_bytes / GB:.1f} GB (short by "
                        f"{(s.device_peak - m.device_bytes) / GB:.1f} GB)")
        return None

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON (``qualify plan --json``)."""
        return {"contract": self.contract, "machine": dataclasses.asdict(self.machine),
                "params": dict(self.params), "cost_model": self.cost_model,
                "steps": [s.to_dict() for s in self.steps], "shortfall": self.shortfall()}


def place_layers(layer_bytes: Sequence[int], devices: int, *, first: int = 0,
                 last: int = 0) -> list[list[int]]:
    """Whole layers per device, contiguous, the fullest device as light as it can be.

    Args:
        layer_bytes: each decoder layer's bytes, in order.
        devices: how many devices (at least 1).
        first: bytes only the first device holds (the embedding).
        last: bytes only the last device holds (final norm, head, logits).

    Returns:
        Per device, the indices of its layers (a device may hold none).

    Raises:
        ValueError: ``devices < 1``.
    """
    if devices < 1:
        raise ValueError("devices must be at least 1")
    n = len(layer_bytes)

    def split(cap: int) -> list[list[int]] | None:
        out: list[list[int]] = [[] for _ in range(devices)]
        dev, load = 0, first
        for k, b in enumerate(layer_bytes):
            while load + b > cap:
                dev += 1
                if dev >= devices:
                    return None
                load = 0
            out[dev].append(k)
            load += b
        # the last device also holds ``last``
        tail = max((d for d in range(devices) if out[d]), default=0)
        used = sum(layer_bytes[k] for k in out[tail]) + (first if tail == 0 else 0)
        if used + last > cap:
            if tail + 1 < devices:
                return out  # the head goes alone on the next device
            return None
        return out

    lo = max([first, last, *layer_bytes], default=0)
    hi = first + last + sum(layer_bytes)
    best = split(hi)
    assert best is not None or n == 0
    while lo < hi:
        mid = (lo + hi) // 2
        got = split(mid)
        if got is None:
            lo = mid + 1
        else:
            hi, best = mid, got
    return best if best is not None else [[] for _ in range(devices)]


def _device_peak(shape: ModelShape, role: str, per_param: float, act_per_layer: int,
                 head_extra: int, *, devices: int) -> int:
    """The fullest device's bytes with whole layers per device (:func:`place_layers`)."""
    layer = int(sum(n for _, n in shape.layer_params()) * per_param) + act_per_layer
    params = dict(shape.params(role))
    first = int(params["model.embed_tokens.weight"] * per_param)
    head = int((params.get("lm_head.weight", 0) + shape.hidden_size) * per_param) + head_extra
    if devices == 1:
        return first + head + layer * shape.num_hidden_layers
    placed = place_layers([layer] * shape.num_hidden_layers, devices, first=first, last=head)
    loads = [len(ks) * layer for ks in placed]
    loads[0] += first
    tail = max((d for d in range(devices) if placed[d]), default=0)
    if tail + 1 < devices and loads[tail] + head > max(loads):
        loads[tail + 1] += head
    else:
        loads[tail] += head
    return max(loads)


def _sampled_elements(params: Iterable[tuple[str, int]], exact: int, sampled: int, *,
                      vocab_rows: int = 0, vocab_size: int = 0) -> int:
    """Elements stored per per-parameter family (``qualify.protocol.ParamSampling.indices``).

    A parameter of at most ``exact`` elements is stored whole; a larger one as ``sampled``
    seeded elements, and a vocab-indexed one (:data:`qualify.protocol.VOCAB_PARAMS`,
    ``[vocab_size, H]``) also as ``vocab_rows`` whole rows (the rollout's distinct token ids;
    :func:`_rollout_ids_bound` gives an upper bound), capped at the whole parameter.
    """
    total = 0
    for name, n in params:
        if n <= exact:
            total += n
        elif vocab_rows and vocab_size and name in VOCAB_PARAMS and n % vocab_size == 0:
            total += min(n, sampled + vocab_rows * (n // vocab_size))
        else:
            total += min(n, sampled)
    return total


def _rollout_ids_bound(contract: Contract, vocab_size: int) -> int:
    """An upper bound on the rollout's distinct token ids (``ParamSampling.rows``).

    The prompts' distinct ids when they are given as token ids (else one per prompt
    position), plus one per response position of every sequence, plus the pad id; at most
    ``vocab_size``.
    """
    n_seq, prompt, resp, _ = _rollout_shape(contract)
    p = contract.prompts
    prompt_ids = (len({t for ids in p.token_ids for t in ids}) if p.token_ids is not None
                  else prompt * (n_seq // max(contract.sampling.samples_per_prompt, 1)))
    return min(vocab_size, prompt_ids + n_seq * resp + 1)


GRAM_BLOCK_BYTES: Final = 256 << 20
"""The factored Gram's block of rebuilt ``J_t`` rows
(:data:`qualify.reference.gram_factors.BLOCK_BYTES`, not imported: that module imports torch)."""

SAFETENSORS_HEADER_BYTES: Final = 121
"""Header bytes per tensor in a safetensors file (docs/scale.md section 2, measured)."""


def _rollout_shape(contract: Contract) -> tuple[int, int, int, str]:
    """``(sequences, longest prompt, response length, how the prompt length is known)``."""
    p, s = contract.prompts, contract.sampling
    if p.token_ids is not None:
        lengths, how = [len(x) for x in p.token_ids], "token ids"
    elif p.text is not None:
        # a byte-level BPE token covers at least one byte: an upper bound without a tokenizer
        lengths, how = [len(t.encode("utf-8")) for t in p.text], "UTF-8 bytes (upper bound)"
    else:
        lengths, how = [s.max_new_tokens], "prompts file (length taken as max_new_tokens)"
    n = len(lengths) * s.samples_per_prompt
    return n, max(lengths), s.max_new_tokens, how


def plan_reference(contract: Contract, machine: Machine) -> list[Step]:
    """The reference stage's steps in the order it runs them (module docstring).

    Each step's peak is the largest over its phases of the terms alive together: ``load``
    (the checkpoint mapped while the model is read), ``backward`` (a micro-batch's graph),
    ``sensitivity`` (the saved copy, forward only), ``tokens`` and ``gram`` (the clip-branch
    passes). With devices, the terms the plan keeps on the host (the AdamW moments, the
    sensitivity copy, the mapped checkpoint, the per-parameter temporaries of the host-side
    arithmetic) are the host's; the rest is placed on the devices, whole layers per device,
    one run at a time (so one device computes at a time: a pipeline without overlap).
    """
    from qualify.lanes import lane_bf16_mode, lane_precision
    from qualify.reference.branches import MAX_SEALED_TOKENS
    from qualify.reference.controls import control_settings
    from qualify.reference.gram import FULL_BUDGET_BYTES

    shape = model_shape(contract)
    roles = ["actor"] + ([] if contract.algorithm.name == "grpo" else ["critic"])
    p = {r: shape.count(r) for r in ("actor", "critic", "reward")}
    largest = {r: max(n for _, n in shape.params(r)) for r in p}
    n_seq, prompt, resp, _ = _rollout_shape(contract)
    positions = prompt + resp
    tokens = n_seq * positions
    mbs = contract.algorithm.micro_batch_size
    rounds = contract.algorithm.rounds
    ev = contract.evidence
    id_rows = _rollout_ids_bound(contract, shape.vocab_size)
    reported = {r: _sampled_elements(shape.params(r), ev.exact_elements, ev.sample_elements,
                                     vocab_rows=id_rows, vocab_size=shape.vocab_size)
                for r in p}
    n_tensors = {r: len(shape.params(r)) for r in p}
    dev = machine.devices > 0
    rate_key = "gpu" if dev else "cpu"
    units = 1 if dev else machine.cores  # whole layers per device: one device at a time
    host_side = {"checkpoint_map", "adamw", "sensitivity_copy", "host_temporaries"}
    steps: list[Step] = []

    def rate(prec: str) -> float:
        return THROUGHPUT[f"{rate_key}-{prec}"] * units

    def load_s(n_bytes: float) -> float:
        return n_bytes / CHECKPOINT_READ_BYTES_PER_S

    def acts(role: str, size: int, pos: int, elem: int, eager: bool) -> tuple[int, int]:
        """(one layer's saved activations of one micro-batch, the head's logits) in bytes."""
        per_layer = activation_elements(shape, eager=eager, positions=pos) * size * pos * elem
        logits = LOGIT_COPIES * size * resp * shape.vocab_size * 4 if role == "actor" else 0
        return per_layer, logits + 2 * size * pos * shape.hidden_size * 4

    def add(name: str, phases: Mapping[str, Mapping[str, int]], role_of: Mapping[str, str],
            per_param_dev: Mapping[str, float], act_dev: Mapping[str, tuple[int, int]], *,
            written: int, seconds: float) -> None:
        """Reduce phases to the step's peaks; with devices split host and device terms."""
        host_peak, dev_peak, at = 0, 0, ""
        terms_at_peak: dict[str, int] = {}
        for phase, terms in phases.items():
            if dev:
                host_t = {"interpreter": INTERPRETER_BYTES,
                          **{k: v for k, v in terms.items() if k in host_side}}
                d = _device_peak(shape, role_of[phase], per_param_dev[phase],
                                 act_dev[phase][0], act_dev[phase][1], devices=machine.devices)
                dev_peak = max(dev_peak, d)
            else:
                host_t = {"interpreter": INTERPRETER_BYTES, **terms}
            total = sum(host_t.values())
            if total > host_peak:
                host_peak = total
                terms_at_peak, at = {k: v for k, v in host_t.items() if v}, phase
        steps.append(Step(name=name, kind="reference", device_peak=dev_peak, host_peak=host_peak,
                          written=written, seconds=seconds, terms=terms_at_peak, phase=at))

    # scoring (stage._score_all): the Actor and the reference policy loaded in FP32 and held
    # together, then the Critic, then the reward model; forward only (one layer's
    # activations at a time), a BF16 copy of the parameters at BF16
    for score_prec in contract.matrix.precisions:
        bf16 = score_prec == "bf16"
        layer_act, head = acts("actor", mbs, positions, 2 if bf16 else 4, False)
        pa = p["actor"]
        phases = {
            "load": {"weights": 8 * pa, "checkpoint_map": 4 * pa},
            "forward": {"weights": 8 * pa, "bf16_work": 2 * pa if bf16 else 0,
                        "activations": layer_act + head}}
        flops = 2.0 * (2 * p["actor"] + p["critic"] + p["reward"]) * tokens
        add(f"scoring {score_prec}", phases, {"load": "actor", "forward": "actor"},
            {"load": 8, "forward": 8 + (2 if bf16 else 0)},
            {"load": (0, 0), "forward": (layer_act, head)}, written=6 * n_seq * resp * 4,
            seconds=flops / rate("bf16" if bf16 else "fp32")
            + load_s(4 * (2 * p["actor"] + p["critic"] + p["reward"])))

    lanes = contract.matrix.lanes()
    runs: list[tuple[str, str, str, int, int, bool]] = []
    for lane in lanes:
        runs.append((f"updates hf-{lane}", str(lane_precision(lane)),
                     str(lane_bf16_mode(lane)), mbs, 0, False))
    for lane in lanes:
        for name, (settings, attn) in control_settings(contract, lane).items():
            if name == "bf16_mode" and "bf16-autocast" in lanes:
                continue  # the stage reuses the autocast lane's update
            runs.append((f"control {name}-{lane}" + (" (eager)" if attn == "eager" else ""),
                         str(settings.precision), str(settings.bf16_mode),
                         settings.micro_batch_size,
                         settings.extra_left_padding + settings.extra_right_padding,
                         attn == "eager"))
    update_file = (SAFETENSORS_HEADER_BYTES * rounds * 4 * sum(n_tensors[r] for r in roles)
                   + 4 * rounds * 4 * sum(reported[r] for r in roles))

    def training(role: str, w: int, bf16_params: bool, autocast: bool) -> dict[str, int]:
        pr = p[role]
        return {"weights": w * pr, "grads": w * pr, "adamw": 2 * w * pr,
                "bf16_work": 2 * pr if bf16_params else 0,
                "autocast_cache": 2 * pr if autocast else 0}

    for label, prec, mode, size, extra, eager in runs:
        w = 8 if prec == "fp64" else 4  # the fp64 control's models, gradients and state
        bf16_params = prec == "bf16" and mode != "autocast"
        autocast = prec == "bf16" and mode == "autocast"
        elem = 8 if prec == "fp64" else (2 if bf16_params else 4)
        pos = positions + extra
        best: tuple[int, str] = (-1, "")
        flops, loads = 0.0, 0
        phases_by_role: dict[str, dict[str, dict[str, int]]] = {}
        for role in roles:
            pr = p[role]
            layer_act, head = acts(role, size, pos, elem, eager)
            # loading: FP32 from the checkpoint, then .double() for the fp64 control; the
            # Actor's run also loads the frozen reference policy beside it
            models_loaded = 2 if role == "actor" else 1
            train = training(role, w, bf16_params, autocast)
            phases = {
                "load": {"weights": models_loaded * w * pr, "checkpoint_map": 4 * pr,
                         "host_temporaries": 4 * pr if w == 8 else 0},
                "backward": {**train, "bf16_work": 4 * pr if bf16_params else 0,
                             "activations": layer_act * shape.num_hidden_layers + head},
                "sensitivity": {**train, "sensitivity_copy": w * pr,
                                "host_temporaries": 3 * 8 * largest[role],
                                "activations": layer_act + head},
            }
            phases_by_role[role] = phases
            peak = max(sum(t.values()) for t in phases.values())
            if peak > best[0]:
                best = (peak, role)
            flops += ((2 * pr * n_seq * pos if role == "actor" else 0)  # KL reference forward
                      + rounds * (6 + 4) * pr * n_seq * pos)  # fwd+bwd, sensitivity 2 fwd
            loads += models_loaded * 4 * pr
        role = best[1]
        layer_act, head = acts(role, size, pos, elem, eager)
        add(label, {f"{role} {k}": v for k, v in phases_by_role[role].items()},
            {f"{role} {k}": role for k in ("load", "backward", "sensitivity")},
            {f"{role} load": w, f"{role} backward": 2 * w + (4 if bf16_params else 0)
             + (2 if autocast else 0), f"{role} sensitivity": 2 * w + (2 if bf16_params else 0)},
            {f"{role} load": (0, 0), f"{role} backward": (layer_act, head),
             f"{role} sensitivity": (0, head)},
            written=update_file,
            seconds=flops / rate(prec if prec in ("fp64", "bf16") else "fp32")
            + load_s(loads)
            + (sum(4 * w * p[r] for r in roles) * rounds / HOST_ADAMW_BYTES_PER_S if dev else 0))

    # clip-branch passes (branches._rerun): per lane and role, the lane's update rerun, then
    # at round r >= 2 one FP32 backward per sealed token (at most MAX_SEALED_TOKENS per
    # round, at most every valid token) and the Gram
    k = min(MAX_SEALED_TOKENS, n_seq * resp)
    for lane in lanes:
        prec, mode = str(lane_precision(lane)), str(lane_bf16_mode(lane))
        bf16_params = prec == "bf16" and mode != "autocast"
        autocast = prec == "bf16" and mode == "autocast"
        for role in roles:
            pr = p[role]
            layer_act, head = acts(role, 1, positions, 4, False)
            train = training(role, 4, bf16_params, autocast)
            keep = k * 4 * pr <= FULL_BUDGET_BYTES
            phases = {
                "rerun": {**train, "sensitivity_copy": 4 * pr,
                          "host_temporaries": 3 * 8 * largest[role]},
                # the work copy's grads were folded into the master; J_t twice (the
                # generator's tuple holds the last one while the next is computed); the
                # FP64 <g, J_t> and |J_t|^2 of the largest parameter
                "tokens": {**train, "autocast_cache": 0, "jt": 8 * pr,
                           "jt_kept": k * 4 * pr if keep else 0,
                           "host_temporaries": 3 * 8 * largest[role],
                           "activations": layer_act * shape.num_hidden_layers + head},
                # the factored Gram (gram_factors.FactorCapture.gram), taken when the whole
                # J_t do not fit: one block of rebuilt J_t rows, the round's gradient of one
                # parameter in FP64 and its square
                "gram": {**train, "autocast_cache": 0,
                         "gram_block": 0 if keep else GRAM_BLOCK_BYTES,
                         "host_temporaries": 2 * 8 * largest[role]},
            }
            flops = (rounds * 10 * pr * n_seq * positions
                     + (rounds - 1) * k * 6 * pr * positions)
            written = (rounds - 1) * k * (4 * reported[role]
                                          + SAFETENSORS_HEADER_BYTES * n_tensors[role])
            extra_dev = 2 if bf16_params else 0
            add(f"branches hf-{lane} {role}", phases,
                {"rerun": role, "tokens": role, "gram": role},
                {"rerun": 8 + extra_dev, "tokens": 8 + extra_dev + 8, "gram": 8 + extra_dev},
                {"rerun": (0, head), "tokens": (layer_act, head), "gram": (0, 0)},
                written=written,
                seconds=flops / rate("fp32") + load_s((2 if role == "actor" else 1) * 4 * pr))
    return steps


def plan_launches(contract: Contract, machine: Machine) -> list[Step]:
    """One step per candidate launch: the matrix's cells grouped by engine and world size.

    Per rank, the cell's role's training state sharded by TP (``16 P / tp`` bytes at FP32:
    weights, gradients, AdamW moments; ``20 P / tp`` at BF16 with an FP32 master and a BF16
    copy and gradient), its activations over TP and the interpreter; with devices each rank
    holds one device, on the host every rank is a process (``world`` of them at once). The
    engines' own buffers (NCCL, DeepSpeed's flat buffers) are not counted.
    """
    shape = model_shape(contract)
    n_seq, prompt, resp, _ = _rollout_shape(contract)
    positions = prompt + resp
    mbs = contract.algorithm.micro_batch_size
    rounds = contract.algorithm.rounds
    ev = contract.evidence
    groups: dict[tuple[str, int], list[Any]] = {}
    for cell in contract.matrix.cells():
        world = cell.tp
        for _, deg in cell.axes:
            world *= deg
        groups.setdefault((cell.engine, world), []).append(cell)
    dev = machine.devices > 0
    steps: list[Step] = []
    for (engine, world), cells in groups.items():
        per_rank, written, flops = 0, 0, 0.0
        for cell in cells:
            pr = shape.count(cell.role)
            per_param = 20 if cell.precision == "bf16" else 16
            elem = 2 if cell.precision == "bf16" else 4
            act = (activation_elements(shape) * mbs * positions * elem
                   * shape.num_hidden_layers // cell.tp)
            logits = (LOGIT_COPIES * mbs * resp * shape.vocab_size * 4 // cell.tp
                      if cell.role == "actor" else 0)
            per_rank = max(per_rank, per_param * pr // cell.tp + act + logits)
            rep = _sampled_elements(shape.params(cell.role), ev.exact_elements,
                                    ev.sample_elements,
                                    vocab_rows=_rollout_ids_bound(contract, shape.vocab_size),
                                    vocab_size=shape.vocab_size)
            written += 4 * rounds * 4 * rep + SAFETENSORS_HEADER_BYTES * rounds * 4 * len(
                shape.params(cell.role))
            flops += rounds * 6 * pr * n_seq * positions
        rk = ("gpu" if dev else "cpu") + ("-bf16" if all(c.precision == "bf16" for c in cells)
                                          else "-fp32")
        units = min(world, machine.devices) if dev else min(world, machine.cores)
        seconds = flops / (THROUGHPUT[rk] * max(units, 1))
        host = (INTERPRETER_BYTES * world + (0 if dev else per_rank * world))
        steps.append(Step(name=f"launch {engine} world {world} ({len(cells)} cells)",
                          kind="launch", device_peak=per_rank if dev else 0, host_peak=host,
                          written=written, seconds=seconds, processes=world,
                          terms={"per_rank": per_rank, "interpreter": INTERPRETER_BYTES}))
    return steps


COST_MODEL: Final = (
    "memory: named terms of the reference code (qualify/reference/plan.py), summed where "
    "alive together; time: FLOPs = 2 P per token forward, 6 P forward+backward (Kaplan et al. "
    "2020), over THROUGHPUT per core (CPU) or per device (GPU) of qualify/reference/plan.py; "
    "host AdamW at 20 GB/s of memory traffic")


def build_plan(contract: Contract, machine: Machine) -> Plan:
    """The reference stage's steps then the candidate launches (:class:`Plan`)."""
    shape = model_shape(contract)
    steps = plan_reference(contract, machine) + plan_launches(contract, machine)
    return Plan(contract=contract.name, machine=machine,
                params={r: shape.count(r) for r in ("actor", "critic")}, steps=steps,
                cost_model=COST_MODEL)


def check_fits(contract: Contract, machine: Machine | None = None) -> Plan:
    """Plan ``contract`` on ``machine`` (default: this one); refuse what cannot fit.

    Only the reference stage's steps are checked: the launches are the candidate stage's,
    planned but not checked here.

    Raises:
        DoesNotFitError: one line naming the first step that does not fit and the shortfall.
        ContractError: the model's sizes are not in the contract (:func:`model_shape`).
    """
    plan = build_plan(contract, machine or machine_defaults())
    short = plan.shortfall("reference")
    if short is not None:
        where = f"{contract.path}" if contract.path else contract.name
        raise DoesNotFitError(f"{where}: does not fit this machine: {short}")
    return plan
