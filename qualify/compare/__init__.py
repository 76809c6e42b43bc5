"""The comparator: verdict types, rows, clip-flip re-judging, sampler rows, mismatch metrics.

Also the report (``report.json`` / ``report.md``) built from the verdicts.
"""
