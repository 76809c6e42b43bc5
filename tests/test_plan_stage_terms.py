"""``qualify plan``: the round-to-round term's updates and ``qualify verify``'s re-read."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from qualify.contract import Contract, load_contract
from qualify.reference import plan, plan_core, round_to_round
from qualify.resources import contracts_dir, repo_root

TINY = contracts_dir() / "tiny-qwen3.toml"
COMMITTED = repo_root() / "references" / f"tiny-qwen3-{load_contract(TINY).digest12}"
HOST = plan_core.Machine(devices=0, device_bytes=0, host_bytes=10**12, cores=2)


def _with(contract: Contract, **bounds: object) -> Contract:
    doc = contract.to_dict()
    doc["bounds"].update(bounds)
    return Contract.from_dict(doc, path=contract.path)


@pytest.mark.parametrize("roles", [("actor", "critic"), ("actor",)])
def test_round_to_round_count_is_the_updates_the_term_runs(roles: tuple[str, ...]) -> None:
    """The planner's count per lane and role is the number of updates
    :func:`round_to_round.measure` asks for (a counting stand-in for the update), with the
    rounds each runs, for every valid token of a rollout; none when the term is off."""
    on = _with(load_contract(TINY), round_to_round=True)
    off = _with(on, round_to_round=False)
    mask = torch.zeros(3, 5)
    mask[0, :4] = mask[1, :2] = mask[2, :1] = 1
    valid = int(mask.sum())
    calls: Counter[tuple[str, int]] = Counter()

    def update(role: str, n: int, offsets: Mapping[int, torch.Tensor] | None
               ) -> dict[str, torch.Tensor]:
        calls[(role, n)] += 1
        return {f"round{r}/{role}/{f}": torch.zeros(3, 5) for r in range(1, 3)
                for f in round_to_round.RESPONDING[role]}

    round_to_round.measure(update, roles=roles, rounds=on.algorithm.rounds,
                           sizes={(1, r): 0.01 for r in roles}, mask=mask,
                           logprobs={1: torch.full((3, 5), -1.0)}, temperature=0.9)
    counted = plan.round_to_round_updates(on, valid)
    assert on.algorithm.rounds == 2
    for role in roles:
        assert {n: c for (r, n), c in calls.items() if r == role} == counted
    assert counted == {2: 2 * valid + 1}
    assert plan.round_to_round_updates(off, valid) == {}
    assert plan.round_to_round_updates(_with(on, lane="deterministic"), valid) == {}


def test_round_to_round_steps_are_planned_only_with_the_term() -> None:
    """One planned step per lane with the term on (and its KL reference forward, once per
    lane), none with it off; each holds what the lane's update holds (no sensitivity pass)
    and the FP32 template its working copy is restored from, and costs the count's runs."""
    on = _with(load_contract(TINY), round_to_round=True)
    off = _with(on, round_to_round=False)
    steps_on = plan.plan_reference(on, HOST)
    steps_off = plan.plan_reference(off, HOST)
    r2r = [s for s in steps_on if s.name.startswith("round_to_round ")]
    kl = [s for s in steps_on if s.name.startswith("kl reference: round_to_round ")]
    assert [s.name for s in steps_off if "round_to_round" in s.name] == []
    assert len(r2r) == len(kl) == len(on.matrix.lanes())
    assert [s.name for s in steps_on if s not in r2r + kl] == [s.name for s in steps_off]
    assert [s.name for s in kl] == [f"kl reference: {s.name}" for s in r2r]
    n_seq, _, resp, _ = plan_core.rollout_shape(on)
    runs = 2 * n_seq * resp + 1
    for lane, s in zip(on.matrix.lanes(), r2r, strict=True):
        assert s.name == f"round_to_round hf-{lane} ({runs} runs per role)"
        update = next(u for u in steps_on if u.name == f"updates hf-{lane}")
        template = s.terms["template"]
        assert template == 4 * plan.build_plan(on, HOST).params[s.phase.split()[0]]
        assert s.host_peak <= update.host_peak + template
        assert "sensitivity" not in s.phase
        assert s.seconds > 10 * update.seconds  # 2 x 80 + 1 runs of 2 rounds each


def test_verify_reread_is_the_sealed_files_verify_reads(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """On the committed tiny-qwen3 reference: the files the plan says ``qualify verify``
    reads back to measure the control errors again are exactly those
    :func:`recompute_control_errors` loads, and no file is larger than planned. The plan
    bounds the rollout's distinct token ids (whose embedding and head rows every update file
    stores) and the sealed clip-branch tokens from above; with the rollout's own ids the
    update files' formula gives each lane's and control's file to 1 %, and the rollout's
    and train inputs' sizes are exact."""
    import numpy as np

    from qualify.evidence import store, tensors
    from qualify.protocol import ParamSampling
    from qualify.reference.control_recompute import recompute_control_errors

    contract = load_contract(TINY)
    got: list[str] = []
    for mod in (tensors, store):
        real = mod.load_tensors

        def spy(path: str | Path, _real=real):  # type: ignore[no-untyped-def]
            got.append(Path(path).relative_to(COMMITTED).as_posix())
            return _real(path)

        monkeypatch.setattr(mod, "load_tensors", spy)
    recompute_control_errors(COMMITTED, contract)
    step = plan.plan_reference(contract, HOST)[-1]
    assert step.kind == "verify"
    assert sorted(got) == sorted(step.reads)
    sizes = {rel: os.path.getsize(COMMITTED / rel) for rel in step.reads}
    assert step.read == sum(step.reads.values()) >= sum(sizes.values()) > 0
    assert all(sizes[rel] <= planned for rel, planned in step.reads.items()), (sizes, step.reads)

    roll = tensors.load_tensors(COMMITTED / "rollout.safetensors")
    shape = plan_core.model_shape(contract)
    ev = contract.evidence
    sampling = ParamSampling(exact_elements=ev.exact_elements,
                             sample_elements=ev.sample_elements).with_rows(
        np.concatenate([roll["prompts"].ravel(), roll["responses"].ravel()]),
        shape.vocab_size)
    roles = ("actor", "critic")
    reported = {r: sum(n if (idx := sampling.indices(name, n)) is None else len(idx)
                       for name, n in shape.params(r)) for r in roles}
    n_seq, _, resp, _ = plan_core.rollout_shape(contract)
    update = plan._update_file_bytes(roles, rounds=contract.algorithm.rounds, reported=reported,
                                     n_tensors={r: len(shape.params(r)) for r in roles},
                                     n_seq=n_seq, resp=resp)
    for rel, size in sizes.items():
        if rel.startswith(("controls/", "reference/")):
            assert abs(update - size) <= 0.01 * size, (rel, size, update)
    assert step.reads["rollout.safetensors"] == sizes["rollout.safetensors"]
    assert step.reads["train_inputs.safetensors"] == sizes["train_inputs.safetensors"]


def test_scoring_counts_a_mapped_model_once_and_bf16_scorings_fp32_copy() -> None:
    """Scoring on the host: an FP32 model read from the FP32 checkpoint is the mapped file's
    pages, so loading the reference policy beside the Actor holds one model and its mapped
    file (``8 P``), not two models and the file (``12 P``: measured 4.31 GB against 6.60
    planned on qwen3-500m, docs/scale.md section 6); BF16 scoring holds both FP32 models and
    one FP32 deep copy before its cast (``12 P``). On CUDA devices the Actor is copied there
    before the policy loads, so the devices hold both."""
    contract = load_contract(contracts_dir() / "qwen3-500m.toml")
    host = plan.build_plan(contract, plan_core.Machine(devices=0, device_bytes=0,
                                                       host_bytes=100 * 10**9, cores=2))
    p_actor = host.params["actor"]
    steps = {s.name: s for s in host.steps}
    fp32, bf16 = steps["scoring fp32"], steps["scoring bf16"]
    assert fp32.phase == "forward"
    assert fp32.terms["weights"] == 8 * p_actor
    assert "checkpoint_map" not in fp32.terms
    assert fp32.host_peak - plan_core.INTERPRETER_BYTES - fp32.terms["activations"] == 8 * p_actor
    assert bf16.phase == "bf16 copy"
    assert bf16.terms == {"interpreter": plan_core.INTERPRETER_BYTES, "weights": 8 * p_actor,
                          "bf16_cast_source": 4 * p_actor}
    gpu = plan.build_plan(contract, plan_core.Machine(devices=1, device_bytes=100 * 10**9,
                                                      host_bytes=100 * 10**9, cores=2))
    on_gpu = next(s for s in gpu.steps if s.name == "scoring fp32")
    assert on_gpu.device_peak >= 8 * p_actor  # both models on the device at the load


def test_a_bf16_copy_is_planned_with_the_fp32_copy_it_is_cast_from() -> None:
    """``bf16_parameters_copy`` deep-copies the FP32 model before casting it: on a device the
    KL reference forward of a BF16-parameter run peaks there (the policy and its copy,
    ``8 P``), not at its forward (``6 P``); the FP32 lane's has no such phase."""
    contract = load_contract(contracts_dir() / "qwen3-500m.toml")
    gpu = plan.build_plan(contract, plan_core.Machine(devices=1, device_bytes=100 * 10**9,
                                                      host_bytes=100 * 10**9, cores=2))
    p_actor = gpu.params["actor"]
    steps = {s.name: s for s in gpu.steps}
    cast = steps["kl reference: updates hf-bf16-castmasters"]
    assert cast.device_phase == "bf16 copy"
    assert cast.device_peak >= 8 * p_actor
    assert steps["kl reference: updates hf-fp32"].device_peak < 8 * p_actor


def test_the_distribution_step_is_planned_on_the_host_after_the_branches() -> None:
    """``seal_distribution`` runs HF models on the host whatever the devices: its step has
    no device bytes, holds two FP32 models (``8 P``) beside the logits of the runs taken so
    far, or every run's logits and the metrics' work, and comes after the clip-branch steps
    and before ``verify``, where the stage runs it."""
    contract = load_contract(contracts_dir() / "qwen3-500m.toml")
    for devices in (0, 1):
        built = plan.build_plan(contract, plan_core.Machine(devices=devices,
                                                            device_bytes=100 * 10**9,
                                                            host_bytes=100 * 10**9, cores=2))
        names = [s.name for s in built.steps]
        step = built.steps[names.index("distribution: HF controls (host)")]
        assert step.device_peak == 0
        n_seq, prompt, resp, _ = plan_core.rollout_shape(contract)
        vocab = plan_core.model_shape(contract).vocab_size
        run = n_seq * resp * vocab * 4
        models = 8 * built.params["actor"] + 7 * run + n_seq * (prompt + resp) * vocab * 4
        assert step.host_peak == plan_core.INTERPRETER_BYTES + max(models, 18 * run)
        last_branch = max(i for i, n in enumerate(names) if n.startswith("branches "))
        assert last_branch < names.index(step.name) < names.index(
            "verify: control errors re-measured")
