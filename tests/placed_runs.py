"""The reference's Actor and Critic update runs on placed ``cpu`` devices, and their comparison.

Shared by the tests of the host AdamW state (``tests/test_host_state.py``), gradient
streaming (``tests/test_grad_stream.py``) and the ``g1`` round 2 (``tests/test_round2_g1.py``):
each runs the same seeded three-layer tiny Qwen3 Actor (its reference policy a second copy)
and Critic on the same batch under one :class:`qualify.reference.devices.ReferenceDevices`,
and compares two such runs tensor for tensor.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from tiny_models import THREE_LAYER_CFG, seeded_batch, seeded_qwen3

from qualify.contract import Contract, load_contract
from qualify.reference import devices, update
from qualify.reference.update import Batch, UpdateSettings
from qualify.resources import contracts_dir


def tiny_contract() -> Contract:
    """The default contract (its algorithm and optimizer drive the runs)."""
    return load_contract(contracts_dir() / "tiny-qwen3.toml")


def placed_update_runs(placed: devices.ReferenceDevices, precision: str,
                       mode: str = "params") -> tuple[Any, ...]:
    """``(actor tensors, critic tensors, actor meta, critic meta, the devices' record)``.

    Args:
        placed: the devices and their choices (state, gradients, round-2 state).
        precision: ``fp32``, ``bf16`` or ``fp64`` (FP64 copies of the seeded models).
        mode: the BF16 style (:class:`qualify.reference.update.UpdateSettings`).
    """
    contract = tiny_contract()
    settings = UpdateSettings(precision=precision,  # type: ignore[arg-type]
                              bf16_mode=mode, micro_batch_size=2)  # type: ignore[arg-type]
    with devices.active(placed) as record:
        models = []
        for role in ("actor", "actor", "critic"):
            m = seeded_qwen3(role, THREE_LAYER_CFG)
            models.append(devices.place(m.double() if precision == "fp64" else m, role))
        batch = cast(Batch, seeded_batch(96, short={0: 4}, masked_targets=False))
        actor, meta_a = update.run_actor(models[0], models[1], batch, contract, settings)
        critic, meta_c = update.run_critic(models[2], batch, contract, settings)
    return actor, critic, meta_a, meta_c, record


def assert_same_runs(a: tuple[Any, ...], b: tuple[Any, ...], *, must_have: str) -> None:
    """Every tensor of both roles equal in dtype and value, and both metas equal.

    ``must_have``: a substring some tensor name of each role must hold (the comparison
    covers what the test is about).
    """
    for x, y in zip(a[:2], b[:2], strict=True):
        assert x.keys() == y.keys()
        assert any(must_have in k for k in x), must_have
        for k in x:
            assert x[k].dtype == y[k].dtype, k
            assert torch.equal(x[k], y[k]), k
    assert a[2] == b[2]
    assert a[3] == b[3]


class EnteredError(Exception):
    """Raised by :func:`spy_on_entered_devices`'s spy once the stage enters its devices."""


def spy_on_entered_devices(monkeypatch: Any) -> list[devices.ReferenceDevices | None]:
    """Stop the reference stage where it enters its devices; the list gets what it entered.

    ``monkeypatch``: pytest's fixture; :func:`qualify.reference.devices.active` raises
    :class:`EnteredError` after appending its argument.
    """
    seen: list[devices.ReferenceDevices | None] = []

    def spy(d: devices.ReferenceDevices | None) -> Any:
        seen.append(d)
        raise EnteredError

    monkeypatch.setattr(devices, "active", spy)
    return seen
