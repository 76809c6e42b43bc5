"""``python -m harnesses.trl CELL_JSON`` (:func:`harnesses.trl.harness.main`)."""

import sys

from harnesses.trl.harness import main

sys.exit(main())
