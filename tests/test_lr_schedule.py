"""The contract's lr schedule: the formula, each engine's own scheduler, the lr rows.

- :mod:`qualify.schedule` against values derived by hand from its stated semantics;
- each engine's real scheduler object on a toy optimizer, stepped as the harness steps it
  (read ``param_groups`` lr, optimizer step, scheduler step): transformers'
  ``get_scheduler`` (torch_tp, fsdp2), Megatron-Core's ``OptimizerParamScheduler``, and
  DeepSpeed's config scheduler through the real ``deepspeed.initialize`` (a subprocess
  with a one-rank gloo group);
- the comparator's ``lr_schedule`` rows: within one FP32 ulp passes, an off-by-one
  scheduler (the real HF scheduler stepped first) fails naming ``lr``, and the root cause
  of a cell whose lr and updates fail is the lr.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from harnesses.hf_schedule import applied_lr, hf_scheduler
from qualify.compare.rootcause import root_causes
from qualify.compare.rows import lr_rows
from qualify.contract import OptimizerSpec, default_contract_path, load_contract
from qualify.schedule import lr_at, lr_factor

REPO = Path(__file__).resolve().parents[1]
BASE = 3e-4


def _spec(schedule: str, *, warmup: int = 0, total: int | None = None,
          ratio: float = 0.0) -> OptimizerSpec:
    return OptimizerSpec(actor_lr=BASE, critic_lr=BASE, betas=(0.9, 0.95), eps=1e-6,
                         weight_decay=0.1, max_grad_norm=0.5, lr_schedule=schedule,
                         warmup_steps=warmup, total_steps=total, min_lr_ratio=ratio)


# (schedule, W, T, r) -> lambda(s - 1) for s = 1..T, by hand from qualify/schedule.py:
# warmup c / W; linear r + (1 - r) (T - c) / (T - W); cosine r + (1 - r) (1 + cos(pi p)) / 2.
HAND = {
    ("constant", 0, None, 0.0): [1.0, 1.0, 1.0],
    ("cosine", 0, 2, 0.1): [1.0, 0.55],                      # cos(pi / 2) = 0
    ("linear", 0, 2, 0.0): [1.0, 0.5],
    ("linear", 0, 2, 0.5): [1.0, 0.75],
    ("linear", 2, 4, 0.0): [0.0, 0.5, 1.0, 0.5],             # warmup 0, 1/2; decay 2/2, 1/2
    ("cosine", 1, 3, 0.0): [0.0, 1.0, 0.5],                  # p = 0, 1/2
    ("cosine", 0, 3, 0.2): [1.0, 0.2 + 0.8 * 0.75, 0.2 + 0.8 * 0.25],  # cos(pi/3) = 1/2
}
SETTINGS = [k for k in HAND if k[0] != "constant"] + [("constant", 0, None, 0.0)]


@pytest.mark.parametrize("key", list(HAND), ids=[f"{k[0]}-W{k[1]}-T{k[2]}-r{k[3]}" for k in HAND])
def test_formula_matches_hand_values(key: tuple[str, int, int | None, float]) -> None:
    schedule, w, t, r = key
    got = [lr_factor(schedule, s, warmup_steps=w, total_steps=t, min_lr_ratio=r)
           for s in range(1, len(HAND[key]) + 1)]
    assert got == pytest.approx(HAND[key], abs=1e-15)


def test_formula_refuses_steps_outside_the_schedule() -> None:
    with pytest.raises(ValueError, match="1-based"):
        lr_factor("cosine", 0, total_steps=2)
    with pytest.raises(ValueError, match="beyond total_steps"):
        lr_factor("cosine", 3, total_steps=2)
    with pytest.raises(ValueError, match="warmup_steps < total_steps"):
        lr_factor("linear", 1, warmup_steps=2, total_steps=2)


def test_default_contract_lrs() -> None:
    c = load_contract(default_contract_path())
    o = c.optimizer
    assert (o.lr_schedule, o.warmup_steps, o.total_steps, o.min_lr_ratio) == ("cosine", 0, 2,
                                                                             0.1)
    lrs = [o.lr("actor", s) for s in (1, 2)]
    assert lrs == pytest.approx([3e-4, 1.65e-4], rel=1e-15)
    assert lrs[0] != lrs[1]
    assert min(lrs) > 0
    assert lr_at(BASE, "cosine", 2, total_steps=2, min_lr_ratio=0.1) == o.lr("critic", 2)


def _ulp_ok(got: list[float], want: list[float]) -> bool:
    return all(abs(a - b) <= float(np.spacing(np.float32(abs(b)))) for a, b in zip(got, want,
                                                                                  strict=True))


def _toy_optimizer() -> torch.optim.Optimizer:
    return torch.optim.AdamW(torch.nn.Linear(3, 1).parameters(), lr=BASE)


def _hf_lrs(spec: OptimizerSpec, steps: int, *, stepped_first: bool = False) -> list[float]:
    opt = _toy_optimizer()
    sched = hf_scheduler(opt, spec)
    out = []
    for _ in range(steps):
        if stepped_first:
            sched.step()
        out.append(applied_lr(opt))
        opt.step()
        if not stepped_first:
            sched.step()
    return out


@pytest.mark.parametrize("key", SETTINGS, ids=[f"{k[0]}-W{k[1]}-T{k[2]}-r{k[3]}"
                                               for k in SETTINGS])
def test_hf_get_scheduler_gives_the_contract_lr(key: tuple[str, int, int | None, float]) -> None:
    schedule, w, t, r = key
    spec = _spec(schedule, warmup=w, total=t, ratio=r)
    n = len(HAND[key])
    assert _ulp_ok(_hf_lrs(spec, n), [spec.lr("actor", s) for s in range(1, n + 1)])


@pytest.mark.parametrize("key", SETTINGS, ids=[f"{k[0]}-W{k[1]}-T{k[2]}-r{k[3]}"
                                               for k in SETTINGS])
def test_megatron_scheduler_gives_the_contract_lr(key: tuple[str, int, int | None,
                                                             float]) -> None:
    pytest.importorskip("megatron.core")
    from harnesses.megatron.train import applied_lr as mcore_lr
    from harnesses.megatron.train import lr_scheduler

    schedule, w, t, r = key
    spec = _spec(schedule, warmup=w, total=t, ratio=r)
    n = len(HAND[key])
    opt = _toy_optimizer()
    min_lr = BASE if schedule == "constant" else r * BASE
    sched = lr_scheduler(opt, spec, lr=BASE, min_lr=min_lr, rounds=n)
    got = []
    for _ in range(n):
        got.append(mcore_lr(opt))
        opt.step()
        sched.step(increment=1)
    assert _ulp_ok(got, [spec.lr("actor", s) for s in range(1, n + 1)]), got


DS_PROBE = r"""
import json, os, sys
import torch, deepspeed
from harnesses import hf_schedule
from harnesses.deepspeed.parallelize import ds_config, ds_scheduler, skip_shm_comm_build
from qualify.contract import OptimizerSpec
skip_shm_comm_build()  # as the harness: no JIT C++ build of the shm all-reduce op (minutes)
deepspeed.init_distributed(dist_backend="gloo")
out = {}
for key in json.loads(sys.argv[1]):
    name, w, t, r = key
    spec = OptimizerSpec(actor_lr=3e-4, critic_lr=3e-4, betas=(0.9, 0.95), eps=1e-6,
                         weight_decay=0.1, max_grad_norm=0.5, lr_schedule=name,
                         warmup_steps=w, total_steps=t, min_lr_ratio=r)
    for how in ("config", "client"):  # DeepSpeed's own class / what the harness passes
        sched = ds_scheduler(spec, 3e-4) if how == "config" else None
        cfg = ds_config(precision="fp32", zero=0, tp=1, micro_batch_size=1, n_micro=1,
                        lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1,
                        max_grad_norm=1.0, scheduler=sched)
        client = None if how == "config" else (lambda o: hf_schedule.hf_scheduler(o, spec))
        engine, *_ = deepspeed.initialize(model=torch.nn.Linear(4, 1), config=cfg,
                                          lr_scheduler=client)
        lrs = []
        for _ in range(t or 2):
            engine.backward(engine(torch.ones(1, 4)).sum())
            lrs.append(float(engine.get_lr()[0]))
            engine.step()
        out[how + " " + json.dumps(key)] = [type(engine.lr_scheduler).__name__, lrs]
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def deepspeed_lrs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per setting: DeepSpeed's scheduler class and the lr ``engine.get_lr()`` gave each step."""
    pytest.importorskip("deepspeed")
    keys = [list(k) for k in SETTINGS]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29761", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "-c", DS_PROBE, json.dumps(keys)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert line, proc.stdout[-3000:]
    return dict(json.loads(line[0].removeprefix("RESULT ")))


def test_deepspeed_config_schedulers(deepspeed_lrs: dict[str, Any]) -> None:
    """DeepSpeed's own classes, what they apply, and where that differs from the contract.

    Measured (deepspeed 0.19.x): the config scheduler is built with
    ``last_batch_iteration = -1`` and stepped only after each optimizer step, so step 1
    applies ``get_lr()`` at -1 (``WarmupDecayLR``: ``warmup_min_lr`` = 0;
    ``WarmupCosineLR``: 0) and step ``s`` applies DeepSpeed's iteration ``s - 2``; its
    warmup lasts at least 2 steps. Every non-constant setting therefore differs from the
    contract at step 1; a constant one (no scheduler) does not.
    """
    for key in SETTINGS:
        schedule, w, t, r = key
        cls, got = deepspeed_lrs["config " + json.dumps(list(key))]
        spec = _spec(schedule, warmup=w, total=t, ratio=r)
        want = [spec.lr("actor", s) for s in range(1, len(got) + 1)]
        if schedule == "constant":
            assert cls == "NoneType"
            assert _ulp_ok(got, want)
            continue
        assert cls == {"linear": "WarmupDecayLR", "cosine": "WarmupCosineLR"}[schedule]
        assert got[:2] == [0.0, 0.0], got  # iterations -1 and 0 of a 2-step warmup
        if want[0] != 0.0:
            assert not _ulp_ok(got, want)
    # The default contract (cosine, T = 2, r = 0.1): DeepSpeed applies 0 at both steps.
    assert deepspeed_lrs["config " + json.dumps(["cosine", 0, 2, 0.1])][1] == [0.0, 0.0]


def test_deepspeed_client_scheduler_gives_the_contract_lr(deepspeed_lrs: dict[str, Any]) -> None:
    """What the harness runs: transformers' scheduler passed to ``deepspeed.initialize`` as
    a client scheduler, stepped by ``engine.step()``: the contract's lr at every step."""
    for key in SETTINGS:
        schedule, w, t, r = key
        cls, got = deepspeed_lrs["client " + json.dumps(list(key))]
        spec = _spec(schedule, warmup=w, total=t, ratio=r)
        assert cls == "LambdaLR"
        assert _ulp_ok(got, [spec.lr("actor", s) for s in range(1, len(got) + 1)]), (key, got)


def _meta(lrs: list[float]) -> dict[str, Any]:
    return {"lr": {f"round{i}": x for i, x in enumerate(lrs, 1)}}


def test_lr_rows_pass_within_one_fp32_ulp_and_fail_off_by_one() -> None:
    spec = _spec("cosine", total=2, ratio=0.1)
    sealed = {f"round{s}": spec.lr("actor", s) for s in (1, 2)}
    ok = lr_rows("c", "actor", _meta(_hf_lrs(spec, 2)), "", sealed)
    assert [r.verdict for r in ok] == ["PASS", "PASS"]
    assert all(r.family == "lr" and r.klass == "lr_schedule" for r in ok)
    # Megatron's min + coeff (max - min) is one FP64 ulp below 3e-4: still a pass.
    assert [r.verdict for r in lr_rows("c", "actor", _meta([0.0002999999999999999, 1.65e-4]),
                                       "", sealed)] == ["PASS", "PASS"]
    # One FP32 ulp is the bound: two ulps off fails.
    two = 3e-4 + 2 * float(np.spacing(np.float32(3e-4)))
    assert lr_rows("c", "actor", _meta([two, 1.65e-4]), "", sealed)[0].verdict == "FAIL"
    # A planted fault: the real HF scheduler stepped before the optimizer (one step early).
    with pytest.warns(UserWarning, match="before `optimizer.step"):  # torch notices it too
        early = _hf_lrs(spec, 2, stepped_first=True)
    assert early == pytest.approx([1.65e-4, 3e-5], rel=1e-12)
    bad = lr_rows("c", "actor", _meta(early), "", sealed)
    assert [r.verdict for r in bad] == ["FAIL", "FAIL"]
    assert bad[0].metric == "round1/actor/lr"
    assert "lr = 0.000165" in str(bad[0].reason)
    assert bad[0].detail is not None
    assert bad[0].detail.table[0][1:3] == (early[0], sealed[
        "round1"])
    missing = lr_rows("c", "actor", {"dtypes": {}}, "", sealed)
    assert [r.verdict for r in missing] == ["FAIL", "FAIL"]
    assert "no lr" in str(
        missing[0].reason)
    assert lr_rows("c", "actor", _meta(early), "", None) == []  # a reference without lr


def test_root_cause_names_the_lr_before_the_updates() -> None:
    spec = _spec("cosine", total=2, ratio=0.1)
    sealed = {f"round{s}": spec.lr("actor", s) for s in (1, 2)}
    rows = [r.to_dict() for r in lr_rows("c", "actor", _meta([0.0, 0.0]), "", sealed)]
    upd = dict(rows[0], **{"class": "candidate_vs_hf", "family": "updates",
                           "metric": "round1/actor/updates", "statistic": "max_rel_l2",
                           "margin": 1e9})
    grads2 = dict(rows[0], **{"class": "candidate_vs_hf", "family": "grads", "round": 2,
                              "metric": "round2/actor/grads", "statistic": "max_rel_l2",
                              "margin": 1e9})
    causes = root_causes([grads2, upd, *rows], ["c"])
    assert len(causes) == 1
    assert causes[0].to_dict()["metric"] == "round1/actor/lr", causes[0].to_dict()
    assert math.isinf(rows[0]["margin"]) or rows[0]["margin"] > 1
