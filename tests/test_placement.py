"""Whole layers per device (:mod:`qualify.reference.placement`), on CPU."""

from __future__ import annotations

import copy
import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import THREE_LAYER_CFG, seeded_qwen3

from qualify.reference.placement import (
    assign_layers,
    device_loads,
    layer_bytes,
    parameter_counts,
    place_for_devices,
    place_model,
    stage_assignment,
)
from qualify.reference.plan import stage_layer_counts
from qualify.reference.plan_core import ModelShape

CFG = THREE_LAYER_CFG


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=0, max_size=6),
       st.lists(st.one_of(st.integers(0, 80), st.just(math.inf)), min_size=1, max_size=4),
       st.integers(0, 30), st.integers(0, 30))
def test_assignment_is_the_lightest_contiguous_one_under_the_caps(
        layers: list[int], caps: list[float], first: int, last: int) -> None:
    """Against brute force over every contiguous, in-order assignment (embedding on the
    first device, head with the last layer): it fits the caps, its fullest device is as light
    as the best one, and it is refused exactly when none fits."""
    n, d = len(layers), len(caps)
    best = math.inf
    for a in itertools.combinations_with_replacement(range(d), n):
        loads = device_loads(layers, a, d, first=first, last=last)
        if all(x <= c for x, c in zip(loads, caps, strict=True)):
            best = min(best, max(loads))
    if best == math.inf:
        with pytest.raises(ValueError, match=r"does not fit|do not fit"):
            assign_layers(layers, caps, first=first, last=last)
        return
    got = assign_layers(layers, caps, first=first, last=last)
    assert len(got) == n
    assert list(got) == sorted(got)
    loads = device_loads(layers, got, d, first=first, last=last)
    assert all(x <= c for x, c in zip(loads, caps, strict=True))
    assert max(loads) == best


def _model(role: str) -> torch.nn.Module:
    return seeded_qwen3(role, CFG)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_placed_model_is_bitwise_the_unplaced_one(role: str) -> None:
    """Placed across three devices (all ``cpu``: the CUDA path has not run on a GPU), the
    forward outputs and every parameter's gradient are bitwise those of the unplaced model,
    the hooks run once per placed module per forward, and the bytes add up."""
    plain = _model(role)
    placed = copy.deepcopy(plain)
    layers, first, last = layer_bytes(placed)
    total = sum(p.numel() * p.element_size() for p in placed.parameters()) + sum(
        b.numel() * b.element_size() for b in placed.buffers())
    assert sum(layers) + first + last == total
    assignment = assign_layers(layers, [math.inf] * 3, first=first, last=last)
    assert len(set(assignment)) > 1
    handles = place_model(placed, ["cpu", "cpu", "cpu"], assignment)
    heads = [n for n, _ in placed.named_children() if n != "model"]  # lm_head; dropout, score
    # backbone, embedding, rotary, layers, norm, heads; the logits' way back
    assert len(handles) == 1 + 2 + CFG["num_hidden_layers"] + 1 + len(heads) + 1
    calls: list[str] = []
    for name, mod in placed.named_modules():
        if name.startswith("model.layers.") and name.count(".") == 2:
            mod.register_forward_pre_hook(lambda m, a, _n=name: calls.append(_n))
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 96, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.int64)
    mask[1, :3] = 0
    outs = []
    for m in (plain, placed):
        m.zero_grad()
        torch.manual_seed(5)  # the critic's classifier dropout draws the same mask
        y = m(input_ids=ids, attention_mask=mask, use_cache=False).logits
        (y.float().square().sum() * 1e-3).backward()
        outs.append((y.detach(), {n: p.grad.clone() for n, p in m.named_parameters()
                                  if p.grad is not None}))
    assert torch.equal(outs[0][0], outs[1][0])
    assert outs[0][1].keys() == outs[1][1].keys()
    assert outs[0][1]
    for n, gr in outs[0][1].items():
        assert torch.equal(gr, outs[1][1][n]), n
    assert len(calls) == CFG["num_hidden_layers"]
    with pytest.raises(ValueError, match="one device index"):
        place_model(copy.deepcopy(plain), ["cpu"], [0, 1, 0])


def _shape(tied: bool) -> ModelShape:
    return ModelShape(model_type="qwen3", vocab_size=CFG["vocab_size"],
                      hidden_size=CFG["hidden_size"],
                      intermediate_size=CFG["intermediate_size"],
                      num_hidden_layers=CFG["num_hidden_layers"],
                      num_attention_heads=CFG["num_attention_heads"],
                      num_key_value_heads=CFG["num_key_value_heads"], head_dim=CFG["head_dim"],
                      tie_word_embeddings=tied)


@pytest.mark.parametrize(("role", "tied"), [("actor", False), ("actor", True),
                                             ("critic", False)])
def test_plan_counts_the_elements_the_stage_places(role: str, tied: bool) -> None:
    """``qualify plan``'s per-layer, embedding and head element counts (from the contract's
    shapes) are those the stage's placement counts on the loaded model, so both take the same
    assignment from :func:`stage_assignment` at every device count."""
    model = seeded_qwen3(role, CFG, tie_word_embeddings=tied)
    got = parameter_counts(model)
    assert got == stage_layer_counts(_shape(tied), role)
    assert sum(got[0]) + got[1] + got[2] == sum(p.numel() for p in model.parameters())
    for n in range(1, 6):
        a = stage_assignment(*got, n)
        assert a == assign_layers(got[0], [math.inf] * n, first=got[1], last=got[2])


@pytest.mark.parametrize("first", ["cpu", "meta"])
@pytest.mark.parametrize(("role", "tied"), [("actor", False), ("actor", True),
                                             ("critic", False)])
def test_each_module_lands_on_its_device(role: str, tied: bool, first: str) -> None:
    """With a second device kind (``meta``: placement only, no forward), every parameter
    lies where the assignment puts its module: the embedding on the first device, each
    layer on its own, the norm and the head with the last layer, a tied head with the
    embedding and still tied (on CUDA ``Module.to`` moves a shared weight in place, so the
    old placement of the head with the last layer took the embedding's weight away from it;
    to ``meta`` it makes the moved module a new ``Parameter``: the head would train apart)."""
    model = seeded_qwen3(role, CFG, tie_word_embeddings=tied)
    devs = [first, "meta" if first == "cpu" else "cpu"]
    assignment = place_for_devices(model, devs)
    assert assignment is not None
    assert assignment[0] == 0
    assert assignment[-1] == 1
    backbone: Any = model.get_submodule("model")
    assert backbone.embed_tokens.weight.device.type == devs[0]
    for layer, a in zip(backbone.layers, assignment, strict=True):
        assert {p.device.type for p in layer.parameters()} == {devs[a]}
    assert backbone.norm.weight.device.type == devs[1]
    head: Any = model.lm_head if role == "actor" else model.score
    assert head.weight.device.type == devs[0 if tied else 1]
    if tied:
        assert head.weight is backbone.embed_tokens.weight
