"""The ranks of ``example_tp1``: a single-process PyTorch trainer at TP 1.

What the engine owns is where the model lives and how its step runs; at TP 1 on one process
that is plain PyTorch, which this repository's ``torch_tp`` harness already runs at TP 1 (a
one-rank device mesh is no sharding at all). The example therefore keeps only the engine
identity and delegates the round loop to that harness, found on the launch's ``PYTHONPATH``
(the qualify checkout leads it); a harness built on the harness SDK supplies its parts to
the SDK's round driver instead. It runs in whichever interpreter the site names
(``QUALIFY_LAUNCHER_EXAMPLE_TP1``) and talks to qualify through files only.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

ENGINE = "example_tp1"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the cell of ``argv[0]`` (a ``cell.json``); the exit status."""
    from harnesses.torch_tp import harness

    harness.ENGINE = ENGINE  # the loop's records (outputs.json, cell check) carry our name
    return int(harness.main(list(sys.argv[1:] if argv is None else argv)) or 0)


if __name__ == "__main__":
    sys.exit(main())
