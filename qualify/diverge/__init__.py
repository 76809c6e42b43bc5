"""``qualify diverge``: rerun a failing cell with layer probes beside the HF reference and name the first module (layer and sub-module) whose output leaves its bound."""
