"""The sealed clip-branch ``J_t``: stored at the reported elements only, and still exact.

Two claims of :mod:`qualify.reference.gram`: (1) the comparator's adjustment
(:func:`qualify.branches.adjusted_expected`) computed from ``J_t`` stored at the protocol's
sampled elements equals, at those elements, the adjustment computed from the whole ``J_t``
(and the moved ``grad_norm`` / ``clip_coef`` are identical): nothing is approximated by not
storing the rest; (2) the off-diagonal ``<J_s, J_t>``, by forward mode (the path used when
the whole ``J_t`` do not fit in memory), equals the FP64 dot product of the whole tensors to
FP32 rounding, on tiny-qwen3's Actor and Critic.
"""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch
from tiny_models import seeded_batch, seeded_qwen3
from transformers import (
    PreTrainedModel,
)

from qualify import branches
from qualify.contract import Contract, load_contract
from qualify.errors import ReferenceDataError
from qualify.models import roles
from qualify.models.manifest import write_dir_manifest
from qualify.protocol import ParamSampling, param_sample_indices
from qualify.reference import gram
from qualify.reference.jacobian import token_gradients
from qualify.reference.update import (
    Batch,
    UpdateSettings,
    run_actor,
    run_critic,
)
from qualify.resources import contracts_dir

torch.set_num_threads(1)

CFG: dict[str, Any] = {
    "vocab_size": 384, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "pad_token_id": 0,
    "eos_token_id": 2, "bos_token_id": 1, "attention_dropout": 0.0}
SAMPLING = ParamSampling(exact_elements=256, sample_elements=256)  # tiny-qwen3.toml's
TOKENS = [(0, 1), (1, 5), (3, 0), (3, 2), (2, 1)]


@pytest.fixture(scope="module")
def contract() -> Contract:
    return dataclasses.replace(load_contract(contracts_dir() / "tiny-qwen3.toml"),
                               evidence=SAMPLING)


@pytest.fixture(scope="module")
def batch() -> Batch:
    return cast(Batch, seeded_batch(384, short={0: 4, 2: 3}, masked_targets=True))


def _model(role: str) -> torch.nn.Module:
    return seeded_qwen3(role, CFG)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_jvp_gram_equals_the_fp64_gram(contract: Contract, batch: Batch, role: str) -> None:
    """At round 2 of a real reference update, the forward-mode Gram of five tokens (four
    sequences: two forwards of two per row) matches the FP64 dot products of their whole
    ``J_t`` within 1e-5 of ``|J_s| |J_t|``, and the model's attention implementation is
    restored after."""
    settings = UpdateSettings(precision="fp32", micro_batch_size=2)
    seen: dict[str, Any] = {}

    def hook(round_: int, work: torch.nn.Module, master: torch.nn.Module, b: Batch,
             old: torch.Tensor) -> None:
        if round_ != 2:
            return
        full, norm_sq, rows, upper = {}, {}, {}, {}
        for tok, c in token_gradients(master, master, b, contract, settings, role=role,
                                      tokens=TOKENS):
            key = branches.token_key(*tok)
            full[key] = c
            norm_sq[key] = sum(float(v.double().square().sum()) for v in c.values())
            row = gram.jvp_row(master, b, contract, role=role, micro_batch_size=2,
                               tokens=TOKENS, direction=c)
            rows[key] = {branches.token_key(*k): v for k, v in row.items()}
            upper[key] = {k: v for k, v in rows[key].items()  # as seal_branches computes it
                          if tuple(map(int, k.split("_"))) >= tok}
        seen["exact"] = gram.exact_gram(full, norm_sq)
        seen["jvp"], seen["err"] = gram.symmetrize(rows, norm_sq)
        seen["upper"], seen["err_upper"] = gram.symmetrize(upper, norm_sq)
        seen["norm"] = {k: v ** 0.5 for k, v in norm_sq.items()}
        seen["attn"] = getattr(master.config, "_attn_implementation", None)

    model = _model(role)
    if role == "actor":
        run_actor(model, copy.deepcopy(model), batch, contract, settings, on_round=hook)
    else:
        run_critic(model, batch, contract, settings, on_round=hook)
    assert seen["attn"] == "sdpa"
    assert 0.0 <= seen["err"] < 1e-5
    assert 0.0 <= seen["err_upper"] <= seen["err"]
    exact, jvp, norm = seen["exact"], seen["jvp"], seen["norm"]
    assert len(exact) == len(TOKENS)
    off = [abs(exact[a][b]) / (norm[a] * norm[b]) for a in exact for b in exact if a != b]
    assert max(off) > 1e-3  # the off-diagonal is not trivially zero
    for a in exact:
        for b in exact:
            assert abs(jvp[a][b] - exact[a][b]) <= 1e-5 * norm[a] * norm[b], (a, b)
            assert abs(seen["upper"][a][b] - exact[a][b]) <= 1e-5 * norm[a] * norm[b], (a, b)


def test_symmetrize_averages_and_refuses_a_discrepant_row() -> None:
    rows = {"0_0": {"0_0": 1.0, "0_1": 0.5}, "0_1": {"0_0": 0.5001, "0_1": 4.0}}
    g, err = gram.symmetrize(rows, {"0_0": 1.0, "0_1": 4.0})
    assert g["0_0"]["0_1"] == g["0_1"]["0_0"] == pytest.approx(0.50005)
    assert g["0_1"]["0_1"] == 4.0
    assert err == pytest.approx(1e-4 / 4.0)  # of max |J_u|^2, not of |J_s| |J_t| = 2
    upper, err = gram.symmetrize({"0_0": rows["0_0"], "0_1": {"0_1": 4.0}},
                                 {"0_0": 1.0, "0_1": 4.0})
    assert upper["0_1"]["0_0"] == 0.5
    assert err == 0.0
    with pytest.raises(ReferenceDataError, match="discrepancy"):
        gram.symmetrize({**rows, "0_1": {"0_0": 0.4, "0_1": 4.0}}, {"0_0": 1.0, "0_1": 4.0})
    # A token of tiny |J_t| (a confident one): 10 % of its own |J_t|^2 is 1e-10 of the scale.
    g, err = gram.symmetrize({"0_0": {"0_0": 4.0, "0_1": 1e-6}, "0_1": {"0_1": 1.1e-9}},
                             {"0_0": 4.0, "0_1": 1e-9})
    assert err == pytest.approx(1e-10 / 4.0)
    with pytest.raises(ReferenceDataError, match="discrepancy inf"):
        gram.symmetrize({"0_0": {"0_0": 1e-30}}, {"0_0": 0.0})
    assert gram.symmetrize({"0_0": {"0_0": 0.0}}, {"0_0": 0.0})[1] == 0.0
    with pytest.raises(ReferenceDataError, match="no <J_0_0, J_0_1>"):
        gram.symmetrize({"0_0": {"0_0": 1.0}, "0_1": {"0_1": 4.0}}, {"0_0": 1.0, "0_1": 4.0})


def test_confident_token_is_exact_to_the_gram_scale(contract: Contract) -> None:
    """A token the policy is sure of: backward and forward mode disagree on its tiny
    ``|J_t|^2`` by a large fraction of it (the error a per-pair ``|J_s| |J_t|`` criterion
    refused on SmolLM2), yet every entry of the forward-mode Gram is within 1e-6 of
    ``max_u |J_u|^2`` of the FP64 Gram, ``symmetrize`` seals it, and a row taken in the
    wrong direction is still refused."""
    model = _model("actor")
    with torch.no_grad():
        model.get_parameter("lm_head.weight").mul_(150.0)  # sharp logits: p -> 1
    g = torch.Generator().manual_seed(1)
    b, p, r = 4, 5, 6
    seq = torch.randint(3, 384, (b, p), generator=g)
    with torch.no_grad():
        for _ in range(r):  # the responses are the greedy continuation
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
        logp = torch.log_softmax(model(seq).logits[:, p - 1:-1].double()
                                 / contract.sampling.temperature, -1)
    responses = seq[:, p:]
    one_minus_p = -torch.expm1(logp.gather(-1, responses[..., None])[..., 0])  # [b, r] FP64
    mask = torch.ones(b, r, dtype=torch.int64)
    batch = Batch(prompts=seq[:, :p], responses=responses,
                  attention_mask=torch.ones(b, p + r, dtype=torch.int64), response_mask=mask,
                  advantages=torch.zeros(b, r), returns=torch.zeros(b, r), pad_token_id=0)
    sure = [(int(i), int(j)) for i, j in (one_minus_p < 1e-9).nonzero()]
    unsure = [(int(i), int(j)) for i, j in (one_minus_p > 0.1).nonzero()]
    assert sure
    assert len(unsure) >= 2
    tokens = sorted({sure[0], unsure[0], unsure[-1], (0, 1), (3, 2)})
    settings = UpdateSettings(precision="fp32", micro_batch_size=2)
    full, norm_sq, rows = {}, {}, {}
    for tok, c in token_gradients(model, model, batch, contract, settings, role="actor",
                                  tokens=tokens):
        key = branches.token_key(*tok)
        full[key] = c
        norm_sq[key] = sum(float(v.double().square().sum()) for v in c.values())
        row = gram.jvp_row(model, batch, contract, role="actor", micro_batch_size=2,
                           tokens=tokens, direction=c)
        rows[key] = {branches.token_key(*k): v for k, v in row.items()}
    s_key = branches.token_key(*sure[0])
    own = abs(rows[s_key][s_key] - norm_sq[s_key]) / norm_sq[s_key]
    assert own > 1e-2  # per |J_s|^2 the two FP32 passes disagree by more than 1 %
    scale = max(norm_sq.values())
    assert norm_sq[s_key] < 1e-12 * scale
    exact = gram.exact_gram(full, norm_sq)
    jvp, err = gram.symmetrize(rows, norm_sq)  # sealed: err <= gram.MAX_REL_ERROR
    assert 0.0 < err <= gram.MAX_REL_ERROR
    for a in exact:
        for c_ in exact:
            assert abs(jvp[a][c_] - exact[a][c_]) <= 1e-6 * scale, (a, c_)
    u0, u1 = branches.token_key(*unsure[0]), branches.token_key(*unsure[-1])
    wrong = gram.jvp_row(model, batch, contract, role="actor", micro_batch_size=2,
                         tokens=tokens, direction=full[u1])  # row u0 taken along J_u1
    swapped = {**rows, u0: {branches.token_key(*k): v for k, v in wrong.items()}}
    with pytest.raises(ReferenceDataError, match="discrepancy"):
        gram.symmetrize(swapped, norm_sq)


def _sample(name: str, a: np.ndarray) -> np.ndarray:
    idx = param_sample_indices(name, a.size, SAMPLING)
    return a.copy() if idx is None else a.reshape(-1)[idx]


def test_adjustment_from_sampled_jacobians_is_exact_at_the_reported_elements() -> None:
    """``adjusted_expected`` on the sampled run with ``J_t`` sampled at the same indices
    gives, bitwise, the sample of the adjustment computed from whole tensors; ``grad_norm``
    and ``clip_coef`` (from the sealed exact scalars) are identical."""
    rng = np.random.default_rng(3)
    shapes = {"model.embed_tokens.weight": (384, 64), "model.norm.weight": (64,),
              "model.layers.0.mlp.up_proj.weight": (160, 64)}
    toks = [(0, 1), (2, 3), (1, 0)]
    keys = [branches.token_key(*t) for t in toks]
    jac = {k: {p: rng.standard_normal(s) for p, s in shapes.items()} for k in keys}
    g = {p: rng.standard_normal(s) for p, s in shapes.items()}
    exp: dict[str, Any] = {"round1/actor/logprobs": rng.standard_normal((3, 4)) - 2.0,
                           "round2/actor/logprobs": rng.standard_normal((3, 4)) - 2.0}
    for p, s in shapes.items():
        exp[f"round2/actor/grads/{p}"] = g[p]
        exp[f"round2/actor/exp_avg/{p}"] = 0.1 * rng.standard_normal(s)
        exp[f"round2/actor/exp_avg_sq/{p}"] = 0.01 * rng.random(s)
        exp[f"round2/actor/updates/{p}"] = 1e-3 * rng.standard_normal(s)
    norm = float(np.sqrt(sum(np.square(v).sum() for v in g.values())))
    exp["round2/actor/grad_norm"] = np.asarray(norm)
    exp["round2/actor/clip_coef"] = np.asarray(min(1.0, 1.0 / (norm + 1e-6)))
    flat = {k: np.concatenate([jac[k][p].ravel() for p in shapes]) for k in keys}
    gflat = np.concatenate([g[p].ravel() for p in shapes])
    scalars = {"tokens": {k: {"dot_grad": float(gflat @ flat[k])} for k in keys},
               "gram": {a: {b: float(flat[a] @ flat[b]) for b in keys} for a in keys}}
    flips = [{"index": list(t), "obtained": o} for t, o in zip(toks, ("full", "zero", "full"),
                                                               strict=True)]
    train = {"advantages": rng.standard_normal((3, 4)), "returns": rng.standard_normal((3, 4))}
    kw: dict[str, Any] = {"role": "actor", "round_": 2, "flips": flips, "scalars": scalars,
                          "train": train, "n_valid": 12.0, "lr": 1e-3, "betas": (0.9, 0.999),
                          "eps": 1e-8, "max_grad_norm": 1.0}
    whole, _ = branches.adjusted_expected(
        exp, jacobians={f"{k}/{p}": v for k in keys for p, v in jac[k].items()}, **kw)
    sampled_exp = {n: (_sample(n.split("/", 3)[3], v) if n.count("/") >= 3 else v)
                   for n, v in exp.items()}
    part, _ = branches.adjusted_expected(
        sampled_exp, jacobians={f"{k}/{p}": _sample(p, v) for k in keys
                                for p, v in jac[k].items()}, **kw)
    assert whole is not None
    assert part is not None
    assert any(param_sample_indices(p, int(np.prod(s)), SAMPLING) is not None
               for p, s in shapes.items())
    for n in ("round2/actor/grad_norm", "round2/actor/clip_coef"):
        assert float(part[n]) == float(whole[n])
    assert float(whole["round2/actor/grad_norm"]) != norm  # the flips moved it
    for n, v in part.items():
        if n.count("/") >= 3 and n.startswith("round2/"):
            np.testing.assert_array_equal(v, _sample(n.split("/", 3)[3], whole[n]))


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_token_outputs_are_the_whole_batch_outputs(contract: Contract, batch: Batch,
                                                   role: str) -> None:
    """:func:`token_outputs` (the rows holding a listed token, cut after the last listed
    position) equals the whole batch's forward at those tokens to FP32 rounding, in the
    order listed, the left-padded row included, with the Actor's head at every position or
    at the listed ones only; the forward holds only the listed rows, cut after the last
    listed position, and changing every response token after it changes nothing (the cut
    is exact for a causal model); a token outside the batch is refused."""
    from qualify.reference.jacobian import token_outputs

    model = _model(role).eval()
    t = contract.sampling.temperature
    p_len = batch.prompts.shape[1]
    ids = torch.cat([batch.prompts, batch.responses], 1)
    pos = torch.clamp(torch.cumsum(batch.attention_mask, 1) - 1, min=0)
    with torch.no_grad():
        y = model(input_ids=ids, attention_mask=batch.attention_mask, position_ids=pos).logits
        y = y[:, p_len - 1: p_len - 1 + batch.responses.shape[1]]
        whole = (torch.log_softmax(y.float() / t, -1).gather(
            -1, batch.responses[..., None])[..., 0] if role == "actor" else y[..., 0])
        later = dataclasses.replace(batch, responses=batch.responses.clone())
        later.responses[:, 3:] = (later.responses[:, 3:] + 7) % 384
        for toks in ([(0, 1), (0, 0), (0, 3)], [(1, 2), (1, 5)], [(3, 1), (1, 0), (3, 0)]):
            mine = token_outputs(model, batch, toks, role=role, temperature=t)
            assert mine.shape == (len(toks),)
            torch.testing.assert_close(mine, whole[[b for b, _ in toks], [u for _, u in toks]],
                                       rtol=1e-5, atol=1e-6)
            # The head at the listed positions only (what the jvp rows run): the same logits.
            torch.testing.assert_close(token_outputs(model, batch, toks, role=role,
                                                     temperature=t, head_at_tokens=True),
                                       mine, rtol=1e-6, atol=1e-7)
            if max(u for _, u in toks) <= 2:
                assert torch.equal(token_outputs(model, later, toks, role=role,
                                                 temperature=t), mine)
        # The forward really is cut: only the rows holding a listed token, P + max t long.
        shapes: list[tuple[int, ...]] = []
        hook = model.register_forward_pre_hook(
            lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
        try:
            token_outputs(model, batch, [(3, 1), (1, 0)], role=role, temperature=t)
        finally:
            hook.remove()
        assert shapes == [(2, p_len + 1)]
        for bad in ([(0, 6)], [(4, 0)], [(-1, 0)], [(0, -1)], []):
            with pytest.raises(ValueError, match="outside"):
                token_outputs(model, batch, bad, role=role, temperature=t)


def test_jvp_row_restores_the_mode_and_refuses_an_empty_group(contract: Contract,
                                                              batch: Batch) -> None:
    """:func:`gram.jvp_row` runs in eval mode and gives a training-mode model back in
    training mode with its attention implementation; ``micro_batch_size < 1`` is refused."""
    model = _model("critic").train()
    direction = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    seen: list[bool] = []
    hook = model.register_forward_pre_hook(lambda m, _a: seen.append(m.training))
    try:
        row = gram.jvp_row(model, batch, contract, role="critic", micro_batch_size=2,
                           tokens=[(0, 1), (3, 2), (1, 0)], direction=direction)
    finally:
        hook.remove()
    assert seen == [False, False]  # two groups of two sequences, both in eval mode
    assert model.training
    assert getattr(model.config, "_attn_implementation", None) == "sdpa"
    assert sorted(row) == [(0, 1), (1, 0), (3, 2)]
    assert any(v != 0.0 for v in row.values())
    for size in (0, -1):
        with pytest.raises(ValueError, match="micro_batch_size"):
            gram.jvp_row(model, batch, contract, role="critic", micro_batch_size=size,
                         tokens=[(0, 1)], direction=direction)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The two role directories :func:`qualify.reference.branches._rerun` loads (with their
    ``qualify-manifest.json``): the module's actor and critic, saved."""
    root = tmp_path_factory.mktemp("bundle")
    for role in ("actor", "critic"):
        model = _model(role)
        assert isinstance(model, PreTrainedModel)
        model.save_pretrained(root / role)
        write_dir_manifest(root / role)
    return SimpleNamespace(actor_dir=root / "actor", critic_dir=root / "critic")


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_the_rerun_takes_each_way_to_the_same_gram(contract: Contract, batch: Batch,
                                                   bundle: Any, role: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``_rerun``'s routing, on a real rerun of the reference update: whole ``J_t`` in
    budget -> the FP64 Gram; over it -> the factored Gram; factors over theirs -> forward
    mode; a factored Gram refused -> forward mode, the refusal recorded. Every way gives the
    sealed tokens' same ``J_t`` (bitwise) and a Gram within FP32 rounding of the FP64 one."""
    from qualify.reference import branches as ref_branches
    from qualify.reference import gram_factors

    settings = UpdateSettings(precision="fp32",
                              micro_batch_size=contract.algorithm.micro_batch_size)
    torch.manual_seed(0)
    if role == "actor":
        run, _ = run_actor(roles.load_actor(bundle.actor_dir, dtype=torch.float32,
                                            attn_implementation="sdpa", requires_grad=True),
                           roles.load_actor(bundle.actor_dir, dtype=torch.float32,
                                            attn_implementation="sdpa"),
                           batch, contract, settings)
    else:
        run, _ = run_critic(roles.load_critic(bundle.critic_dir, dtype=torch.float32,
                                              attn_implementation="sdpa", requires_grad=True),
                            batch, contract, settings)

    def refuse(*_a: object, **_k: object) -> object:
        raise ReferenceDataError("factored clip-branch Gram: a test's refusal")

    seen: dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}
    for way in ("fp64", "factored", "jvp", "refused"):
        with monkeypatch.context() as m:
            if way != "fp64":
                m.setattr(gram, "FULL_BUDGET_BYTES", 0)
            if way == "jvp":
                m.setattr(gram_factors, "BUDGET_BYTES", 0)
            if way == "refused":
                m.setattr(gram_factors.FactorCapture, "gram", refuse)
            rounds_doc: dict[str, Any] = {"round2": {"tol_cur": 1e-3, "tokens": {},
                                                     "gram": {}}}
            tensors: dict[str, torch.Tensor] = {}
            ref_branches._rerun(contract, bundle, batch, prec="fp32", role=role,
                                wanted={2: TOKENS}, run=run, tensors=tensors,
                                rounds_doc=rounds_doc, attn="sdpa")
            seen[way] = (rounds_doc["round2"], tensors)
    said = {way: rd["gram_off_diagonal"].split(":")[0] for way, (rd, _) in seen.items()}
    jvp = "forward mode (jvp) over the whole J_t, FP32 rounding"
    assert said == {"fp64": "exact", "factored": "factored", "jvp": jvp, "refused": jvp}
    assert "a test's refusal" in seen["refused"][0]["gram_factored_refused"]
    assert all("gram_factored_refused" not in seen[w][0] for w in ("fp64", "factored", "jvp"))
    exact_rd, exact_t = seen["fp64"]
    assert len(exact_rd["tokens"]) == len(TOKENS)
    assert exact_rd["rerun_max_abs_diff"] == 0.0  # the rerun is the sealed run, bitwise
    norm = {k: v["norm_sq"] ** 0.5 for k, v in exact_rd["tokens"].items()}
    for way, (rd, tensors) in seen.items():
        assert tensors.keys() == exact_t.keys()
        assert all(torch.equal(tensors[k], exact_t[k]) for k in exact_t), way
        assert rd["tokens"] == exact_rd["tokens"], way
        for a, norm_a in norm.items():
            for b, norm_b in norm.items():
                assert abs(rd["gram"][a][b] - exact_rd["gram"][a][b]) \
                    <= 1e-5 * norm_a * norm_b, (way, a, b)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_one_j_t_is_alive_during_each_backward(contract: Contract, batch: Batch, role: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer that drops each ``J_t`` before asking for the next one holds no earlier
    ``J_t`` while the next backward runs (tokens of one sequence and of several), so the
    clip-branch step's peak carries one model-sized ``J_t``, not two."""
    import weakref

    model = _model(role)
    settings = UpdateSettings(precision="fp32", micro_batch_size=2)
    earlier: list[weakref.ref[torch.Tensor]] = []
    alive: list[int] = []
    real = torch.autograd.grad

    def spy(*args: Any, **kwargs: Any) -> Any:
        alive.append(sum(r() is not None for r in earlier))
        out = real(*args, **kwargs)
        earlier.extend(weakref.ref(g) for g in out if g is not None)
        return out

    monkeypatch.setattr(torch.autograd, "grad", spy)
    n = 0
    for _, c in token_gradients(model, model, batch, contract, settings, role=role,
                                tokens=TOKENS):
        assert c
        assert all(v.dtype == torch.float32 for v in c.values())
        del c
        n += 1
    assert n == len(TOKENS)
    assert alive == [0] * len(TOKENS)
