"""Gate policies (qualify.evidence.policy): evaluation, the committed policies, the gate with
a policy on the fresh signed world, and a corpus of bad policy files (exit 2, one line)."""

from __future__ import annotations

import fnmatch
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fresh_world import code_root, fresh, fresh_world
from test_verify import CONTRACT, CUDA_ONLY, FAIL_CELL, World, run_cli, signed_world

from qualify.cli.main import main as qualify_main
from qualify.contract import load_contract
from qualify.errors import ContractError, ExitCode
from qualify.evidence.gate import gate
from qualify.evidence.policy import (
    KNOWN_FAMILIES,
    all_cells,
    default_policy,
    evaluate,
    load_policy,
    policy_for,
)
from qualify.pipeline.sweep import rule_digest
from qualify.resources import contracts_dir, repo_root

__all__ = ["fresh", "fresh_world", "signed_world"]

TINY = contracts_dir() / "tiny-qwen3.toml"
# The findings of the default run (qualify run contracts/tiny-qwen3.toml on the BF16-
# representable checkpoint, each BF16 cell against the reference of its own BF16 style: run
# 20261205T125331Z of the h/bf16ckpt branch, its report.json): cell -> the families of its
# FAIL rows. Only the DeepSpeed BF16 ZeRO-0 defects fail.
TINY_FINDINGS: dict[str, list[str]] = {
    "deepspeed-bf16-zero0-actor-tp1": ["dtypes", "entropy", "exp_avg", "exp_avg_sq", "grads",
                                       "logprobs", "losses", "updates"],
    "deepspeed-bf16-zero0-actor-tp2": ["clip_coef", "dtypes", "entropy", "exp_avg", "exp_avg_sq",
                                       "grad_norm", "grads", "logprobs", "losses", "updates"],
    "deepspeed-bf16-zero0-critic-tp1": ["clip_coef", "dtypes", "grad_norm", "values"],
    "deepspeed-bf16-zero0-critic-tp2": ["clip_coef", "dtypes", "exp_avg", "exp_avg_sq",
                                        "grad_norm", "values"],
}


def _role(cell: str) -> str:
    return next((r for r in ("actor", "critic", "sampler") if f"-{r}" in cell), "actor")


def row(cell: str, family: str, verdict: str, *, rnd: int = 2,
        margin: float | None = None) -> dict[str, Any]:
    role = _role(cell)
    return {"cell": cell, "family": family, "verdict": verdict, "round": rnd, "role": role,
            "statistic": "abs" if family in ("grad_norm", "clip_coef") else "max_abs",
            "metric": f"round{rnd}/{role}/{family}", "margin": margin}


def _first_round(contract: Path, cell: str, family: str) -> int:
    """The first round the committed policy expects ``cell``'s ``family`` to fail in (2
    when no entry names rounds): the synthetic finding fails where the run's did."""
    policy = policy_for(load_contract(contract))
    for e in policy.expected_failures:
        if fnmatch.fnmatchcase(cell, e.cells) and family in e.families and e.rounds:
            return min(e.rounds)
    return 2


def cell_doc(cell: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    order = ("FAIL", "ERROR", "NOT_RUN", "PASS")
    verdict = next((v for v in order if any(r["verdict"] == v for r in rows)), "NOT_RUN")
    return {"cell": cell, "engine": cell.split("-", maxsplit=1)[0], "verdict": verdict,
            "reason": None if verdict == "PASS" else f"{verdict} row"}


def tiny_report(findings: dict[str, list[str]] | None = None,
                contract: Path = TINY) -> dict[str, Any]:
    """A report of ``contract`` (default: the default contract) as its run gave it: the
    findings FAIL (margin 1.5), everything else PASS (every cell runs on CPU, Megatron's
    training included)."""
    found = TINY_FINDINGS if findings is None else findings
    cells, rows = [], []
    for cid in all_cells(load_contract(contract)):
        rs = [row(cid, "losses" if "sampler" not in cid else "install", "PASS", margin=0.1)]
        rs += [row(cid, f, "FAIL", rnd=_first_round(contract, cid, f), margin=1.5)
               for f in found.get(cid, [])]
        cells.append(cell_doc(cid, rs))
        rows += rs
    return {"cells": cells, "rows": rows}


# --------------------------------------------------------------------------- evaluation


def test_committed_tiny_policy_gates_the_default_findings_to_exit_0() -> None:
    policy = policy_for(load_contract(TINY))
    assert policy.path == contracts_dir() / "gates" / "tiny-qwen3.toml"
    ev = evaluate(tiny_report(), policy)
    assert ev.exit_code == ExitCode.OK, list(ev.offending)
    assert ev.counts() == {"PASS": 38, "XFAIL": 4, "FAIL": 0, "NOT_RUN": 0, "STALE": 0,
                           "XPASS": 0}
    by = {c.cell: c for c in ev.cells}
    ds = by["deepspeed-bf16-zero0-actor-tp2"]
    assert (ds.outcome, ds.allowed_not_run) == ("XFAIL", None)
    assert "TP rank 0's shards" in (ds.reason or "")
    assert ds.first is not None
    # its root cause, as in the run: the round-1 grad norm of TP rank 0's shards
    assert (ds.first["family"], ds.first["round"], ds.first["margin"]) == ("grad_norm", 1, 1.5)
    # DeepSpeed ZeRO-1/2 and Megatron-Core BF16 meet their own style's reference: no entry
    assert all(by[c].outcome == "PASS" for c in by
               if c.startswith(("megatron-bf16", "deepspeed-bf16-zero1", "deepspeed-bf16-zero2")))
    # the same report without a policy: the 4 findings FAIL, nothing else
    plain = evaluate(tiny_report(), default_policy(load_contract(TINY)))
    assert plain.counts()["FAIL"] == 4
    assert {c.cell for c in plain.offending} == set(TINY_FINDINGS)


# The findings of the full GRPO and decoupled-PPO runs on CPU (report.json of `qualify run
# contracts/tiny-qwen3-{grpo,dppo}.toml`, each BF16 cell against its own BF16 style's
# reference): cell -> the families of its FAIL rows. Every other cell PASSed.
ALGO_FINDINGS: dict[str, dict[str, list[str]]] = {
    "tiny-qwen3-grpo": {
        "deepspeed-bf16-zero0-actor-tp1": ["clip_coef", "dtypes", "entropy", "exp_avg",
                                           "exp_avg_sq", "grad_norm", "grads", "logprobs",
                                           "losses", "updates"],
    },
    "tiny-qwen3-dppo": {
        "deepspeed-bf16-zero0-actor-tp1": ["dtypes", "entropy", "exp_avg", "exp_avg_sq",
                                           "grads", "logprobs", "losses"],
        "deepspeed-bf16-zero0-critic-tp1": ["clip_coef", "dtypes", "grad_norm", "losses",
                                            "values"],
    },
}


@pytest.mark.parametrize("name", sorted(ALGO_FINDINGS))
def test_committed_algorithm_policies_gate_their_runs_findings_to_exit_0(name: str) -> None:
    path = contracts_dir() / f"{name}.toml"
    contract = load_contract(path)
    policy = policy_for(contract)
    assert policy.path == contracts_dir() / "gates" / f"{name}.toml"
    findings = ALGO_FINDINGS[name]
    assert set(findings) <= set(all_cells(contract))
    ev = evaluate(tiny_report(findings, path), policy)
    assert ev.exit_code == ExitCode.OK, list(ev.offending)
    n = len(all_cells(contract))
    assert ev.counts() == {"PASS": n - len(findings), "XFAIL": len(findings), "FAIL": 0,
                           "NOT_RUN": 0, "STALE": 0, "XPASS": 0}
    # without the policy exactly the findings FAIL; with it, a finding that passes is XPASS
    plain = evaluate(tiny_report(findings, path), default_policy(contract))
    assert {c.cell for c in plain.offending} == set(findings)
    gone = next(iter(sorted(findings)))
    fixed = evaluate(tiny_report({k: v for k, v in findings.items() if k != gone}, path),
                     policy)
    assert fixed.exit_code != ExitCode.OK
    assert [(c.cell, c.outcome) for c in fixed.offending] == [(gone, "XPASS")]
    # a failure in a family no entry expects fails the gate
    extra = {**findings, gone: [*findings[gone], "replica"]}
    worse = evaluate(tiny_report(extra, path), policy)
    assert [(c.cell, c.outcome) for c in worse.offending] == [(gone, "FAIL")]


GATED = sorted(p.stem for p in (contracts_dir() / "gates").glob("*.toml")
               if p.stem not in ("tiny-qwen3", "smollm2-135m"))
"""Gated contracts whose policy their own committed seed sweep derived (the default
contract's is checked against its sweep by test_policy_ceiling; SmolLM2's is hand-written:
its sweep is not run here, docs/ci-gating.md)."""


@pytest.mark.parametrize("name", GATED)
def test_algorithm_policies_are_derived_by_their_committed_sweep(name: str) -> None:
    """Each entry is one the contract's committed seed sweep (``evidence/<name>/sweep.json``,
    the contract itself and seed variants 1-5) derived, with its ceiling, and every derived
    entry is in the policy: no family listed that no seed failed in (it would hide a
    regression there), none missing; the sweep judged every variant 0 under this policy
    (exit 0, nothing unexplained), with this contract and policy."""
    contract = load_contract(contracts_dir() / f"{name}.toml")
    policy = policy_for(contract)
    sweep = json.loads((repo_root() / "evidence" / name / "sweep.json").read_text())
    assert sweep["contract_digest"] == contract.digest, "the contract changed since the sweep"
    assert sweep["policy_digest"] == policy.digest, "the policy changed since the sweep"
    assert sweep["rule_digest"] == rule_digest(), "the bound rule changed since the sweep"
    assert [v["offset"] for v in sweep["variants"]] == [0, 1, 2, 3, 4, 5]
    assert sweep["exit_code"] == 0
    assert sweep["unexplained"] == []
    assert all(v["exit_code"] == 0 for v in sweep["variants"])
    derived = {(d["cells"], tuple(d["families"])): d["max_margin"] for d in sweep["derived"]}
    listed = {(e.cells, tuple(e.families)): e.max_margin for e in policy.expected_failures}
    assert listed == derived
    # every cell the contract's own run failed (ALGO_FINDINGS, where recorded) is covered
    for cell, families in ALGO_FINDINGS.get(name, {}).items():
        assert set(families) <= {f for (c, fs) in listed if fnmatch.fnmatchcase(cell, c)
                                 for f in fs}, cell


@pytest.mark.parametrize(("change", "cell", "outcome", "words"), [
    ({"deepspeed-bf16-zero0-actor-tp2": []}, "deepspeed-bf16-zero0-actor-tp2", "XPASS",
     "expected failure now passes: update the policy"),
    ({"deepspeed-bf16-zero0-critic-tp1": ["grad_norm", "replica"]},
     "deepspeed-bf16-zero0-critic-tp1", "FAIL", "fails outside the expected families: replica"),
    ({"torch_tp-bf16-actor-tp1": ["logprobs"]}, "torch_tp-bf16-actor-tp1", "FAIL", "FAIL row"),
    ({"deepspeed-bf16-zero0-critic-tp2": []}, "deepspeed-bf16-zero0-critic-tp2", "XPASS",
     "update the policy"),
    # the masters' birth is no expected failure of the default contract any more
    ({"megatron-bf16-actor-tp2": ["entropy"]}, "megatron-bf16-actor-tp2", "FAIL", "FAIL row"),
], ids=["xfail-passes", "fail-outside-families", "unexpected-fail", "ds-xpass",
        "castmasters-fail"])
def test_anything_else_fails_the_policy(change: dict[str, list[str]], cell: str,
                                        outcome: str, words: str) -> None:
    findings = {**TINY_FINDINGS, **change}
    ev = evaluate(tiny_report(findings), policy_for(load_contract(TINY)))
    assert ev.exit_code == ExitCode.QUALIFICATION_FAILED
    (bad,) = ev.offending
    assert (bad.cell, bad.outcome, bad.ok) == (cell, outcome, False)
    assert words in (bad.reason or "")


def test_not_run_rows_need_an_allowance_and_stale_wins() -> None:
    policy = policy_for(load_contract(TINY))
    report = tiny_report()
    cid = "deepspeed-fp32-zero1-actor-tp1"
    report["rows"].append(row(cid, "grads", "NOT_RUN"))
    ev = evaluate(report, policy)
    (bad,) = ev.offending
    assert (bad.cell, bad.outcome) == (cid, "NOT_RUN")
    assert "without an allowance" in (bad.reason or "")
    ok = evaluate(report, policy, allow_not_run=["deepspeed-fp32-*"])
    assert ok.exit_code == ExitCode.OK
    stale = evaluate(tiny_report(), policy, stale={
        "deepspeed-bf16-zero0-actor-tp1": ["harnesses/deepspeed/harness.py"]})
    (bad,) = stale.offending
    assert bad.outcome == "STALE"
    assert bad.stale_files == ("harnesses/deepspeed/harness.py",)
    assert "harnesses/deepspeed/harness.py" in (bad.reason or "")


def test_absent_cell_is_not_run_and_error_is_never_expected() -> None:
    policy = policy_for(load_contract(TINY))
    report = tiny_report()
    report["cells"] = [c for c in report["cells"] if c["cell"] != "vllm-fp32-sampler-tp2"]
    cid = "deepspeed-bf16-zero0-actor-tp1"
    report["rows"].append(row(cid, "logprobs", "ERROR"))
    ev = evaluate(report, policy)
    by = {c.cell: c for c in ev.offending}
    assert by["vllm-fp32-sampler-tp2"].outcome == "NOT_RUN"
    assert by["vllm-fp32-sampler-tp2"].reason == "absent from the report"
    assert by[cid].outcome == "FAIL"


def _heading_exists(md: Path, anchor: str) -> bool:
    return any(re.fullmatch(r"#+ (.*)", line) and line.lstrip("#").strip() == anchor
               for line in md.read_text().splitlines())


@pytest.mark.parametrize("name", ["tiny-qwen3", "smollm2-135m", "tiny-qwen3-grpo",
                                  "tiny-qwen3-dppo"])
def test_committed_policies_load_and_point_at_real_sections(name: str) -> None:
    contract = load_contract(contracts_dir() / f"{name}.toml")
    policy = policy_for(contract)
    assert policy.path is not None
    assert policy.path.name == f"{name}.toml"
    pointers = [e.upstream for e in policy.expected_failures] + [
        a.upstream for a in policy.allowed_not_run if a.upstream]
    assert pointers
    for up in pointers:
        if up.startswith("http"):
            continue
        path, _, anchor = up.partition("#")
        md = repo_root() / path
        assert md.is_file(), up
        assert _heading_exists(md, anchor), f"{up}: no such heading in {path}"


# --------------------------------------------------------------------------- gate + policy


def write_policy(w: World, text: str) -> Path:
    path = w.contracts / "gates" / f"{CONTRACT}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


HEAD = f'schema_version = 1\ncontract = "{CONTRACT}"\n'
ALLOW = f'[[allowed_not_run]]\ncells = "{CUDA_ONLY}-*"\nreason = "needs CUDA"\n'


def xfail(families: str, max_margin: float = 1e6) -> str:
    return (f'[[expected_failures]]\ncells = "{FAIL_CELL}"\nfamilies = [{families}]\n'
            f'max_margin = {max_margin}\n'
            'reason = "planted logprobs fault"\nupstream = "https://example.org/bug/1"\n')


def gate_world(w: World, run: Path, *extra: str) -> tuple[int, str]:
    return run_cli(["gate", str(run), "--keys", str(w.keys), "--contract", str(w.contract),
                    "--sources-root", str(code_root(w)), *extra])


def test_gate_with_policy_xfail_xpass_and_fail_outside(fresh: World, tmp_path: Path) -> None:
    write_policy(fresh, HEAD + xfail('"logprobs"') + ALLOW)
    out = tmp_path / "gate.json"
    code, text = gate_world(fresh, fresh.failing, "--json", str(out))
    assert code == ExitCode.OK, text
    assert "4 PASS" not in text  # 3 PASS, 1 XFAIL, 4 NOT_RUN
    assert "3 PASS, 1 XFAIL, 4 NOT_RUN (4 NOT_RUN allowed by policy)" in text
    assert re.search(rf"{FAIL_CELL}\s.*XFAIL\s.*ok\s.*logprobs, round 1, max_abs", text), text
    doc = json.loads(out.read_text())
    (c,) = doc["contracts"]
    assert c["policy"]["path"].endswith(f"gates/{CONTRACT}.toml")
    assert c["notes"] == [f"policy edited since the run (recorded none, now "
                          f"{c['policy']['digest'][:12]}): evaluating with the current policy"]
    assert "note: policy edited since the run (recorded none" in text
    # the good run: the expected failure does not happen
    code, text = gate_world(fresh, fresh.good)
    assert code == ExitCode.QUALIFICATION_FAILED
    assert "expected failure now passes: update the policy" in text
    assert re.search(rf"{FAIL_CELL}\s.*XPASS\s.*FAILS", text), text
    # expected in another family only: a FAIL
    write_policy(fresh, HEAD + xfail('"entropy"') + ALLOW)
    code, text = gate_world(fresh, fresh.failing)
    assert code == ExitCode.QUALIFICATION_FAILED
    assert "fails outside the expected families: logprobs" in text
    # expected in its family, but failing beyond the entry's ceiling: a FAIL naming the row
    write_policy(fresh, HEAD + xfail('"logprobs"', max_margin=1.0001) + ALLOW)
    code, text = gate_world(fresh, fresh.failing, "--json", str(out))
    assert code == ExitCode.QUALIFICATION_FAILED
    assert re.search(rf"{FAIL_CELL}\s.*FAIL\s.*FAILS\s.*regressed beyond", text), text
    (bad,) = [c for c in json.loads(out.read_text())["contracts"][0]["cells"] if not c["ok"]
              and c["required"]]
    assert re.fullmatch(r"regressed beyond the expected failure: round1/actor/logprobs "
                        r"\(\w+\) margin \S+ > max_margin 1.0001( \(and \d+ more rows\))?",
                        bad["reason"]), bad


def test_audit_verdict_is_the_gate_decision_under_todays_policy(fresh: World) -> None:
    """audit's verdict is the gate's (the policy beside the committed contract, read now),
    the comparator's verdict beside it: one answer with the gate."""
    from qualify.evidence.audit import audit

    def rows() -> dict[str, Any]:
        result = audit(fresh.root, trusted_keys_dir=fresh.keys, contracts_dir=fresh.contracts,
                       source_root=code_root(fresh))
        return {Path(r.path).name: r for r in result.rows}

    assert (rows()["run-3-fail"].verdict, rows()["run-3-fail"].comparator) == ("FAIL", "FAIL")
    write_policy(fresh, HEAD + xfail('"logprobs"') + ALLOW)
    row = rows()["run-3-fail"]
    assert (row.verdict, row.comparator, row.problems) == ("PASS", "FAIL", ())
    code, _ = gate_world(fresh, fresh.failing)
    assert code == ExitCode.OK  # the gate agrees
    write_policy(fresh, HEAD + xfail('"logprobs"', max_margin=1.0001) + ALLOW)
    assert rows()["run-3-fail"].verdict == "FAIL"
    write_policy(fresh, HEAD + '[[expected_failures]]\ncells = "x"\n')
    row = rows()["run-3-fail"]
    assert row.verdict == "FAIL"
    assert any(p.startswith("gate policy: ") for p in row.problems), row.problems


def test_allow_not_run_flag_adds_to_the_policy(fresh: World) -> None:
    write_policy(fresh, HEAD + xfail('"logprobs"'))
    code, text = gate_world(fresh, fresh.failing)
    assert code == ExitCode.QUALIFICATION_FAILED
    assert f"4 not passed: {CUDA_ONLY}-fp32-zero0-actor-tp1" in text
    code, text = gate_world(fresh, fresh.failing, "--allow-not-run", f"{CUDA_ONLY}-*")
    assert code == ExitCode.OK, text


def test_policy_option_and_the_run_recorded_policy(fresh: World, tmp_path: Path) -> None:
    """--policy FILE replaces the one beside the contract."""
    other = tmp_path / "p.toml"
    other.write_text(HEAD + xfail('"logprobs"') + ALLOW)
    result = gate(fresh.failing, [fresh.contract], trusted_keys_dir=fresh.keys,
                  policy=other, sources_root=code_root(fresh))
    assert result.exit_code == ExitCode.OK
    assert result.contracts[0].policy is not None
    assert result.contracts[0].policy.path == other


# --------------------------------------------------------------------------- bad input

def _ef(cells: str = FAIL_CELL, families: str = '"logprobs"', extra: str = "") -> str:
    return (f'[[expected_failures]]\ncells = "{cells}"\nfamilies = [{families}]\n'
            f'max_margin = 2.0\nreason = "r r r"\nupstream = "https://x.org/1"\n{extra}')


BAD: dict[str, tuple[str, str]] = {
    "malformed-toml": (HEAD + "[[expected_failures]\ncells = 1\n", "invalid TOML"),
    "unknown-top-key": (HEAD + "gate = true\n", "Additional properties are not allowed"),
    "unknown-entry-key": (HEAD + _ef(extra='severity = "low"\n'),
                          "expected_failures.0: Additional properties"),
    "families-not-a-list": (HEAD + _ef(families='"x"').replace('["x"]', '"logprobs"'),
                            "expected_failures.0.families"),
    "unknown-family": (HEAD + _ef(families='"logprob"'),
                       "expected_failures.0.families.0: unknown family 'logprob'"),
    "no-such-cell": (HEAD + _ef(cells="megatron-*"),
                     "expected_failures.0.cells: 'megatron-*' matches no cell"),
    "required-no-cell": (HEAD + 'required = ["vllm-*"]\n', "required.0: 'vllm-*' matches no"),
    "required-and-allowed": (HEAD + f'required = ["{CUDA_ONLY}-*"]\n' + ALLOW,
                             "is also listed in required"),
    "duplicate-xfail": (HEAD + _ef() + _ef(families='"entropy", "logprobs"'),
                        "is listed twice in expected_failures with overlapping families"),
    "no-max-margin": (HEAD + _ef().replace("max_margin = 2.0\n", ""),
                      "expected_failures.0.max_margin: missing: an expected failure names the "
                      "largest margin it accepts"),
    "max-margin-not-above-1": (HEAD + _ef().replace("2.0", "1.0"),
                               "expected_failures.0.max_margin: 1.0 is less than or equal"),
    "max-margin-a-string": (HEAD + _ef().replace("2.0", '"2"'),
                            "expected_failures.0.max_margin"),
    "round-beyond-contract": (HEAD + _ef(extra="rounds = [9]\n"),
                              "expected_failures.0.rounds: round 9 beyond the contract's"),
    "round-zero": (HEAD + _ef(extra="rounds = [0]\n"), "expected_failures.0.rounds.0"),
    "unknown-role": (HEAD + _ef(extra='roles = ["reward"]\n'), "expected_failures.0.roles.0"),
    "other-contract": ('schema_version = 1\ncontract = "tiny-qwen3"\n',
                       "contract: 'tiny-qwen3' is not the gated contract"),
    "missing-reason": (HEAD + f'[[allowed_not_run]]\ncells = "{CUDA_ONLY}-*"\n',
                       "'reason' is a required property"),
    "bad-upstream": (HEAD + _ef().replace("https://x.org/1", "see the wiki"),
                     "expected_failures.0.upstream"),
    "schema-version": ('schema_version = 2\ncontract = "gate-tiny"\n', "schema_version"),
    "binary-file": ("\udcff", "cannot read the gate policy"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_policy_is_one_line_exit_2(fresh_world: World, case: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    text, words = BAD[case]
    path = tmp_path / "policy.toml"
    if case == "binary-file":
        path.write_bytes(b"\xff\xfe\x00bad")
    else:
        path.write_text(text)
    code = qualify_main(["gate", str(fresh_world.good), "--keys", str(fresh_world.keys),
                     "--contract", str(fresh_world.contract), "--policy", str(path)])
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE_ERROR, err
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"qualify: error: {path}: ")
    assert words in line, line
    with pytest.raises(ContractError):
        load_policy(path, load_contract(fresh_world.contract))


def _missing_policy(w: World, tmp: Path) -> list[str]:
    return ["--policy", str(tmp / "nope.toml")]


def _directory_policy(w: World, tmp: Path) -> list[str]:
    (tmp / "dir.toml").mkdir()
    return ["--policy", str(tmp / "dir.toml")]


def _two_contracts(w: World, tmp: Path) -> list[str]:
    return ["--contract", str(w.contract), "--policy", str(tmp / "x.toml")]


BAD_USE: dict[str, tuple[Callable[[World, Path], list[str]], str]] = {
    "missing-policy": (_missing_policy, "gate policy not found"),
    "directory-policy": (_directory_policy, "cannot read the gate policy"),
    "policy-with-two-contracts": (_two_contracts, "--policy applies to one --contract"),
}


@pytest.mark.parametrize("case", list(BAD_USE), ids=list(BAD_USE))
def test_bad_policy_use_is_one_line_exit_2(fresh_world: World, case: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    make, words = BAD_USE[case]
    code = qualify_main(["gate", str(fresh_world.good), "--keys", str(fresh_world.keys),
                     "--contract", str(fresh_world.contract), *make(fresh_world, tmp_path)])
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE_ERROR, err
    (line,) = err.strip().splitlines()
    assert words in line
    assert "Traceback" not in err


def test_committed_run_whose_reference_is_missing_is_exit_3_one_line(fresh: World) -> None:
    import shutil

    from qualify.evidence import store

    store.make_writable(fresh.root / "references")
    shutil.rmtree(fresh.root / "references")
    code, text = gate_world(fresh, fresh.good)
    assert code == ExitCode.INTEGRITY_ERROR
    head = [x for x in text.splitlines() if x.startswith(f"[{CONTRACT}")]
    assert len(head) == 1
    assert f"run {fresh.good} fails verification at step 7" in head[0]
    assert "run.json: reference" in text
    assert "not found" in text
    assert "Traceback" not in text


def test_known_families_cover_every_report_family() -> None:
    from qualify.compare.sampler import PROBES
    from qualify.statistics import FAMILY_STATISTIC

    assert set(FAMILY_STATISTIC) | set(PROBES) | {"dtypes", "replica"} <= set(KNOWN_FAMILIES)


# --------------------------------------------------------------------------- qualify run


def test_run_exits_by_the_policy_when_one_exists(tmp_path: Path) -> None:
    """qualify run's decision (pipeline/chain.py): the policy decides when the contract has
    one; otherwise the report's verdict, as before policies."""
    from qualify.pipeline.chain import run_decision

    contract = load_contract(TINY)
    report = {**tiny_report(), "passed": False}
    code, ev = run_decision(tmp_path, contract, policy_for(contract), report=report)
    assert code == ExitCode.OK
    assert ev.counts()["XFAIL"] == 4
    planted = {**tiny_report({**TINY_FINDINGS, "torch_tp-fp32-actor-tp1": ["grads"]}),
               "passed": False}
    code, ev = run_decision(tmp_path, contract, policy_for(contract), report=planted)
    assert code == ExitCode.QUALIFICATION_FAILED
    assert [c.cell for c in ev.offending] == ["torch_tp-fp32-actor-tp1"]
    code, _ = run_decision(tmp_path, contract, default_policy(contract), report=report)
    assert code == ExitCode.QUALIFICATION_FAILED
    code, _ = run_decision(tmp_path, contract, default_policy(contract),
                           report={**report, "passed": True})
    assert code == ExitCode.OK
