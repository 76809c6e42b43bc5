"""Model manifests: file digests, role-directory manifests, config fields, TP sizes.

Before use, every file of ``model.manifest.files`` (relative to the source directory; the
GGUF file name for ``smollm2-135m``) is hashed (:func:`check_manifest_files`) and every field
of ``model.manifest.config`` is compared with the effective config (the source's config with
the contract's overrides; floats compared after rounding to float32, since GGUF stores
float32: :func:`check_config_fields`). Every TP size of the contract must split the model's
attention heads (:func:`check_tp_sizes`).

Each role directory qualify builds holds ``qualify-manifest.json`` (:data:`ROLE_MANIFEST`:
sha256 of every other file in it), written by :func:`write_dir_manifest` and checked by
:func:`verify_model_dir`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np
import torch

from qualify.contract import Contract
from qualify.digests import sha256_file
from qualify.errors import ContractError, ModelSourceError
from qualify.jsonio import loads_strict

__all__ = ["ROLE_MANIFEST", "check_config_fields", "check_manifest_files", "check_tp_sizes",
           "compare_files", "hash_tree", "short_digest", "valid_tp_sizes", "verify_model_dir",
           "write_dir_manifest"]

ROLE_MANIFEST: Final = "qualify-manifest.json"
"""Per-directory manifest: sha256 of every other file of a role directory."""
_MISSING: Final = object()

# ----------------------------------------------------------------------------- hashing


def short_digest(digest: str) -> str:
    """The first 12 hex digits of ``digest`` and an ellipsis (for messages)."""
    return f"{digest[:12]}…"


def hash_tree(directory: Path, *, skip: frozenset[str] = frozenset()) -> dict[str, str]:
    """sha256 of every regular file under ``directory`` (relative POSIX paths, sorted)."""
    out: dict[str, str] = {}
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if p.is_file() and rel not in skip:
            out[rel] = sha256_file(p)
    return out


def write_dir_manifest(directory: Path) -> dict[str, str]:
    """Write ``directory/qualify-manifest.json`` (sha256 of every other file); return them."""
    files = hash_tree(directory, skip=frozenset({ROLE_MANIFEST}))
    doc = {"format": "qualify-dir-manifest", "files": files}
    (directory / ROLE_MANIFEST).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n",
                                           encoding="utf-8")
    return files


def compare_files(where: str, expected: Mapping[str, str], found: Mapping[str, str],
                  hint: str) -> None:
    """Compare measured digests with expected ones.

    Raises:
        ModelSourceError: a file is missing, changed or not in ``expected`` (named, with
            ``where`` first and ``hint`` last).
    """
    for rel in sorted(expected):
        if rel not in found:
            raise ModelSourceError(f"{where}: file {rel!r} is missing{hint}")
        if found[rel] != expected[rel]:
            raise ModelSourceError(
                f"{where}: file {rel!r}: sha256 mismatch: expected {short_digest(expected[rel])}, "
                f"found {found[rel]}{hint}"
            )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ModelSourceError(f"{where}: file {extra[0]!r} is not in the manifest{hint}")


def verify_model_dir(directory: str | Path) -> dict[str, str]:
    """Check a role directory against its ``qualify-manifest.json``.

    Args:
        directory: a role directory written by :func:`prepare_models`.

    Returns:
        Relative file name -> hex sha256 of every file the manifest lists.

    Raises:
        ModelSourceError: the directory or its manifest is missing, or a file is missing,
            added, or changed (the message names the file).
    """
    d = Path(directory)
    if not d.is_dir():
        raise ModelSourceError(f"{d}: model directory not found")
    manifest = d / ROLE_MANIFEST
    if not manifest.is_file():
        raise ModelSourceError(f"{d}: {ROLE_MANIFEST} missing; not a directory qualify built")
    try:
        expected = loads_strict(manifest.read_bytes(), what=str(manifest),
                                error=ModelSourceError)["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelSourceError(f"{manifest}: malformed manifest ({exc})") from None
    found = hash_tree(d, skip=frozenset({ROLE_MANIFEST}))
    compare_files(str(d), expected, found, hint="")
    return dict(expected)


def check_manifest_files(base: Path, expected: Mapping[str, str],
                         known: Mapping[str, str] | None = None) -> dict[str, str]:
    """Hash the manifest's files under ``base``; return name -> measured sha256.

    ``known`` holds digests measured already (name -> sha256), not hashed again.

    Raises:
        ModelSourceError: a file is missing or its sha256 differs (the message names the
            ``model.manifest.files`` entry).
    """
    out: dict[str, str] = {}
    for name, digest in expected.items():
        p = base / name
        key = f"model.manifest.files[{json.dumps(name)}]"
        if not p.is_file():
            raise ModelSourceError(f"{key}: file not found: {p}")
        found = (known or {}).get(name) or sha256_file(p)
        if found != digest:
            raise ModelSourceError(f"{key}: sha256 mismatch: expected {short_digest(digest)}, "
                                   f"found {found} ({p})")
        out[name] = found
    return out


# ----------------------------------------------------------------------------- config checks


def _config_value(config: Any, field: str) -> Any:
    """Read ``field`` (dotted for nested) from a transformers config; ``_MISSING`` if absent."""
    obj: Any = config
    for part in field.split("."):
        obj = obj.get(part, _MISSING) if isinstance(obj, Mapping) else getattr(obj, part, _MISSING)
        if obj is _MISSING:
            break
    if obj is _MISSING and "." not in field:
        # transformers 5 keeps rope_theta & co. in config.rope_parameters.
        rope = getattr(config, "rope_parameters", None)
        if isinstance(rope, Mapping) and field in rope:
            return rope[field]
    return obj


def _values_equal(expected: Any, found: Any) -> bool:
    if isinstance(found, torch.dtype):
        found = str(found).removeprefix("torch.")
    if isinstance(expected, bool) or isinstance(found, bool):
        return type(expected) is type(found) and expected == found
    if isinstance(expected, int) and isinstance(found, int):
        return expected == found
    if isinstance(expected, int | float) and isinstance(found, int | float):
        return bool(np.float32(expected) == np.float32(found))
    return bool(expected == found)


def check_config_fields(config: Any, expected: Mapping[str, Any], *, where: str) -> None:
    """Compare config fields with ``model.manifest.config``.

    Integers, booleans and strings must be equal; floats equal after rounding to float32.

    Args:
        config: a transformers ``PretrainedConfig``.
        expected: field name (dotted for nested) -> expected value.
        where: what the config belongs to (for the message).

    Raises:
        ModelSourceError: a field is absent or differs (one line naming the field).
    """
    for field, value in expected.items():
        found = _config_value(config, field)
        if found is _MISSING:
            raise ModelSourceError(f"model.manifest.config.{field}: no such field in the config "
                                   f"of {where}")
        if not _values_equal(value, found):
            raise ModelSourceError(f"model.manifest.config.{field}: expected {value!r}, found "
                                   f"{found!r} (config of {where})")


def valid_tp_sizes(config: Any, candidates: tuple[int, ...] = (1, 2, 3, 4, 6, 8)) -> list[int]:
    """TP sizes that split the attention heads of ``config`` evenly.

    A TP size must divide ``num_attention_heads``; the KV heads are either split
    (``kv % tp == 0``) or replicated (``tp % kv == 0``), as Megatron and vLLM do.
    """
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    return [tp for tp in candidates if heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)]


def check_tp_sizes(contract: Contract, config: Any) -> None:
    """Check every TP size of the contract against the model's attention heads.

    Raises:
        ContractError: a TP size does not split the heads (names the field and the valid sizes).
    """
    fields: list[tuple[str, int]] = [(f"matrix.tp_sizes ({tp})", tp)
                                     for tp in contract.matrix.tp_sizes]
    fields += [(f"matrix.topologies[{i}].rollout_tp", t.rollout_tp)
               for i, t in enumerate(contract.matrix.topologies)]
    fields.append(("sampling.tp", contract.sampling.tp))
    ok = valid_tp_sizes(config, tuple(sorted({tp for _, tp in fields} | {1, 2, 3, 4, 6, 8})))
    for name, tp in fields:
        if tp not in ok:
            heads = config.num_attention_heads
            kv = getattr(config, "num_key_value_heads", None) or heads
            raise ContractError(
                f"{name}: TP {tp} cannot split num_attention_heads = {heads} / "
                f"num_key_value_heads = {kv} of model source {contract.model.source!r}; "
                f"valid TP sizes: {ok}"
            )
