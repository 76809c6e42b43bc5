"""The standing seed sweep of every contract with a gate policy (slow tier).

Each contract with a committed gate policy
(``contracts/gates/<name>.toml``) is run over seed variants 1..5 (model, sampling, critic
head and reward seeds moved, :func:`qualify.pipeline.sweep.variant_text`), every cell, and
each variant is judged by the committed policy: every variant must gate 0 and no cell outside
the policy may fail (``sweep.json``'s ``exit_code`` and ``unexplained``). The default
contract's sweep is committed (``evidence/tiny-qwen3/sweep.json``, checked against this
checkout by ``tests/test_sweep.py``); the other gated contracts are swept here:
``python -m pytest -m slow tests/test_sweep_standing.py``. SmolLM2-135M's sweep runs only
when ``QUALIFY_SWEEP_SMOLLM2=1`` (its cost: ``docs/ci-gating.md``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qualify.cli.main import main
from qualify.contract import load_contract
from qualify.evidence.policy import policy_for

ROOT = Path(__file__).resolve().parent.parent
GATED = sorted(p.stem for p in (ROOT / "contracts" / "gates").glob("*.toml"))
VARIANTS = 5


def test_every_gated_contract_is_listed() -> None:
    """The list the slow sweep walks is every committed policy's contract, and each policy
    belongs to a committed contract of its name."""
    assert "tiny-qwen3" in GATED
    for name in GATED:
        contract = load_contract(ROOT / "contracts" / f"{name}.toml")
        assert policy_for(contract).path == ROOT / "contracts" / "gates" / f"{name}.toml"


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in GATED if n != "tiny-qwen3"])
def test_every_seed_variant_of_a_gated_contract_gates_zero(name: str, tmp_path: Path) -> None:
    if name == "smollm2-135m" and os.environ.get("QUALIFY_SWEEP_SMOLLM2") != "1":
        pytest.skip("SmolLM2-135M: tens of minutes per variant on CPU; "
                    "QUALIFY_SWEEP_SMOLLM2=1 runs it")
    code = main(["sweep", str(ROOT / "contracts" / f"{name}.toml"), "--out", str(tmp_path),
                 "--variants", str(VARIANTS), "--summary-dir", str(tmp_path)])
    assert code in (0, 1), f"qualify sweep {name}: exit {code} (not a verdict)"
    doc = json.loads((tmp_path / "sweep.json").read_text())
    failing = {v["name"]: v["outside"] for v in doc["variants"] if v["exit_code"] != 0}
    assert len(doc["variants"]) == VARIANTS
    assert failing == {}, failing
    assert doc["unexplained"] == []
    assert code == 0
