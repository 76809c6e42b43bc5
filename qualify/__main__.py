"""``python -m qualify``: the same as the ``qualify`` console script."""

import sys

from qualify.cli.main import main

sys.exit(main())
