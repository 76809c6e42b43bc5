"""HF <-> Megatron-Core conversion: bitwise round trips, layout checks, a real forward.

The round trips and layout checks are pure torch (no megatron import). The forward test
builds megatron-core 0.16.1's own ``GPTModel`` (local spec) on CPU in this process (gloo,
world 1) and compares its logits / values with the HF model's.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3ForTokenClassification,
)

from harnesses.megatron import convert
from qualify.errors import HarnessError

# Non-square tiny shapes; vocab 300 is no multiple of 128 * TP, so padding is exercised.
BASE = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 2, "max_position_embeddings": 64}
MODELS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "qwen3-kv2-hd16-untied": (Qwen3Config, Qwen3ForCausalLM,
                              {"num_attention_heads": 8, "num_key_value_heads": 2,
                               "head_dim": 16, "tie_word_embeddings": False}),
    "qwen3-kv4-hd32-tied": (Qwen3Config, Qwen3ForCausalLM,
                            {"num_attention_heads": 8, "num_key_value_heads": 4,
                             "head_dim": 32, "tie_word_embeddings": True}),
    "qwen3-critic": (Qwen3Config, Qwen3ForTokenClassification,
                     {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
                      "tie_word_embeddings": False, "num_labels": 1}),
    "llama-kv2-untied": (LlamaConfig, LlamaForCausalLM,
                         {"num_attention_heads": 8, "num_key_value_heads": 2,
                          "tie_word_embeddings": False}),
    "llama-kv4-tied": (LlamaConfig, LlamaForCausalLM,
                       {"num_attention_heads": 8, "num_key_value_heads": 4,
                        "tie_word_embeddings": True}),
}


def _hf(name: str, seed: int = 0) -> tuple[Any, dict[str, torch.Tensor], convert.Shape]:
    cfg_cls, model_cls, extra = MODELS[name]
    cfg = cfg_cls(**BASE, **extra)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # HF zero-initialises norms and biases: make every row distinct
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    head: convert.Head = "value" if "critic" in name else "lm"
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, sd, convert.Shape.from_hf_config(cfg, head=head)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_round_trip_is_bitwise(name: str, tp: int) -> None:
    _, sd, shape = _hf(name)
    shards = convert.hf_to_megatron(sd, shape, tp)
    assert len(shards) == tp
    assert all(set(s) == set(convert.megatron_param_names(shape)) for s in shards)
    vp = shape.padded_vocab(tp)
    assert vp % (128 * tp) == 0
    assert vp >= shape.vocab > vp - 128 * tp
    emb = torch.cat([s["embedding.word_embeddings.weight"] for s in shards])
    assert emb.shape == (vp, shape.hidden)
    assert torch.equal(emb[shape.vocab:], torch.zeros(vp - shape.vocab, shape.hidden))
    assert convert.layout_errors(sd, shards, shape) == []
    assert convert.replica_mismatches(shards, shape) == []
    back = convert.megatron_to_hf(shards, shape)
    assert set(back) == set(convert.hf_param_names(shape))
    for k, v in back.items():
        assert v.dtype == sd[k].dtype, k
        assert torch.equal(v, sd[k]), k
    # the HF names are exactly the model's parameters (a tied lm_head is the embedding)
    expected = {k for k in sd if not (shape.tied and k == "lm_head.weight")}
    assert set(back) == expected


def test_fc1_and_qkv_rank_layouts_by_hand() -> None:
    """Row identities of a tiny case, written out: gate/up per rank, q/k/v per group."""
    shape = convert.Shape(family="llama", num_layers=1, hidden=2, ffn=4, heads=4, kv_heads=2,
                          head_dim=1, vocab=3, tied=True)
    rows = {  # each HF row holds its own (projection, index) code
        "model.layers.0.self_attn.q_proj.weight": torch.tensor([[10.0, 0], [11, 0], [12, 0],
                                                                [13, 0]]),
        "model.layers.0.self_attn.k_proj.weight": torch.tensor([[20.0, 0], [21, 0]]),
        "model.layers.0.self_attn.v_proj.weight": torch.tensor([[30.0, 0], [31, 0]]),
        "model.layers.0.mlp.gate_proj.weight": torch.tensor([[40.0, 0], [41, 0], [42, 0],
                                                             [43, 0]]),
        "model.layers.0.mlp.up_proj.weight": torch.tensor([[50.0, 0], [51, 0], [52, 0],
                                                           [53, 0]]),
    }
    sd = {n: torch.zeros(1) for n in convert.hf_param_names(shape)}
    sd.update(rows)
    sd["model.embed_tokens.weight"] = torch.zeros(3, 2)
    sd["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(2, 4)
    sd["model.layers.0.mlp.down_proj.weight"] = torch.zeros(2, 4)
    shards = convert.hf_to_megatron(sd, shape, 2)
    qkv = [s["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() for s in shards]
    fc1 = [s["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() for s in shards]
    assert qkv == [[10, 11, 20, 30], [12, 13, 21, 31]]  # q heads of group g, k_g, v_g
    assert fc1 == [[40, 41, 50, 51], [42, 43, 52, 53]]  # gate rows of rank r, then up rows


def _wrong_fc1(sd: dict[str, torch.Tensor], shards: list[dict[str, torch.Tensor]],
               shape: convert.Shape) -> list[dict[str, torch.Tensor]]:
    """The classic bug: the global ``[gate; up]`` (the TP1 layout) chunked over ranks."""
    bad = [dict(s) for s in shards]
    for i in range(shape.num_layers):
        full = torch.cat([sd[f"model.layers.{i}.mlp.gate_proj.weight"],
                          sd[f"model.layers.{i}.mlp.up_proj.weight"]])
        for r, c in enumerate(full.chunk(len(shards))):
            bad[r][f"decoder.layers.{i}.mlp.linear_fc1.weight"] = c.contiguous()
    return bad


def _wrong_qkv(sd: dict[str, torch.Tensor], shards: list[dict[str, torch.Tensor]],
               shape: convert.Shape) -> list[dict[str, torch.Tensor]]:
    """Plain ``[Q; K; V]`` concatenation instead of per-group interleave, chunked per rank."""
    bad = [dict(s) for s in shards]
    for i in range(shape.num_layers):
        p = f"model.layers.{i}.self_attn"
        full = torch.cat([sd[f"{p}.q_proj.weight"], sd[f"{p}.k_proj.weight"],
                          sd[f"{p}.v_proj.weight"]])
        for r, c in enumerate(full.chunk(len(shards))):
            bad[r][f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = c.contiguous()
    return bad


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["qwen3-kv2-hd16-untied", "llama-kv4-tied"])
def test_wrong_layouts_are_detected(name: str, tp: int) -> None:
    _, sd, shape = _hf(name)
    shards = convert.hf_to_megatron(sd, shape, tp)
    errs = convert.layout_errors(sd, _wrong_fc1(sd, shards, shape), shape)
    assert errs, "per-rank gate/up read as global chunks must be detected"
    assert all("linear_fc1" in e for e in errs)
    assert len(errs) == tp * shape.num_layers  # every rank of every layer is wrong
    errs = convert.layout_errors(sd, _wrong_qkv(sd, shards, shape), shape)
    assert errs
    assert all("linear_qkv" in e for e in errs)
    # the wrong layouts also break the inverse: the round trip is no longer the identity
    back = convert.megatron_to_hf(_wrong_fc1(sd, shards, shape), shape)
    assert not torch.equal(back["model.layers.0.mlp.gate_proj.weight"],
                           sd["model.layers.0.mlp.gate_proj.weight"])


def test_replica_mismatch_and_bad_tp_are_reported() -> None:
    _, sd, shape = _hf("qwen3-kv2-hd16-untied")
    shards = convert.hf_to_megatron(sd, shape, 2)
    shards[1]["decoder.final_layernorm.weight"] = shards[1]["decoder.final_layernorm.weight"] + 1
    assert convert.replica_mismatches(shards, shape) == ["decoder.final_layernorm.weight"]
    with pytest.raises(HarnessError, match="num_attention_heads = 8 not divisible by TP = 3"):
        convert.hf_to_megatron(sd, shape, 3)
    with pytest.raises(HarnessError, match="lacks"):
        convert.hf_to_megatron({}, shape, 1)


# --------------------------------------------------------------------------- real megatron


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def megatron_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A gloo world of one rank with the harness's role groups and CPU shims (undone after)."""
    pytest.importorskip("megatron.core")
    import torch.distributed as dist

    from harnesses.megatron import model as mm

    monkeypatch.setattr(torch.cuda, "current_device", torch.cuda.current_device)  # restored
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    try:
        groups = mm.role_groups(1, 0, 0, 60.0)
        mm.apply_group_shims()
        mm.apply_cpu_shims()
        yield groups
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name", ["qwen3-kv2-hd16-untied", "qwen3-critic", "llama-kv4-tied"])
def test_megatron_tp1_forward_matches_hf(megatron_world: Any, name: str) -> None:
    """Converted weights in megatron-core's GPTModel give the HF model's outputs.

    Tolerance 2e-5 absolute on logits of magnitude ~1: both sides run FP32 on the same
    weights; they differ only in summation order (fused QKV / fc1 GEMMs, RMSNorm and
    softmax kernels) and in RoPE angles of left-padded rows (Megatron rotates positions
    0..T-1, HF the position ids; relative angles agree). Measured: 3e-7 to 6e-7 on outputs up
    to 1.4. A layout error
    moves logits by O(1) (see the wrong-QKV case below).
    """
    from harnesses.megatron import model as mm

    hf_model, sd, shape = _hf(name)
    cfg = hf_model.config
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape.vocab, (3, 11), generator=g)
    am = torch.ones(3, 11, dtype=torch.long)
    am[1, :4] = 0  # left padding
    am[2, 9:] = 0  # right padding
    pos = (am.cumsum(1) - 1).clamp(min=0)
    model = mm.build_gpt(cfg, shape, megatron_world, bf16=False, cpu=True).eval()
    shards = convert.hf_to_megatron(sd, shape, 1)
    mm.load_shard(model, shards[0])  # strict: Megatron's parameter names == converter's
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos, attention_mask=mm.padding_mask(am))
        ref = hf_model(input_ids=ids, attention_mask=am, position_ids=pos).logits
    valid = am.bool()
    got = out[..., :ref.shape[-1]]
    err = float((got - ref).abs()[valid].max())
    print(f"\n[megatron] TP1 forward vs HF ({name}): max abs {err:.2e} "
          f"(outputs up to {float(ref.abs().max()):.2f})")
    assert err < 2e-5
    if shape.head == "lm":
        assert torch.equal(out[..., shape.vocab:], torch.zeros_like(out[..., shape.vocab:]))
        bad = _wrong_qkv(sd, shards, shape)
        mm.load_shard(model, bad[0])
        with torch.no_grad():
            wrong = model(input_ids=ids, position_ids=pos, attention_mask=mm.padding_mask(am))
        werr = float((wrong[..., :ref.shape[-1]] - ref).abs()[valid].max())
        print(f"[megatron] wrong QKV layout: max abs {werr:.2e}")
        assert werr > 100 * 2e-5


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_vocab_parallel_logprobs_entropy_exclude_padding(megatron_world: Any) -> None:
    """The harness's log-softmax on one shard = torch's over the true vocab, with gradients."""
    from harnesses.megatron import losses

    g = torch.Generator().manual_seed(3)
    vocab, padded = 11, 16
    logits = torch.randn(2, 5, padded, generator=g) * 3
    logits[..., vocab:] = 50.0  # padding columns must not count, whatever they hold
    logits.requires_grad_(True)
    targets = torch.randint(0, vocab, (2, 5), generator=g)
    lp, ent = losses.vocab_parallel_logprobs_entropy(
        logits, targets, vocab=vocab, tp_rank=0, group=megatron_world.tp_group, temperature=0.7)
    ref_logits = logits.detach()[..., :vocab].clone().requires_grad_(True)
    ref = torch.log_softmax(ref_logits / 0.7, dim=-1)
    ref_lp = ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    (lp.sum() + ent.sum()).backward()
    (ref_lp.sum() + ref_ent.sum()).backward()
    assert logits.grad is not None
    assert ref_logits.grad is not None
    torch.testing.assert_close(logits.grad[..., :vocab], ref_logits.grad)
    assert torch.equal(logits.grad[..., vocab:], torch.zeros(2, 5, padded - vocab))


def test_ppo_losses_follow_the_protocol() -> None:
    from qualify_harness import losses  # the Megatron harness's losses (the SDK's)

    lp = torch.tensor([[-1.0, -2.0, -0.5]])
    old = torch.tensor([[-1.2, -1.0, -0.5]])
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    mask = torch.tensor([[True, True, False]])
    ratio = torch.exp(lp - old)
    want = sum(max(-a * r, -a * min(max(r, 0.8), 1.2))
               for a, r in zip(adv[0, :2].tolist(), ratio[0, :2].tolist(), strict=True))
    assert float(losses.policy_loss_sum(lp, old, adv, mask, 0.2)) == pytest.approx(want)
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    torch.testing.assert_close(losses.kl_penalty(lp, ref, "k1"), lp - ref)
    torch.testing.assert_close(losses.kl_penalty(lp, ref, "k2"), 0.5 * (lp - ref) ** 2)
    torch.testing.assert_close(losses.kl_penalty(lp, ref, "k3"),
                               torch.exp(ref - lp) - (ref - lp) - 1)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        losses.kl_penalty(lp, ref, "k4")  # type: ignore[arg-type]
    v, v_old, ret = torch.tensor([[1.0, 0.0, 9.0]]), torch.tensor([[0.5, 0.1, 0.0]]), \
        torch.tensor([[2.0, -1.0, 0.0]])
    # token 0: unclipped (1-2)^2 = 1, clipped 0.5+0.2-2 -> 1.69 -> max 1.69; token 1:
    # unclipped 1, clipped (0.1-0.1+1)^2 = 1 -> 1
    assert float(losses.value_loss_sum(v, v_old, ret, mask, 0.2)) == pytest.approx(
        0.5 * (1.69 + 1.0))
