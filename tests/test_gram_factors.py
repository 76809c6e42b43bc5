"""The factored clip-branch Gram (:mod:`qualify.reference.gram_factors`) equals the FP64 one.

At round 2 of a real reference update of tiny Qwen3 models (Actor with a separate and with a
tied head, the SmolLM2 case; Critic), five tokens' ``J_t`` rebuilt from their backward
factors give every ``<J_s, J_t>`` of the FP64 Gram over the whole ``J_t`` to FP32 rounding,
and the rebuilt ``|J_t|^2`` and ``<g, J_t>`` are autograd's to FP32 rounding: within 1e-5 of
``|J_s||J_t|`` and of the Gram's scale, the bound ``tests/test_branch_gram.py`` holds the
forward-mode Gram to (the products are FP32 sums of up to 65,536 terms, measured 4.3e-6 at
most here). The check can fail: a weight read by code the hooks do not see (the tied head's
Embedding use hidden from the capture) is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import test_branch_gram
import torch
from tiny_models import seeded_qwen3

from qualify import atomic, branches
from qualify.contract import Contract
from qualify.errors import ReferenceDataError
from qualify.reference import gram, gram_factors
from qualify.reference.jacobian import token_gradients
from qualify.reference.update import Batch, UpdateSettings, run_actor, run_critic

torch.set_num_threads(1)

CFG, TOKENS = test_branch_gram.CFG, test_branch_gram.TOKENS
contract, batch = test_branch_gram.contract, test_branch_gram.batch  # module fixtures


def _model(kind: str) -> torch.nn.Module:
    return seeded_qwen3("critic" if kind == "critic" else "actor", CFG,
                        tie_word_embeddings=kind == "actor-tied")


def _round2(kind: str, contract: Contract, batch: Batch,
            seal: Callable[[torch.nn.Module, Batch], dict[str, Any]]) -> dict[str, Any]:
    """Run the reference update and call ``seal(master, batch)`` at round 2."""
    settings = UpdateSettings(precision="fp32", micro_batch_size=2)
    seen: dict[str, Any] = {}

    def hook(round_: int, work: torch.nn.Module, master: torch.nn.Module, b: Batch,
             old: torch.Tensor) -> None:
        if round_ == 2:
            seen.update(seal(master, b))

    model = _model(kind)
    if kind == "critic":
        run_critic(model, batch, contract, settings, on_round=hook)
    else:
        run_actor(model, copy.deepcopy(model), batch, contract, settings, on_round=hook)
    return seen


def _seal(contract: Contract, role: str, hide: str | None = None, spill: Path | None = None
          ) -> Callable[[torch.nn.Module, Batch], dict[str, Any]]:
    settings = UpdateSettings(precision="fp32", micro_batch_size=2)

    def seal(master: torch.nn.Module, b: Batch) -> dict[str, Any]:
        names = [n for n, p in master.named_parameters() if p.requires_grad]
        cap = gram_factors.FactorCapture(master, names, spill=spill)
        if hide is not None:  # a use the hooks do not see (the refusal test)
            cap._uses[hide] = [u for u in cap._uses[hide] if u.kind != "embedding"]
        grad = {n: (p.grad if p.grad is not None else torch.zeros_like(p))
                for n, p in master.named_parameters() if p.requires_grad}
        full, norm_sq, dots = {}, {}, {}
        with cap.hooks():
            for tok, c in token_gradients(master, master, b, contract, settings, role=role,
                                          tokens=TOKENS):
                key = branches.token_key(*tok)
                full[key] = c
                norm_sq[key] = sum(float(v.double().square().sum()) for v in c.values())
                dots[key] = sum(float((grad[n].double() * v.double()).sum())
                                for n, v in c.items())
                cap.take(key, c)
        out: dict[str, Any] = {"exact": gram.exact_gram(full, norm_sq),
                               "norm": {k: v ** 0.5 for k, v in norm_sq.items()},
                               "uncovered": cap.uncovered, "dots": dots}
        try:
            out["factored"], out["err"] = cap.gram(norm_sq, dots, grad)
        except ReferenceDataError as e:
            out["refused"] = str(e)
        return out
    return seal


@pytest.mark.parametrize(("kind", "spilled", "pad"), [
    ("actor", True, False), ("actor-tied", True, False), ("actor-tied", False, False),
    ("actor-tied", True, True), ("critic", True, False)])
def test_factored_gram_equals_the_fp64_gram(contract: Contract, batch: Batch, kind: str,
                                            spilled: bool, pad: bool, tmp_path: Path) -> None:
    """Spilled: the output gradients written to disk per token and module (the reference
    stage's way); in memory: the same Gram from the same factors. ``pad``: the pad id (the
    Embedding's ``padding_idx``, whose row autograd leaves without gradient) sampled as a
    real, attended token before sealed tokens of two sequences."""
    role = "critic" if kind == "critic" else "actor"
    if pad:
        prompts = batch.prompts.clone()
        prompts[0, 3] = prompts[3, 1] = batch.pad_token_id  # attention_mask stays 1 there
        batch = dataclasses.replace(batch, prompts=prompts)
        assert int(batch.attention_mask[0, 3]) == int(batch.attention_mask[3, 1]) == 1
    seen = _round2(kind, contract, batch,
                   _seal(contract, role, spill=tmp_path if spilled else None))
    if spilled:  # one directory per token, one file per module that got a gradient
        dirs = sorted(d.name for d in tmp_path.iterdir())
        assert dirs == sorted(seen["exact"])
        assert all(any(d.glob("*.safetensors")) for d in tmp_path.iterdir())
    assert "refused" not in seen, seen.get("refused")
    exact, fact, norm = seen["exact"], seen["factored"], seen["norm"]
    assert len(exact) == len(TOKENS)
    # only the RMSNorm vectors are kept whole; every matrix is rebuilt from factors
    assert seen["uncovered"]
    assert all(n.endswith("norm.weight") for n in seen["uncovered"])
    assert any(abs(d) > 0.0 for d in seen["dots"].values())  # the g row is checked
    assert 0.0 <= seen["err"] < 1e-5
    off = [abs(exact[a][b]) / (norm[a] * norm[b]) for a in exact for b in exact if a != b]
    assert max(off) > 1e-3  # the off-diagonal is not trivially zero
    for a in exact:  # the diagonal is the exact |J_t|^2 by construction; seen["err"] checks
        for b in exact:  # the rebuilt one against it
            if a != b:
                assert abs(fact[a][b] - exact[a][b]) <= 1e-5 * norm[a] * norm[b], (a, b)


def test_a_weight_read_outside_the_hooks_is_refused(contract: Contract,
                                                    batch: Batch) -> None:
    """The tied head's weight, with its Embedding use hidden from the capture: the rebuilt
    ``J_t`` miss the embedding rows, their diagonal no longer matches autograd's ``|J_t|^2``
    and the Gram is refused."""
    seen = _round2("actor-tied", contract, batch,
                   _seal(contract, "actor", hide="model.embed_tokens.weight"))
    assert "factored clip-branch Gram" in seen["refused"]
    assert "exceeds" in seen["refused"]


def test_factor_bytes_counts_every_linear_and_embedding() -> None:
    """Inputs once per sequence (one forward each), output gradients once per token (plus one
    token's whole while it is filed) with an int64 row index per module."""
    model = _model("actor-tied")
    h, i, v, layers = CFG["hidden_size"], CFG["intermediate_size"], CFG["vocab_size"], 2
    q, kv = CFG["num_attention_heads"] * CFG["head_dim"], CFG["num_key_value_heads"] * 32
    width_in = layers * (3 * h + q + 2 * h + i) + h + 2  # + lm_head + the embedding's ids
    width_out = layers * (q + 2 * kv + h + 2 * i + h) + v + h
    modules = layers * 7 + 2
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert gram_factors.factor_bytes(model, 3, 2, 10) == (
        10 * (4 * 2 * width_in + 4 * 4 * width_out + 8 * 3 * modules) + 4 * 3 * norms)


def test_a_killed_stages_spill_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    """A SIGKILLed reference stage leaves its spill (up to ``BUDGET_BYTES``): the next one
    removes it. A running writer's spill, another host's and a name without a writer stay."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          check=True, capture_output=True, text=True).stdout.strip()
    name, host = gram_factors.SPILL_NAME, atomic.host_tag()
    dead = tmp_path / f".tmp-{name}.{host}.{gone}.abc.partial"
    live = tmp_path / f"{atomic.temp_prefix(name)}xyz.partial"
    elsewhere = tmp_path / f".tmp-{name}.another-host.{gone}.abc.partial"
    other = tmp_path / f"{name}-notapid"
    for d in (dead, live, elsewhere, other):
        (d / "tok").mkdir(parents=True)
        (d / "tok" / "lm_head.safetensors").write_bytes(b"x" * 64)
    with gram_factors.spill_directory(tmp_path) as spill:
        assert Path(spill).name.startswith(atomic.temp_prefix(name))
        assert not dead.exists()
        assert live.is_dir()
        assert elsewhere.is_dir()
        assert other.is_dir()
    assert not Path(spill).exists()
