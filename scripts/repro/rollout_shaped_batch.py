"""A batch shaped like a contract's rollout, for the repro scripts beside this file.

``samples_per_prompt x prompts`` sequences, the contract's prompts (token ids, or texts
through the Actor's tokenizer) left-padded to the longest, responses of ``max_new_tokens``
seeded ids (``torch.Generator().manual_seed(0)``, ids from 3 to the vocabulary size),
every response token valid, zero advantages and returns. Used by
``branch_token_cost.py`` and ``head_rows_precision.py`` (run as ``python
scripts/repro/NAME.py``, which puts this folder on ``sys.path``).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoTokenizer

from qualify.contract import Contract
from qualify.models.bundle import ModelBundle
from qualify.reference.update import Batch


def rollout_shaped_batch(contract: Contract, bundle: ModelBundle) -> Batch:
    """The batch (module docstring): prompts ``[B, P]``, responses ``[B, R]``, int64."""
    spec, copies = contract.prompts, contract.sampling.samples_per_prompt
    if spec.token_ids is not None:
        enc = [list(p) for p in spec.token_ids for _ in range(copies)]
        vocab = int(AutoConfig.from_pretrained(bundle.actor_dir).vocab_size)
    else:
        tok = AutoTokenizer.from_pretrained(bundle.actor_dir)
        enc = [tok(p)["input_ids"] for p in spec.text or () for _ in range(copies)]
        vocab = int(tok.vocab_size)
    p_len, r_len, n = max(map(len, enc)), contract.sampling.max_new_tokens, len(enc)
    pad = bundle.pad_token_id
    prompts = torch.full((n, p_len), pad, dtype=torch.long)
    prompt_mask = torch.zeros(n, p_len, dtype=torch.long)
    for i, e in enumerate(enc):
        prompts[i, p_len - len(e):] = torch.tensor(e)
        prompt_mask[i, p_len - len(e):] = 1
    responses = torch.randint(3, vocab, (n, r_len), generator=torch.Generator().manual_seed(0))
    ones = torch.ones(n, r_len, dtype=torch.long)
    return Batch(prompts=prompts, responses=responses,
                 attention_mask=torch.cat([prompt_mask, ones], 1), response_mask=ones,
                 advantages=torch.zeros(n, r_len), returns=torch.zeros(n, r_len),
                 pad_token_id=pad)
