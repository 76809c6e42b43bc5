"""Which per-parameter statistics are exact and which estimated, and how far off an estimate is.

A per-parameter family (grads, exp_avg, exp_avg_sq, updates) is stored whole for a
parameter of at most ``exact_elements`` elements, else as a seeded simple random sample
without replacement of ``sample_elements`` of its flattened values
(:class:`qualify.protocol.ParamSampling`). The same elements are stored on every side, so
the relative L2 error ``||a_s - b_s|| / ||b_s||`` of a sampled parameter is a like-for-like
*estimate* of the whole parameter's ``||a - b|| / ||b||``; of a whole one it is exact.

:func:`sampling_summary` writes that down per cell (``outputs.json`` ``param_sampling``).
:func:`rel_l2_halfwidth` gives the estimate's approximate error bound from the sample
itself: with ``u_i = (a_i - b_i)^2`` and ``v_i = b_i^2`` over the ``n`` sampled of ``N``
elements, the ratio estimator ``R = sum u / sum v`` of ``||a - b||^2 / ||b||^2`` has
relative standard error ``sqrt((1 - n/N) / n) * sd(u - R v) / mean(u)`` (Cochran,
*Sampling Techniques*, 3rd ed. 1977, section 6.3, eq. 6.9, with the finite-population
correction ``1 - n/N`` of section 2.5); ``sqrt(R)``, the relative L2 error, has half of
it (first-order delta method). The half-width is ``z`` standard errors. It is a
large-sample approximation: a parameter whose difference sits in a few elements outside
the sample is not seen by any sample, which is why ``exact_elements`` should cover the
parameters where that matters. A vocab-indexed parameter (``model.embed_tokens.weight``,
``lm_head.weight``) also stores whole the rows of every token id of the rollout
(``ParamSampling.rows``, :func:`rollout_sampling`), so a difference confined to one token's
row is measured, not estimated; its stored elements are then the sample and those rows, and
the summary's ``se_factor`` (the simple-random-sample formula at that size) only
approximates them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from qualify.protocol import PER_PARAM_METRICS, ParamSampling

__all__ = ["DEFAULT_Z", "rel_l2_halfwidth", "rollout_sampling", "sampling_summary",
           "standard_error_factor"]

DEFAULT_Z: Final = 3.0
"""Standard errors in :func:`rel_l2_halfwidth` (about 99.7 % two-sided, normal approximation)."""


def rollout_sampling(sampling: ParamSampling, inputs: Path) -> ParamSampling:
    """``sampling`` with the rows of every token id of a staged rollout (``cell.json``).

    The ids are every entry of ``inputs/rollout.safetensors`` ``prompts`` and ``responses``
    (pad columns included), the vocabulary the actor's ``config.json`` ``vocab_size``
    (``inputs/model.json`` ``actor_dir``): :meth:`ParamSampling.with_rows`, the same rows
    the reference stores (:func:`qualify.reference.update.run_actor` / ``run_critic``).

    Raises:
        ValueError: a token id outside the vocabulary.
        OSError: a file is missing; KeyError: a field is missing.
    """
    from safetensors.numpy import load_file

    tensors = load_file(str(inputs / "rollout.safetensors"))
    model = json.loads((inputs / "model.json").read_text("utf-8"))
    config = json.loads((Path(str(model["actor_dir"])) / "config.json").read_text("utf-8"))
    ids = np.concatenate([tensors["prompts"].reshape(-1), tensors["responses"].reshape(-1)])
    return sampling.with_rows(ids, int(config["vocab_size"]))


def standard_error_factor(numel: int, stored: int) -> float:
    """``sqrt((1 - n/N) / n)``: the data-free part of a sampled statistic's standard error.

    Args:
        numel: ``N``, the parameter's elements.
        stored: ``n``, the sampled elements (``1 <= n <= N``).

    Returns:
        The factor (0 when the whole parameter is stored).

    Raises:
        ValueError: ``n`` outside ``[1, N]``.
    """
    if not 1 <= stored <= numel:
        raise ValueError(f"stored {stored} must be in [1, numel = {numel}]")
    return math.sqrt((1.0 - stored / numel) / stored)


def sampling_summary(sampling: ParamSampling, numels: Mapping[str, int],
                     stored: Mapping[str, int]) -> dict[str, Any]:
    """The ``param_sampling`` record of one cell: what is exact, what is estimated.

    Args:
        sampling: the contract's sampling.
        numels: ``{HF parameter name: elements of the parameter}`` (from the model).
        stored: ``{HF parameter name: elements stored}`` (from the cell's tensors).

    Returns:
        ``{"exact_elements", "sample_elements", "families", "exact": [names whose
        statistics are exact], "sampled": {name: {"numel", "stored", "fraction",
        "se_factor"}}, "unknown": [stored parameters the model does not name]}``.
    """
    exact: list[str] = []
    sampled: dict[str, dict[str, Any]] = {}
    unknown: list[str] = []
    for name in sorted(stored):
        n_all, n = numels.get(name), int(stored[name])
        if n_all is None:
            unknown.append(name)
        elif n >= n_all:
            exact.append(name)
        else:
            sampled[name] = {"numel": int(n_all), "stored": n, "fraction": n / n_all,
                             "se_factor": standard_error_factor(int(n_all), n)}
    return {"exact_elements": sampling.exact_elements,
            "sample_elements": sampling.sample_elements,
            "families": list(PER_PARAM_METRICS), "exact": exact, "sampled": sampled,
            "unknown": unknown}


def rel_l2_halfwidth(obtained: npt.ArrayLike, expected: npt.ArrayLike, numel: int,
                     z: float = DEFAULT_Z) -> float:
    """Approximate ``z``-standard-error half-width of a sampled relative L2 error.

    Args:
        obtained: ``[n]`` the candidate's sampled values (any float dtype).
        expected: ``[n]`` the reference's values at the same indices.
        numel: ``N``, the whole parameter's elements.
        z: standard errors (default :data:`DEFAULT_Z`).

    Returns:
        The half-width in units of the relative L2 error itself (0 for an exact parameter,
        ``n = N``, or a zero difference; ``inf`` when ``||b_s|| = 0`` but not ``||a_s - b_s||``).
        Formula: module docstring (Cochran 1977, eq. 6.9).

    Raises:
        ValueError: shapes differ, or ``n`` outside ``[1, N]``.
    """
    a = np.asarray(obtained, dtype=np.float64).reshape(-1)
    b = np.asarray(expected, dtype=np.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    factor = standard_error_factor(numel, a.size)
    u, v = (a - b) ** 2, b**2
    if factor == 0.0 or not u.any():
        return 0.0
    if not v.any():
        return math.inf
    ratio = u.sum() / v.sum()
    rel_se = factor * float(np.std(u - ratio * v, ddof=1 if a.size > 1 else 0)) / float(u.mean())
    return z * 0.5 * rel_se * math.sqrt(ratio)

