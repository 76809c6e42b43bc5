"""``python -m harnesses.verl CELL_JSON`` (:func:`harnesses.verl.harness.main`)."""

import sys

from harnesses.verl.harness import main

sys.exit(main())
