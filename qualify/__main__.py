"""``python -m qualify``: the same as the ``qualify`` console script."""

import sys

from qualify.cli import main

sys.exit(main())
