"""The harness SDK (``sdk/qualify_harness``): its promise to harnesses and to the comparator.

- it imports nothing beyond torch, numpy, safetensors and the standard library (so it
  installs into a training stack's own environment), and never ``qualify``;
- its protocol names, per-parameter sampling and SDPA route recorder are the only copy:
  ``qualify`` imports them and defines none of them again;
- :class:`~qualify_harness.Recipe` reads every committed contract as ``qualify.contract`` does
  (a default that drifts between the two would train another algorithm than the reference);
- the writer writes, and ``outputs.schema.json`` requires, exactly the role keys the
  comparator reads; a role part without them is refused, naming them;
- the candidate stage refuses outputs of another SDK major version in one line.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import qualify_harness as sdk
import torch
from qualify_harness import outputs as sdk_outputs
from qualify_harness import protocol as sdk_protocol
from qualify_harness import routes as sdk_routes

from qualify import protocol
from qualify.candidate.launch import check_outputs
from qualify.contract import load_contract
from qualify.errors import HarnessError
from qualify.resources import contracts_dir, repo_root

SDK_DIR = repo_root() / "sdk" / "qualify_harness"
ALLOWED_THIRD_PARTY = {"torch", "numpy", "safetensors", "qualify_harness"}


def _top_imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_sdk_imports_only_torch_numpy_safetensors_and_the_standard_library() -> None:
    files = sorted(SDK_DIR.rglob("*.py"))
    assert len(files) >= 5, files
    for path in files:
        extra = _top_imports(path) - set(sys.stdlib_module_names) - ALLOWED_THIRD_PARTY
        assert not extra, f"{path.name} imports {sorted(extra)}"


def test_the_example_harness_runs_on_the_sdk_alone() -> None:
    """The worked example's ranks import the SDK, torch and transformers, nothing of qualify."""
    harness = (repo_root() / "examples" / "qualify-example-engine" / "src" /
               "qualify_example_engine" / "harness.py")
    extra = _top_imports(harness) - set(sys.stdlib_module_names) - {
        "torch", "transformers", "qualify_harness"}
    assert not extra, f"{harness.name} imports {sorted(extra)}"


def _public_defs(module: Any) -> set[str]:
    """Public names ``module`` itself defines (not imports), read from its source."""
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    out: set[str] = set()
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            out.add(node.name)
        out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return {n for n in out if not n.startswith("_")}


def test_qualify_defines_no_copy_of_the_sdk_protocol_or_routes() -> None:
    # the comparator reads the recorded map with its own tolerant reader (evidence is input)
    shared = _public_defs(sdk_protocol) | _public_defs(sdk_routes) - {"sdpa_backends"}
    assert {"ROLLOUT_FILE", "ParamSampling", "tensor_name", "sdpa_recorder"} <= shared
    for path in sorted((repo_root() / "qualify").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined |= {t.id for t in targets if isinstance(t, ast.Name)}
        copies = sorted(defined & shared - {"__all__"})
        assert not copies, f"{path.relative_to(repo_root())} defines {copies} again"
    for name in _public_defs(sdk_protocol):
        if hasattr(protocol, name):
            assert getattr(protocol, name) is getattr(sdk_protocol, name), name
    assert sdk.SDK_MAJOR == protocol.HARNESS_SDK_MAJOR


@pytest.mark.parametrize("path", sorted(contracts_dir().glob("*.toml")), ids=lambda p: p.stem)
def test_recipe_reads_every_contract_as_qualify_does(path: Path) -> None:
    c = load_contract(path)
    r = sdk.Recipe.from_contract(c.to_dict())
    a, o = c.algorithm, c.optimizer
    assert (r.algorithm, r.rounds, r.micro_batch_size, r.loss_agg_mode) == (
        a.name, a.rounds, a.micro_batch_size, a.loss_agg_mode)
    assert (r.clip_ratio, r.value_clip, r.kl_loss_coef, r.kl_loss_estimator,
            r.entropy_coef) == (a.clip_ratio, a.value_clip, a.kl_loss_coef,
                                a.kl_loss_estimator, a.entropy_coef)
    assert (r.behavior_weight_cap, r.behavior_weight_cap_mode) == (
        a.behavior_weight_cap, a.behavior_weight_cap_mode)
    assert (r.actor_lr, r.critic_lr, r.betas, r.eps, r.weight_decay, r.max_grad_norm) == (
        o.actor_lr, o.critic_lr, tuple(o.betas), o.eps, o.weight_decay, o.max_grad_norm)
    assert r.temperature == c.sampling.temperature


def test_recipe_names_a_missing_field() -> None:
    with pytest.raises(sdk.InputError, match=r"contract.json: missing or bad field 'optimizer'"):
        sdk.Recipe.from_contract({"algorithm": {}, "sampling": {}})


def test_schema_requires_exactly_what_the_writer_writes() -> None:
    schema = json.loads((repo_root() / "contracts" / "schema" /
                         "outputs.schema.json").read_text("utf-8"))
    role = schema["$defs"]["role"]
    required = set(role["required"]) | set(role["anyOf"][0]["required"])
    assert required == set(sdk_outputs.ROLE_REQUIRED)
    dtypes = role["properties"]["dtypes"]["required"]
    assert set(dtypes) == set(sdk_outputs.DTYPE_REQUIRED)
    assert "sdk_version" in schema["required"]


def _recorder() -> sdk.Recorder:
    rec = sdk.Recorder(role="actor", writer=True)
    rec.compute_dtypes.add(torch.float32)
    rec.master_dtypes.add(torch.float32)
    rec.grad_dtypes.add(torch.float32)
    for key in ("exp_avg", "exp_avg_sq"):
        rec.state_dtypes[key].add(torch.float32)
    rec.engine_dtypes({"allreduce": {torch.float32}}, {"main_grad": {torch.float32}})
    rec.lrs["round1"] = 3e-4
    rec.replicas(1, {"model.norm.weight": True}, {"model.norm.weight": 0.0})
    return rec


@pytest.mark.parametrize("value", [torch.ones(3), torch.ones(3, dtype=torch.float64)])
def test_a_recorded_tensor_is_a_copy_not_the_engines_live_tensor(value: torch.Tensor) -> None:
    rec = sdk.Recorder(role="actor", writer=True)
    rec.put(1, "exp_avg", value, "w")  # an optimizer state the next step changes in place
    value.add_(1.0)
    assert torch.equal(rec.tensors[sdk.tensor_name(1, "actor", "exp_avg", "w")], torch.ones(3))


def test_role_meta_holds_every_dtype_key_and_refuses_an_empty_record() -> None:
    meta = sdk.role_meta(_recorder(), tp=1, global_ranks=[0], precision="fp32")
    assert set(sdk_outputs.ROLE_REQUIRED) <= set(meta)
    assert set(meta["dtypes"]) == set(sdk_outputs.DTYPE_REQUIRED)
    with pytest.raises(sdk.OutputError, match=r"actor: nothing recorded for lr, "
                                              r"replica_consistency, dtypes.compute"):
        sdk.role_meta(sdk.Recorder(role="actor", writer=True), tp=1, global_ranks=[0],
                      precision="fp32")


@pytest.mark.parametrize("drop", sdk_outputs.ROLE_REQUIRED)
def test_a_part_without_a_required_key_is_refused(tmp_path: Path, drop: str) -> None:
    meta = sdk.role_meta(_recorder(), tp=1, global_ranks=[0], precision="fp32")
    del meta[drop]
    with pytest.raises(sdk.OutputError, match=rf"roles.actor lacks \['{drop}'\]"):
        sdk.write_part("x", tmp_path, "actor", {"round1/actor/logprobs": torch.zeros(1)}, meta)
    assert not list(tmp_path.iterdir())


def _outputs(tmp_path: Path, sdk_version: str | None) -> Path:
    rec = _recorder()
    rec.put(1, "logprobs", torch.zeros(2, 3))
    meta = sdk.role_meta(rec, tp=1, global_ranks=[0], precision="fp32")
    sdk.write_part("torch_tp", tmp_path, "actor", rec.tensors, meta)
    head = sdk.outputs_head(engine="torch_tp", cell={"actor_tp": 1, "critic_tp": 0},
                            packages=["torch"], world=1, backend="gloo",
                            device=torch.device("cpu"), timings={}, shims=[], faults=[])
    if sdk_version is None:
        del head["sdk_version"]
    else:
        head["sdk_version"] = sdk_version
    sdk.merge_parts("torch_tp", ["actor"], tmp_path, head, wait_s=1.0)
    return tmp_path


def test_written_outputs_pass_the_candidate_stage_check(tmp_path: Path) -> None:
    check_outputs(_outputs(tmp_path, sdk.SDK_VERSION))


@pytest.mark.parametrize(("version", "message"), [
    ("2.0", r"outputs.json: sdk_version 2.0 is not supported: qualify reads harness SDK 1.x"),
    ("0.9", r"outputs.json: sdk_version 0.9 is not supported"),
    (None, r"outputs.json: .*'sdk_version' is a required property"),
])
def test_another_sdk_major_is_refused_in_one_line(tmp_path: Path, version: str | None,
                                                   message: str) -> None:
    out = _outputs(tmp_path, version)
    with pytest.raises(HarnessError, match=message) as info:
        check_outputs(out)
    assert "\n" not in str(info.value)


def test_sdpa_routes_are_read_back_per_call_not_from_config() -> None:
    """The backend torch selects for each call is counted, a forced one included."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 5, 8)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdk_routes.sdpa_recorder() as seen:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        with sdpa_kernel([SDPBackend.MATH]):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            torch.nn.functional.scaled_dot_product_attention(q.double(), q.double(), q.double())
    assert torch.nn.functional.scaled_dot_product_attention is sdpa  # restored
    assert seen["MATH cpu float32"] == 1
    assert seen["MATH cpu float64"] == 1
    assert sum(seen.values()) == 3
    assert sdk_routes.sdpa_summary({}) == {sdk_routes.NO_SDPA: 0}
    assert sdk_routes.sdpa_backends(seen) <= set(SDPBackend.__members__)


def test_role_meta_carries_the_routes_the_driver_read_back(tmp_path: Path) -> None:
    rec = _recorder()
    with sdk_routes.sdpa_recorder(rec.sdpa):
        q = torch.randn(1, 1, 3, 4)
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    rec.routes["optimizer"] = sdk_routes.optimizer_route(
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=False, foreach=False))
    meta = sdk.role_meta(rec, tp=1, global_ranks=[0], precision="fp32")
    assert sum(meta["routes"]["sdpa_backends"].values()) == 1
    assert meta["routes"]["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    assert meta["routes"]["optimizer"]["fused"] is False
    empty = sdk.role_meta(_recorder(), tp=1, global_ranks=[0], precision="fp32")
    assert empty["routes"]["sdpa_backends"] == {sdk_routes.NO_SDPA: 0}
    from qualify.compare.distribution import cell_routes

    out = _outputs(tmp_path, sdk.SDK_VERSION)
    doc = json.loads((out / "outputs.json").read_text("utf-8"))
    got = cell_routes({"c": doc, "old": {"roles": {"actor": {}}}}, tmp_path)
    assert got["c"] == {"actor": doc["roles"]["actor"]["routes"]}
    assert got["old"] == "not recorded by this harness"


class _PlainEngine(sdk.TorchOptimEngine):
    """A two-layer model on one process (plain tensors): the parts come from the SDK."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any) -> None:
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.device = torch.device("cpu")

    def logprobs_and_entropy(self, model: Any, batch: sdk.Batch) -> tuple[Any, Any]:
        raise NotImplementedError

    def check_replicas(self) -> tuple[dict[str, bool], dict[str, float]]:
        return {}, {}


def test_torch_optim_engine_reads_what_its_optimizer_holds() -> None:
    """The SDK's plain-optimizer parts report the optimizer's own tensors, step and lr."""
    from qualify_harness.errors import OutputError

    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)
    model = torch.nn.Sequential(first, second)
    second.bias.requires_grad_(False)  # not trained: never reported
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine = _PlainEngine(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s))
    model(torch.randn(5, 4)).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert list(engine.full_grads()) == list(grads) == ["0.weight", "0.bias", "1.weight"]
    assert all(torch.equal(engine.full_grads()[n], g) for n, g in grads.items())
    norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads.values()]))
    torch.testing.assert_close(engine.clip(0.1), norm)  # pre-clip norm, gradients clipped
    torch.testing.assert_close(first.weight.grad, grads["0.weight"] * 0.1 / (norm + 1e-6))
    before = engine.full_params()
    assert engine.applied_lr() == 1e-2
    engine.optimizer_step()
    engine.scheduler_step()
    engine.zero_grad()
    assert all(p.grad is None for p in engine.params())
    assert engine.applied_lr() == 5e-3
    assert engine.state_dtypes("exp_avg") == {torch.float32}
    assert torch.equal(engine.full_optimizer_state("exp_avg")["1.weight"],
                       opt.state[second.weight]["exp_avg"])
    assert not torch.equal(engine.full_params()["0.bias"], before["0.bias"])
    assert engine.routes()["optimizer"]["class"] == "torch.optim.adamw.AdamW"
    opt.add_param_group({"params": [second.bias], "lr": 1.0})
    with pytest.raises(OutputError, match=r"different lrs \[0.005, 1.0\]"):
        engine.applied_lr()


class _LogitsEngine(_PlainEngine):
    """An engine that exposes its logits and keeps the SDK's default scoring."""

    logits: torch.Tensor

    def response_logits(self, model: Any, batch: sdk.Batch) -> Any:
        return self.logits

    logprobs_and_entropy = sdk.Engine.logprobs_and_entropy


def test_the_default_scoring_is_the_sdk_log_softmax_of_the_logits_at_the_temperature() -> None:
    """``Engine.logprobs_and_entropy``'s default scores ``response_logits`` at the engine's
    ``temperature``: the logprob of each response token of ``log_softmax(z / T)`` and the
    entropy of that distribution, computed here in FP64; without a temperature it says so."""
    torch.manual_seed(3)
    model = torch.nn.Linear(2, 2)
    engine = _LogitsEngine(model, torch.optim.AdamW(model.parameters()), None)
    engine.logits = torch.randn(2, 3, 5) * 4
    responses = torch.tensor([[0, 4, 2], [1, 1, 3]])
    batch = type("B", (), {"responses": responses})()
    with pytest.raises(NotImplementedError, match="sets no temperature"):
        engine.logprobs_and_entropy(model, batch)
    engine.temperature = 0.7
    lp, ent = engine.logprobs_and_entropy(model, batch)
    full = torch.log_softmax(engine.logits.double() / 0.7, dim=-1)
    want_lp = full.gather(-1, responses[..., None])[..., 0]
    want_ent = -(full.exp() * full).sum(-1)
    torch.testing.assert_close(lp.double(), want_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent.double(), want_ent, rtol=1e-5, atol=1e-6)
