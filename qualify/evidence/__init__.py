"""Evidence: storing, sealing, signing, verifying, gating and auditing evidence directories.

Storage: store, sealed, attempts, tensors, timestamps. Signing: dsse, keys, statement, sign.
Checking: steps, verify, discover, gate, audit. The environment record: environment.
Docstring only: import the submodules explicitly (``from qualify.evidence import store``).
"""
