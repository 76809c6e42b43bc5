"""The model bundle: the role directories of one contract, built once and verified.

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
then cast to the saved dtype (rounded to BF16 first under ``model.bf16_representable``, as
every tiny-qwen3 parameter then is); bias (critic) zero. Every dropout probability of the three
configs (``attention_dropout``, ``classifier_dropout``, ...) is set to 0. The configs keep
``pad_token_id``. Weights are saved in FP32 for ``tiny-qwen3`` and ``smollm2-135m`` and in the
source's dtype for ``hf-dir``. Each role directory holds ``qualify-manifest.json`` (sha256 of
every other file in it), checked by the ``load_*`` functions.

Sources are resolved by :mod:`qualify.models.sources`, manifests checked by
:mod:`qualify.models.manifest`, roles loaded by :mod:`qualify.models.roles`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Literal

import torch

from qualify.contract import Contract, ModelSpec
from qualify.digests import sha256_file
from qualify.errors import ModelSourceError
from qualify.jsonio import loads_strict
from qualify.models.manifest import (
    compare_files,
    hash_tree,
    short_digest,
    write_dir_manifest,
)
from qualify.models.sources import (
    TINY_EOS_LOGIT_SCALE,
    TOKENIZER_FILES,
    Source,
    default_cache_dir,
    publish,
    quiet,
    resolve_source,
    tmp_dir,
    token_id,
    zero_dropout,
)

__all__ = ["BUILD_VERSION", "BUNDLE_RECORD", "ModelBundle", "check_source", "prepare_models",
           "read_bundle", "verify_bundle"]

BUILD_VERSION: Final = 1
"""Version of the role-building recipe recorded in ``bundle.json`` (bump on any change)."""
BUNDLE_RECORD: Final = "bundle.json"
"""The bundle record in ``<cache>/<contract digest12>/``."""
_WEIGHT_INDEX: Final = "model.safetensors.index.json"

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
        found.update({f"{prefix}/{k}": v for k, v in hash_tree(d).items()})
    compare_files(f"models cache {bundle.root}", bundle.files, found,
                  hint=f"; delete {bundle.root} to rebuild")


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` (read-only use) or copy it when linking is impossible."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


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
        if spec.bf16_representable:
            _round_to_bf16(model)
    with quiet():
        model.save_pretrained(dst)


def _round_to_bf16(model: torch.nn.Module) -> None:
    """Round every parameter to its nearest BF16 value in place, keeping its dtype.

    Round to nearest even (``Tensor.to(torch.bfloat16)``); the values of a checkpoint stored
    in BF16, as ``model.bf16_representable`` declares. Buffers (rotary ``inv_freq``) are
    computed from the config, not stored, and are left alone.
    """
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).to(param.dtype))


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
        elif f.name == _WEIGHT_INDEX or f.name in TOKENIZER_FILES:
            shutil.copyfile(f, dst / f.name)
            has_tokenizer |= f.name in TOKENIZER_FILES
    config.save_pretrained(dst)
    pad = int(config.pad_token_id)
    if (src / "generation_config.json").is_file():
        gen = GenerationConfig.from_pretrained(src, local_files_only=True)
        gen.pad_token_id = pad
        gen.save_pretrained(dst)
    if has_tokenizer:
        with quiet():
            tok = AutoTokenizer.from_pretrained(dst, local_files_only=True)
            if tok.pad_token_id != pad:
                tok.pad_token = tok.convert_ids_to_tokens(pad)
                tok.save_pretrained(dst)


def _build_head_model(role: Literal["critic", "reward"], actor_dir: Path, dst: Path, *,
                      seed: int, dtype: torch.dtype, bf16_representable: bool = False) -> None:
    """Backbone from the actor dir + a seeded ``score = Linear(hidden, 1)`` head.

    ``bf16_representable``: the head's weight is rounded to BF16 too (the backbone already
    is, in the actor directory).
    """
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    with quiet():
        config = AutoConfig.from_pretrained(actor_dir, local_files_only=True)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    zero_dropout(config)
    config.architectures = None
    auto = AutoModelForTokenClassification if role == "critic" else (
        AutoModelForSequenceClassification)
    with quiet(), torch.random.fork_rng(devices=[]):
        model = auto.from_pretrained(actor_dir, config=config, dtype=dtype,
                                     local_files_only=True)
    score = model.score
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(tuple(score.weight.shape), generator=gen, dtype=torch.float32)
    with torch.no_grad():
        score.weight.copy_((weight * float(config.initializer_range)).to(score.weight.dtype))
        if score.bias is not None:
            score.bias.zero_()
    if bf16_representable:
        _round_to_bf16(score)
    with quiet():
        model.save_pretrained(dst)


def _build_bundle(contract: Contract, source: Source, tmp: Path) -> None:
    spec, roles = contract.model, contract.roles
    actor_dir = tmp / "actor"
    if source.directory is None:
        _build_tiny_actor(spec, source.config, actor_dir)
    else:
        _materialize_actor(source.directory, source.config, actor_dir)
    rounded = spec.bf16_representable
    _build_head_model("critic", actor_dir, tmp / "critic", seed=roles.critic_head_seed,
                      dtype=source.dtype, bf16_representable=rounded)
    if roles.reward == "model":
        _build_head_model("reward", actor_dir, tmp / "reward", seed=roles.reward_seed,
                          dtype=source.dtype, bf16_representable=rounded)
    init = "normal(0, initializer_range) from torch.Generator().manual_seed(seed), float32"
    if rounded:
        init += ", rounded to bf16"
    record = {
        **source.record,
        "critic_head": {"seed": roles.critic_head_seed, "init": f"{init}; bias 0"},
        "reward": ({"seed": roles.reward_seed, "init": f"{init}; no bias"}
                   if roles.reward == "model" else {"rule": roles.reward}),
    }
    files: dict[str, str] = {}
    dirs: list[str] = ["actor", "critic"] + (["reward"] if roles.reward == "model" else [])
    for name in dirs:
        write_dir_manifest(tmp / name)
        files.update({f"{name}/{k}": v for k, v in hash_tree(tmp / name).items()})
    has_tok = any((actor_dir / f).is_file() for f in TOKENIZER_FILES)
    bundle = ModelBundle(
        root=tmp,
        actor_dir=actor_dir,
        critic_dir=tmp / "critic",
        reward_dir=tmp / "reward" if roles.reward == "model" else None,
        tokenizer_dir=actor_dir if has_tok else None,
        files=files,
        pad_token_id=int(source.config.pad_token_id),
        eos_token_id=int(token_id(source.config.eos_token_id) or 0),
        bos_token_id=token_id(getattr(source.config, "bos_token_id", None)),
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
        doc = loads_strict(path.read_bytes(), what=str(path), error=ModelSourceError)
    except ValueError as exc:
        raise ModelSourceError(f"{path}: not valid JSON ({exc}); delete {root} to rebuild") \
            from None
    return ModelBundle.from_dict(doc, root=root)


def _check_same_source(bundle: ModelBundle, source: Source) -> None:
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
                               f"{short_digest(str(built.get('gguf_sha256')))}, the installed "
                               f"file is {short_digest(source.record['gguf_sha256'])}{hint}")
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
    return resolve_source(contract, root, building=True).config


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
    source = resolve_source(contract, root, building=not final.is_dir())
    if not final.is_dir():
        tmp = tmp_dir(root, contract.digest12)
        try:
            _build_bundle(contract, source, tmp)
            publish(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    bundle = read_bundle(final)
    _check_same_source(bundle, source)
    if bundle.contract_digest != contract.digest:
        raise ModelSourceError(f"{final / BUNDLE_RECORD}: built for contract "
                               f"{short_digest(bundle.contract_digest)}, not "
                               f"{short_digest(contract.digest)}; delete {final} to rebuild")
    if bundle.build_version != BUILD_VERSION:
        raise ModelSourceError(f"{final / BUNDLE_RECORD}: built by recipe version "
                               f"{bundle.build_version}, this qualify uses {BUILD_VERSION}; "
                               f"delete {final} to rebuild")
    verify_bundle(bundle)
    return bundle
