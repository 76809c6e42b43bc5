"""Per-layer gradient streaming of the reference update (``gradients = "host"``).

:class:`qualify.reference.update._GradStream` moves each parameter's gradient to the host as
the backward completes it and every reader of the round's gradient (the sealed ``grads``, the
norm and the clip, :class:`~qualify.reference.update.HostAdamW`'s step, the sensitivity pass)
reads the host copy. The micro-batch accumulation is then a host sum of the same gradients in
the same order: every sealed tensor and the meta must equal, bitwise, the unstreamed run with
the state on the host, and the option must really be taken (the devices hold no gradient at
the step, one hook call per parameter, micro-batch and round).
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from tiny_models import THREE_LAYER_CFG, seeded_batch, seeded_qwen3

from qualify.contract import load_contract
from qualify.reference import devices, update
from qualify.reference.update import Batch, UpdateSettings
from qualify.resources import contracts_dir


def _run(gradients: str, precision: str, mode: str,
         seen: list[update._GradStream]) -> tuple[Any, ...]:
    """The Actor's and the Critic's update runs on two ``cpu`` devices, state on the host."""
    contract = load_contract(contracts_dir() / "tiny-qwen3.toml")
    st_ = UpdateSettings(precision=precision,  # type: ignore[arg-type]
                         bf16_mode=mode, micro_batch_size=2)  # type: ignore[arg-type]
    two = devices.ReferenceDevices(("cpu", "cpu"), devices.ENV, "host", gradients)
    with devices.active(two) as record:
        models = []
        for role in ("actor", "actor", "critic"):
            m = seeded_qwen3(role, THREE_LAYER_CFG)
            models.append(devices.place(m.double() if precision == "fp64" else m, role))
        batch = cast(Batch, seeded_batch(96, short={0: 4}, masked_targets=False))
        actor, meta_a = update.run_actor(models[0], models[1], batch, contract, st_)
        critic, meta_c = update.run_critic(models[2], batch, contract, st_)
    assert record["gradients"] == gradients
    return actor, critic, meta_a, meta_c, record["memory"]["bytes"], contract


@pytest.mark.parametrize(("precision", "mode"), [("fp32", "params"), ("bf16", "castmasters"),
                                                 ("fp64", "params")])
@pytest.mark.usefixtures("one_thread")
def test_streamed_gradients_seal_bitwise_the_unstreamed(precision: str, mode: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor (grads, norms, moments, updates, logprobs, values, losses) and the meta
    (dtypes, FP32 norm evaluations, sensitivities) equal; the streamed run's hooks ran once
    per parameter, micro-batch and round on the module the backward went through."""
    seen: list[update._GradStream] = []
    plain_attach = update._GradStream.attach

    def spy(self: update._GradStream, module: torch.nn.Module) -> None:
        if self not in seen:
            seen.append(self)
        plain_attach(self, module)

    monkeypatch.setattr(update._GradStream, "attach", spy)
    dev = _run("device", precision, mode, seen)
    assert not seen
    host = _run("host", precision, mode, seen)
    for a, b in zip(dev[:2], host[:2], strict=True):
        assert a.keys() == b.keys()
        assert any("/grads/" in k for k in a)
        for k in a:
            assert a[k].dtype == b[k].dtype, k
            assert torch.equal(a[k], b[k]), k
    assert dev[2] == host[2]
    assert dev[3] == host[3]
    # noted per device at each step: the master and its .grad, or the master alone
    assert [2 * b for b in host[4]] == dev[4]
    assert all(b > 0 for b in host[4])
    contract = host[5]
    rounds, batches = contract.algorithm.rounds, 2  # 4 rows, micro-batches of 2
    assert len(seen) == 2  # the Actor's and the Critic's runs
    n_params = len([p for p in seeded_qwen3("actor", THREE_LAYER_CFG).parameters()
                    if p.requires_grad])
    assert seen[0].calls == rounds * batches * n_params
    assert all(not s.grads and not s._handles for s in seen)  # emptied, hooks removed


def test_streaming_needs_the_host_state() -> None:
    """``gradients = "host"`` with the AdamW state on the devices is refused (the step reads
    the host copies only through :class:`~qualify.reference.update.HostAdamW`)."""
    with pytest.raises(ValueError, match="needs optimizer_state host"):
        devices.ReferenceDevices(("cpu",), devices.ENV, "device", "host")
    with pytest.raises(ValueError, match=r"ReferenceDevices\.gradients"):
        devices.ReferenceDevices(("cpu",), devices.ENV, "host", "disk")
