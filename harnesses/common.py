"""What every trainer harness does the same way, none of it numerical.

The torch_tp, DeepSpeed and Megatron-Core harnesses read the same inputs, write the same
output files and start the same way; this module holds that scaffolding once. It holds no
model computation, loss, norm or optimizer code: each engine's numbers come from its own
modules (``harnesses/<engine>/``), and the reference path (``qualify.reference.scoring``,
``qualify.reference.targets``, ``qualify.reference.update``) shares nothing with any of them.

The stack adapters (TRL, verl: ``harnesses/trl``, ``harnesses/verl``), which run a stack's
own loss and update rather than the SDK's, start and end the same way too
(:func:`stack_inputs`, :func:`merge_stack_outputs`) and read their stack's compute dtypes and
clip the same way (:func:`compute_dtype_hooks`, :func:`measured_clip_coef`): measurements of
what the stack did, never part of its update.

Files (docs/engine-guide.md): a harness reads ``cell.json`` and, from ``inputs_dir``,
``rollout.safetensors``, ``train_inputs.safetensors``, ``contract.json`` and ``model.json``
(never reference scores). TP rank 0 of each role writes its role's part
(``.part-<role>.safetensors`` then ``.part-<role>.json``, each by atomic rename, the JSON
last); global rank 0 waits for every part and merges them into ``outputs.safetensors`` +
``outputs.json`` (JSON last).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn

import qualify_harness as sdk
import torch
from safetensors.torch import save
from torch import Tensor, nn

from qualify import atomic
from qualify.candidate import imported
from qualify.contract import Contract
from qualify.errors import HarnessError
from qualify.protocol import (
    CELL_FILE,
    HarnessCell,
)

Batch = sdk.Batch
"""The rollout rows an engine consumes (:class:`qualify_harness.Batch`)."""
micro_slices = sdk.micro_slices
"""Row slices of a micro-batch partition (:func:`qualify_harness.micro_slices`)."""

PART_WAIT_S: Final = 24 * 3600.0
"""Upper bound of rank 0's wait for the other role's part (torchrun ends the job first
when a rank fails; the launcher's wall-clock timeout ends a stuck one)."""


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Inputs:
    """What a harness reads from ``inputs_dir`` (and nothing else).

    Attributes:
        batch: the rollout with the training inputs.
        recipe: the SDK's view of the contract (what its round driver runs).
        contract: the contract (``contract.json``).
        actor_dir, critic_dir, ref_dir: HF model directories (``model.json``; ``ref_dir``
            defaults to ``actor_dir``).
    """

    batch: Batch
    recipe: sdk.Recipe
    contract: Contract
    actor_dir: Path
    critic_dir: Path
    ref_dir: Path


def read_inputs(inputs_dir: Path) -> Inputs:
    """Load the frozen inputs (:func:`qualify_harness.read_inputs`) and the typed contract.

    Raises:
        HarnessError: a file, tensor or model path is missing, or shapes disagree.
        ContractError: ``contract.json`` fails validation.
    """
    try:
        got = sdk.read_inputs(inputs_dir)
    except sdk.InputError as exc:
        raise HarnessError(str(exc)) from None
    return Inputs(batch=got.batch, recipe=got.recipe, contract=Contract.from_dict(got.contract),
                  actor_dir=got.actor_dir, critic_dir=got.critic_dir, ref_dir=got.ref_dir)


def load_hf_model(kind: str, path: Path, device: torch.device) -> nn.Module:
    """Load an HF model in FP32 with SDPA attention, dropout off (``eval()`` mode).

    Args:
        kind: ``causal_lm`` (actor, reference policy) or ``value`` (critic:
            ``AutoModelForTokenClassification``, ``num_labels=1``: backbone + ``score``).
        path: HF directory.
        device: where the model lives.

    Raises:
        HarnessError: the directory does not exist.
    """
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if not path.is_dir():
        raise HarnessError(f"{path}: model directory not found")
    kw: dict[str, Any] = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if kind == "value":
        model = AutoModelForTokenClassification.from_pretrained(str(path), num_labels=1, **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kw)
    model.to(device)
    model.eval()  # dropout off; autograd is unaffected by eval mode
    model.config.use_cache = False
    return model


def pad_token_id(model: nn.Module) -> int:
    """The model config's ``pad_token_id`` (0 when unset), used for the padding rerun."""
    pad = getattr(model.config, "pad_token_id", None)
    return int(pad) if pad is not None else 0


# --------------------------------------------------------------------------- output files


def atomic_json(path: Path, doc: Any) -> None:
    """Write ``doc`` as sorted JSON (indent 1, no NaN) to ``path`` (:mod:`qualify.atomic`)."""
    atomic.write_bytes(path, (json.dumps(doc, indent=1, sort_keys=True, allow_nan=False)
                              + "\n").encode("utf-8"))


def atomic_tensors(path: Path, tensors: dict[str, Tensor], meta: dict[str, str]) -> None:
    """Write ``tensors`` (safetensors, with ``meta``) to ``path`` (:mod:`qualify.atomic`)."""
    atomic.write_bytes(path, save(tensors, metadata=meta))


def topology_runs(cell: HarnessCell) -> list[tuple[tuple[int, int], list[HarnessCell]]]:
    """The launch's variants (:meth:`HarnessCell.variant_cells`) by topology, in launch order.

    Consecutive variants of one ``(actor_tp, critic_tp)`` form one run: a harness builds
    that topology's role groups (``torch.distributed.new_group`` on every rank, in the
    same order) once per run, then runs its variants in turn, each from the frozen inputs
    with a fresh model, optimizer and seed (issue #17: one launch per world size).

    Raises:
        HarnessError: a variant's topology has another world size than the launch.
    """
    try:
        cells = cell.variant_cells()
    except ValueError as exc:
        raise HarnessError(f"{CELL_FILE}: variants: {exc}") from None
    out: list[tuple[tuple[int, int], list[HarnessCell]]] = []
    for vcell in cells:
        topo = (vcell.actor_tp, vcell.critic_tp)
        if out and out[-1][0] == topo:
            out[-1][1].append(vcell)
        else:
            out.append((topo, [vcell]))
    return out


def roles(actor_tp: int, critic_tp: int) -> list[str]:
    """The roles a launch runs, in rank order (a role with TP 0 is absent)."""
    return [r for r, n in (("actor", actor_tp), ("critic", critic_tp)) if n]




# --------------------------------------------------------------------------- process


def env_int(name: str) -> int:
    """An integer torchrun sets (``RANK``, ``WORLD_SIZE``...).

    Raises:
        HarnessError: the variable is unset (the harness is not under torchrun).
    """
    value = os.environ.get(name)
    if value is None:
        raise HarnessError(f"${name} is not set: run this harness under torchrun "
                           f"(qualify.candidate.launch.launch)")
    return int(value)


def device_and_backend(*, share_devices: bool = False) -> tuple[torch.device, str]:
    """CUDA (NCCL) when available and not disabled by ``QUALIFY_DEVICE=cpu``; else CPU (gloo).

    Args:
        share_devices: with fewer GPUs than ranks, put rank ``LOCAL_RANK % device_count`` on
            a device (fine when every NCCL group that communicates holds one rank per
            device); otherwise one device per rank is required.

    Raises:
        HarnessError: more local ranks than CUDA devices and ``share_devices`` is false.
    """
    if torch.cuda.is_available() and os.environ.get("QUALIFY_DEVICE", "") != "cpu":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        count = torch.cuda.device_count()
        if share_devices:
            local %= count
        elif local >= count:
            raise HarnessError(f"LOCAL_RANK {local} but only {count} CUDA device(s): NCCL "
                               f"needs one device per rank (QUALIFY_DEVICE=cpu runs on CPU "
                               f"with gloo)")
        torch.cuda.set_device(local)
        return torch.device("cuda", local), "nccl"
    return torch.device("cpu"), "gloo"


def role_device(actor_tp: int, critic_tp: int) -> tuple[torch.device, str, torch.device | None]:
    """The rank's device and backend, and the ``device_id`` for ``init_process_group``.

    Ranks share CUDA devices (rank ``LOCAL_RANK % device_count``) only when no role's TP
    group would then hold two ranks on one device (NCCL refuses such a group): on a one-GPU
    machine Actor TP1 + Critic TP1 run both ranks on GPU 0, each role group on its own.
    ``device_id`` (eager NCCL init of the world group) is ``None`` when ranks share a
    device: the world group, never used for a collective, is then never made a communicator
    (NCCL refuses two ranks of one communicator on one GPU); the role groups are made lazily.

    Args:
        actor_tp: Actor TP size (0 = absent).
        critic_tp: Critic TP size (0 = absent).

    Returns:
        ``(device, backend, device_id)``; on CPU ``(cpu, "gloo", None)``.

    Raises:
        HarnessError: more local ranks than CUDA devices while a TP group would share one.
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device, backend = device_and_backend(share_devices=0 < max(actor_tp, critic_tp) <= count)
    if device.type != "cuda":
        return device, backend, None
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return device, backend, (device if local_world <= count else None)


def launch_device(cell: HarnessCell) -> tuple[torch.device, str, torch.device | None]:
    """:func:`role_device` for a whole launch: the largest TP of every topology it runs.

    A launch runs every topology of one world size (:func:`topology_runs`); whether ranks
    may share a GPU depends on the largest TP group of any of them, not the first one's.

    Raises:
        HarnessError: as :func:`role_device`, or a variant of another world size.
    """
    tps = [tp for (a, c), _ in topology_runs(cell) for tp in (a, c)]
    return role_device(max(tps, default=0), 0)


# --------------------------------------------------------------------------- stack adapters


def stack_inputs(cell: HarnessCell, *, stack: str, lacking: Callable[[Contract], list[str]],
                 faults: str, harness: str) -> Inputs:
    """A stack adapter's start: the frozen inputs, the stack's gaps refused, faults planted.

    Args:
        cell: the launch.
        stack: the stack's name for the error (``TRL``).
        lacking: the contract's variants the stack does not run (the adapter's
            ``translate.unsupported``).
        faults: the adapter's fault plugin (``harnesses.trl.faults``), imported only when
            the cell names faults (the test suite's deliberate bugs); its
            ``install(names, harness_module)`` patches the running harness.
        harness: the running harness module's name (its ``__name__``).

    Raises:
        HarnessError: a variant the stack does not implement, an unknown fault, bad inputs.
    """
    inputs = read_inputs(Path(cell.inputs_dir))
    missing = lacking(inputs.contract)
    if missing:
        raise HarnessError(f"{stack} does not implement the contract's variant "
                           f"{', '.join(missing)}")
    if cell.faults:
        importlib.import_module(faults).install(cell.faults, sys.modules[harness])
    return inputs


def merge_stack_outputs(cell: HarnessCell, *, engine: str, packages: Sequence[str],
                        world: int, backend: str, shims: Sequence[str], t0: float) -> None:
    """A stack adapter's end, on global rank 0: ``outputs.json``'s head, the parts merged.

    The ranks ran on CPU; the roles are the cell's (:func:`roles`), each part already written
    by its role's writer (:func:`qualify_harness.write_part`).

    Args:
        cell: the launch (its ``output_dir`` holds the parts).
        engine: the engine name.
        packages: distributions whose versions ``outputs.json`` records (this interpreter's).
        world: the launch's ranks.
        backend: the ``torch.distributed`` backend (``none`` for one process).
        shims: what the adapter sets in the stack from outside.
        t0: ``time.perf_counter()`` at the start of the run (``rank0_total_s``).

    Raises:
        OutputError: a part is missing or malformed (:func:`qualify_harness.merge_parts`).
    """
    head = sdk.outputs_head(engine=engine, cell=cell.to_dict(), packages=packages, world=world,
                            backend=backend, device=torch.device("cpu"),
                            timings={"rank0_total_s": round(time.perf_counter() - t0, 4)},
                            shims=list(shims), faults=cell.faults)
    sdk.merge_parts(engine, roles(cell.actor_tp, cell.critic_tp), Path(cell.output_dir), head)


def compute_dtype_hooks(module: nn.Module, into: set[torch.dtype]) -> list[Any]:
    """Forward hooks adding each ``nn.Linear`` output dtype of ``module`` to ``into``.

    ``into`` is the role's compute dtypes (BF16 under a stack's autocast or mixed-precision
    parameters); returns the hook handles (``.remove()`` each after the rounds).
    """
    def hook(_m: nn.Module, _args: Any, out: Any) -> None:
        if isinstance(out, Tensor):
            into.add(out.dtype)

    return [m.register_forward_hook(hook) for m in module.modules() if isinstance(m, nn.Linear)]


def measured_clip_coef(clipped: Iterable[Tensor], unclipped: Iterable[Tensor]) -> Tensor:
    """The clip a stack applied, measured: ``||clipped|| / ||unclipped||`` (FP64 sums), 0-d.

    1.0 when the unclipped gradients are all zero. A measurement of the stack's own clip
    (its gradients read before and after it), not a clip.
    """
    def norm(grads: Iterable[Tensor]) -> float:
        return math.sqrt(sum(float(g.double().square().sum()) for g in grads))

    num, den = norm(clipped), norm(unclipped)
    return torch.tensor(num / den if den > 0 else 1.0)


def harness_main(argv: Sequence[str] | None, *, engine: str, module: str,
                 run: Callable[[HarnessCell], None]) -> int:
    """Entry point shared by the harnesses: ``python -m MODULE CELL_JSON``.

    Returns:
        0 on success, 2 on a usage error (exceptions propagate so torchrun records them).

    Raises:
        HarnessError: the cell names another engine.
    """
    imported.install()  # this process's imported files, written as it ends (provenance)
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(f"usage: python -m {module} {CELL_FILE}", file=sys.stderr)
        return 2
    cell = HarnessCell.from_dict(json.loads(Path(args[0]).read_text("utf-8")))
    if cell.engine != engine:
        raise HarnessError(f"{args[0]}: engine {cell.engine!r} is not {engine!r}")
    run(cell)
    return 0


def exit_now(code: int | None) -> NoReturn:
    """End a harness process now: flush stdio, then ``os._exit(code)`` (``None``: 0).

    Called only from a harness module's ``__main__`` block, after :func:`harness_main`
    returned: every output file is already durable (:mod:`qualify.atomic` fsyncs the file
    and its directory before the rename) and the process group is destroyed, so the
    interpreter's teardown (module finalizers, garbage collection of the engine's objects;
    measured in ``docs/performance.md``, issue #17) does nothing the evidence needs. Not for
    processes that own child processes needing a clean shutdown (the vLLM harness keeps
    ``sys.exit``). In-process callers (tests) use ``main()``.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0 if code is None else int(code))

