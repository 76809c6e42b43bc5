"""``qualify plan``: the model's parameter counts, the layer placement, the refusal."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from qualify.contract import load_contract
from qualify.errors import ExitCode
from qualify.reference import plan, plan_core
from qualify.resources import contracts_dir

CONTRACTS = ["tiny-qwen3", "qwen3-34m", "qwen3-500m", "smollm2-135m", "qwen3-8b"]


@pytest.mark.parametrize("name", CONTRACTS)
def test_parameter_names_and_counts_are_the_hf_models(name: str) -> None:
    """The formula's parameters are, name for name and element for element, those of the
    Hugging Face classes the stage loads (built on the meta device: no memory, no weights)."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    shape = plan_core.model_shape(load_contract(contracts_dir() / f"{name}.toml"))
    fields = {k: getattr(shape, k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")}
    config = AutoConfig.for_model(shape.model_type, **fields, num_labels=1)
    for role, cls in (("actor", AutoModelForCausalLM), ("critic", AutoModelForTokenClassification),
                      ("reward", AutoModelForSequenceClassification)):
        with torch.device("meta"):
            model = cls.from_config(config)
        got = {n: p.numel() for n, p in model.named_parameters()}
        assert got == dict(shape.params(role)), (name, role)


def test_qwen3_8b_counts_are_the_documented_ones() -> None:
    """docs/scale.md's figures: 8,190.7 M Actor and 7,568.4 M Critic parameters."""
    shape = plan_core.model_shape(load_contract(contracts_dir() / "qwen3-8b.toml"))
    assert round(shape.count("actor") / 1e5) == 81907
    assert round(shape.count("critic") / 1e5) == 75684


def _plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from qualify.cli.main import main

    code = main(["plan", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_qwen3_8b_fits_a_node_of_eight_and_not_one_device(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The refusal is one line naming the step and the shortfall, exit 2. The launches are
    the candidate stage's (Actor and Critic ranks side by side, one device each). On a node
    of eight the reference stage and the a2c2 and a4c4 launches fit; an a1c1 launch's TP 1
    BF16 cell (20 bytes per parameter: FP32 master, gradient and moments, BF16 copy and
    gradient) does not fit one 141 GB device, an a8c8 launch needs 16 devices, and the
    refusal names the first such launch and counts the others. On one 141 GB device the reference
    stage does not fit with the AdamW moments and the sensitivity copy on the device (20
    bytes per parameter, 164 GB: the plan's reason names its first update), so the plan keeps
    them on the host; the FP32 lanes then fit (the BF16-parameter lane's clip-branch passes,
    the fullest, hold the FP32 master, its gradient, a ``J_t`` and a BF16 copy: 14 bytes per
    parameter), and the FP64 control's weights and gradient (16 bytes per parameter, 131 GB)
    fit only with the gradient streamed to the host (its reason names that control): its
    load holds the FP64 Actor alone (the KL reference policy is taken before it), 12 bytes
    per parameter. The whole reference stage then fits one device, and no launch does (each
    has two ranks or more)."""
    import json

    code, out, _ = _plan(capsys, str(contracts_dir() / "qwen3-8b.toml"), "--devices", "8",
                         "--device-memory", "141", "--host-memory", "2048", "--json")
    doc = json.loads(out)
    assert all(s["device_peak_bytes"] <= 141e9 and s["host_peak_bytes"] <= 2048e9
               for s in doc["steps"] if s["kind"] == "reference"
               or not any(f"-{t} (" in s["step"] for t in ("a1c1", "a8c8")))
    assert code == ExitCode.USAGE_ERROR
    assert doc["shortfall"].startswith("launch torch_tp-a1c1 (4 cells, 2 ranks)"), \
        doc["shortfall"]
    # the candidate stage's launches: Actor and Critic ranks side by side, one device each
    assert [line.split(": ", 1)[0] for line in doc["shortfalls"]] == [
        f"launch {e}-{t} ({n} cells, {w} ranks)" for e, n in
        (("torch_tp", 4), ("deepspeed", 8), ("megatron", 4))
        for t, w in (("a1c1", 2), ("a8c8", 16))], doc["shortfalls"]
    assert all(line.endswith("needs 16 devices at once; the machine has 8")
               for line in doc["shortfalls"] if "a8c8" in line), doc["shortfalls"]
    assert all(line.endswith("needs 168.7 GB on a device, each of the 8 has 141.0 GB (short by "
                             "27.7 GB)") for line in doc["shortfalls"] if "a1c1" in line), \
        doc["shortfalls"]
    code, out, err = _plan(capsys, str(contracts_dir() / "qwen3-8b.toml"), "--devices", "8",
                           "--device-memory", "141", "--host-memory", "2048")
    assert code == ExitCode.USAGE_ERROR
    assert "reference stage: fits this machine" in out
    assert "candidate launches: 6 of 12 do not fit:" in out
    assert len(err.strip().splitlines()) == 1, err
    assert err.rstrip().endswith("(and 5 more: launch torch_tp-a8c8 (4 cells, 16 ranks); "
                                 "launch deepspeed-a1c1 (8 cells, 2 ranks); "
                                 "launch deepspeed-a8c8 (8 cells, 16 ranks); ...)"), err
    code, out, _ = _plan(capsys, str(contracts_dir() / "qwen3-8b.toml"), "--devices", "1",
                         "--device-memory", "141", "--host-memory", "2048", "--json")
    doc = json.loads(out)
    ref = [s for s in doc["steps"] if s["kind"] == "reference"]
    assert all(s["device_peak_bytes"] <= 141e9 and s["host_peak_bytes"] <= 2048e9 for s in ref)
    top = max((s for s in ref if "fp64" not in s["step"]), key=lambda s: s["device_peak_bytes"])
    assert top["step"] == "branches hf-bf16-castmasters actor"
    assert 14 * 8.19e9 < top["device_peak_bytes"] <= 141e9
    fp64 = next(s for s in ref if s["step"] == "control fp64-fp32")
    assert 12 * 8.19e9 < fp64["device_peak_bytes"] < 16 * 8.19e9
    assert doc["optimizer_state"] == "host"
    assert doc["optimizer_state_why"].startswith(
        "with the AdamW state on the devices: updates hf-fp32: "), doc["optimizer_state_why"]
    assert doc["gradients"] == "host"
    assert doc["gradients_why"].startswith(
        "with them on the devices: control fp64-fp32: "), doc["gradients_why"]
    assert doc["shortfall"].startswith("launch torch_tp-a1c1"), doc["shortfall"]
    assert len(doc["shortfalls"]) == 12  # every launch: 2 ranks or more, one device
    assert all(line.endswith("at once; the machine has 1")
               for line in doc["shortfalls"]), doc["shortfalls"]
    code, _, err = _plan(capsys, str(contracts_dir() / "qwen3-8b.toml"), "--devices", "1",
                         "--device-memory", "141", "--host-memory", "2048")
    assert code == ExitCode.USAGE_ERROR
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for part in ("does not fit", "launch torch_tp-a1c1", "needs 2 devices", "(and 11 more"):
        assert part in lines[0], lines[0]


def test_a_step_that_cannot_fit_is_refused_before_anything_is_written(tmp_path: Path,
                                                                     monkeypatch: pytest
                                                                     .MonkeyPatch) -> None:
    """``qualify reference`` plans first: on a machine too small for the plan it raises
    :class:`~qualify.reference.plan.DoesNotFitError` and leaves no directory behind."""
    from qualify.reference import stage

    small = plan_core.Machine(devices=0, device_bytes=0, host_bytes=10**8, cores=2)
    monkeypatch.setattr(plan_core, "machine_defaults", lambda: small)
    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    def started(name: str) -> None:
        raise AssertionError(f"the stage started ({name}) on a machine its plan does not fit")

    with pytest.raises(plan.DoesNotFitError,
                       match=r"does not fit this machine: rollout vllm tp1 \(child process\)"):
        stage.run_reference_stage(contract, root=tmp_path / "refs", quiet=True,
                                  on_step=started)
    assert not (tmp_path / "refs").exists()
    record = stage._plan_check(contract, enforce=False)
    assert record["enforced"] is False
    assert "short by" in record["shortfall"]


def test_mirrored_constants_are_the_codes() -> None:
    """The plan mirrors the factored Gram's block size without importing torch at import."""
    from qualify.reference import gram_factors

    assert plan.GRAM_BLOCK_BYTES == gram_factors.BLOCK_BYTES


@pytest.mark.parametrize("name", ["tiny-qwen3-vocab32k", "smollm2-135m"])
def test_reported_elements_are_the_stored_ones_with_the_rollouts_rows(name: str) -> None:
    """For a rollout whose distinct ids reach the planner's bound, the planned per-family
    element count is exactly what :meth:`ParamSampling.indices` stores (the sample plus the
    whole rows of every rollout id in the vocab-indexed parameters), and the bound holds:
    no larger number of distinct ids fits the rollout's shape."""
    from qualify.protocol import ParamSampling

    contract = load_contract(contracts_dir() / f"{name}.toml")
    shape = plan_core.model_shape(contract)
    ev = contract.evidence
    bound = plan_core.rollout_ids_bound(contract, shape.vocab_size)
    n_seq, prompt, resp, _ = plan_core.rollout_shape(contract)
    assert bound <= min(shape.vocab_size, n_seq * (prompt + resp) + 1)
    ids = torch.randperm(shape.vocab_size, generator=torch.Generator().manual_seed(0))[:bound]
    sampling = ParamSampling(exact_elements=ev.exact_elements,
                             sample_elements=ev.sample_elements).with_rows(
        ids.numpy(), shape.vocab_size)
    for role in ("actor", "critic"):
        stored = 0
        for pname, numel in shape.params(role):
            idx = sampling.indices(pname, numel)
            stored += numel if idx is None else len(idx)
        planned = plan_core.sampled_elements(shape.params(role), ev.exact_elements,
                                             ev.sample_elements, vocab_rows=bound,
                                             vocab_size=shape.vocab_size)
        # the seeded sample and the rows may overlap: the plan never under-counts
        assert stored <= planned <= stored + 2 * ev.sample_elements


def test_the_text_says_which_stage_fits(capsys: pytest.CaptureFixture[str]) -> None:
    """Below the table: one line for the reference stage, one for the candidate launches
    (every one that does not fit listed), the refusal naming the first step that does not
    fit and the others after it. The default contract fits this machine's plan with 64 GB
    of host memory; with 0.1 GB every step needs more host memory than the machine has."""
    code, out, err = _plan(capsys, "--devices", "0", "--host-memory", "64")
    assert code == ExitCode.OK, err
    assert "reference stage: fits this machine" in out
    assert "candidate launches: all 4 fit" in out  # three trainer launches, the sampler
    assert "candidate launch times: compute only" in out
    code, out, err = _plan(capsys, "--devices", "0", "--host-memory", "0.1")
    assert code == ExitCode.USAGE_ERROR
    assert "reference stage: does not fit: " in out
    assert "candidate launches: 4 of 4 do not fit:" in out
    assert len(err.strip().splitlines()) == 1, err
    assert "of host memory" in err, err
    assert "; ...)" in err, err  # the first step, three more by name, the rest counted


def test_the_launches_are_the_ones_the_committed_run_made(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The plan's launch steps are the launches the candidate stage really made for the
    default contract (the committed run's ``launches/`` directories), each with its ranks:
    the Actor's TP ranks beside the Critic's (a2c1 and a1c2: 3)."""
    import json

    from committed import committed_runs

    runs = committed_runs("tiny-qwen3")  # git-tracked: a local run of command 1 left out
    assert runs, "no committed tiny-qwen3 run"
    made = sorted(p.name for p in (runs[-1] / "launches").iterdir())
    code, out, _ = _plan(capsys, str(contracts_dir() / "tiny-qwen3.toml"), "--devices", "0",
                         "--host-memory", "64", "--json")
    assert code == ExitCode.OK
    planned = json.loads(out)["steps"]
    steps = [s for s in planned if s["kind"] == "launch"]
    assert sorted(s["step"].split()[1] for s in steps) == made
    assert {s["processes"] for s in steps} == {3}
    # and one step for the sampler cells the run made (cells/vllm-fp32-sampler-tp*)
    sampler = sorted(p.name for p in (runs[-1] / "cells").iterdir() if "-sampler-" in p.name)
    assert sampler == ["vllm-fp32-sampler-tp1", "vllm-fp32-sampler-tp2"]
    assert [s["step"] for s in planned if s["kind"] == "sampler"] == [
        "sampler vllm-tp1-tp2 (2 cells, 3 ranks)"]


def test_a_plans_steps_cannot_change_behind_its_shortfall() -> None:
    """The steps a plan was made of are copied into a tuple: changing the list given cannot
    make the once-found shortfall disagree with the steps."""
    base = plan.build_plan(load_contract(contracts_dir() / "tiny-qwen3.toml"),
                           plan_core.machine_defaults())
    given = list(base.steps)
    made = plan_core.Plan(contract=base.contract, machine=base.machine, params=base.params,
                          steps=given, cost_model=base.cost_model)
    assert made.shortfall() is None
    huge = dataclasses.replace(given[0], host_peak=made.machine.host_bytes + 1)
    given.append(huge)
    assert isinstance(made.steps, tuple)
    assert huge not in made.steps
    assert made.shortfall() is None
    # the same step given at the start is found
    short = plan_core.Plan(contract=base.contract, machine=base.machine, params=base.params,
                           steps=given, cost_model=base.cost_model)
    line = short.shortfall()
    assert line is not None
    assert line.startswith(f"{huge.name}: needs ")
