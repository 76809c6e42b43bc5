"""The ``qualify`` command line: argument parsing and exit codes only."""
