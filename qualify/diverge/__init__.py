"""``qualify diverge``: name the first layer and sub-module whose output leaves its bound.

A failing cell is rerun with layer probes beside the HF reference of its lane and its
controls (:mod:`qualify.diverge.run`).
"""
