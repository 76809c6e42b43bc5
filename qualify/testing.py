"""A pytest plugin for harness authors: the conformance check inside their own test suite.

Enable it in the plugin's ``conftest.py``::

    pytest_plugins = ["qualify.testing"]

    def test_my_engine_conforms(qualify_harness_check):
        qualify_harness_check("my_engine")          # fails naming every missing output

The fixture runs :func:`qualify.candidate.conformance.check_engine` (one FP32 TP 1 cell of
the embedded ``tiny-qwen3`` contract, or the contract and reference given, through the real
launcher and the engine's own interpreter when ``QUALIFY_LAUNCHER_<ENGINE>`` names one) into
the test's temporary directory, and fails the test with one line per problem, the
protocol versions first (:func:`assert_conforms`). It returns the
:class:`~qualify.candidate.conformance.CheckResult` for further assertions.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from qualify.candidate.conformance import CheckResult, check_engine

__all__ = ["assert_conforms", "qualify_harness_check"]


def assert_conforms(result: CheckResult) -> None:
    """Fail with every finding of ``result``, one per line (nothing when it conforms).

    Raises:
        AssertionError: the outputs are incomplete; the message names each problem.
    """
    if result:
        return
    lines = [f"{k}: {v}" for k, v in result.versions.items()]
    lines += [str(f) for f in result.findings]
    raise AssertionError(f"harness check {result.engine}: {len(result.findings)} problem(s) "
                         f"(outputs in {result.attempt_dir})\n" + "\n".join(lines))


@pytest.fixture
def qualify_harness_check(tmp_path: Path) -> Callable[..., CheckResult]:
    """``check(engine, **kwargs)``: run the conformance check and assert that it conforms.

    ``kwargs`` go to :func:`~qualify.candidate.conformance.check_engine` (``contract_path``,
    ``reference``, ``timeout_s``); ``conform=False`` returns the result without asserting.
    """

    def check(engine: str, *, conform: bool = True, **kwargs: Any) -> CheckResult:
        result = check_engine(engine, out=tmp_path / f"check-{engine}", **kwargs)
        if conform:
            assert_conforms(result)
        return result

    return check
