"""The fsdp2 harness under real torchrun + gloo on a tiny Qwen3 (CPU, 2 cores).

Launches (each a real ``torch.distributed.run`` of ``(actor_tp + critic_tp) * dp`` ranks,
the world-size rule of :data:`harnesses.fsdp2.spec.SPEC`, cached per module):

- ``fp32-dp1``: Actor and Critic each on one rank (2 ranks);
- ``fp32-dp2``: each role sharded over 2 ranks, each rank half of the batch rows (4 ranks);
- ``fault-dp2``: ``fp32-dp2`` with ``grad_averaged_twice`` (FSDP2's default divide-by-dp
  left on a loss already normalised by the global token count);
- ``fp32-tp2-dp2`` / ``fault-tp2-dp2``: the 2-D cell, each role on a 2 x 2 ``("dp", "tp")``
  mesh (8 ranks), without and with the fault.

Plus in-process units (the DP row slice, the losses) and a 2-rank torchrun script that
checks the gathered layout of sharded parameters, gradients and AdamW state against the
unsharded HF module, and a 4-rank one for the 2-D layout, the local heads and the
clip-norm reduction over both mesh dims. The 4-rank script is ``slow``-marked,
and so is the real chain (reference, candidate, compare) on
``contracts/tiny-qwen3-fsdp2.toml`` with the fault on, which sees the DP 2 cells (TP 1 and
TP 2) FAIL.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from harness_outputs import (
    build_inputs,
    expected_names,
    family_errors,
    rank_stderr,
    role_tensors,
    warm_command,
)
from qualify_harness import losses as sdk_losses
from safetensors.torch import load_file

from harnesses.fsdp2.faults import Faults
from harnesses.fsdp2.harness import dp_degree
from harnesses.fsdp2.parallelize import dp_rows, grid, role_ranks
from qualify.candidate.launch import check_outputs, launch_command, launch_env, validate_cell
from qualify.candidate.stage import plan_launches
from qualify.contract import Contract, load_contract
from qualify.errors import HarnessError
from qualify.protocol import HarnessCell
from qualify.registry import get_engine
from qualify.resources import contracts_dir, repo_root

RESPONSE_LENGTHS = (10, 6, 3, 8)
R = 10
LAUNCH_TIMEOUT_S = 600.0
ENGINE = get_engine("fsdp2")
CONTRACT = contracts_dir() / "tiny-qwen3-fsdp2.toml"

RUNS: dict[str, dict[str, Any]] = {
    "fp32-dp1": {"precision": "fp32", "dp": 1},
    "fp32-dp2": {"precision": "fp32", "dp": 2},
    "fault-dp2": {"precision": "fp32", "dp": 2, "faults": ("grad_averaged_twice",)},
    "fp32-tp2-dp2": {"precision": "fp32", "dp": 2, "tp": 2},
    "fault-tp2-dp2": {"precision": "fp32", "dp": 2, "tp": 2,
                      "faults": ("grad_averaged_twice",)},
}
GRAD_FAMILIES = ("grads", "exp_avg", "exp_avg_sq")


class Runs:
    """Each named launch run once per module, with the spec's world size."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.inputs_dir = root / "inputs"
        self.inputs_dir.mkdir(parents=True)
        build_inputs(self.inputs_dir, RESPONSE_LENGTHS, R)
        self.rollout = load_file(str(self.inputs_dir / "rollout.safetensors"))
        self.params = json.loads((self.inputs_dir / "params.json").read_text())
        self.mask = self.rollout["response_mask"].bool()
        self.results: dict[str, dict[str, Any]] = {}

    def cell(self, name: str) -> HarnessCell:
        spec = RUNS[name]
        tp = spec.get("tp", 1)
        return HarnessCell(engine="fsdp2", precision=spec["precision"],
                           options={"dp": spec["dp"]}, actor_tp=tp, critic_tp=tp, rounds=2,
                           seed=0, inputs_dir=str(self.inputs_dir),
                           output_dir=str(self.root / name), collective_timeout_s=120.0,
                           faults=tuple(spec.get("faults", ())))

    def _launch(self, name: str) -> Path:
        """torchrun with the launcher's command line, at ``ENGINE.world_size(cell)`` ranks."""
        out = self.root / name
        if name not in self.results:
            cell = self.cell(name)
            out.mkdir(parents=True)
            validate_cell(cell.to_dict())
            cell_file = out / "cell.json"
            cell_file.write_text(json.dumps(cell.to_dict()))
            cmd = launch_command(cell_file, module=ENGINE.module,
                                 world_size=ENGINE.world_size(cell), log_dir=out / "logs",
                                 preload=ENGINE.warm_imports)
            t0 = time.monotonic()
            proc = subprocess.run(cmd, cwd=out, env=launch_env(None), capture_output=True,
                                  text=True, timeout=LAUNCH_TIMEOUT_S, check=False)
            status, reason = "OK", ""
            if proc.returncode != 0:
                logs = "\n".join(p.read_text()[-2000:] for p in (out / "logs").rglob("stderr*"))
                status, reason = "ERROR", f"rc {proc.returncode}: {proc.stderr[-2000:]}\n{logs}"
            else:
                try:
                    check_outputs(out)
                except HarnessError as exc:
                    status, reason = "ERROR", str(exc)
            self.results[name] = {"status": status, "reason": reason,
                                  "wall_s": time.monotonic() - t0}
            print(f"\n[fsdp2] launch {name}: {self.results[name]['wall_s']:.1f} s wall")
        result = self.results[name]
        assert result["status"] == "OK", f"{name}: {result['reason']}"
        return out

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        return load_file(str(self._launch(name) / "outputs.safetensors"))

    def meta(self, name: str) -> dict[str, Any]:
        meta: dict[str, Any] = json.loads((self._launch(name) / "outputs.json").read_text())
        return meta


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("fsdp2_runs"))


# --------------------------------------------------------------------------- launches


@pytest.mark.parametrize("run", ["fp32-dp1", "fp32-dp2"])
def test_launch_writes_complete_outputs(runs: Runs, run: str) -> None:
    t, meta = runs.tensors(run), runs.meta(run)
    assert set(t) == (expected_names("actor", runs.params["actor"])
                      | expected_names("critic", runs.params["critic"]))
    assert t["round1/actor/logprobs"].shape == (len(RESPONSE_LENGTHS), R)
    assert all(v.dtype == torch.float32 for v in t.values())
    dp = RUNS[run]["dp"]
    assert meta["world_size"] == 2 * dp
    assert [(r["rank"], r["role"]) for r in meta["ranks"]] == (
        [(i, "actor") for i in range(dp)] + [(dp + i, "critic") for i in range(dp)])
    for role, rm in meta["roles"].items():
        par = rm["parallelism"]
        assert rm["tp"] == 1
        assert par["dp"] == dp
        assert rm["global_ranks"] == list(role_ranks(1, 1, dp)[role])
        assert par["replicated_params"] == []
        assert set(par["sharded_params"]) == set(runs.params[role])
        assert par["fully_shard_units"] == ["model.layers.0", "model.layers.1", ""]
        assert par["gradient_reduction"] == {"force_sum_reduction_for_comms": True,
                                             "gradient_divide_factor": 1.0}
        assert par["dp_rows"]["row_range_by_dp_rank"] == [
            [d * 4 // dp, (d + 1) * 4 // dp] for d in range(dp)]
        assert par["replica_check"].startswith("not applicable")
        assert rm["replica_consistency"] == {
            "all_equal": True, "params": {},
            "rounds": [{"round": r, "all_equal": True, "max_abs_diff": 0.0} for r in (1, 2)]}
        d = rm["dtypes"]
        assert d["master_weights"] == d["grads"] == "torch.float32", d
        assert d["grad_reduction"] == {"fully_shard.reduce_scatter": "torch.float32"}, d
        assert d["grad_accumulation"] == {"fully_shard.sharded_grad": "torch.float32"}, d
        assert d["optimizer_state"] == {"exp_avg": "torch.float32",
                                        "exp_avg_sq": "torch.float32"}, d
        assert d["compute"] == ["torch.float32"], d
        opt = Contract.from_dict(json.loads((runs.inputs_dir / "contract.json").read_text())
                                 ).optimizer
        assert rm["lr"] == pytest.approx({f"round{r}": opt.lr(role, r) for r in (1, 2)},
                                         rel=2**-24)  # transformers.get_scheduler's lr
        assert rm["lr_scheduler"].startswith("transformers.get_scheduler")
        assert rm["micro_batches"] == 1  # 4 rows / dp ranks, micro_batch_size 4
        assert rm["valid_tokens"] == sum(RESPONSE_LENGTHS)  # the global N on every rank
        routes = rm["routes"]  # read back as the forwards ran and from the live optimizer
        assert sum(routes["sdpa_backends"].values()) > 0, routes
        assert routes["optimizer"]["class"] == "torch.optim.adamw.AdamW"
        assert routes["optimizer"]["fused"] is False
    assert meta["faults"] == []
    assert meta["shims"] == []


def test_dp2_shards_parameters_over_two_ranks(runs: Runs) -> None:
    shapes = runs.meta("fp32-dp2")["roles"]["critic"]["parallelism"]["local_shard_shapes_dp_rank0"]
    assert shapes["model.embed_tokens.weight"] == [192, 64]  # 384 rows / 2
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == [32, 64]
    assert shapes["score.weight"] == [1, 64]  # 1 row: rank 0 holds it, rank 1 an empty shard


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_dp2_agrees_with_dp1(runs: Runs, role: str) -> None:
    """Each rank's half of the rows, summed once: the single-rank update at FP32 rounding."""
    err = family_errors(role_tensors(runs.tensors("fp32-dp2"), role),
                        role_tensors(runs.tensors("fp32-dp1"), role), runs.mask)
    print(f"\n[fsdp2] DP2 vs DP1 fp32 {role}: "
          + ", ".join(f"{k}={v:.2e}" for k, v in sorted(err.items())))
    floors = load_contract(CONTRACT).bounds.floors["fp32"]
    for fam in ("logprobs", "entropy", "values", "grads", "exp_avg", "exp_avg_sq"):
        if fam in err:
            assert err[fam] <= floors[fam], (fam, err)
    if role == "actor":  # the initial-weights distributions, rows gathered over dp
        assert max(err["prefill_raw"], err["prefill_tempered"]) <= floors["logprobs"], err
    assert err["updates"] <= 10 * floors["updates"], err  # AdamW's m / sqrt(v) amplifies
    assert err["loss"] <= 10 * floors["losses"], err
    assert err["grad_norm"] <= 10 * floors["grad_norm"], err


def test_losses_are_the_global_sums(runs: Runs) -> None:
    """DP 2's reported loss terms are the all-reduced shares (each over the global N)."""
    a, b = runs.tensors("fp32-dp2"), runs.tensors("fp32-dp1")
    for name in [k for k in b if "/loss/" in k]:
        assert float(a[name]) == pytest.approx(float(b[name]), rel=1e-5, abs=1e-7), name
    for role, terms in (("actor", ("policy", "kl", "entropy")), ("critic", ("value",))):
        total = sum(float(a[f"round1/{role}/loss/{t}"]) for t in terms)
        assert float(a[f"round1/{role}/loss/total"]) == pytest.approx(total, rel=1e-6)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_fault_grad_averaged_twice_halves_the_gradients(runs: Runs, role: str) -> None:
    bad, good = runs.tensors("fault-dp2"), runs.tensors("fp32-dp2")
    assert runs.meta("fault-dp2")["roles"][role]["parallelism"]["gradient_reduction"][
        "gradient_divide_factor"] == "FSDP2 default (the DP size)"
    # round 1 precedes any faulty step: same forward, gradients exactly halved
    for k in [k for k in good if k.startswith(f"round1/{role}/grads/")]:
        torch.testing.assert_close(bad[k], good[k] / 2, rtol=1e-6, atol=1e-9)
    assert float(bad[f"round1/{role}/grad_norm"]) == pytest.approx(
        float(good[f"round1/{role}/grad_norm"]) / 2, rel=1e-6)
    per_token = "logprobs" if role == "actor" else "values"
    torch.testing.assert_close(bad[f"round1/{role}/{per_token}"],
                               good[f"round1/{role}/{per_token}"], rtol=0, atol=0)
    err = family_errors(role_tensors(bad, role), role_tensors(good, role), runs.mask)
    floors = load_contract(CONTRACT).bounds.floors["fp32"]
    assert err["grads"] >= 0.49, err  # 50 % relative: far outside any FP32 bound
    assert err["grad_norm"] > 100 * floors["grad_norm"], err
    # The step itself hides the fault when both runs clip (the gradient is rescaled to
    # max_grad_norm either way); otherwise the AdamW moments see the halved gradient.
    coefs = [float(t[f"round1/{role}/clip_coef"]) for t in (good, bad)]
    moments = family_errors(
        {k: v for k, v in role_tensors(bad, role).items() if k.startswith("round1/")
         and k.split("/")[2] in GRAD_FAMILIES},
        {k: v for k, v in role_tensors(good, role).items() if k.startswith("round1/")
         and k.split("/")[2] in GRAD_FAMILIES}, runs.mask)
    print(f"\n[fsdp2] grad_averaged_twice {role}: clip_coef good/bad {coefs}, round 1 "
          + ", ".join(f"{k}={v:.2e}" for k, v in sorted(moments.items())))
    if max(coefs) < 1.0:
        assert moments["exp_avg"] < floors["exp_avg"], moments
    else:
        assert moments["exp_avg"] > 100 * floors["exp_avg"], moments


# --------------------------------------------------------------------------- the real chain


@pytest.fixture(scope="module")
def fault_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """reference -> candidate (fp32 cells, ``grad_averaged_twice`` on) -> compare."""
    from qualify.candidate.stage import run_candidate_stage
    from qualify.compare.stage import compare_run
    from qualify.reference.stage import run_reference_stage

    contract = load_contract(CONTRACT)
    ref = run_reference_stage(contract, root=tmp_path_factory.mktemp("refs"), quiet=True)
    run_dir = run_candidate_stage(contract, reference=ref, root=tmp_path_factory.mktemp("ev"),
                                  cells=["fsdp2-fp32-*"], quiet=True,
                                  faults=("grad_averaged_twice",))
    compare_run(run_dir)
    doc: dict[str, Any] = json.loads((run_dir / "report.json").read_text("utf-8"))
    return doc


@pytest.mark.slow
@pytest.mark.parametrize("role", ["actor", "critic"])
def test_fault_grad_averaged_twice_fails_the_dp2_cells(fault_report: dict[str, Any],
                                                      role: str) -> None:
    verdict = {c["cell"]: c["verdict"] for c in fault_report["cells"]}
    for tp in (1, 2):  # divided by dp = 1: no change, at TP 1 and TP 2 alike
        assert verdict[f"fsdp2-fp32-{role}-tp{tp}-dp1"] == "PASS"
    for cell in (f"fsdp2-fp32-{role}-tp1-dp2", f"fsdp2-fp32-{role}-tp2-dp2"):  # 1-D and 2-D
        assert verdict[cell] == "FAIL"
        failed = {(r["class"], r["round"], r["family"]) for r in fault_report["rows"]
                  if r["cell"] == cell and r["verdict"] == "FAIL"}
        print(f"\n[fsdp2] grad_averaged_twice, {cell} FAIL rows: {sorted(failed)}")
        for klass in ("candidate_vs_hf", "tp_vs_tp1"):
            assert {(klass, 1, "grads"), (klass, 1, "grad_norm")} <= failed


# --------------------------------------------------------------------------- layout


GATHER_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch, torch.distributed as dist
    from harnesses import common
    from harnesses.fsdp2 import parallelize, state_dict_adapter as sda
    from torch.distributed.tensor import DTensor
    dist.init_process_group("gloo")
    mesh = parallelize.build_role_mesh(actor_tp=1, critic_tp=0, dp=2, rank=dist.get_rank(),
                                       device_type="cpu", timeout_s=60.0).mesh
    path = common.Path(sys.argv[1])
    hf = common.load_hf_model("value", path, torch.device("cpu"))
    model = common.load_hf_model("value", path, torch.device("cpu"))
    parallelize.shard_model(model, mesh, parallelize.mp_policy("fp32"))
    parallelize.set_sum_reduction(model, divide_factor=1.0)
    initial = sda.full_params(model)
    hf_initial = {n: p.detach().clone() for n, p in hf.named_parameters()}
    ids = torch.arange(3, 27).reshape(2, 12)
    rows = slice(dist.get_rank(), dist.get_rank() + 1)   # one row per rank
    model(input_ids=ids[rows], use_cache=False).logits.sum().backward()
    hf(input_ids=ids, use_cache=False).logits.sum().backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False, fused=False)
    ref_opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, foreach=False, fused=False)
    grads = sda.full_grads(model)
    opt.step(); ref_opt.step()
    params = sda.full_params(model)
    exp_avg = sda.full_optimizer_state(model, opt, "exp_avg")
    rep = {"all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
           "local_rows": {n: int(p.to_local().shape[0]) for n, p in model.named_parameters()},
           "initial": all(torch.equal(initial[n], t) for n, t in hf_initial.items()),
           "param": max(float((params[n] - p.detach()).abs().max())
                        for n, p in hf.named_parameters()),
           "grad": max(float((grads[n] - p.grad).abs().max() / (p.grad.abs().max() + 1e-30))
                       for n, p in hf.named_parameters()),
           "exp_avg": max(float((exp_avg[n] - ref_opt.state[p]["exp_avg"]).abs().max()
                                / (ref_opt.state[p]["exp_avg"].abs().max() + 1e-30))
                          for n, p in hf.named_parameters()),
           "names": sorted(params) == sorted(n for n, _ in hf.named_parameters())}
    # One file per rank: two ranks printing to torchrun's shared stdout can interleave
    # their lines (seen once: two reports on one line, a JSON decode error).
    out = common.Path(sys.argv[2]) / f"rank{dist.get_rank()}.json"
    out.write_text(json.dumps(rep))
    dist.destroy_process_group()
''')


def test_sharded_parameters_gather_to_the_hf_layout(runs: Runs, tmp_path: Path) -> None:
    """``full_tensor()`` of each FSDP2 shard (incl. ``score.weight``'s empty rank-1 shard)
    is the HF tensor; a 2-row batch split over 2 ranks gives the 2-row HF gradient."""
    script = tmp_path / "gather.py"
    script.write_text(GATHER_SCRIPT)
    cmd = warm_command(str(script), 2, tmp_path / "logs", str(runs.inputs_dir / "critic"),
                       str(tmp_path))
    proc = subprocess.run(cmd, cwd=repo_root(), env=launch_env(None), capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT_S, check=False)
    assert proc.returncode == 0, rank_stderr(tmp_path / "logs")
    reps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert len(reps) == 2
    for rep in reps:
        assert rep["all_dtensor"]
        assert rep["names"]
        assert rep["initial"]  # the gathered shards are the HF weights, bitwise
        assert rep["param"] < 1e-6, rep  # after one AdamW step on each side (lr 1e-3)
        assert rep["grad"] < 1e-5, rep
        assert rep["exp_avg"] < 1e-5, rep
    assert sorted(r["local_rows"]["score.weight"] for r in reps) == [0, 1]
    assert [r["local_rows"]["model.embed_tokens.weight"] for r in reps] == [192, 192]


# --------------------------------------------------------------------------- in-process units


def test_dp_rows_slice_the_batch_in_order() -> None:
    assert dp_rows(8, 1, 0, 4) == slice(0, 8)
    assert [dp_rows(8, 2, d, 4) for d in (0, 1)] == [slice(0, 4), slice(4, 8)]
    covered = [i for d in range(2) for i in range(8)[dp_rows(8, 2, d, 2)]]
    assert covered == list(range(8))
    with pytest.raises(HarnessError, match="7 rows, not divisible by dp = 2"):
        dp_rows(7, 2, 0, 4)
    with pytest.raises(HarnessError, match="not a valid placement"):
        dp_rows(8, 2, 2, 4)


def test_world_size_rule_and_options() -> None:
    cell = HarnessCell(engine="fsdp2", precision="fp32", options={"dp": 2}, actor_tp=1,
                       critic_tp=1, rounds=2, seed=0, inputs_dir="i", output_dir="o")
    assert ENGINE.world_size(cell) == 4
    assert dp_degree(cell) == 2
    assert role_ranks(1, 1, 2) == {"actor": (0, 1), "critic": (2, 3)}
    assert role_ranks(0, 1, 2) == {"critic": (0, 1)}
    two_d = dataclasses.replace(cell, actor_tp=2, critic_tp=2)
    assert ENGINE.world_size(two_d) == 8
    assert dp_degree(two_d) == 2
    assert role_ranks(2, 2, 2) == {"actor": (0, 1, 2, 3), "critic": (4, 5, 6, 7)}
    assert grid((4, 5, 6, 7), 2) == [[4, 5], [6, 7]]  # TP groups contiguous, dp rows
    tp_axis = ENGINE.axis("tp")
    assert tp_axis is not None
    assert tp_axis.degrees == (1, 2)
    with pytest.raises(HarnessError, match="only the option 'dp'"):
        dp_degree(dataclasses.replace(cell, options={"zero": 1}))


def test_contract_cells_and_lanes() -> None:
    c = load_contract(CONTRACT)
    ids = [x.cell_id for x in c.matrix.cells()]
    assert ids == [f"fsdp2-{p}-{r}-tp{t}-dp{d}" for p in ("fp32", "bf16")
                   for r in ("actor", "critic") for t in (1, 2) for d in (1, 2)]
    dp2 = next(x for x in c.matrix.cells() if x.cell_id == "fsdp2-bf16-actor-tp1-dp2")
    assert dp2.base_cell_id() == "fsdp2-bf16-actor-tp1-dp1"  # the DP 1 vs DP 2 comparison
    assert dp2.lane == "bf16"  # BF16 parameters from FP32 masters: the params style
    two_d = next(x for x in c.matrix.cells() if x.cell_id == "fsdp2-fp32-critic-tp2-dp2")
    assert two_d.base_cell_id() == "fsdp2-fp32-critic-tp1-dp1"
    launches = plan_launches(c, c.matrix.cells())
    assert [(lc.launch_id, ENGINE.world_size(HarnessCell(
        engine="fsdp2", precision="fp32", options=dict(lc.options), actor_tp=lc.actor.tp,
        critic_tp=lc.critic.tp, rounds=2, seed=0, inputs_dir="i", output_dir="o")))
        for lc in launches if lc.precision == "fp32" and lc.actor and lc.critic] == [
        ("fsdp2-fp32-dp1-a1c1", 2), ("fsdp2-fp32-dp1-a2c2", 4),
        ("fsdp2-fp32-dp2-a1c1", 4), ("fsdp2-fp32-dp2-a2c2", 8)]


def test_vocab_math_matches_log_softmax() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    targets = torch.randint(0, 11, (3, 5), generator=g)
    lp, ent = sdk_losses.logprobs_and_entropy(logits, targets, 0.7)
    ref = torch.log_softmax(logits / 0.7, dim=-1)
    torch.testing.assert_close(lp, ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))


def test_unknown_fault_is_refused() -> None:
    with pytest.raises(HarnessError, match="unknown fault"):
        Faults(["grad_averaged_twise"])
    assert "grad_averaged_twice" in Faults(["grad_averaged_twice"])


# --------------------------------------------------------------------------- 2-D: dp 2 x tp 2


def test_tp2_dp2_launch_places_a_2d_mesh(runs: Runs) -> None:
    t, meta = runs.tensors("fp32-tp2-dp2"), runs.meta("fp32-tp2-dp2")
    assert set(t) == (expected_names("actor", runs.params["actor"])
                      | expected_names("critic", runs.params["critic"]))
    assert meta["world_size"] == 8
    assert [(r["rank"], r["role"], r["tp_rank"], r["tp_group"]) for r in meta["ranks"]] == [
        (base + 2 * d + k, role, k, [base + 2 * d, base + 2 * d + 1])
        for base, role in ((0, "actor"), (4, "critic")) for d in (0, 1) for k in (0, 1)]
    for role, rm in meta["roles"].items():
        par = rm["parallelism"]
        assert rm["tp"] == 2
        assert par["dp"] == 2
        assert par["mesh_dim_names"] == ["dp", "tp"]
        base = 0 if role == "actor" else 4
        assert par["rank_grid_dp_by_tp"] == [[base, base + 1], [base + 2, base + 3]]
        tpi = par["tensor_parallel"]
        assert tpi["lm_head"] == ("colwise_gathered" if role == "actor" else None)
        pl = par["placements"]
        # TP first, then FSDP2 over dp: every parameter a 2-D DTensor
        assert pl["model.layers.0.self_attn.q_proj.weight"] == [
            "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
        assert pl["model.layers.0.self_attn.o_proj.weight"] == ["Shard(dim=0)", "Shard(dim=1)"]
        assert pl["model.layers.0.input_layernorm.weight"] == ["Shard(dim=0)", "Replicate()"]
        assert set(pl) == set(runs.params[role])
        assert "model.embed_tokens.weight" in par["tp_replicated_params"]
        assert par["replica_check"].startswith("bitwise over each TP group")
        rc = rm["replica_consistency"]
        assert rc["all_equal"], rc  # TP replicas bitwise equal after each step
        assert set(rc["params"]) == set(par["tp_replicated_params"])
        assert rm["micro_batches"] == 1
        assert rm["valid_tokens"] == sum(RESPONSE_LENGTHS)
    shapes = meta["roles"]["actor"]["parallelism"]["local_shard_shapes_dp_rank0"]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == [32, 64]  # 128 rows / tp / dp
    assert shapes["lm_head.weight"] == [96, 64]  # 384 vocab rows / tp / dp


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_tp2_dp2_agrees_with_dp1(runs: Runs, role: str) -> None:
    """dp 2 x tp 2 against the single rank: FP32 rounding of the row-parallel sums only."""
    err = family_errors(role_tensors(runs.tensors("fp32-tp2-dp2"), role),
                        role_tensors(runs.tensors("fp32-dp1"), role), runs.mask)
    print(f"\n[fsdp2] TP2xDP2 vs DP1 fp32 {role}: "
          + ", ".join(f"{k}={v:.2e}" for k, v in sorted(err.items())))
    floors = load_contract(CONTRACT).bounds.floors["fp32"]
    for fam in ("logprobs", "entropy", "values", "grads", "exp_avg", "exp_avg_sq"):
        if fam in err:
            assert err[fam] <= floors[fam], (fam, err)
    if role == "actor":  # the initial-weights distributions, rows gathered over dp
        assert max(err["prefill_raw"], err["prefill_tempered"]) <= floors["logprobs"], err
    assert err["updates"] <= 10 * floors["updates"], err
    assert err["loss"] <= 10 * floors["losses"], err
    assert err["grad_norm"] <= 10 * floors["grad_norm"], err


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_fault_grad_averaged_twice_halves_the_2d_gradients(runs: Runs, role: str) -> None:
    """FSDP2's divide-by-dp left on: still the dp size (2) on the 2-D mesh, not dp x tp."""
    bad, good = runs.tensors("fault-tp2-dp2"), runs.tensors("fp32-tp2-dp2")
    for k in [k for k in good if k.startswith(f"round1/{role}/grads/")]:
        torch.testing.assert_close(bad[k], good[k] / 2, rtol=1e-6, atol=1e-9)
    assert float(bad[f"round1/{role}/grad_norm"]) == pytest.approx(
        float(good[f"round1/{role}/grad_norm"]) / 2, rel=1e-6)
    err = family_errors(role_tensors(bad, role), role_tensors(good, role), runs.mask)
    assert err["grads"] >= 0.49, err


GATHER_2D_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch, torch.distributed as dist
    from harnesses import common
    from harnesses.fsdp2 import parallelize, state_dict_adapter as sda, tensor_parallel
    from torch.distributed.tensor import DTensor
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rm = parallelize.build_role_mesh(actor_tp=2, critic_tp=0, dp=2, rank=rank,
                                     device_type="cpu", timeout_s=60.0)
    path = common.Path(sys.argv[1])
    hf = common.load_hf_model("causal_lm", path, torch.device("cpu"))
    model = common.load_hf_model("causal_lm", path, torch.device("cpu"))
    tensor_parallel.apply_tp(model, rm.tp_mesh)
    parallelize.shard_model(model, rm.dp_mesh, parallelize.mp_policy("fp32"))
    parallelize.set_sum_reduction(model, divide_factor=1.0)
    initial = sda.full_params(model)
    hf_initial = {n: p.detach().clone() for n, p in hf.named_parameters()}
    heads = []  # what HF's attention computes: q_proj's local output, viewed as heads
    model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda m, a, out: heads.append([type(out).__name__, list(out.shape)]))
    ids = torch.arange(3, 27).reshape(2, 12)
    rows = slice(rm.dp_rank, rm.dp_rank + 1)   # one row per DP rank, both TP ranks alike
    logits = model(input_ids=ids[rows], use_cache=False).logits
    hf_logits = hf(input_ids=ids, use_cache=False).logits
    fwd = float((logits - hf_logits[rows]).abs().max())
    (logits.float() ** 2).sum().backward()
    (hf_logits.float() ** 2).sum().backward()
    params = [p for p in model.parameters()]
    grads = sda.full_grads(model)
    # the classic bug: the local squares summed over dp only (not over tp)
    local_sq = torch.stack([p.grad.to_local().double().pow(2).sum() for p in params]).sum()
    dist.all_reduce(local_sq, group=rm.dp_group)
    dp_only = float(local_sq.sqrt())
    norm = torch.nn.utils.clip_grad_norm_(params, 1e9)
    norm_full = float(norm.full_tensor()) if isinstance(norm, DTensor) else float(norm)
    from_gathered = float(torch.cat([g.double().reshape(-1) for g in grads.values()]).norm())
    hf_norm = float(torch.nn.utils.clip_grad_norm_(list(hf.parameters()), 1e9))
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=False, fused=False)
    ref_opt = torch.optim.AdamW(hf.parameters(), lr=1e-3, foreach=False, fused=False)
    opt.step(); ref_opt.step()
    after = sda.full_params(model)
    exp_avg = sda.full_optimizer_state(model, opt, "exp_avg")
    def rel(a, b):
        return float((a - b).abs().max() / (b.abs().max() + 1e-30))
    rep = {"mesh": list(rm.mesh_dim_names), "dp_rank": rm.dp_rank, "tp_rank": rm.tp_rank,
           "all_2d": all(isinstance(p, DTensor) and p.device_mesh.ndim == 2 for p in params),
           "initial": all(torch.equal(initial[n], t) for n, t in hf_initial.items()),
           "names": sorted(after) == sorted(hf_initial),
           "heads": heads[0], "fwd": fwd,
           "grad": max(rel(grads[n], p.grad) for n, p in hf.named_parameters()),
           "param": max(float((after[n] - p.detach()).abs().max())
                        for n, p in hf.named_parameters()),
           "exp_avg": max(rel(exp_avg[n], ref_opt.state[p]["exp_avg"])
                          for n, p in hf.named_parameters()),
           "norm": norm_full, "norm_from_gathered": from_gathered, "norm_hf": hf_norm,
           "norm_dp_only": dp_only}
    out = common.Path(sys.argv[2]) / f"rank{rank}.json"
    out.write_text(json.dumps(rep))
    dist.destroy_process_group()
''')


@pytest.mark.slow  # a 4-rank torchrun, kept out of the README command for its 8-minute limit
def test_2d_layout_gathers_to_hf_and_clip_reduces_over_both_dims(runs: Runs,
                                                                  tmp_path: Path) -> None:
    """One role on a 2 x 2 ``("dp", "tp")`` mesh (4 ranks): the TP forward (local heads) is
    the unsharded one at FP32 rounding; ``full_tensor()`` of the 2-D parameters, gradients
    and AdamW state is the HF layout; ``clip_grad_norm_``'s norm is the norm of the gathered
    gradients, which a sum over ``dp`` only (the classic bug, computed here too) is not."""
    script = tmp_path / "gather2d.py"
    script.write_text(GATHER_2D_SCRIPT)
    cmd = warm_command(str(script), 4, tmp_path / "logs", str(runs.inputs_dir / "actor"),
                       str(tmp_path))
    proc = subprocess.run(cmd, cwd=repo_root(), env=launch_env(None), capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT_S, check=False)
    assert proc.returncode == 0, rank_stderr(tmp_path / "logs")
    reps = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    print("\n[fsdp2] 2-D gather/clip:", json.dumps(reps[0]))
    assert [(r["dp_rank"], r["tp_rank"]) for r in reps] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rep in reps:
        assert rep["mesh"] == ["dp", "tp"]
        assert rep["all_2d"]
        assert rep["names"]
        assert rep["initial"]  # the gathered 2-D shards are the HF weights, bitwise
        # a plain local tensor of 4 query heads / TP 2 = 2 heads of head_dim 32: HF's
        # view(*input_shape, -1, head_dim) sees the local heads
        assert rep["heads"] == ["Tensor", [1, 12, 64]]
        assert rep["fwd"] < 1e-5, rep  # row-parallel partial sums: FP32 rounding only
        assert rep["grad"] < 1e-5, rep
        assert rep["exp_avg"] < 1e-5, rep
        assert rep["param"] < 1e-6, rep
        assert rep["norm"] == pytest.approx(rep["norm_from_gathered"], rel=1e-6)
        assert rep["norm"] == pytest.approx(rep["norm_hf"], rel=1e-5)
        # the check can fail: a norm summed over dp only misses the other TP shard's squares
        assert abs(rep["norm_dp_only"] / rep["norm_from_gathered"] - 1) > 0.05, rep
    assert len({r["norm"] for r in reps}) == 1  # one norm on every rank
