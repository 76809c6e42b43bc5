"""Measurements of qualify's fixed costs (issue #17); each module is ``python -m benchmarks.X``."""
