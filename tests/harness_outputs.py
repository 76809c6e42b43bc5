"""What the trainer-harness tests check in a harness's ``outputs.safetensors``.

Shared by ``test_torch_tp.py`` and ``test_deepspeed.py``: the tensor names a complete
Actor / Critic part holds, and the worst error per metric family between two runs.
"""

from __future__ import annotations

import torch


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
    """Every tensor name a two-round trainer part of ``role`` must hold (DESIGN.md section 6)."""
    per_token = ("logprobs", "entropy") if role == "actor" else ("values",)
    terms = ("policy", "kl", "entropy", "total") if role == "actor" else ("value", "total")
    names = {f"round1/{role}/{per_token[0]}_padded"}
    for r in (1, 2):
        names |= {f"round{r}/{role}/{m}" for m in (*per_token, "grad_norm", "clip_coef")}
        names |= {f"round{r}/{role}/loss/{t}" for t in terms}
        names |= {f"round{r}/{role}/{fam}/{p}" for fam in
                  ("grads", "exp_avg", "exp_avg_sq", "updates") for p in params}
    return names
