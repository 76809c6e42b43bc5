"""A named corpus of bad inputs: every one is one line on stderr, exit 2, the file and field named.

Each case writes its input under ``tmp_path`` and runs the real CLI in-process
(:func:`qualify.cli.main.main`). The corpus covers the contract (TOML syntax, schema,
cross-field rules, pathological nesting), the prompts (inline and JSONL file), the
reference and run documents a stage reads, and CLI paths. What is asserted for each:
exit code 2, exactly one line on stderr starting ``qualify: error:``, that line names the
file (or directory) and the field, and no traceback anywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from qualify.cli.main import main
from qualify.contract import default_contract_path

BASE = default_contract_path().read_text(encoding="utf-8")


def _sub(old: str, new: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        assert old in text, old
        return text.replace(old, new, 1)
    return edit


def _append(extra: str) -> Callable[[str], str]:
    return lambda text: text + "\n" + extra + "\n"


def _prompts_file(lines: bytes) -> Callable[[str, Path], str]:
    """Replace inline prompts by a JSONL file holding ``lines`` (its digest is right)."""
    def edit(text: str, d: Path) -> str:
        (d / "prompts.jsonl").write_bytes(lines)
        digest = hashlib.sha256(lines).hexdigest()
        start = text.index("[prompts]")
        end = text.index("[sampling]")
        return (text[:start] + f'[prompts]\nfile = "prompts.jsonl"\nsha256 = "{digest}"\n\n'
                + text[end:])
    return edit


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad contract: an edit of the default contract and what the message must name."""

    id: str
    edit: Callable[..., str]
    names: tuple[str, ...]
    needs_dir: bool = False


CONTRACT_CASES = [
    Case("toml-syntax", _sub('name = "tiny-qwen3"', 'name = "tiny-qwen3'), ("line",)),
    Case("unknown-top-key", _append("colour = 1"), ("colour",)),
    Case("unknown-nested-key", _sub("gamma = 1.0", "gamma = 1.0\ngama = 1.0"), ("gama",)),
    Case("name-wrong-type", _sub('name = "tiny-qwen3"', "name = 3"), ("name",)),
    Case("schema-version", _sub("schema_version = 1", "schema_version = 2"),
         ("schema_version",)),
    Case("model-source-unknown", _sub('source = "tiny-qwen3"', 'source = "gpt-5"'),
         ("model.source",)),
    Case("temperature-negative", _sub("temperature = 0.9", "temperature = -1.0"),
         ("temperature",)),
    Case("top-p-above-one", _sub("top_p = 0.95", "top_p = 1.5"), ("top_p",)),
    Case("max-new-tokens-zero", _sub("max_new_tokens = 10", "max_new_tokens = 0"),
         ("max_new_tokens",)),
    Case("engine-unknown", _sub('engines = ["torch_tp", "deepspeed", "megatron"]',
                                'engines = ["torch_tpp", "deepspeed", "megatron"]'),
         ("torch_tpp",)),
    Case("precision-unknown", _sub('precisions = ["fp32", "bf16"]',
                                   'precisions = ["fp32", "fp16"]'), ("fp16",)),
    Case("tp-zero", _sub("tp_sizes = [1, 2]\nroles", "tp_sizes = [0, 2]\nroles"),
         ("tp_sizes",)),
    Case("role-unknown", _sub('roles = ["actor", "critic"]', 'roles = ["actor", "judge"]'),
         ("judge",)),
    Case("zero-stage-unknown", _sub("zero_stage = [0, 1, 2]", "zero_stage = [0, 7]"),
         ("zero_stage",)),
    Case("engine-options-unknown-engine",
         _sub("[matrix.engine_options.deepspeed]", "[matrix.engine_options.nosuch]"),
         ("nosuch",)),
    Case("algorithm-unknown", _sub('name = "ppo"', 'name = "dpo"'), ("algorithm",)),
    Case("clip-ratio-negative", _sub("clip_ratio = 0.2", "clip_ratio = -0.2"),
         ("clip_ratio",)),
    Case("rounds-zero", _sub("rounds = 2", "rounds = 0"), ("rounds",)),
    Case("kl-estimator-unknown", _sub('kl_estimator = "k1"', 'kl_estimator = "k9"'),
         ("kl_estimator",)),
    Case("betas-short", _sub("betas = [0.9, 0.95]", "betas = [0.9]"), ("betas",)),
    Case("betas-above-one", _sub("betas = [0.9, 0.95]", "betas = [1.5, 0.95]"),
         ("betas",)),
    Case("lr-string", _sub("actor_lr = 3e-4", 'actor_lr = "fast"'), ("actor_lr",)),
    Case("lr-schedule-unknown", _sub('lr_schedule = "cosine"', 'lr_schedule = "cosin"'),
         ("lr_schedule",)),
    Case("lr-schedule-total-missing", _sub("total_steps = 2\n", ""),
         ("optimizer.total_steps",)),
    Case("lr-schedule-total-below-rounds", _sub("total_steps = 2", "total_steps = 1"),
         ("optimizer.total_steps", "rounds")),
    Case("lr-schedule-warmup-not-below-total",
         _sub("total_steps = 2", "total_steps = 2\nwarmup_steps = 2"),
         ("optimizer.warmup_steps",)),
    Case("lr-schedule-warmup-negative",
         _sub("total_steps = 2", "total_steps = 2\nwarmup_steps = -1"), ("warmup_steps",)),
    Case("lr-schedule-warmup-float",
         _sub("total_steps = 2", "total_steps = 2\nwarmup_steps = 0.5"), ("warmup_steps",)),
    Case("lr-schedule-min-ratio-above-one", _sub("min_lr_ratio = 0.1", "min_lr_ratio = 1.5"),
         ("min_lr_ratio",)),
    Case("lr-schedule-min-ratio-one", _sub("min_lr_ratio = 0.1", "min_lr_ratio = 1.0"),
         ("min_lr_ratio", "no decay")),
    Case("lr-schedule-constant-with-total",
         _sub('lr_schedule = "cosine"', 'lr_schedule = "constant"'),
         ("optimizer.total_steps", "constant")),
    Case("k-negative", _sub("k = 4.0", "k = -1.0"), ("k",)),
    Case("lane-unknown", _sub('lane = "approximate"', 'lane = "fuzzy"'), ("lane",)),
    Case("control-unknown", _sub('candidate_vs_hf = ["attn_impl"', 'candidate_vs_hf = ["nope"'),
         ("nope",)),
    Case("floor-negative", _sub("logprobs = 1e-5", "logprobs = -1e-5"), ("logprobs",)),
    Case("k-nan", _sub("k = 4.0", "k = nan"), ("bounds.k", "finite")),
    Case("k-inf", _sub("k = 4.0", "k = inf"), ("bounds.k", "finite")),
    Case("k-vacuous", _sub("k = 4.0", "k = 1e300"), ("bounds.k",)),
    Case("floor-inf", _sub("logprobs = 1e-5", "logprobs = inf"),
         ("bounds.floors.fp32.logprobs", "finite")),
    Case("temperature-nan", _sub("temperature = 0.9", "temperature = nan"),
         ("sampling.temperature", "finite")),
    Case("lr-inf", _sub("actor_lr = 3e-4", "actor_lr = inf"), ("optimizer.actor_lr", "finite")),
    Case("nested-pathological", _append("deep = " + "[" * 5000 + "]" * 5000), ("deep",)),
    Case("topology-tp-unknown", _sub("actor_tp = 2\ncritic_tp = 1", "actor_tp = 5\ncritic_tp = 1"),
         ("actor_tp",)),
    Case("sampler-weights-from-unknown",
         _sub('weights_from = "torch_tp-fp32-actor-tp2"', 'weights_from = "nosuch-cell"'),
         ("weights_from",)),
    Case("prompts-empty-list", _sub("token_ids = [\n", "token_ids = [\n]\nx_ = [\n"),
         ("prompts",)),
    Case("prompt-empty", _sub("[1, 90, 12],", "[],"), ("prompts",)),
    Case("prompt-negative-id", _sub("[1, 90, 12],", "[1, -90, 12],"), ("prompts",)),
    Case("prompt-string-id", _sub("[1, 90, 12],", '[1, "90", 12],'), ("prompts",)),
    Case("prompts-file-missing",
         lambda t, d: _prompts_file(b'{"token_ids": [1, 2]}\n')(t, d).replace(
             '"prompts.jsonl"', '"absent.jsonl"'), ("absent.jsonl",), needs_dir=True),
    Case("prompts-file-digest",
         lambda t, d: re.sub(r'sha256 = "[0-9a-f]+"', 'sha256 = "' + "0" * 64 + '"',
                             _prompts_file(b'{"token_ids": [1, 2]}\n')(t, d)),
         ("prompts.sha256",), needs_dir=True),
    Case("prompts-file-bad-json", _prompts_file(b'{"token_ids": [1, 2]\n'),
         ("prompts.jsonl", "line 1"), needs_dir=True),
    Case("prompts-file-not-utf8", _prompts_file(b'{"text": "\xff\xfe"}\n'),
         ("prompts.jsonl",), needs_dir=True),
    Case("prompts-file-not-object", _prompts_file(b"[1, 2]\n"),
         ("prompts.jsonl", "line 1"), needs_dir=True),
    Case("prompts-file-string-id", _prompts_file(b'{"token_ids": [1, "2"]}\n'),
         ("prompts.jsonl", "line 1"), needs_dir=True),
    Case("prompts-file-empty", _prompts_file(b""), ("prompts.jsonl",), needs_dir=True),
    Case("prompts-file-empty-prompt", _prompts_file(b'{"token_ids": []}\n'),
         ("prompts.jsonl", "line 1"), needs_dir=True),
    Case("prompts-file-negative-id", _prompts_file(b'{"token_ids": [1, -2]}\n'),
         ("prompts.jsonl", "line 1"), needs_dir=True),
    Case("prompts-file-mixed", _prompts_file(b'{"token_ids": [1]}\n{"text": "a"}\n'),
         ("prompts.jsonl",), needs_dir=True),
]


def _check_one_line(rc: int, err: str, out: str, *, code: int, names: tuple[str, ...]) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err + out
    assert rc == code, err
    assert len(lines) == 1, err
    assert lines[0].startswith("qualify: error: "), err
    for name in names:
        assert name in lines[0], (name, lines[0])


@pytest.mark.parametrize("case", CONTRACT_CASES, ids=[c.id for c in CONTRACT_CASES])
def test_bad_contract_is_one_line_exit_2(case: Case, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    text = case.edit(BASE, tmp_path) if case.needs_dir else case.edit(BASE)
    path = tmp_path / "bad.toml"
    path.write_text(text, encoding="utf-8")
    rc = main(["validate", str(path)])
    cap = capsys.readouterr()
    _check_one_line(rc, cap.err, cap.out, code=2, names=("bad.toml", *case.names))


def _file_cases(tmp: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    """CLI path cases: argv and the names the message must hold."""
    (tmp / "a-file").write_text("x")
    (tmp / "unsealed").mkdir()
    (tmp / "empty").mkdir()
    (tmp / "notutf8.toml").write_bytes(b"name = \"\xff\"\n")
    (tmp / "empty.toml").write_text("")
    (tmp / "dir.toml").mkdir()
    run = tmp / "run"
    run.mkdir()
    (run / "run.json").write_text("{not json")
    run2 = tmp / "run2"
    run2.mkdir()
    (run2 / "run.json").write_text(json.dumps({
        "schema_version": 1, "contract": "tiny-qwen3", "contract_digest": "0" * 64,
        "reference": {"path": str(tmp / "nowhere"), "manifest_digest": "0" * 64},
        "run_id": "run2", "started": "2026-01-01T00:00:00Z", "faults": [],
        "cells": {"torch_tp-fp32-actor-tp1": {"status": "COMPLETE", "tp": "one",
                                              "attempt": "cells/x/attempt-1"}}}))
    return {
        "contract-missing": (["validate", str(tmp / "absent.toml")], ("absent.toml",)),
        "contract-is-dir": (["validate", str(tmp / "dir.toml")], ("dir.toml",)),
        "contract-not-utf8": (["validate", str(tmp / "notutf8.toml")], ("notutf8.toml",)),
        "contract-empty": (["validate", str(tmp / "empty.toml")], ("empty.toml",)),
        "reference-missing": (["candidate", "--reference", str(tmp / "absent"),
                               "--out", str(tmp / "ev")], ("absent",)),
        "reference-is-file": (["candidate", "--reference", str(tmp / "a-file"),
                               "--out", str(tmp / "ev")], ("a-file",)),
        "reference-unsealed": (["candidate", "--reference", str(tmp / "unsealed"),
                                "--out", str(tmp / "ev")], ("unsealed",)),
        "compare-not-a-run": (["compare", str(tmp / "empty")], ("empty", "run.json")),
        "compare-run-json-bad": (["compare", str(run)], ("run.json",)),
        "compare-run-json-tp-string": (["compare", str(run2)], ("run.json", "tp")),
        "verify-missing": (["verify", str(tmp / "absent-run")], ("absent-run",)),
        "verify-json-is-dir": (["verify", str(tmp / "empty"), "--json", str(tmp / "empty")],
                               ("--json", "is a directory")),
        "verify-json-no-parent": (["verify", str(tmp / "empty"), "--json",
                                   str(tmp / "no" / "such" / "out.json")], ("--json",)),
        "audit-output-is-dir": (["audit", str(tmp / "empty"), "--output", str(tmp / "empty")],
                                ("--output",)),
        "gate-missing": (["gate", str(tmp / "absent-ev"), "--contract", str(tmp / "c.toml")],
                         ("absent-ev",)),
        "run-id-moved-aside": (["candidate", "--reference", str(tmp / "unsealed"),
                                "--out", str(tmp / "ev"), "--run-id", "x.incomplete-2"],
                               ("--run-id",)),
    }


FILE_CASE_IDS = (
    "contract-missing", "contract-is-dir", "contract-not-utf8", "contract-empty",
    "reference-missing", "reference-is-file", "reference-unsealed", "compare-not-a-run",
    "compare-run-json-bad", "compare-run-json-tp-string", "verify-missing", "gate-missing",
    "run-id-moved-aside", "verify-json-is-dir", "verify-json-no-parent", "audit-output-is-dir",
)


@pytest.mark.parametrize("case_id", FILE_CASE_IDS)
def test_bad_path_is_one_line_exit_2(case_id: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    argv, names = _file_cases(tmp_path)[case_id]
    rc = main(argv)
    cap = capsys.readouterr()
    _check_one_line(rc, cap.err, cap.out, code=2, names=names)


def test_corpus_is_named_and_large_enough(tmp_path: Path) -> None:
    assert set(FILE_CASE_IDS) == set(_file_cases(tmp_path))
    assert len(CONTRACT_CASES) + len(FILE_CASE_IDS) >= 40
