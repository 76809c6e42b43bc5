"""``python -m qualify``: the same as the ``qualify`` console script."""

from qualify.cli.main import console

console()
