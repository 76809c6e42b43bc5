"""vLLM harness: the real vLLM engine as the rollout sampler and the candidate sampler cell.

- :mod:`harnesses.vllm.engine`: builds a ``vllm.LLM`` with this project's settings.
- :mod:`harnesses.vllm.capture`: ``python -m harnesses.vllm.capture`` captures the
  reference-stage rollout in a child process.
- :mod:`harnesses.vllm.rollout`: :class:`~harnesses.vllm.rollout.VllmRolloutBackend`, the
  ``vllm`` rollout backend of :mod:`qualify.reference.sampling` (runs the capture child).

Importing this package imports no engine: vllm is imported only inside the functions that
build one.

Its specs are in :mod:`harnesses.vllm.spec`: :data:`~harnesses.vllm.spec.SPEC` (the
sampler cells) and :data:`~harnesses.vllm.spec.ROLLOUT` (the rollout backend).
"""
