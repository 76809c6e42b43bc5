"""tests/installed.py: a missing package skips its module without being imported."""

from __future__ import annotations

import sys

import pytest
from installed import skip_unless_installed


@pytest.mark.parametrize("name", ["qualify_no_such_package", "qualify_no_such_package.core"])
def test_a_missing_package_skips(name: str) -> None:
    with pytest.raises(pytest.skip.Exception, match=f"^{name} is not installed$"):
        skip_unless_installed(name)


def test_an_installed_package_is_found_and_not_imported() -> None:
    assert "this" not in sys.modules  # the stdlib's Zen, which no test imports
    skip_unless_installed("this")
    assert "this" not in sys.modules
