"""Harness programs: one folder per engine, each speaking the harness protocol.

A harness is launched by :func:`qualify.candidate.launch.launch` under torchrun, reads the cell file
and the frozen inputs named in :mod:`qualify.protocol`, drives its engine's own code path
and writes ``outputs.safetensors`` + ``outputs.json``. An engine harness on the harness SDK
(``sdk/qualify_harness``: the rounds, the losses, the output writer) holds only what its
engine dictates (torchtitan's ``models/<name>/`` layout):

- ``spec.py``: the engine's :class:`~qualify.registry.EngineSpec` (harness entry, parallel
  axes with their degrees, number-changing options with their allowed values,
  distributions); :data:`qualify.registry.BUILTIN_ENGINES` names it in one line;
- ``harness.py``: the program (``python -m harnesses.<engine>.harness CELL_JSON``) and the
  engine's parts the SDK's round driver asks for;
- ``parallelize.py``: how the engine shards the Hugging Face model;
- ``state_dict_adapter.py``: engine layout -> Hugging Face names and full tensors;
- ``faults.py``: deliberate bugs the test suite patches in (never on in real runs);
- ``README.md``: what the engine does, and its design choices.

Nothing here is imported by ``import qualify``; engines are found through
:mod:`qualify.registry`, which imports only the light ``spec`` modules (never a harness).
An engine outside this repository ships the same ``spec`` module in its own distribution and
names it in the ``qualify.engines`` entry-point group.
"""
