"""The prompts JSONL file of a contract (``[prompts] file``): read and checked once.

One ``{"token_ids": [int, ...]}`` or ``{"text": "..."}`` object per line, all lines of the
same kind, UTF-8, at least one prompt, no empty prompt, no negative token id; the file's
sha256 must equal the contract's ``prompts.sha256``. ``qualify validate`` checks it
(through :func:`qualify.contract.load_contract`), and the reference stage reads the
prompts through the same function, so a bad file fails before any model is built.
Each line is parsed by :func:`qualify.jsonio.loads_strict` (a duplicate key, which two
readers may resolve differently, and ``NaN`` / ``Infinity`` are refused). Token ids against
the vocabulary, and each prompt's length plus ``sampling.max_new_tokens`` against the
model's ``max_position_embeddings``, are checked by :func:`check_token_ids` wherever the
model's config is known: when the contract loads (``model.config`` or
``model.manifest.config`` gives them), inline and file prompts alike, and again in the
reference stage on the real model's config (:func:`qualify.reference.stage.resolve_prompts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from qualify.digests import sha256_bytes
from qualify.errors import ContractError
from qualify.jsonio import loads_strict
from qualify.userfiles import read_input_bytes

__all__ = ["MAX_PROMPTS_BYTES", "PromptsFile", "check_prompts_fit", "check_token_ids",
           "read_prompts_file"]

MAX_PROMPTS_BYTES: Final = 256 << 20
"""A prompts file larger than this (256 MiB) is refused before it is read."""


@dataclasses.dataclass(frozen=True, slots=True)
class PromptsFile:
    """The checked content of a prompts file: exactly one of the two is set.

    Attributes:
        token_ids: one tuple of non-negative token ids per prompt.
        text: one non-empty string per prompt.
    """

    token_ids: tuple[tuple[int, ...], ...] | None
    text: tuple[str, ...] | None


def _line_prompt(obj: Any, where: str) -> tuple[str, tuple[int, ...] | str]:
    if not isinstance(obj, dict):
        raise ContractError(f"{where}: expected a JSON object, found {type(obj).__name__}")
    keys = set(obj) & {"token_ids", "text"}
    if len(keys) != 1:
        raise ContractError(f"{where}: needs exactly one of 'token_ids' or 'text'")
    if "token_ids" in obj:
        ids = obj["token_ids"]
        if not isinstance(ids, list) or not ids:
            raise ContractError(f"{where}: token_ids: expected a non-empty list of integers")
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise ContractError(f"{where}: token_ids[{i}]: expected an integer, "
                                    f"found {t!r:.40}")
            if t < 0:
                raise ContractError(f"{where}: token_ids[{i}]: negative token id {t}")
        return "token_ids", tuple(ids)
    text = obj["text"]
    if not isinstance(text, str) or not text:
        raise ContractError(f"{where}: text: expected a non-empty string")
    return "text", text


def read_prompts_file(path: Path, sha256: str | None) -> PromptsFile:
    """Read and check a prompts JSONL file.

    Args:
        path: the file (already resolved against the contract's directory).
        sha256: the contract's ``prompts.sha256`` (hex), checked against the bytes.

    Returns:
        The prompts, token ids or texts.

    Raises:
        ContractError: missing or not a regular file, too large, wrong digest, not UTF-8,
            a line that is not JSON, not an object, or not a valid prompt, prompts of
            mixed kinds, or no prompt at all; the message names the file, the line and
            the field (``prompts.file``, ``prompts.sha256``).
    """
    data = read_input_bytes(path, what="prompts.file", max_bytes=MAX_PROMPTS_BYTES,
                            error=ContractError)
    digest = sha256_bytes(data)
    if digest != sha256:
        raise ContractError(f"prompts.sha256: {path}: expected {sha256}, found {digest}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ContractError(f"prompts.file: {path}: not UTF-8 ({exc.reason} at byte "
                            f"{exc.start})") from None
    kinds: set[str] = set()
    rows: list[tuple[int, ...] | str] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"prompts.file: {path}: line {n}"
        obj = loads_strict(line, what=where, error=ContractError)
        kind, value = _line_prompt(obj, where)
        kinds.add(kind)
        rows.append(value)
    if not rows:
        raise ContractError(f"prompts.file: {path}: no prompt (the file is empty)")
    if len(kinds) > 1:
        raise ContractError(f"prompts.file: {path}: mixes 'token_ids' and 'text' lines; "
                            "use one kind")
    if kinds == {"token_ids"}:
        return PromptsFile(token_ids=tuple(r for r in rows if isinstance(r, tuple)), text=None)
    return PromptsFile(token_ids=None, text=tuple(r for r in rows if isinstance(r, str)))


def check_token_ids(token_ids: Sequence[Sequence[int]], vocab_size: int | None,
                    where: str = "", *,
                    max_positions: int | None = None, max_new_tokens: int = 0,
                    field: str = "prompts.token_ids") -> None:
    """Refuse a prompt the model cannot embed or cannot extend by ``max_new_tokens``.

    Args:
        token_ids: the prompts, ``[n_prompts][len]`` token ids.
        vocab_size: the model's ``vocab_size`` (ids ``0 .. vocab_size - 1``; ``None``: not
            checked).
        where: a prefix naming the file (``"contracts/x.toml: "``).
        max_positions: the model's ``max_position_embeddings`` (``None``: not checked).
        max_new_tokens: ``sampling.max_new_tokens``: a prompt of length ``L`` needs
            ``L + max_new_tokens <= max_positions`` positions.
        field: how the prompts are named (``prompts.token_ids``, or the prompts file).

    Raises:
        ContractError: ``<field>[i]: ids [...] >= vocab_size V`` or ``<field>[i]: L tokens +
            sampling.max_new_tokens N > max_position_embeddings P``, the first prompt with one.
    """
    for i, row in enumerate(token_ids):
        if vocab_size is not None and (bad := [t for t in row if t >= vocab_size]):
            raise ContractError(f"{where}{field}[{i}]: ids {bad[:8]} >= vocab_size "
                                f"{vocab_size}")
        if max_positions is not None and len(row) + max_new_tokens > max_positions:
            raise ContractError(f"{where}{field}[{i}]: {len(row)} tokens + "
                                f"sampling.max_new_tokens {max_new_tokens} > the model's "
                                f"max_position_embeddings {max_positions}")


def check_prompts_fit(token_ids: Sequence[Sequence[int]], config: Mapping[str, Any],
                      max_new_tokens: int, *, field: str = "prompts.token_ids") -> None:
    """Check prompts against the model config fields a contract states.

    :func:`check_token_ids` with the ``vocab_size`` and ``max_position_embeddings`` that
    ``config`` names; a field it does not name, or that is not an integer, is not checked
    (the reference stage checks it on the real model's config).

    Raises:
        ContractError: as :func:`check_token_ids`.
    """
    vocab, positions = config.get("vocab_size"), config.get("max_position_embeddings")
    check_token_ids(token_ids, vocab if type(vocab) is int else None,
                    max_positions=positions if type(positions) is int else None,
                    max_new_tokens=max_new_tokens, field=field)
