"""Evidence: the store, attempts, signing (DSSE, in-toto), verify, gate, audit."""
