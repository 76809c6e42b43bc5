"""Protocol conventions: tensor names and the seeded per-parameter sample."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from qualify.protocol import (
    EXACT_PARAM_ELEMENTS,
    SAMPLED_PARAM_ELEMENTS,
    param_sample_indices,
    parse_tensor_name,
    tensor_name,
)


def test_small_parameters_are_exact() -> None:
    assert param_sample_indices("model.norm.weight", 64) is None
    assert param_sample_indices("lm_head.weight", EXACT_PARAM_ELEMENTS) is None


def test_large_parameters_get_a_fixed_seeded_sample() -> None:
    n = 49152 * 576
    idx = param_sample_indices("model.embed_tokens.weight", n)
    assert idx is not None
    assert idx.shape == (SAMPLED_PARAM_ELEMENTS,)
    assert idx.dtype == np.int64
    assert np.all(np.diff(idx) > 0)  # sorted and distinct
    assert idx[0] >= 0
    assert idx[-1] < n
    again = param_sample_indices("model.embed_tokens.weight", n)
    assert again is not None
    assert np.array_equal(idx, again)
    other = param_sample_indices("lm_head.weight", n)
    assert other is not None
    assert not np.array_equal(idx, other)


def test_sample_is_the_same_in_another_process() -> None:
    """Harness ranks and the reference run in other processes: the sample must not depend
    on the process (no PYTHONHASHSEED, no global RNG)."""
    code = ("from qualify.protocol import param_sample_indices as f;"
            "print(f('model.layers.0.mlp.up_proj.weight', 1536*576)[:5].tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    idx = param_sample_indices("model.layers.0.mlp.up_proj.weight", 1536 * 576)
    assert idx is not None
    assert out == str(idx[:5].tolist())


@pytest.mark.parametrize(("name", "parsed"), [
    ("round1/actor/logprobs", (1, "actor", "logprobs", None)),
    ("round2/critic/loss/value", (2, "critic", "loss/value", None)),
    ("round2/actor/grads/model.layers.0.self_attn.q_proj.weight",
     (2, "actor", "grads", "model.layers.0.self_attn.q_proj.weight")),
])
def test_tensor_names_round_trip(name: str, parsed: tuple[object, ...]) -> None:
    assert parse_tensor_name(name) == parsed
    r, role, metric, param = parsed
    if metric.startswith("loss/"):
        assert tensor_name(r, role, metric) == name
    else:
        assert tensor_name(r, role, metric, param) == name


@pytest.mark.parametrize("bad", ["actor/logprobs", "roundx/actor/logprobs", "round1/actor/loss"])
def test_bad_tensor_names(bad: str) -> None:
    with pytest.raises(ValueError, match="tensor"):
        parse_tensor_name(bad)
