"""Size model of qualify evidence (docs/evidence-size.md): bytes per cell and per reference.

``python scripts/evidence_size.py`` prints, for tiny-qwen3, SmolLM2-135M and Qwen3-8B, the
per-parameter bytes of one cell, one reference update file and one sealed clip-branch token
under a contract's ``[evidence]`` sampling (:class:`qualify.protocol.ParamSampling`), from
the models' parameter shapes (the contracts' ``[model.config]``) and the measured per-tensor
overheads of tiny-qwen3 (docs/evidence-size.md). Only shapes are used; nothing is loaded.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from dataclasses import dataclass

ROUNDS = 2
FAMILIES = 4  # grads, exp_avg, exp_avg_sq, updates
F32 = 4
HEADER_PER_TENSOR = 121  # measured on tiny-qwen3: safetensors JSON entry + name, bytes per tensor


@dataclass(frozen=True)
class Shape:
    """What fixes a Qwen3 / Llama-style model's parameter shapes."""

    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qk_norm: bool

    def params(self, role: str) -> Iterator[int]:
        """Element counts of every trained parameter of ``role`` (actor or critic)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        yield self.vocab * h  # embed_tokens
        for _ in range(self.layers):
            yield from (h * q, h * kv, h * kv, q * h, h * self.inter, h * self.inter,
                        self.inter * h, h, h)
            if self.qk_norm:
                yield from (self.head_dim, self.head_dim)
        yield h  # final norm
        if role == "actor" and not self.tied:
            yield self.vocab * h  # lm_head
        if role == "critic":
            yield from (h, 1)  # score weight and bias


MODELS = {
    "tiny-qwen3": Shape(384, 64, 160, 2, 4, 2, 32, tied=False, qk_norm=True),
    "smollm2-135m": Shape(49152, 576, 1536, 30, 9, 3, 64, tied=True, qk_norm=False),
    "qwen3-8b": Shape(151936, 4096, 12288, 36, 32, 8, 128, tied=False, qk_norm=True),
}


def stored(shape: Shape, role: str, exact: int, sample: int) -> tuple[int, int]:
    """``(elements stored, parameters)`` of one per-parameter family, one round."""
    ps = list(shape.params(role))
    return sum(n if n <= exact else sample for n in ps), len(ps)


def role_bytes(shape: Shape, role: str, exact: int, sample: int) -> int:
    """Per-parameter bytes of one role's outputs (a cell, or half a reference file)."""
    n, p = stored(shape, role, exact, sample)
    return ROUNDS * FAMILIES * (n * F32 + p * HEADER_PER_TENSOR)


def main() -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sampling", nargs="*", default=["32768:16384", "4096:1024", "1024:1024",
                                                       "256:256"],
                    help="EXACT:SAMPLE pairs")
    args = ap.parse_args()
    print("model         E:S            params  actor cell  critic cell  ref file  J_t token")
    for name, shape in MODELS.items():
        total = sum(shape.params("actor"))
        for pair in args.sampling:
            e, s = (int(x) for x in pair.split(":"))
            a, c = role_bytes(shape, "actor", e, s), role_bytes(shape, "critic", e, s)
            tok = stored(shape, "actor", e, s)[0] * F32
            print(f"{name:13} {pair:13} {total / 1e6:8.2f}M {a / 1e6:10.2f}MB "
                  f"{c / 1e6:10.2f}MB {(a + c) / 1e6:8.2f}MB {tok / 1e6:8.3f}MB")


if __name__ == "__main__":
    main()
