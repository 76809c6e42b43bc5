"""The rollout document: sampled once, stored, never recomputed.

The reference stage's first step (docs/concepts.md). A :class:`Rollout` holds the tensors of
:data:`qualify.protocol.ROLLOUT_KEYS` in the exact layout written in
:mod:`qualify.protocol`, plus metadata (sampler name and version, settings, logprobs
mode, finish reasons, seed). A rollout is stored as ``rollout.safetensors`` +
``rollout.json`` (validated by ``contracts/schema/rollout.schema.json``) and every
later stage reads it back with :meth:`Rollout.load`, which checks the layout.
:func:`build_rollout` lays out any sampler's ragged output.

The samplers that produce a rollout (the backend registry, :class:`HfRolloutBackend`,
:func:`capture_rollout`) live in :mod:`qualify.reference.sampling`; ``vllm`` lives in
``harnesses/vllm/rollout.py``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from safetensors.torch import save as save_bytes

from qualify import schema
from qualify.atomic import write_bytes
from qualify.contract import SamplingSpec
from qualify.errors import ReferenceDataError, RolloutLayoutError
from qualify.protocol import ROLLOUT_FILE, ROLLOUT_KEYS, ROLLOUT_META_FILE

__all__ = ["ROLLOUT_SCHEMA_VERSION", "FinishReason", "LogprobsMode", "Rollout",
           "RolloutLayoutError", "build_rollout"]

LogprobsMode = Literal["processed", "raw"]
FinishReason = Literal["eos", "length"]

ROLLOUT_SCHEMA_VERSION: Final = 1
"""``schema_version`` written to ``rollout.json``."""

_INT_KEYS: Final = frozenset(ROLLOUT_KEYS) - {"behavior_logprobs"}
_SETTINGS_KEYS: Final = (
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "samples_per_prompt",
    "seed",
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class Rollout:
    """A captured rollout: the tensors of :data:`qualify.protocol.ROLLOUT_KEYS` plus metadata.

    ``B`` sequences (prompt-major: the ``n = samples_per_prompt`` samples of prompt ``i``
    are rows ``i*n .. i*n+n-1``), ``P`` = longest prompt, ``R`` = ``max_new_tokens``.
    Construction validates the layout (see :meth:`load` for the checks) and raises
    :class:`RolloutLayoutError`.

    Attributes:
        prompts: ``[B, P]`` int64, left-padded with ``pad_token_id``.
        responses: ``[B, R]`` int64, right-padded with ``pad_token_id`` (tokens after EOS
            are padding).
        attention_mask: ``[B, P + R]`` int64, 1 on real prompt and response tokens.
        position_ids: ``[B, P + R]`` int64, ``clamp(cumsum(attention_mask) - 1, min=0)``.
        response_mask: ``[B, R]`` int64, 1 up to and including the EOS token if any
            (equals ``attention_mask[:, P:]``).
        behavior_logprobs: ``[B, R]`` float32, the sampler's logprob of each sampled token
            under the distribution named by ``logprobs_mode``; 0 on padding.
        eos_terminated: ``[B]`` int64, 1 if the response ends with EOS, 0 if cut by length.
        group_index: ``[B]`` int64, index of the prompt a sample came from.
        sampler: backend name (``hf``, ``vllm``).
        sampler_version: version of the sampling library.
        sampler_details: backend facts (torch version, dtype, attention, warpers...).
        settings: temperature, top_p, top_k, max_new_tokens, samples_per_prompt, seed.
        logprobs_mode: ``processed`` (the sampling distribution: temperature-scaled,
            top-k/top-p truncated and renormalised) or ``raw`` (log_softmax of the logits).
        finish_reasons: per sequence, ``eos`` or ``length``.
        seed: the sampler seed.
        pad_token_id: padding id.
        eos_token_id: end-of-sequence id.
    """

    prompts: torch.Tensor
    responses: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    behavior_logprobs: torch.Tensor
    eos_terminated: torch.Tensor
    group_index: torch.Tensor
    sampler: str
    sampler_version: str
    sampler_details: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    settings: Mapping[str, Any]
    logprobs_mode: LogprobsMode
    finish_reasons: tuple[FinishReason, ...]
    seed: int
    pad_token_id: int
    eos_token_id: int

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def batch_size(self) -> int:
        """``B``, the number of sequences."""
        return int(self.prompts.shape[0])

    @property
    def prompt_length(self) -> int:
        """``P``, the padded prompt width."""
        return int(self.prompts.shape[1])

    @property
    def response_length(self) -> int:
        """``R``, the padded response width (``max_new_tokens``)."""
        return int(self.responses.shape[1])

    @property
    def input_ids(self) -> torch.Tensor:
        """``[B, P + R]`` int64, ``cat(prompts, responses)`` (the teacher-forcing input)."""
        return torch.cat([self.prompts, self.responses], dim=1)

    @property
    def response_lengths(self) -> torch.Tensor:
        """``[B]`` int64, valid response tokens per sequence (EOS included)."""
        return self.response_mask.sum(dim=1)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors of ``rollout.safetensors``, keyed by ``ROLLOUT_KEYS``."""
        return {key: getattr(self, key) for key in ROLLOUT_KEYS}

    def meta(self) -> dict[str, Any]:
        """The JSON document of ``rollout.json`` (``contracts/schema/rollout.schema.json``)."""
        return {
            "schema_version": ROLLOUT_SCHEMA_VERSION,
            "sampler": {
                "name": self.sampler,
                "version": self.sampler_version,
                "details": dict(self.sampler_details),
            },
            "settings": dict(self.settings),
            "logprobs_mode": self.logprobs_mode,
            "seed": self.seed,
            "pad_token_id": self.pad_token_id,
            "eos_token_id": self.eos_token_id,
            "batch_size": self.batch_size,
            "prompt_length": self.prompt_length,
            "response_length": self.response_length,
            "finish_reasons": list(self.finish_reasons),
        }

    def save(self, directory: str | Path, *, overwrite: bool = False) -> Path:
        """Write ``rollout.safetensors`` and ``rollout.json`` into ``directory``.

        Each file is written atomically (:func:`qualify.atomic.write_bytes`: a temporary
        file in the same directory, renamed into place), tensors first, metadata last.

        Args:
            directory: target directory (created if missing).
            overwrite: replace an existing rollout (a captured rollout is never
                recomputed once sealed, so the default refuses).

        Returns:
            The directory.

        Raises:
            ReferenceDataError: a rollout already exists there and ``overwrite`` is false,
                or the metadata fails its schema (``sampler_details`` not JSON).
        """
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        if not overwrite and ((out / ROLLOUT_FILE).exists() or (out / ROLLOUT_META_FILE).exists()):
            raise ReferenceDataError(f"{out}: a rollout is already stored there")
        meta = self.meta()
        try:
            problem = schema.first_error(meta, "rollout")
            text = json.dumps(meta, indent=2, sort_keys=True) + "\n"
        except (TypeError, ValueError) as exc:
            raise ReferenceDataError(f"{out / ROLLOUT_META_FILE}: invalid metadata: {exc}") from exc
        if problem is not None:
            raise ReferenceDataError(f"{out / ROLLOUT_META_FILE}: invalid metadata: {problem}")
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.to_tensors().items()}
        write_bytes(out / ROLLOUT_FILE, save_bytes(tensors, metadata={"format": "pt"}))
        write_bytes(out / ROLLOUT_META_FILE, text.encode("utf-8"))
        return out

    @classmethod
    def load(cls, directory: str | Path) -> Rollout:
        """Read and validate a stored rollout.

        Checks, each raising :class:`~qualify.errors.ReferenceDataError` whose message
        starts with the file path and the tensor key or JSON field: both files exist;
        ``rollout.json`` is JSON and passes its schema; ``rollout.safetensors`` is readable
        and holds exactly :data:`~qualify.protocol.ROLLOUT_KEYS`; dtypes (int64, float32
        logprobs) and shapes agree with each other and with ``batch_size`` /
        ``prompt_length`` / ``response_length``; masks are 0/1; prompts are left-padded
        and responses right-padded with ``pad_token_id`` where the mask is 0;
        ``response_mask == attention_mask[:, P:]``; position ids follow the convention;
        behavior logprobs are finite and <= 0 on valid tokens and 0 on padding; EOS
        appears only as the last valid token, exactly where ``eos_terminated`` says, and a
        response without EOS fills ``R``; ``finish_reasons`` agree; ``group_index`` is
        ``arange(B) // samples_per_prompt`` and a group shares one prompt.

        Args:
            directory: a directory written by :meth:`save`.

        Returns:
            The rollout (tensors on CPU).

        Raises:
            ReferenceDataError: a check above failed.
        """
        src = Path(directory)
        st_path, meta_path = src / ROLLOUT_FILE, src / ROLLOUT_META_FILE
        for path in (st_path, meta_path):
            if not path.is_file():
                raise ReferenceDataError(f"{path}: missing")
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ReferenceDataError(f"{meta_path}: not valid JSON: {exc}") from None
        problem = schema.first_error(meta, "rollout")
        if problem is not None:
            raise ReferenceDataError(f"{meta_path}: {problem}")
        try:
            tensors = load_file(st_path)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ReferenceDataError(f"{st_path}: not a readable safetensors file: {exc}") from None
        for key in ROLLOUT_KEYS:
            if key not in tensors:
                raise ReferenceDataError(f"{st_path}: {key}: missing")
        for key in sorted(set(tensors) - set(ROLLOUT_KEYS)):
            raise ReferenceDataError(f"{st_path}: {key}: unexpected tensor")
        sampler = meta["sampler"]
        try:
            rollout = cls(
                **{k: tensors[k] for k in ROLLOUT_KEYS},
                sampler=sampler["name"],
                sampler_version=sampler["version"],
                sampler_details=sampler["details"],
                settings=meta["settings"],
                logprobs_mode=meta["logprobs_mode"],
                finish_reasons=tuple(meta["finish_reasons"]),
                seed=meta["seed"],
                pad_token_id=meta["pad_token_id"],
                eos_token_id=meta["eos_token_id"],
            )
        except RolloutLayoutError as exc:
            raise ReferenceDataError(f"{src / exc.file}: {exc.key}: {exc.problem}") from None
        for field, value in (
            ("batch_size", rollout.batch_size),
            ("prompt_length", rollout.prompt_length),
            ("response_length", rollout.response_length),
        ):
            if meta[field] != value:
                raise ReferenceDataError(
                    f"{meta_path}: {field}: {meta[field]} but the tensors have {value}"
                )
        return rollout


def _validate(r: Rollout) -> None:
    """Check the layout of :mod:`qualify.protocol`; raise :class:`RolloutLayoutError`."""
    meta_file = ROLLOUT_META_FILE

    def fail(key: str, problem: str, file: str = ROLLOUT_FILE) -> RolloutLayoutError:
        return RolloutLayoutError(key, problem, file=file)

    t = {key: getattr(r, key) for key in ROLLOUT_KEYS}
    for key, value in t.items():
        if not isinstance(value, torch.Tensor):
            raise fail(key, f"expected a tensor, got {type(value).__name__}")
        want = torch.float32 if key == "behavior_logprobs" else torch.int64
        if value.dtype != want:
            raise fail(key, f"dtype {value.dtype}, expected {want}")
    if t["prompts"].ndim != 2 or t["prompts"].shape[1] < 1:
        raise fail("prompts", f"shape {list(t['prompts'].shape)}, expected [B, P] with P >= 1")
    if t["responses"].ndim != 2 or t["responses"].shape[1] < 1:
        raise fail("responses", f"shape {list(t['responses'].shape)}, expected [B, R] with R >= 1")
    b, p = t["prompts"].shape
    rr = t["responses"].shape[1]
    shapes = {
        "responses": [b, rr],
        "attention_mask": [b, p + rr],
        "position_ids": [b, p + rr],
        "response_mask": [b, rr],
        "behavior_logprobs": [b, rr],
        "eos_terminated": [b],
        "group_index": [b],
    }
    for key, shape in shapes.items():
        if list(t[key].shape) != shape:
            raise fail(key, f"shape {list(t[key].shape)}, expected {shape} (B={b}, P={p}, R={rr})")
    for key in ("attention_mask", "response_mask", "eos_terminated"):
        if not ((t[key] == 0) | (t[key] == 1)).all():
            raise fail(key, "values other than 0 and 1")

    am, rm, pad = t["attention_mask"], t["response_mask"], r.pad_token_id
    if not torch.equal(rm, am[:, p:]):
        raise fail("response_mask", "differs from attention_mask[:, P:]")
    pm = am[:, :p]
    if (pm.diff(dim=1) < 0).any() or (pm[:, -1] != 1).any():
        raise fail("attention_mask", "prompt part is not left-padded (0...0 1...1, last column 1)")
    if (t["prompts"][pm == 0] != pad).any():
        raise fail("prompts", f"padding positions (attention 0) do not hold pad_token_id={pad}")
    if (rm.diff(dim=1) > 0).any() or (rm[:, 0] != 1).any():
        raise fail("response_mask", "not right-padded (1...1 0...0 with at least one token)")
    if (t["responses"][rm == 0] != pad).any():
        raise fail("responses", f"padding positions (mask 0) do not hold pad_token_id={pad}")
    want_pos = (am.cumsum(dim=1) - 1).clamp(min=0)
    if not torch.equal(t["position_ids"], want_pos):
        raise fail("position_ids", "not clamp(cumsum(attention_mask) - 1, min=0)")
    lp, valid = t["behavior_logprobs"], rm == 1
    if (lp[~valid] != 0).any():
        raise fail("behavior_logprobs", "non-zero on padding")
    if not torch.isfinite(lp[valid]).all() or (lp[valid] > 0).any():
        raise fail("behavior_logprobs", "not finite and <= 0 on every valid token")

    lengths = rm.sum(dim=1)
    is_eos = (t["responses"] == r.eos_token_id) & valid
    last_is_eos = is_eos.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1)
    if (is_eos.sum(dim=1) != last_is_eos.long()).any():
        raise fail("responses", f"eos_token_id={r.eos_token_id} inside a response (not last)")
    if not torch.equal(t["eos_terminated"], last_is_eos.long()):
        raise fail("eos_terminated", "disagrees with the last valid response token")
    if ((~last_is_eos) & (lengths != rr)).any():
        raise fail("response_mask", "a response without EOS stops before R (max_new_tokens)")

    for key in _SETTINGS_KEYS:
        if key not in r.settings:
            raise fail(f"settings.{key}", "missing", meta_file)
    if r.logprobs_mode not in ("processed", "raw"):
        raise fail("logprobs_mode", f"{r.logprobs_mode!r} is not 'processed' or 'raw'", meta_file)
    if r.seed != r.settings["seed"]:
        raise fail("seed", f"{r.seed} differs from settings.seed={r.settings['seed']}", meta_file)
    if r.settings["max_new_tokens"] != rr:
        want_r = r.settings["max_new_tokens"]
        raise fail("responses", f"R={rr} differs from settings.max_new_tokens={want_r}")
    want_reasons = tuple("eos" if e else "length" for e in t["eos_terminated"].tolist())
    if tuple(r.finish_reasons) != want_reasons:
        raise fail("finish_reasons", f"{list(r.finish_reasons)} disagrees with eos_terminated "
                   f"{list(want_reasons)}", meta_file)
    n = int(r.settings["samples_per_prompt"])
    if n < 1 or b % n:
        raise fail("settings.samples_per_prompt", f"{n} does not divide B={b}", meta_file)
    if not torch.equal(t["group_index"], torch.arange(b) // n):
        raise fail("group_index", f"not arange(B) // samples_per_prompt (= {n})")
    grouped = t["prompts"].view(b // n, n, p)
    if not (grouped == grouped[:, :1]).all():
        raise fail("prompts", "samples of one group do not share their prompt")


def build_rollout(
    *,
    prompts: Sequence[Sequence[int]],
    generated: Sequence[Sequence[int]],
    logprobs: Sequence[Sequence[float] | torch.Tensor],
    sampling: SamplingSpec,
    pad_token_id: int,
    eos_token_id: int,
    sampler: str,
    sampler_version: str,
    sampler_details: Mapping[str, Any] | None = None,
) -> Rollout:
    """Lay out ragged sampler output as a :class:`Rollout` (shared by every backend).

    Args:
        prompts: the ``len(generated) // samples_per_prompt`` prompts (unpadded ids).
        generated: per sequence (prompt-major), the sampled ids; anything after the first
            ``eos_token_id`` is dropped (it becomes padding), at most ``max_new_tokens``.
        logprobs: per sequence, the behavior logprob of each id of ``generated`` (same
            length; values are stored as float32).
        sampling: the contract's sampling settings.
        pad_token_id: padding id.
        eos_token_id: end-of-sequence id.
        sampler: backend name.
        sampler_version: version of the sampling library.
        sampler_details: backend facts for ``rollout.json``.

    Returns:
        The validated rollout (CPU tensors).

    Raises:
        ValueError: inconsistent lengths, an empty prompt or response, or a response longer
            than ``max_new_tokens``.
        RolloutLayoutError: the assembled tensors break the layout (a backend bug).
    """
    n, big_r = sampling.samples_per_prompt, sampling.max_new_tokens
    if len(generated) != len(prompts) * n or len(logprobs) != len(generated):
        raise ValueError(
            f"{len(prompts)} prompts x {n} samples, but {len(generated)} responses and "
            f"{len(logprobs)} logprob rows"
        )
    if any(len(q) == 0 for q in prompts):
        raise ValueError("empty prompt")
    b, big_p = len(generated), max(len(q) for q in prompts)
    prompt_t = torch.full((b, big_p), pad_token_id, dtype=torch.int64)
    resp_t = torch.full((b, big_r), pad_token_id, dtype=torch.int64)
    lp_t = torch.zeros((b, big_r), dtype=torch.float32)
    resp_mask = torch.zeros((b, big_r), dtype=torch.int64)
    prompt_mask = torch.zeros((b, big_p), dtype=torch.int64)
    eos = torch.zeros(b, dtype=torch.int64)
    for i, (ids, lps) in enumerate(zip(generated, logprobs, strict=True)):
        q = prompts[i // n]
        ids_t = torch.as_tensor(list(ids), dtype=torch.int64)
        lps_t = torch.as_tensor(lps, dtype=torch.float32).reshape(-1)
        if ids_t.numel() != lps_t.numel():
            raise ValueError(f"sequence {i}: {ids_t.numel()} ids but {lps_t.numel()} logprobs")
        hits = (ids_t == eos_token_id).nonzero()
        if hits.numel():
            cut = int(hits[0, 0]) + 1
            ids_t, lps_t, eos[i] = ids_t[:cut], lps_t[:cut], 1
        length = ids_t.numel()
        if not 1 <= length <= big_r:
            raise ValueError(f"sequence {i}: {length} response tokens, expected 1..{big_r}")
        prompt_t[i, big_p - len(q):] = torch.as_tensor(list(q), dtype=torch.int64)
        prompt_mask[i, big_p - len(q):] = 1
        resp_t[i, :length], lp_t[i, :length], resp_mask[i, :length] = ids_t, lps_t, 1
    attention = torch.cat([prompt_mask, resp_mask], dim=1)
    return Rollout(
        prompts=prompt_t,
        responses=resp_t,
        attention_mask=attention,
        position_ids=(attention.cumsum(dim=1) - 1).clamp(min=0),
        response_mask=resp_mask,
        behavior_logprobs=lp_t,
        eos_terminated=eos,
        group_index=torch.arange(b, dtype=torch.int64) // n,
        sampler=sampler,
        sampler_version=sampler_version,
        sampler_details=dict(sampler_details or {}),
        settings={key: getattr(sampling, key) for key in _SETTINGS_KEYS},
        logprobs_mode=sampling.logprobs_mode,
        finish_reasons=tuple("eos" if e else "length" for e in eos.tolist()),
        seed=sampling.seed,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
    )
