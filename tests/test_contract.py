"""Contract loading: the valid contracts load, and malformed ones fail with one clear line."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from qualify.contract import Contract, cells_matching, load_contract
from qualify.errors import ContractError, ExitCode
from qualify.resources import contracts_dir

TINY = contracts_dir() / "tiny-qwen3.toml"


def _doc() -> dict[str, Any]:
    return tomllib.loads(TINY.read_text())


def _dump(doc: dict[str, Any]) -> str:
    """Minimal TOML writer for the test documents (tables, arrays, scalars)."""
    lines: list[str] = []

    def val(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f'"{k}" = {val(x)}' for k, x in v.items()) + "}"
        return repr(v)

    def table(prefix: str, d: dict[str, Any]) -> None:
        scalars = {k: v for k, v in d.items()
                   if not isinstance(v, dict) and not (isinstance(v, list) and v
                                                       and all(isinstance(x, dict) for x in v))}
        if prefix:
            lines.append(f"[{prefix}]")
        lines.extend(f'"{k}" = {val(v)}' for k, v in scalars.items())
        for k, v in d.items():
            if isinstance(v, dict):
                table(f"{prefix}.{k}" if prefix else k, v)
            elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                for item in v:
                    lines.append(f"[[{prefix}.{k}]]" if prefix else f"[[{k}]]")
                    lines.extend(f'"{ik}" = {val(iv)}' for ik, iv in item.items())

    table("", doc)
    return "\n".join(lines) + "\n"


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        d = doc
        for p in parents:
            d = d[p]
        d[leaf] = value
    return mutate


def _del(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        d = doc
        for p in parents:
            d = d[p]
        del d[leaf]
    return mutate


def _update(path: str, **values: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(doc: dict[str, Any]) -> None:
        d = doc
        for p in path.split("."):
            d = d[p]
        d.update(values)
    return mutate


# name -> (mutation, regex the one-line message must match)
INVALID: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "missing_field": (_del("sampling.temperature"), r"sampling: 'temperature' is a required"),
    "prompt_id_outside_the_vocabulary": (
        _set("prompts.token_ids", [[1, 90, 12], [1, 383, 384]]),
        r"prompts\.token_ids\[1\]: ids \[384\] >= vocab_size 384"),
    "missing_section": (_del("optimizer"), r"'optimizer' is a required property"),
    "wrong_type": (_set("sampling.max_new_tokens", "ten"), r"sampling\.max_new_tokens: 'ten'"),
    "unknown_key": (_set("algorithm.learning_rate", 1e-3),
                    r"algorithm: Additional properties .*'learning_rate'"),
    "unknown_top_level_key": (_set("extra", 1), r"Additional properties .*'extra'"),
    "misspelt_key": (_set("sampling.temprature", 0.5),
                     r"sampling: Additional properties .*'temprature': did you mean "
                     r"'temperature'\?"),
    "bad_tp_list": (_set("matrix.tp_sizes", [1, 3]), r"matrix\.tp_sizes\.1: 3 is not one of"),
    "tp_unused_by_topologies": (_set("matrix.tp_sizes", [1, 2, 4]),
                                r"matrix\.tp_sizes: TP sizes \[4\] are used by no topology"),
    "topology_tp_not_in_list": (_set("matrix.tp_sizes", [2]),
                                r"matrix\.topologies\[0\]\.critic_tp: 1 is not in"),
    "negative_lr": (_set("optimizer.actor_lr", -1e-3), r"optimizer\.actor_lr: -0\.001 is less"),
    "unknown_engine_name_format": (_set("matrix.engines", ["Torch-TP"]),
                                   r"matrix\.engines\.0: 'Torch-TP' does not match"),
    "unknown_precision": (_set("matrix.precisions", ["fp16"]),
                          r"matrix\.precisions\.0: 'fp16' is not one of"),
    "unknown_algorithm": (_set("algorithm.name", "reinforce"),
                          r"algorithm\.name: 'reinforce' is not one of"),
    "gamma_above_one": (_set("algorithm.gamma", 1.5), r"algorithm\.gamma: 1\.5 is greater"),
    "bad_betas": (_set("optimizer.betas", [0.9]), r"optimizer\.betas: \[0\.9\] is too short"),
    "missing_floor_for_precision": (_del("bounds.floors.bf16"),
                                    r"bounds\.floors\.bf16: missing"),
    "bad_manifest_digest_format": (_set("model.manifest.files", {"model.safetensors": "xyz"}),
                                   r"model\.manifest\.files\.model\.safetensors: 'xyz' does not"),
    "heads_not_divisible": (_set("model.config.num_key_value_heads", 3),
                            r"num_key_value_heads: 3 does not divide"),
    "two_prompt_sources": (_set("prompts.text", ["hi"]), r"prompts: give exactly one of"),
    "bf16_control_in_tp_class": (_set("bounds.controls.tp_vs_tp1", ["bf16_mode"]),
                                 r"tp_vs_tp1: 'bf16_mode' is not a same-precision"),
    "negative_floor": (_set("bounds.floors.fp32.logprobs", -1.0),
                       r"bounds\.floors\.fp32\.logprobs: -1\.0 is less"),
    "zero_temperature": (_set("sampling.temperature", 0),
                         r"sampling\.temperature: 0 is less than or equal"),
    "unknown_engine": (_set("matrix.engines", ["torch_tp", "deepspeeed"]),
                       r"matrix\.engines\.1: unknown engine 'deepspeeed'; did you mean "
                       r"'deepspeed'\? registered engines: deepspeed, fsdp2, megatron, "
                       r"torch_tp, trl, verl, vllm"),
    "sampler_as_trainer": (_set("matrix.engines", ["torch_tp", "vllm"]),
                           r"matrix\.engines\.1: 'vllm' is a sampler engine, not a trainer"),
    "bad_zero_stage": (_set("matrix.engine_options.deepspeed.zero_stage", [0, 3]),
                       r"matrix\.engine_options\.deepspeed\.zero_stage\.1: 3 is not one of the "
                       r"values 'deepspeed' takes \(0, 1, 2\)"),
    "zero_stage_not_a_list": (_set("matrix.engine_options.deepspeed.zero_stage", 1),
                              r"matrix\.engine_options\.deepspeed\.zero_stage: 1 is not of "
                              r"type 'array'"),
    "unknown_engine_option": (_set("matrix.engine_options.deepspeed.zero", [1]),
                              r"matrix\.engine_options\.deepspeed\.zero: 'deepspeed' has no "
                              r"option or axis 'zero'; did you mean 'zero_stage'\? it takes: "
                              r"zero_stage"),
    "option_of_optionless_engine": (_set("matrix.engine_options.torch_tp", {"zero_stage": [0]}),
                                    r"engine_options\.torch_tp\.zero_stage: 'torch_tp' has "
                                    r"no option or axis 'zero_stage'; it takes: no options"),
    "tp_as_engine_option": (_set("matrix.engine_options.deepspeed.tp", [1]),
                            r"deepspeed\.tp: .*the TP degrees come from matrix\.topologies"),
    "options_of_unknown_engine": (_set("matrix.engine_options.deepspeeed", {"zero_stage": [0]}),
                                  r"matrix\.engine_options\.deepspeeed: unknown engine "
                                  r"'deepspeeed'; did you mean 'deepspeed'\?"),
    "unknown_rollout_backend": (_set("sampling.engine", "vlm"),
                                r"sampling\.engine: unknown rollout backend 'vlm'; did you mean "
                                r"'vllm'\? known backends: hf, vllm"),
    "hf_rollout_with_tp": (_update("sampling", engine="hf", tp=2),
                           r"sampling\.tp: the hf sampler has no tensor parallelism; got tp = 2 "
                           r"\(use engine = \"vllm\"\)"),
    "unknown_sampler_engine": (_set("sampler.engine", "vlm"),
                               r"sampler\.engine: unknown engine 'vlm'; did you mean 'vllm' or "
                               r"'verl'\?"),
    "trainer_as_sampler": (_set("sampler.engine", "torch_tp"),
                           r"sampler\.engine: 'torch_tp' is a trainer engine, not a sampler"),
    "duplicate_topology_names": (
        _set("matrix.topologies", [{"name": "a", "actor_tp": 1, "critic_tp": 2},
                                   {"name": "a", "actor_tp": 2, "critic_tp": 1}]),
        r"duplicate topology names"),
}


def test_default_contract_loads() -> None:
    c = load_contract(TINY)
    assert c.name == "tiny-qwen3"
    assert len(c.digest) == 64
    ids = [x.cell_id for x in c.matrix.cells()]
    assert ids == [
        "torch_tp-fp32-actor-tp1", "torch_tp-fp32-actor-tp2",
        "torch_tp-fp32-critic-tp1", "torch_tp-fp32-critic-tp2",
        "torch_tp-bf16-actor-tp1", "torch_tp-bf16-actor-tp2",
        "torch_tp-bf16-critic-tp1", "torch_tp-bf16-critic-tp2",
    ] + [f"deepspeed-{p}-zero{z}-{r}-tp{t}" for p in ("fp32", "bf16") for z in (0, 1, 2)
         for r in ("actor", "critic") for t in (1, 2)] + [
        f"megatron-{p}-{r}-tp{t}" for p in ("fp32", "bf16") for r in ("actor", "critic")
        for t in (1, 2)]
    assert len(ids) == 8 + 24 + 8


@pytest.mark.parametrize("path", sorted(contracts_dir().glob("*.toml")), ids=lambda p: p.stem)
def test_committed_contracts_load(path: Path) -> None:
    c = load_contract(path)
    assert c.matrix.cells()


def test_digest_is_canonical() -> None:
    """Key order and formatting do not change the digest; a value does."""
    doc = _doc()
    a = Contract.from_dict(doc)
    reordered = dict(reversed(list(doc.items())))
    assert Contract.from_dict(reordered).digest == a.digest
    doc["sampling"]["seed"] += 1
    assert Contract.from_dict(doc).digest != a.digest


@pytest.mark.parametrize("case", sorted(INVALID), ids=str)
def test_invalid_contract_message(case: str, tmp_path: Path) -> None:
    mutate, pattern = INVALID[case]
    doc = _doc()
    mutate(doc)
    f = tmp_path / f"{case}.toml"
    f.write_text(_dump(doc))
    with pytest.raises(ContractError) as info:
        load_contract(f)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(str(f.resolve())), msg
    assert re.search(pattern, msg), msg


def test_fp32_tp_class_is_fed_by_the_fp64_control() -> None:
    """The committed contracts bound TP=n vs TP=1 at FP32 by the FP32 rounding scale too.

    The reorder controls can round a quantity bitwise alike (tiny-qwen3's round-1 Actor
    grad_norm: microbatch and attn_impl errors 0.0) while a TP=2 engine sums sharded squares
    in another order (1.9e-6 from TP=1 on a norm bound by the floor alone, 1e-6).
    """
    for name in ("tiny-qwen3", "smollm2-135m", "qwen3-8b"):
        c = load_contract(TINY.parent / f"{name}.toml")
        assert "fp64" in c.bounds.controls_tp_vs_tp1, name
        assert "bf16_mode" not in c.bounds.controls_tp_vs_tp1, name


@pytest.mark.parametrize("path", sorted(contracts_dir().glob("*.toml")), ids=lambda p: p.stem)
def test_bf16_tp_classes_measure_the_row_parallel_repartition(path: Path) -> None:
    """Every committed contract with BF16 cells at TP > 1 runs the ``row_split`` control in
    both classes it bounds them by (issue #49): TP re-rounds each row-parallel partial sum,
    which neither eager-vs-sdpa attention nor the micro-batch partition does, so without it
    a conforming TP 2 BF16 cell (torch_tp) failed a round-2 grad_norm at margin 1.05."""
    c = load_contract(path)
    bf16_tp = [x.cell_id for x in c.matrix.cells() if x.precision == "bf16" and x.tp > 1]
    if not bf16_tp:
        pytest.skip(f"{path.name}: no BF16 cell at TP > 1")
    assert "row_split" in c.bounds.controls_candidate_vs_hf, (path.name, bf16_tp[0])
    assert "row_split" in c.bounds.controls_tp_vs_tp1, (path.name, bf16_tp[0])


def test_round_trip_dump_is_valid(tmp_path: Path) -> None:
    f = tmp_path / "same.toml"
    f.write_text(_dump(_doc()))
    assert load_contract(f).digest == load_contract(TINY).digest


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ContractError, match="contract file not found"):
        load_contract(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ContractError, match="not valid TOML"):
        load_contract(bad)


def test_cells_matching() -> None:
    c = load_contract(TINY)
    assert [x.cell_id for x in cells_matching(c, ["torch_tp:*bf16*actor*"])] == [
        "torch_tp-bf16-actor-tp1", "torch_tp-bf16-actor-tp2"]
    assert len(cells_matching(c, ["deepspeed-bf16-zero1-*"])) == 4
    with pytest.raises(ContractError, match="matches no cell"):
        cells_matching(c, ["nosuch:*"])


@pytest.mark.parametrize("case", ["unknown_key", "negative_lr", "bad_tp_list", "missing_field"])
def test_cli_exit_code_two_no_traceback(case: str, tmp_path: Path) -> None:
    mutate, _ = INVALID[case]
    doc = _doc()
    mutate(doc)
    f = tmp_path / "c.toml"
    f.write_text(_dump(doc))
    proc = subprocess.run([sys.executable, "-m", "qualify", "validate", str(f)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == ExitCode.USAGE_ERROR
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("qualify: error: "), proc.stderr


def test_base_cell_is_every_axis_at_degree_one() -> None:
    """The TP=n vs TP=1 comparison side: the same cell with every parallel axis at 1."""
    by_id = {c.cell_id: c for c in load_contract(TINY).matrix.cells()}
    cell = by_id["deepspeed-bf16-zero1-critic-tp2"]
    assert not cell.is_base
    assert cell.base_cell_id() == "deepspeed-bf16-zero1-critic-tp1"
    assert cell.base_cell() is not cell
    assert cell.base_cell() == by_id["deepspeed-bf16-zero1-critic-tp1"]
    assert by_id["torch_tp-fp32-actor-tp1"].is_base
    assert by_id["torch_tp-fp32-actor-tp1"].base_cell_id() == "torch_tp-fp32-actor-tp1"
    assert cell.harness_options == {"zero": 1}


def test_engine_options_default_to_the_spec() -> None:
    """Without ``matrix.engine_options.deepspeed`` the spec's default (ZeRO 0) is qualified."""
    doc = _doc()
    del doc["matrix"]["engine_options"]
    c = Contract.from_dict(doc)
    assert c.matrix.engine_options_of("deepspeed") == [(("zero", 0),)]
    assert c.matrix.engine_options_of("torch_tp") == [()]
    assert c.matrix.axis_degrees("deepspeed") == [()]
    assert sorted({x.cell_id.split("-")[2] for x in c.matrix.cells()
                   if x.engine == "deepspeed"}) == ["zero0"]


def test_engine_options_keep_contract_order() -> None:
    doc = _doc()
    doc["matrix"]["engine_options"]["deepspeed"]["zero_stage"] = [2, 0]
    c = Contract.from_dict(doc)
    assert c.matrix.engine_options_of("deepspeed") == [(("zero", 2),), (("zero", 0),)]


def test_sampler_cells_are_named_by_their_engine() -> None:
    c = load_contract(TINY)
    assert c.sampler is not None
    assert c.sampler.cell_ids() == ["vllm-fp32-sampler-tp1", "vllm-fp32-sampler-tp2"]
    assert c.sampling.engine == "vllm"
