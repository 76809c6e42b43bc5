"""The trainer-harness tests' shared inputs and checks.

Shared by ``test_torch_tp.py`` and ``test_deepspeed.py``: the tiny Qwen3 harness inputs,
the lock that lets pytest-xdist workers share one launch, the tensor names a complete
Actor / Critic part holds, and the worst error per metric family between two runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForTokenClassification

from qualify.contract import load_contract
from qualify.resources import contracts_dir

TINY: dict[str, Any] = {
    "vocab_size": 384, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}
"""A Qwen3 small enough for 2 CPU cores, with non-square shapes and 2 KV heads (TP 2)."""


def tiny_rollout(prompts_l: Sequence[Sequence[int]], response_lengths: Sequence[int], r: int,
                 g: torch.Generator) -> dict[str, torch.Tensor]:
    """A frozen-rollout dict: the prompts left-padded, response ``i`` of
    ``response_lengths[i]`` random ids in ``r`` columns (EOS last when shorter), masks,
    positions, behavior logprobs; draws from ``g`` in a fixed order.
    """
    b, p_len = len(prompts_l), max(map(len, prompts_l))
    prompts = torch.zeros(b, p_len, dtype=torch.long)
    responses = torch.zeros(b, r, dtype=torch.long)
    am = torch.zeros(b, p_len + r, dtype=torch.long)
    rmask = torch.zeros(b, r, dtype=torch.long)
    for i, (p, n) in enumerate(zip(prompts_l, response_lengths, strict=True)):
        prompts[i, p_len - len(p):] = torch.tensor(list(p))
        toks = torch.randint(3, TINY["vocab_size"], (n,), generator=g)
        if n < r:
            toks[-1] = 2  # EOS
        responses[i, :n] = toks
        rmask[i, :n] = 1
        am[i, p_len - len(p):p_len + n] = 1
    return {"prompts": prompts, "responses": responses, "attention_mask": am,
            "position_ids": (am.cumsum(1) - 1).clamp(min=0), "response_mask": rmask,
            "behavior_logprobs": -torch.rand(b, r, generator=g) * rmask,
            "eos_terminated": torch.tensor([int(n < r) for n in response_lengths]),
            "group_index": torch.arange(b)}


def build_inputs(root: Path, response_lengths: Sequence[int], r: int) -> None:
    """Harness inputs under ``root``: tiny Qwen3 actor and critic (seeded), a rollout of
    ``len(response_lengths)`` sequences (the contract's prompts, repeated as needed;
    response ``i`` has ``response_lengths[i]`` tokens of ``r`` columns, ending in EOS when
    shorter), train inputs, ``contract.json``, ``model.json`` and ``params.json``.
    """
    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    cfg = Qwen3Config(**TINY, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, max_position_embeddings=128)
    torch.manual_seed(1234)
    actor = Qwen3ForCausalLM(cfg)
    critic_cfg = {k: v for k, v in cfg.to_dict().items() if k not in ("id2label", "label2id")}
    # num_labels goes to PreTrainedConfig via @strict's **kwargs; mypy sees only the fields.
    critic = Qwen3ForTokenClassification(Qwen3Config(**critic_cfg, num_labels=1))  # type: ignore[call-arg]
    critic.model.load_state_dict(actor.model.state_dict())
    actor.save_pretrained(root / "actor")
    critic.save_pretrained(root / "critic")
    g = torch.Generator().manual_seed(7)
    prompts_l = [list(p) for p in contract.prompts.token_ids or ()]
    n_seq = len(response_lengths)
    rollout = tiny_rollout((prompts_l * -(-n_seq // len(prompts_l)))[:n_seq],
                           response_lengths, r, g)
    b, rmask = n_seq, rollout["response_mask"]
    train = {"advantages": torch.randn(b, r, generator=g) * rmask,
             "returns": torch.randn(b, r, generator=g) * rmask}
    save_file(rollout, str(root / "rollout.safetensors"))
    save_file(train, str(root / "train_inputs.safetensors"))
    (root / "contract.json").write_text(json.dumps(contract.to_dict()))
    (root / "model.json").write_text(json.dumps({
        "actor_dir": str(root / "actor"), "critic_dir": str(root / "critic"),
        "ref_dir": str(root / "actor")}))
    (root / "params.json").write_text(json.dumps({
        "actor": [n for n, _ in actor.named_parameters()],
        "critic": [n for n, _ in critic.named_parameters()]}))


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock shared by pytest-xdist workers (``fcntl.flock``)."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def role_tensors(t: dict[str, torch.Tensor], role: str) -> dict[str, torch.Tensor]:
    """The tensors ``round<r>/<role>/...`` of ``t``."""
    return {k: v for k, v in t.items() if k.split("/")[1] == role}


def family_errors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                  mask: torch.Tensor) -> dict[str, float]:
    """Worst error per metric family of ``a`` against ``b`` (the same names).

    Per-token ``[B, R]`` tensors: max abs over valid tokens (``mask``, ``[B, R]`` bool);
    scalars: abs; ``grads`` / ``exp_avg`` / ``exp_avg_sq`` / ``updates``: relative L2 per
    parameter (absolute where ``b`` is all zero). FP64.
    """
    assert a.keys() == b.keys()
    out: dict[str, float] = {}
    for k, va in a.items():
        fam = k.split("/")[2]
        x, y = va.double(), b[k].double()
        if fam in ("grads", "exp_avg", "exp_avg_sq", "updates"):
            n = float(y.norm())
            e = float((x - y).norm()) / n if n > 0 else float((x - y).norm())
        elif x.ndim == 2:
            e = float((x - y).abs()[mask].max())
        else:
            e = float((x - y).abs().max())
        out[fam] = max(out.get(fam, 0.0), e)
    return out


def expected_names(role: str, params: list[str]) -> set[str]:
    """Every tensor name a two-round trainer part of ``role`` must hold (docs/engine-guide.md)."""
    per_token = ("logprobs", "entropy") if role == "actor" else ("values",)
    terms = ("policy", "kl", "entropy", "total") if role == "actor" else ("value", "total")
    names = {f"round1/{role}/{per_token[0]}_padded"}
    if role == "actor":  # the initial weights' distributions (V = 384: the full path)
        names |= {"round1/actor/prefill_raw", "round1/actor/prefill_tempered",
                  "round1/actor/prefill_top_logit"}
    for r in (1, 2):
        names |= {f"round{r}/{role}/{m}" for m in (*per_token, "grad_norm", "clip_coef")}
        names |= {f"round{r}/{role}/loss/{t}" for t in terms}
        names |= {f"round{r}/{role}/{fam}/{p}" for fam in
                  ("grads", "exp_avg", "exp_avg_sq", "updates") for p in params}
    return names


def warm_command(target: str, nproc: int, log_dir: Path, *args: str,
                 preload: Sequence[str] = ()) -> list[str]:
    """The command line that starts ``nproc`` ranks of ``target`` (a test script or module)
    with qualify's CPU launcher (:mod:`qualify.candidate.warm`), as ``torchrun
    --nproc-per-node nproc target args`` would; every rank's logs go under ``log_dir``."""
    import sys

    pre = [a for m in preload for a in ("--preload", m)]
    return [sys.executable, "-m", "qualify.candidate.warm", "--nproc-per-node", str(nproc),
            "--log-dir", str(log_dir), *pre, target, *args]


def rank_stderr(log_dir: Path, chars: int = 3000) -> str:
    """The tail of every rank's ``stderr.log`` under ``log_dir`` (a failed launch's message)."""
    return "\n".join(f"{p}:\n{p.read_text(errors='replace')[-chars:]}"
                     for p in sorted(log_dir.rglob("stderr*")))
