"""The comparator: verdict types, rows, clip-flip re-judging, sampler rows, mismatch metrics.

Also the report (``report.json`` / ``report.md``) built from the verdicts, each failing
cell's root cause (:mod:`qualify.compare.rootcause`), and ``report.html``
(:mod:`qualify.compare.html`, made from ``report.json`` and the stored tensors).
"""
