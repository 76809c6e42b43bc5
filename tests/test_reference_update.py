"""The independent reference update: hand-derived loss values, invariances, dtypes."""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref
from typing import Any, Literal, cast

import pytest
import torch
from tiny_models import seeded_batch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForTokenClassification

from qualify.contract import Contract, load_contract
from qualify.protocol import ParamSampling
from qualify.reference.update import Batch, UpdateSettings, run_actor, run_critic
from qualify.resources import contracts_dir

torch.set_num_threads(1)

Models = tuple[Qwen3ForCausalLM, Qwen3ForTokenClassification]

CFG: dict[str, Any] = {
    "vocab_size": 384, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "pad_token_id": 0,
    "eos_token_id": 2, "bos_token_id": 1, "attention_dropout": 0.0}


@pytest.fixture(scope="module")
def contract() -> Contract:
    """tiny-qwen3 with every per-parameter tensor reported whole (no ``[evidence]`` sample):
    these tests recompute norms and AdamW steps from the reported gradients."""
    c = load_contract(contracts_dir() / "tiny-qwen3.toml")
    return dataclasses.replace(c, evidence=ParamSampling(exact_elements=1 << 30,
                                                         sample_elements=1))


@pytest.fixture(scope="module")
def models() -> tuple[Qwen3ForCausalLM, Qwen3ForTokenClassification]:
    torch.manual_seed(0)
    cfg = Qwen3Config(**CFG)
    cfg._attn_implementation = "sdpa"
    actor = Qwen3ForCausalLM(cfg)
    # num_labels goes to PreTrainedConfig via @strict's **kwargs; mypy sees only the fields.
    cfg_c = Qwen3Config(**CFG, num_labels=1)  # type: ignore[call-arg]
    cfg_c._attn_implementation = "sdpa"
    critic = Qwen3ForTokenClassification(cfg_c)
    return actor, critic


@pytest.fixture(scope="module")
def batch() -> Batch:
    return cast(Batch, seeded_batch(384, short={0: 4, 2: 3}, masked_targets=True))


def _fresh(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def test_round1_policy_loss_is_minus_mean_advantage(models: Models, batch: Batch,
                                                    contract: Contract) -> None:
    """At round 1 ratio = 1, so the clipped surrogate is -A; KL vs an identical ref is 0."""
    actor, _ = models
    out, meta = run_actor(_fresh(actor), _fresh(actor), batch, contract,
                          UpdateSettings(precision="fp32", micro_batch_size=2))
    mask = batch.response_mask.float()
    expected = float(-(batch.advantages * mask).sum() / mask.sum())
    assert float(out["round1/actor/loss/policy"]) == pytest.approx(expected, abs=1e-6)
    assert float(out["round1/actor/loss/kl"]) == pytest.approx(0.0, abs=1e-7)
    ent = out["round1/actor/entropy"]
    exp_ent = -contract.algorithm.entropy_coef * float((ent * mask).sum() / mask.sum())
    assert float(out["round1/actor/loss/entropy"]) == pytest.approx(exp_ent, rel=1e-5)
    assert meta["optimizer_state"] == {"exp_avg": "torch.float32", "exp_avg_sq": "torch.float32"}
    # Round 2 moved away from the old policy: ratio != 1 somewhere, KL > 0.
    assert float(out["round2/actor/loss/kl"]) > 0


def test_clip_coef_and_first_adam_step(models: Models, batch: Batch, contract: Contract) -> None:
    actor, _ = models
    out, _ = run_actor(_fresh(actor), _fresh(actor), batch, contract,
                       UpdateSettings(precision="fp32", micro_batch_size=4))
    norm = float(out["round1/actor/grad_norm"])
    grads = {k: v for k, v in out.items() if k.startswith("round1/actor/grads/")}
    # sum() over a non-empty dict of tensors is a Tensor (typeshed says Tensor | Literal[0]).
    by_hand = float(torch.sqrt(cast(torch.Tensor,
                                    sum((g.double() ** 2).sum() for g in grads.values()))))
    assert norm == pytest.approx(by_hand, rel=1e-6)
    coef = float(out["round1/actor/clip_coef"])
    assert coef == pytest.approx(min(1.0, contract.optimizer.max_grad_norm / (norm + 1e-6)),
                                 rel=1e-6)
    # AdamW's first step on a parameter with large gradients: update ~ -lr * sign(g)
    # (bias-corrected m / sqrt(v) = g / |g|) minus decoupled weight decay lr * wd * w.
    name = "model.layers.0.mlp.down_proj.weight"
    g = grads[f"round1/actor/grads/{name}"]
    upd = out[f"round1/actor/updates/{name}"]
    w0 = dict(actor.named_parameters())[name].detach()
    lr, wd = contract.optimizer.actor_lr, contract.optimizer.weight_decay
    big = g.abs() * coef > 1e-4
    expected = -lr * torch.sign(g) - lr * wd * w0
    assert torch.allclose(upd[big], expected[big], atol=lr * 1e-2)


def test_microbatch_and_padding_invariance_fp32(models: Models, batch: Batch,
                                                contract: Contract) -> None:
    actor, critic = models
    a, _ = run_actor(_fresh(actor), _fresh(actor), batch, contract,
                     UpdateSettings(precision="fp32", micro_batch_size=4))
    b, _ = run_actor(_fresh(actor), _fresh(actor), batch, contract,
                     UpdateSettings(precision="fp32", micro_batch_size=1, extra_left_padding=2,
                                    extra_right_padding=3))
    for key in ("round1/actor/logprobs", "round2/actor/logprobs"):
        assert torch.allclose(a[key], b[key][:, : a[key].shape[1]], atol=2e-5)
    for key, val in a.items():
        if "/grads/" in key:
            assert torch.allclose(val, b[key], rtol=1e-3, atol=1e-6), key
    ca, _ = run_critic(_fresh(critic), batch, contract,
                       UpdateSettings(precision="fp32", micro_batch_size=4))
    cb, _ = run_critic(_fresh(critic), batch, contract,
                       UpdateSettings(precision="fp32", micro_batch_size=2))
    assert torch.allclose(ca["round2/critic/values"], cb["round2/critic/values"], atol=1e-5)


def test_critic_round1_value_loss(models: Models, batch: Batch, contract: Contract) -> None:
    """Round 1: clipped == unclipped (old = V), so loss = 0.5 * mean((V - G)^2)."""
    _, critic = models
    out, meta = run_critic(_fresh(critic), batch, contract,
                           UpdateSettings(precision="fp32", micro_batch_size=3))
    mask = batch.response_mask.float()
    v = out["round1/critic/values"]
    expected = 0.5 * float((((v - batch.returns) ** 2) * mask).sum() / mask.sum())
    assert float(out["round1/critic/loss/value"]) == pytest.approx(expected, rel=1e-5)
    assert meta["master_weights"] == "torch.float32"


@pytest.mark.parametrize("mode", ["params", "autocast"])
def test_bf16_keeps_fp32_master_and_state(models: Models, batch: Batch, contract: Contract,
                                          mode: Literal["params", "autocast"]) -> None:
    actor, _ = models
    out, meta = run_actor(_fresh(actor), _fresh(actor), batch, contract,
                          UpdateSettings(precision="bf16", bf16_mode=mode, micro_batch_size=2))
    assert meta["master_weights"] == "torch.float32"
    assert meta["optimizer_state"] == {"exp_avg": "torch.float32", "exp_avg_sq": "torch.float32"}
    assert meta["compute"] == ["torch.bfloat16"]
    fp32, _ = run_actor(_fresh(actor), _fresh(actor), batch, contract,
                        UpdateSettings(precision="fp32", micro_batch_size=2))
    diff = (out["round1/actor/logprobs"] - fp32["round1/actor/logprobs"]).abs().max()
    assert 0 < float(diff) < 0.5
    assert all(v.dtype == torch.float32 for v in out.values())


def _bf16_rounded(model: torch.nn.Module) -> torch.nn.Module:
    twin = _fresh(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.copy_(p.bfloat16().float())
    return twin


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_castmasters_births_the_masters_from_the_bf16_cast_parameters(
        models: Models, batch: Batch, contract: Contract, role: str) -> None:
    """``castmasters`` steps masters born ``bf16(checkpoint)``, ``params`` the checkpoint.

    On an FP32 checkpoint (values BF16 cannot hold) the two styles run the same round-1
    forward and gradients (both on the BF16 cast) and part in round 2, after one AdamW step
    from different masters; on a BF16-representable checkpoint they are one computation.
    """
    actor, critic = models
    model = actor if role == "actor" else critic
    masters: dict[str, dict[str, torch.Tensor]] = {}

    def run(m: torch.nn.Module, mode: Literal["params", "castmasters"]) -> dict[str, torch.Tensor]:
        settings = UpdateSettings(precision="bf16", bf16_mode=mode, micro_batch_size=2)

        def hook(round_: int, _w: torch.nn.Module, master: torch.nn.Module, _b: Batch,
                 _o: torch.Tensor) -> None:
            if round_ == 1:
                masters[mode] = {n: p.detach().clone() for n, p in master.named_parameters()}

        if role == "actor":
            return run_actor(_fresh(m), _fresh(m), batch, contract, settings, on_round=hook)[0]
        return run_critic(_fresh(m), batch, contract, settings, on_round=hook)[0]

    params, cast = run(model, "params"), run(model, "castmasters")
    born = dict(_bf16_rounded(model).named_parameters())
    ckpt = dict(model.named_parameters())
    assert all(torch.equal(masters["castmasters"][n], born[n]) for n in born)
    assert all(torch.equal(masters["params"][n], ckpt[n]) for n in ckpt)
    assert any(not torch.equal(born[n], ckpt[n]) for n in ckpt)  # an FP32 checkpoint
    first = "logprobs" if role == "actor" else "values"
    assert torch.equal(params[f"round1/{role}/{first}"], cast[f"round1/{role}/{first}"])
    assert torch.equal(params[f"round1/{role}/grad_norm"], cast[f"round1/{role}/grad_norm"])
    assert not torch.equal(params[f"round2/{role}/{first}"], cast[f"round2/{role}/{first}"])
    # A BF16-representable checkpoint: the two styles coincide bitwise, every tensor.
    rounded = _bf16_rounded(model)
    params, cast = run(rounded, "params"), run(rounded, "castmasters")
    assert params.keys() == cast.keys()
    assert all(torch.equal(params[k], cast[k]) for k in params)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_token_gradients_sum_to_the_batch_gradient(models: Models, batch: Batch,
                                                   contract: Contract, role: str) -> None:
    """``J_t`` from :func:`token_gradients` at round 2, weighted and summed, equals the
    gradient of the same weighted sum of logprobs / values computed from one whole-batch
    forward of a copy of the round-2 model; ``.grad`` of the run is left alone."""
    from qualify.reference.jacobian import token_gradients

    actor, critic = models
    tokens = [(0, 1), (1, 5), (3, 0), (3, 2)]
    weights = dict(zip(tokens, (0.7, -1.3, 0.4, 2.0), strict=True))
    seen: dict[str, Any] = {}
    settings = UpdateSettings(precision="fp32", micro_batch_size=2)

    def hook(round_: int, work: torch.nn.Module, master: torch.nn.Module, b: Batch,
             old: torch.Tensor) -> None:
        if round_ != 2:
            return
        before = {n: p.grad.clone() for n, p in master.named_parameters() if p.grad is not None}
        total: dict[str, torch.Tensor] = {}
        for tok, j in token_gradients(work, master, b, contract, settings, role=role,
                                      tokens=tokens):
            for n, g in j.items():
                total[n] = total.get(n, torch.zeros_like(g)) + weights[tok] * g
        after = {n: p.grad for n, p in master.named_parameters() if p.grad is not None}
        assert all(torch.equal(before[n], after[n]) for n in before)
        twin = copy.deepcopy(work)
        ids = torch.cat([b.prompts, b.responses], 1)
        pos = torch.clamp(torch.cumsum(b.attention_mask, 1) - 1, min=0)
        out = twin(input_ids=ids, attention_mask=b.attention_mask, position_ids=pos).logits
        p_len, r_len = b.prompts.shape[1], b.responses.shape[1]
        out = out[:, p_len - 1: p_len - 1 + r_len]
        if role == "actor":
            z = torch.log_softmax(out.float() / contract.sampling.temperature, -1)
            x = z.gather(-1, b.responses.unsqueeze(-1)).squeeze(-1)
        else:
            x = out.squeeze(-1)
        twin.zero_grad()
        torch.stack([w * x[t] for t, w in weights.items()]).sum().backward()
        seen["pairs"] = [(total[n], p.grad) for n, p in twin.named_parameters()
                         if p.requires_grad]

    model = _fresh(actor if role == "actor" else critic)
    if role == "actor":
        run_actor(model, _fresh(actor), batch, contract, settings, on_round=hook)
    else:
        run_critic(model, batch, contract, settings, on_round=hook)
    pairs = seen["pairs"]
    assert pairs
    for mine, theirs in pairs:
        assert theirs is not None
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)
    assert any(float(m.abs().max()) > 0 for m, _ in pairs)


@pytest.mark.parametrize("settings", [
    UpdateSettings(precision="fp32", micro_batch_size=2),
    UpdateSettings(precision="bf16", bf16_mode="params", micro_batch_size=2)],
    ids=["fp32", "bf16-params"])
def test_reference_policy_is_freed_before_the_rounds(models: Models, batch: Batch,
                                                     contract: Contract,
                                                     settings: UpdateSettings) -> None:
    """A reference policy passed without a caller's name is gone (with its BF16 copy) by the
    first round's backward: the rounds run with one model less in memory."""
    actor, _ = models
    holder = [_fresh(actor)]
    gone = weakref.ref(holder[0])
    seen: list[bool] = []

    def hook(_r: int, _w: torch.nn.Module, _m: torch.nn.Module, _b: Batch,
             _o: torch.Tensor) -> None:
        gc.collect()
        seen.append(gone() is None)

    run_actor(_fresh(actor), holder.pop(), batch, contract, settings, on_round=hook)
    assert seen == [True] * contract.algorithm.rounds


def test_sampled_updates_are_the_exact_ones_at_the_sampled_elements(
        models: Models, batch: Batch, contract: Contract) -> None:
    """The reported ``updates`` of a sampled parameter (the pre-step weights kept only at the
    sampled elements) are bitwise the whole run's updates there; small tensors stay whole."""
    actor, _ = models
    sampling = ParamSampling(exact_elements=64, sample_elements=16)
    settings = UpdateSettings(precision="fp32", micro_batch_size=2)
    whole, _ = run_actor(_fresh(actor), _fresh(actor), batch, contract, settings)
    part, _ = run_actor(_fresh(actor), _fresh(actor), batch,
                        dataclasses.replace(contract, evidence=sampling), settings)
    sampled = 0
    for name, t in whole.items():
        if "/updates/" not in name and "/grads/" not in name:
            continue
        # the reported sample includes the rows of the batch's token ids (ParamSampling.rows)
        idx = sampling.with_rows(torch.cat([batch.prompts.reshape(-1),
                                            batch.responses.reshape(-1)]).numpy(),
                                 CFG["vocab_size"]).indices(name.split("/", 3)[3], t.numel())
        want = t if idx is None else t.reshape(-1)[torch.from_numpy(idx)]
        sampled += idx is not None
        assert torch.equal(part[name], want), name
        if "/updates/" in name:
            assert bool((want != 0).any()), name  # AdamW moved every parameter
    assert sampled > 0


def test_a_difference_in_one_token_row_is_seen_by_the_per_parameter_rows(
        models: Models, batch: Batch, contract: Contract) -> None:
    """The pad id sampled as a real response token: an engine that trains its embedding row
    (Megatron-Core's ``VocabParallelEmbedding`` has no ``padding_idx``; here the HF module with
    ``padding_idx`` removed) and HF, which freezes it, differ in round 1 only in that row.
    At tiny-qwen3's sampling (256 of the embedding's 24,576 elements, a seeded sample that
    holds none of row 0) the reported ``grads`` and ``updates`` must still see it."""
    actor, _ = models
    pad = CFG["pad_token_id"]
    responses = batch.responses.clone()
    assert int(batch.response_mask[3, 2]) == 1
    responses[3, 2] = pad  # a valid response position
    b = dataclasses.replace(batch, responses=responses)
    tiny = dataclasses.replace(contract, evidence=ParamSampling(exact_elements=256,
                                                                sample_elements=256))
    settings = UpdateSettings(precision="fp32", micro_batch_size=4)
    trains = _fresh(actor)
    cast(Any, trains).model.embed_tokens.padding_idx = None
    frozen, _ = run_actor(_fresh(actor), _fresh(actor), b, tiny, settings)
    trained, _ = run_actor(trains, _fresh(actor), b, tiny, settings)
    name = "model.embed_tokens.weight"
    numel = CFG["vocab_size"] * CFG["hidden_size"]
    idx = tiny.evidence.with_rows(torch.cat([b.prompts, b.responses], 1).numpy(),
                                  CFG["vocab_size"]).indices(name, numel)
    assert idx is not None
    in_pad_row = torch.from_numpy(idx // CFG["hidden_size"] == pad)
    assert int(in_pad_row.sum()) == CFG["hidden_size"]  # the whole row is reported
    for family in ("grads", "updates"):
        f, t = frozen[f"round1/actor/{family}/{name}"], trained[f"round1/actor/{family}/{name}"]
        assert f.shape == t.shape == (len(idx),)
        assert float(f[in_pad_row].abs().max()) == 0.0, family  # HF: the pad row is frozen
        assert float(t[in_pad_row].abs().max()) > 0.0, family  # trained: the row moved
        if family == "grads":  # the difference is confined to that row
            assert torch.equal(f[~in_pad_row], t[~in_pad_row])
        rel = float((t - f).norm() / f.norm())
        assert rel > 1e-3, (family, rel)  # far outside any per-parameter bound


def test_fp64_control_runs_in_fp64_and_reports_fp32(models: Models, batch: Batch,
                                                    contract: Contract) -> None:
    actor, _ = models
    fp32, _ = run_actor(_fresh(actor), _fresh(actor), batch, contract,
                        UpdateSettings(precision="fp32", micro_batch_size=4))
    out, meta = run_actor(_fresh(actor).double(), _fresh(actor).double(), batch, contract,
                          UpdateSettings(precision="fp64", micro_batch_size=4))
    assert meta["compute"] == ["torch.float64"]
    assert meta["optimizer_state"] == {"exp_avg": "torch.float64", "exp_avg_sq": "torch.float64"}
    assert {str(v.dtype) for v in out.values()} == {"torch.float32"}
    d = (out["round1/actor/logprobs"] - fp32["round1/actor/logprobs"]).abs().max()
    assert 0 < float(d) < 1e-5


def test_fp32_entropy_error_is_seen_only_against_fp64() -> None:
    """Why the FP32 class has an ``fp64`` control. Over a 49152-entry vocabulary the
    reference's FP32 ``-sum p log p`` (from ``log_softmax``) is further from FP64 than a
    vocab-parallel engine's ``lse - sum p (z - m)``; a reorder control that reuses the
    reference's formula cannot see that share, the FP64 run does, and k = 4 times it covers
    the difference between the two FP32 formulas."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(64, 49152, generator=g) * 3.0
    lp64 = torch.log_softmax(z.double(), -1)
    h64 = -(lp64.exp() * lp64).sum(-1)
    lp = torch.log_softmax(z, -1)
    h_ref = -(lp.exp() * lp).sum(-1)
    s = z - z.amax(-1, keepdim=True)
    lse = s.exp().sum(-1, keepdim=True).log()
    h_alt = lse.squeeze(-1) - ((s - lse).exp() * s).sum(-1)
    ref_err = float((h_ref.double() - h64).abs().max())
    alt_err = float((h_alt.double() - h64).abs().max())
    between = float((h_alt - h_ref).abs().max())
    assert alt_err < ref_err / 3
    assert between <= 4 * ref_err


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_fp32_token_gradients_stand_for_the_bf16_ones(models: Models, batch: Batch,
                                                      contract: Contract, role: str) -> None:
    """The reference seals BF16 ``J_t`` computed in FP32 from the FP32 master
    (:mod:`qualify.reference.branches`). On a real BF16 round-2 model that differs from the
    BF16 forward's own ``J_t`` by BF16 rounding only: a few per cent relative L2, not zero
    (the BF16 path really ran), and nowhere near the size of ``J_t`` itself."""
    from qualify.reference.jacobian import token_gradients

    actor, critic = models
    tokens = [(0, 1), (1, 5), (3, 2)]
    bf16 = UpdateSettings(precision="bf16", micro_batch_size=2)
    fp32 = UpdateSettings(precision="fp32", micro_batch_size=2)
    rel: list[float] = []

    def hook(round_: int, work: torch.nn.Module, master: torch.nn.Module, b: Batch,
             old: torch.Tensor) -> None:
        if round_ != 2:
            return
        assert next(work.parameters()).dtype == torch.bfloat16
        theirs = dict(token_gradients(work, master, b, contract, bf16, role=role,
                                      tokens=tokens))
        mine = dict(token_gradients(master, master, b, contract, fp32, role=role,
                                    tokens=tokens))
        for tok in tokens:
            a = torch.cat([mine[tok][n].double().flatten() for n in sorted(mine[tok])])
            c = torch.cat([theirs[tok][n].double().flatten() for n in sorted(theirs[tok])])
            rel.append(float((a - c).norm() / c.norm()))

    model = _fresh(actor if role == "actor" else critic)
    if role == "actor":
        run_actor(model, _fresh(actor), batch, contract, bf16, on_round=hook)
    else:
        run_critic(model, batch, contract, bf16, on_round=hook)
    assert len(rel) == len(tokens)
    assert all(0 < r < 0.05 for r in rel), rel


# --- the independent controls (qualify.reference.controls) -------------------------------


def test_control_settings_per_lane(contract: Contract) -> None:
    import dataclasses

    from qualify.reference.controls import control_settings

    mbs = contract.algorithm.micro_batch_size
    fp32 = control_settings(contract, "fp32")
    bf16 = control_settings(contract, "bf16")
    auto = control_settings(contract, "bf16-autocast")
    cast = control_settings(contract, "bf16-castmasters")
    assert list(fp32) == ["attn_impl", "microbatch", "row_split", "fp64"]
    # The default contract bounds BF16 by same-style controls only (no bf16_mode), the TP
    # re-partition (row_split) among them.
    assert list(bf16) == list(auto) == list(cast) == ["attn_impl", "microbatch", "row_split"]
    assert {s.bf16_mode for s, _ in bf16.values()} == {"params"}
    assert {s.bf16_mode for s, _ in cast.values()} == {"castmasters"}
    assert {s.row_split for n, (s, _) in cast.items() if n == "row_split"} == {2}
    assert {s.bf16_mode for s, _ in auto.values()} == {"autocast"}
    assert {s.precision for s, _ in auto.values()} == {"bf16"}
    assert fp32["attn_impl"][1] == "eager"
    assert {attn for name, (_, attn) in fp32.items() if name != "attn_impl"} == {"sdpa"}
    micro = fp32["microbatch"][0]
    assert (micro.micro_batch_size, micro.extra_left_padding, micro.extra_right_padding) == (
        max(1, mbs // 2) if mbs > 1 else 2, 2, 3)
    assert (fp32["fp64"][0].precision, fp32["fp64"][0].label) == ("fp64", "fp64-fp32")
    assert all(s.label == f"{name}-{p}"
               for p, ctl in (("fp32", fp32), ("bf16", bf16), ("bf16-autocast", auto),
                              ("bf16-castmasters", cast))
               for name, (s, _) in ctl.items())
    # A contract that still names bf16_mode measures it from the BF16-parameters lane only.
    named = dataclasses.replace(contract, bounds=dataclasses.replace(
        contract.bounds,
        controls_candidate_vs_hf=(*contract.bounds.controls_candidate_vs_hf, "bf16_mode")))
    with_mode = control_settings(named, "bf16")
    assert (with_mode["bf16_mode"][0].bf16_mode, with_mode["bf16_mode"][0].label) == (
        "autocast", "bf16_mode-bf16")
    assert "bf16_mode" not in control_settings(named, "bf16-autocast")
    assert "bf16_mode" not in control_settings(named, "bf16-castmasters")
    with pytest.raises(ValueError, match="lane"):
        control_settings(contract, "fp64")


def test_lanes_follow_the_engines_bf16_styles(contract: Contract) -> None:
    from qualify.lanes import (
        BF16_STYLES,
        forward_mode,
        lane_bf16_mode,
        lane_of,
        lane_precision,
        lanes,
    )

    # Only the lanes the matrix's cells need: no engine of the default matrix keeps the
    # checkpoint as its master (params), so no bf16 lane.
    assert contract.matrix.lanes() == ["fp32", "bf16-castmasters", "bf16-autocast"]
    by_engine = {c.engine: c.lane for c in contract.matrix.cells() if c.precision == "bf16"}
    assert by_engine == {"torch_tp": "bf16-autocast", "deepspeed": "bf16-castmasters",
                         "megatron": "bf16-castmasters"}
    assert {c.lane for c in contract.matrix.cells() if c.precision == "fp32"} == {"fp32"}
    assert lanes(["fp32", "bf16"], []) == ["fp32", "bf16"]
    assert lanes(["bf16"], ["autocast"]) == ["bf16-autocast"]
    assert lanes(["bf16", "fp32"], ["autocast", "castmasters", "params"]) == [
        "bf16", "bf16-castmasters", "bf16-autocast", "fp32"]
    assert (lane_of("fp32", "autocast"), lane_precision("bf16-autocast"),
            lane_bf16_mode("bf16-autocast"), lane_bf16_mode("fp32")) == (
        "fp32", "bf16", "autocast", "params")
    # Every style round-trips through its lane; a forward runs on BF16 parameters in both
    # master styles.
    for style in BF16_STYLES:
        lane = lane_of("bf16", style)
        assert (lane_precision(lane), lane_bf16_mode(lane)) == ("bf16", style)
    assert [forward_mode(s) for s in BF16_STYLES] == ["params", "params", "autocast"]
    with pytest.raises(ValueError, match="bf16_style"):
        lane_of("bf16", "fp8")
    with pytest.raises(ValueError, match="unknown BF16 style 'fp8'"):
        lane_bf16_mode("bf16-fp8")


def test_control_settings_only_the_named_controls(contract: Contract) -> None:
    import dataclasses

    from qualify.reference.controls import control_settings

    only = dataclasses.replace(contract.bounds, controls_candidate_vs_hf=("microbatch",),
                               controls_tp_vs_tp1=())
    one = dataclasses.replace(contract, bounds=only)
    assert list(control_settings(one, "fp32")) == ["microbatch"]
    assert list(control_settings(one, "bf16")) == ["microbatch"]


# --- the row_split control (qualify.reference.row_split.split_row_parallel) -------------------


def test_row_split_sums_rounded_partials_like_a_row_parallel_all_reduce(
        models: tuple[Qwen3ForCausalLM, Qwen3ForTokenClassification]) -> None:
    import copy

    from qualify.reference.row_split import split_row_parallel

    actor = copy.deepcopy(models[0])
    actor.to(torch.bfloat16)  # type: ignore[arg-type]  # transformers types .to(PreTrainedModel)
    plain = copy.deepcopy(actor)
    assert split_row_parallel(actor, 2) == 2 * CFG["num_hidden_layers"]
    lin = actor.model.layers[0].mlp.down_proj
    x = torch.randn(3, lin.in_features, generator=torch.Generator().manual_seed(5)).bfloat16()
    half = lin.in_features // 2
    # Two BF16 partial products (each accumulated in FP32 and rounded once), summed in BF16:
    # what Megatron-Core's RowParallelLinear + BF16 all-reduce compute at TP 2.
    want = (torch.nn.functional.linear(x[:, :half], lin.weight[:, :half])
            + torch.nn.functional.linear(x[:, half:], lin.weight[:, half:]))
    with torch.no_grad():
        assert torch.equal(lin(x), want)
        single = plain.model.layers[0].mlp.down_proj(x)
        assert not torch.equal(single, want)  # one rounding is not two
        ids = torch.randint(3, 384, (2, 7), generator=torch.Generator().manual_seed(6))
        a, b = actor(ids).logits.float(), plain(ids).logits.float()
    assert 0 < float((a - b).abs().max()) < 0.1
    # The hooks travel with the deep copy the BF16-parameters mode makes of the master.
    again = copy.deepcopy(actor)
    with torch.no_grad():
        assert torch.equal(again.model.layers[0].mlp.down_proj(x), want)
    with pytest.raises(ValueError, match="parts"):
        split_row_parallel(plain, 1)
    with pytest.raises(ValueError, match="no row-parallel projection"):
        split_row_parallel(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2)


def test_row_split_control_is_built_per_lane(contract: Contract) -> None:
    import dataclasses

    from qualify.reference.controls import control_settings

    named = dataclasses.replace(contract, bounds=dataclasses.replace(
        contract.bounds, controls_tp_vs_tp1=("row_split",)))
    for lane, mode in (("fp32", "params"), ("bf16", "params"), ("bf16-autocast", "autocast")):
        settings, attn = control_settings(named, lane)["row_split"]
        assert (settings.row_split, settings.bf16_mode, settings.label, attn) == (
            max(2, *contract.matrix.tp_sizes), mode, f"row_split-{lane}", "sdpa")


# --------------------------------------------------------------------------- reuse, bit for bit


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ in any bit (or are missing on one side)."""
    return sorted(k for k in a.keys() | b.keys()
                  if k not in a or k not in b or not torch.equal(a[k], b[k]))


@pytest.mark.parametrize("bf16_mode", ["castmasters", "params"])
def test_the_bf16_working_copy_reused_across_rounds_is_a_new_copy_bit_for_bit(
        models: Models, batch: Batch, contract: Contract, bf16_mode: Literal[
            "castmasters", "params"], monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round's BF16 working copy is the master's parameters rounded again into the same
    module: every tensor of a two-round run equals the run that deep-copies the module at
    every round (the code before), and the copy is made once."""
    from qualify.reference import update

    actor, _ = models
    settings = UpdateSettings(precision="bf16", bf16_mode=bf16_mode, micro_batch_size=2)
    copies: list[int] = []
    original = update.bf16_parameters_copy

    def counted(model: torch.nn.Module) -> torch.nn.Module:
        copies.append(1)
        return original(model)

    monkeypatch.setattr(update, "bf16_parameters_copy", counted)
    reused, _ = run_actor(_fresh(actor), _fresh(actor), batch, contract, settings)
    # one for the KL reference policy, one for the trained Actor (not one per round)
    assert len(copies) == 2
    copies.clear()

    def always_new(self: Any) -> torch.nn.Module:
        if not self.bf16_params:
            return cast(torch.nn.Module, self.master)
        self.work = counted(self.master)
        return cast(torch.nn.Module, self.work)

    monkeypatch.setattr(update._Precision, "refresh", always_new)
    fresh, _ = run_actor(_fresh(actor), _fresh(actor), batch, contract, settings)
    assert len(copies) == 1 + contract.algorithm.rounds
    assert _equal(reused, fresh) == []


def test_kl_reference_logprobs_passed_back_give_the_same_run_bit_for_bit(
        models: Models, batch: Batch, contract: Contract) -> None:
    """run_actor with the KL reference logprobs taken once (kl_reference_logprobs) and no
    reference policy equals the run that forwards the reference policy itself; logprobs of
    another shape or dtype are refused, naming the argument."""
    from qualify.reference.update import kl_reference_logprobs

    actor, _ = models
    settings = UpdateSettings(precision="bf16", bf16_mode="castmasters", micro_batch_size=2,
                              extra_left_padding=1, extra_right_padding=2)
    ref_logp = kl_reference_logprobs(_fresh(actor), batch, contract, settings)
    assert ref_logp.shape == (batch.responses.shape[0], batch.responses.shape[1] + 2)
    given, _ = run_actor(_fresh(actor), None, batch, contract, settings,
                         ref_logprobs=ref_logp)
    computed, _ = run_actor(_fresh(actor), _fresh(actor), batch, contract, settings)
    assert _equal(given, computed) == []
    # the KL term was live: a reference policy one step away changes the run
    moved = _fresh(actor)
    run_actor(moved, _fresh(actor), batch, contract, settings)
    other, _ = run_actor(_fresh(actor), None, batch, contract, settings,
                         ref_logprobs=kl_reference_logprobs(moved, batch, contract, settings))
    assert "round1/actor/loss/kl" in _equal(given, other)
    with pytest.raises(ValueError, match="ref_logprobs"):
        run_actor(_fresh(actor), None, batch, contract, settings, ref_logprobs=ref_logp[:, 1:])
    with pytest.raises(ValueError, match="give the reference policy"):
        run_actor(_fresh(actor), None, batch, contract, settings)
    with pytest.raises(ValueError, match="ref_logprobs"):
        run_actor(_fresh(actor), None, batch, contract, settings,
                  ref_logprobs=ref_logp.double())


def test_restore_model_gives_back_what_a_new_deep_copy_would_be(models: Models,
                                                                 batch: Batch,
                                                                 contract: Contract) -> None:
    """After a run trains the working copy (and rounds its masters to BF16), restore_model
    puts back every parameter and buffer, drops every gradient and keeps requires_grad and
    the mode: a second run on it equals a run on a new deep copy, bit for bit. A module that
    is not a copy is refused."""
    from qualify.models.roles import restore_model

    actor, critic = models
    template = _fresh(actor)
    work = _fresh(template)
    settings = UpdateSettings(precision="bf16", bf16_mode="castmasters", micro_batch_size=2)
    first, _ = run_actor(work, _fresh(actor), batch, contract, settings)
    next(work.parameters()).requires_grad_(False)  # flags a caller may have changed
    work.train()
    assert not torch.equal(dict(work.named_parameters())["model.norm.weight"],
                           dict(template.named_parameters())["model.norm.weight"])
    restore_model(work, template)
    for (name, w), (_, t) in zip(work.state_dict(keep_vars=True).items(),
                                 template.state_dict(keep_vars=True).items(), strict=True):
        assert torch.equal(w, t), name
    for b_w, b_t in zip(work.buffers(), template.buffers(), strict=True):
        assert torch.equal(b_w, b_t)
    assert all(p.grad is None and p.requires_grad == q.requires_grad
               for p, q in zip(work.parameters(), template.parameters(), strict=True))
    assert all(m.training == t.training
               for m, t in zip(work.modules(), template.modules(), strict=True))
    again, _ = run_actor(work, _fresh(actor), batch, contract, settings)
    assert _equal(first, again) == []
    with pytest.raises(ValueError, match="not a copy"):
        restore_model(work, critic)
    # a hook registered on the working copy since it was copied would stay: refused
    handle = dict(work.named_modules())["model.layers.0"].register_forward_pre_hook(
        lambda m, a: None)
    with pytest.raises(ValueError, match="hooks differ"):
        restore_model(work, template)
    handle.remove()
    restore_model(work, template)


def _perturbed_updates(models: Models, batch: Batch, contract: Contract,
                       settings: UpdateSettings, *, restored: bool, placed: bool,
                       ) -> list[dict[str, torch.Tensor]]:
    """The round-to-round step's perturbed updates of both roles (no offset, then +-1e-3 at
    two tokens in round ``rounds - 1``, the last round forward only): each from a new deep
    copy with the reference policy run (the code before), or, ``restored``, from one working
    copy restored each time with the KL reference logprobs taken once (the stage's way)."""
    from qualify.models.roles import restore_model
    from qualify.reference import devices
    from qualify.reference.update import kl_reference_logprobs

    rounds = contract.algorithm.rounds
    b, r = batch.responses.shape
    offsets: list[dict[int, torch.Tensor] | None] = [None]
    for sign in (1.0, -1.0):
        for token in ((0, 1), (2, 3)):
            o = torch.zeros(b, r, dtype=torch.float64)
            o[token] = sign * 1e-3
            offsets.append({rounds - 1: o})
    out = []
    for role, base in zip(("actor", "critic"), models, strict=True):
        template = _fresh(base)
        if placed:
            with devices.active(devices.ReferenceDevices(("cpu", "cpu", "cpu"), devices.ENV)):
                devices.place(template, role)
        work = _fresh(template)
        kl: torch.Tensor | None = None
        for offs in offsets:
            torch.manual_seed(0)
            model = restore_model(work, template) if restored else _fresh(template)
            if role == "critic":
                out.append(run_critic(model, batch, contract, settings, offsets=offs,
                                      last_forward=rounds)[0])
            elif restored:
                kl = kl if kl is not None else kl_reference_logprobs(
                    _fresh(template).requires_grad_(False), batch, contract, settings)
                out.append(run_actor(model, None, batch, contract, settings, offsets=offs,
                                     last_forward=rounds, ref_logprobs=kl)[0])
            else:
                out.append(run_actor(model, _fresh(template).requires_grad_(False), batch,
                                     contract, settings, offsets=offs, last_forward=rounds)[0])
    return out


@pytest.mark.parametrize(("precision", "bf16_mode", "placed"), [
    ("fp32", "params", False), ("bf16", "castmasters", True)])
def test_perturbed_updates_restored_equal_new_copies_bit_for_bit(
        models: Models, batch: Batch, contract: Contract, precision: Literal["fp32", "bf16"],
        bf16_mode: Literal["params", "castmasters"], placed: bool) -> None:
    """The round-to-round step's way (one working copy restored per update, the KL reference
    logprobs once, one BF16 copy per run) gives every perturbed update's tensors bit for bit
    as a new deep copy per update does, unplaced and placed across three ``cpu`` devices;
    the offsets moved the results (the runs compared are not all the same run)."""
    settings = UpdateSettings(precision=precision, bf16_mode=bf16_mode, micro_batch_size=2)
    before = _perturbed_updates(models, batch, contract, settings, restored=False,
                                placed=placed)
    after = _perturbed_updates(models, batch, contract, settings, restored=True, placed=placed)
    assert [_equal(x, y) for x, y in zip(before, after, strict=True)] == [[]] * len(before)
    assert _equal(before[0], before[1]) != []


def test_a_diverging_update_stops_at_the_round_that_shows_it(models: Models, batch: Batch,
                                                             contract: Contract) -> None:
    """A learning rate far too large for the model: round 1's Adam step moves every
    parameter by about lr, round 2's logprobs fall by hundreds of nats and the k3 KL
    overflows. The run stops there, naming the role, round, terms and the lr, instead of
    sealing a NaN target that only the bounds step would find. The same for the Critic, whose
    round-2 value loss overflows."""
    from qualify.errors import ReferenceDivergedError

    actor, critic = models
    huge = dataclasses.replace(contract, optimizer=dataclasses.replace(
        contract.optimizer, actor_lr=1e3, critic_lr=1e30))
    settings = UpdateSettings(precision="fp32", micro_batch_size=2, label="hf-fp32")
    with pytest.raises(ReferenceDivergedError) as exc:
        run_actor(_fresh(actor), _fresh(actor), batch, huge, settings)
    msg = str(exc.value)
    assert msg.startswith("hf-fp32: the actor's round 2 loss is not finite ("), msg
    assert "the reference update diverged; round 1's update moved them by up to " in msg, msg
    assert "optimizer.actor_lr 1000 is too large a step for this model" in msg, msg
    with pytest.raises(ReferenceDivergedError, match=r"hf-fp32: the critic's round 2 loss is "
                       r"not finite \(value (inf|nan)\).*optimizer\.critic_lr 1e\+30"):
        run_critic(_fresh(critic), batch, huge, settings)
    # the contract's own lr runs both roles to the end (the check stops only a divergence)
    run_actor(_fresh(actor), _fresh(actor), batch, contract, settings)
    # a perturbed round-to-round run records its overflow instead of stopping the stage
    offsets = {2: torch.full(batch.responses.shape, -1e30)}  # every target logit pushed down
    out, _ = run_actor(_fresh(actor), _fresh(actor), batch, contract, settings,
                       offsets=offsets, last_forward=2)
    assert not torch.isfinite(out["round2/actor/loss/kl"])
