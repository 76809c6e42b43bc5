"""The plan's primitives: the model's sizes, the machine, a planned step, the whole plan.

What both stages' plans are written in: the reference stage's
(:mod:`qualify.reference.plan`) and the candidate stage's (:mod:`qualify.candidate.plan`).
:class:`ModelShape` (the decoder's sizes, from the contract: :func:`model_shape`) and
:func:`activation_elements` size the tensors; :class:`Machine` (:func:`machine_defaults`:
this one) is where they run; a :class:`Step` is one planned step's peaks, bytes written and
seconds, and a :class:`Plan` the steps in order, each checked against the machine
(:meth:`Plan.shortfall`). Beside them the rollout's shape (:func:`rollout_shape`), the
elements a per-parameter family stores (:func:`sampled_elements`), the vLLM processes of a
set of engines (:func:`vllm_processes`), and the constants both plans count with: a
process's interpreter (:data:`INTERPRETER_BYTES`), a vLLM process (:data:`VLLM_ENGINE_BYTES`),
the head's logit copies (:data:`LOGIT_COPIES`), a safetensors header
(:data:`SAFETENSORS_HEADER_BYTES`).

Time: ``FLOPs / throughput`` with ``FLOPs = 2 P`` per token for a forward and ``6 P`` for
a forward and backward (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", eq.
2.1), the throughputs of :data:`THROUGHPUT` (their sources beside them). An estimate of order
only: the CPU's GEMM efficiency on the stage's small matrices is far below peak.

This module imports neither torch nor any engine, nor either stage's plan.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from qualify.contract import Contract
from qualify.errors import ContractError
from qualify.hostmem import meminfo_bytes
from qualify.protocol import VOCAB_PARAMS

__all__ = ["GB", "INTERPRETER_BYTES", "LOGIT_COPIES", "SAFETENSORS_HEADER_BYTES", "THROUGHPUT",
           "VLLM_ENGINE_BYTES", "Machine", "ModelShape", "Plan", "Step", "activation_elements",
           "machine_defaults", "model_shape", "rollout_ids_bound", "rollout_shape",
           "sampled_elements", "vllm_processes"]

GB: Final = 10**9

INTERPRETER_BYTES: Final = 514 * 10**6
"""The stage's process before any model: Python, torch, transformers, every module of
``qualify.reference`` and ``qualify.evidence`` imported, and a 2-layer Qwen3 of 160 K
parameters run forward and backward in FP32, under BF16 autocast and with BF16 parameters
(the kernels' code and pools): ``VmRSS`` 501,556 KiB on the 2-core AMD EPYC CI machine
(docs/scale.md, "The memory model"; measured apart from the runs it is validated against)."""

VLLM_ENGINE_BYTES: Final = 597 * 10**6
"""A process holding vLLM (CPU build) before its model's parameters, mapped checkpoint and KV
cache: the reference stage's rollout child of tiny-qwen3 peaked at a PSS of 845,548 KiB (its
pages shared with other processes counted once), less its 256 MiB KV cache (docs/scale.md,
"The vLLM processes")."""

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
    memory and ``cores`` CPU cores. ``device_kind``: ``gpu`` (each device computes at
    :data:`THROUGHPUT`'s ``gpu`` rates) or ``cpu`` (``cpu`` devices under a memory budget,
    ``$QUALIFY_REFERENCE_DEVICE_MEMORY``: the reference stage's memory counted per device
    and, since they are in the host's memory, on the host too; time at the host's cores'
    rates; the candidate launches planned on the host).

    Raises:
        ValueError: ``device_kind`` is neither ``gpu`` nor ``cpu``.
    """

    devices: int
    device_bytes: int
    host_bytes: int
    cores: int
    device_kind: str = "gpu"

    def __post_init__(self) -> None:
        if self.device_kind not in {"gpu", "cpu"}:
            raise ValueError(f"Machine.device_kind: {self.device_kind!r}, expected gpu or cpu")


def machine_defaults() -> Machine:
    """This machine.

    CUDA devices and the smallest one's memory when torch sees any, the host's ``MemTotal``
    (``/proc/meminfo``) and its usable cores (``os.sched_getaffinity``).
    """
    host = meminfo_bytes("MemTotal") or 0
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

    ``reads``: ``{file relative to the reference: bytes}`` the step reads back from a sealed
    reference (``qualify verify``'s re-measurement of the control errors); empty for the
    stage's own steps.
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
    reads: Mapping[str, int] = dataclasses.field(default_factory=dict)
    device_phase: str = ""

    @property
    def read(self) -> int:
        """Bytes read back from a sealed reference (the sum of :attr:`reads`)."""
        return sum(self.reads.values())

    def to_dict(self) -> dict[str, Any]:
        """The step as JSON (``qualify plan --json``)."""
        return {"step": self.name, "kind": self.kind, "device_peak_bytes": self.device_peak,
                "host_peak_bytes": self.host_peak, "bytes_written": self.written,
                "bytes_read": self.read, "files_read": dict(self.reads),
                "seconds": round(self.seconds, 1), "processes": self.processes,
                "peak_phase": self.phase, "device_peak_phase": self.device_phase,
                "terms": dict(self.terms)}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The whole plan: the machine, the model's parameter counts, the steps."""

    contract: str
    machine: Machine
    params: Mapping[str, int]
    steps: Sequence[Step]
    cost_model: str
    optimizer_state: str = "device"
    optimizer_state_why: str = ""
    gradients: str = "device"
    gradients_why: str = ""
    round2_state: str = "moments"
    round2_state_why: str = ""

    def __post_init__(self) -> None:
        # a tuple: what does not fit is found once (:attr:`_short`), so the steps never change
        object.__setattr__(self, "steps", tuple(self.steps))

    def shortfall(self, kind: str | None = None) -> str | None:
        """The first step that does not fit, as one line; ``None`` when all fit.

        Args:
            kind: only steps of this kind (``reference`` or ``launch``); default any.
        """
        found = self._first_short(kind)
        return None if found is None else found[1]

    def shortfalls(self, kind: str | None = None) -> list[str]:
        """Every step that does not fit, one line each, in the plan's order (``[]``: all fit).

        Args:
            kind: only steps of this kind (``reference`` or ``launch``); default any.
        """
        return [line for _, line in self.short_steps(kind)]

    def short_steps(self, kind: str | None = None) -> list[tuple[Step, str]]:
        """Every step that does not fit with its line, in the plan's order (``[]``: all fit).

        Args:
            kind: only steps of this kind (``reference`` or ``launch``); default any.
        """
        return [(s, line) for _, s, line in self._short if kind is None or s.kind == kind]

    def _first_short(self, kind: str | None) -> tuple[int, str] | None:
        """``(index of the first step that does not fit, its line)``; ``None``: all fit."""
        return next(((i, line) for i, s, line in self._short
                     if kind is None or s.kind == kind), None)

    @functools.cached_property
    def _short(self) -> tuple[tuple[int, Step, str], ...]:
        """``(index, step, line)`` of every step that does not fit, in the plan's order.

        Found once per plan (:meth:`_short_line` of each step); every question about what does
        not fit is answered from it.
        """
        return tuple((i, s, line) for i, s in enumerate(self.steps)
                     if (line := self._short_line(s)) is not None)

    def _short_line(self, s: Step) -> str | None:
        """Why step ``s`` does not fit this plan's machine, one line; ``None`` when it fits.

        Host memory first, then (GPU devices, launches) one device per rank, then the memory
        of its fullest device.
        """
        m = self.machine
        if s.host_peak > m.host_bytes:
            return (f"{s.name}: needs {_size(s.host_peak)} of host memory, the machine has "
                    f"{_size(m.host_bytes)} (short by {_size(s.host_peak - m.host_bytes)})")
        if m.devices and m.device_kind == "gpu" and s.kind == "launch" \
                and s.processes > m.devices:
            return (f"{s.name}: needs {s.processes} devices at once; the machine has "
                    f"{m.devices}")
        if m.devices and s.device_peak > m.device_bytes:
            return (f"{s.name}: needs {_size(s.device_peak)} on a device, each of the "
                    f"{m.devices} has {_size(m.device_bytes)} (short by "
                    f"{_size(s.device_peak - m.device_bytes)})")
        return None

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON (``qualify plan --json``)."""
        return {"contract": self.contract, "machine": dataclasses.asdict(self.machine),
                "params": dict(self.params), "cost_model": self.cost_model,
                "optimizer_state": self.optimizer_state,
                "optimizer_state_why": self.optimizer_state_why,
                "gradients": self.gradients, "gradients_why": self.gradients_why,
                "round2_state": self.round2_state, "round2_state_why": self.round2_state_why,
                "steps": [s.to_dict() for s in self.steps], "shortfall": self.shortfall(),
                "shortfalls": self.shortfalls()}


def _size(n: int) -> str:
    """``n`` bytes for a refusal line, never ``0.0`` of a unit.

    GB with one decimal; MB below 0.1 GB; bytes below 0.1 MB.
    """
    if n >= GB // 10:
        return f"{n / GB:.1f} GB"
    return f"{n / 10**6:.1f} MB" if n >= 10**5 else f"{n} bytes"


def sampled_elements(params: Iterable[tuple[str, int]], exact: int, sampled: int, *,
                      vocab_rows: int = 0, vocab_size: int = 0) -> int:
    """Elements stored per per-parameter family (``qualify.protocol.ParamSampling.indices``).

    A parameter of at most ``exact`` elements is stored whole; a larger one as ``sampled``
    seeded elements, and a vocab-indexed one (:data:`qualify.protocol.VOCAB_PARAMS`,
    ``[vocab_size, H]``) also as ``vocab_rows`` whole rows (the rollout's distinct token ids;
    :func:`rollout_ids_bound` gives an upper bound), capped at the whole parameter.
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


def rollout_ids_bound(contract: Contract, vocab_size: int) -> int:
    """An upper bound on the rollout's distinct token ids (``ParamSampling.rows``).

    The prompts' distinct ids when they are given as token ids (else one per prompt
    position), plus one per response position of every sequence, plus the pad id; at most
    ``vocab_size``.
    """
    n_seq, prompt, resp, _ = rollout_shape(contract)
    p = contract.prompts
    prompt_ids = (len({t for ids in p.token_ids for t in ids}) if p.token_ids is not None
                  else prompt * (n_seq // max(contract.sampling.samples_per_prompt, 1)))
    return min(vocab_size, prompt_ids + n_seq * resp + 1)



SAFETENSORS_HEADER_BYTES: Final = 121
"""Header bytes per tensor in a safetensors file (docs/scale.md section 2, measured)."""



def rollout_shape(contract: Contract) -> tuple[int, int, int, str]:
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




def vllm_processes(tps: Sequence[int]) -> int:
    """Processes holding vLLM for engines of TP ``tps`` started by one process.

    That process (which runs the TP 1 engine, if any) and ``t`` ranks for each engine of
    ``t > 1`` (forked, or spawned by vLLM's executor).
    """
    return 1 + sum(t for t in tps if t > 1)

