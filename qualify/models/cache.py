"""Where the prepared models live: ``$QUALIFY_CACHE/models`` (no torch import).

:func:`qualify.models.bundle.prepare_models` builds each contract's role models once into
``<cache>/<digest12>/`` (``actor/``, ``critic/``, ``reward/``, each with its
``config.json``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

__all__ = ["CACHE_ENV", "default_cache_dir"]

CACHE_ENV: Final = "QUALIFY_CACHE"
"""Environment variable of qualify's cache root; models live under ``$QUALIFY_CACHE/models``."""


def default_cache_dir() -> Path:
    """``$QUALIFY_CACHE/models`` if set, else ``~/.cache/qualify/models``."""
    base = os.environ.get(CACHE_ENV)
    return (Path(base) if base else Path.home() / ".cache" / "qualify") / "models"
