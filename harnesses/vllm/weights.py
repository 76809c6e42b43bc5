"""Install Actor weights into a running vLLM sampler: versions, per-rank digests, acks.

:class:`WeightSync` is the update protocol of the sampler cell. One
:meth:`WeightSync.install` of HF-layout weights (``model.safetensors``) at a version:

1. **version**: refuse a version that is not greater than the installed one (nothing is
   touched);
2. **complete**: refuse a weights file that lacks a tensor of the model (``missing_tensor``,
   checked on the file given and on the staged copy vLLM would load, before the engine is
   touched). vLLM's in-place reload does not: a layer none of whose weights arrive keeps
   its previous kernel tensors (``finalize_layerwise_processing`` places them back and logs
   a warning), so a partial file installs the rest and serves the old tensor; and since
   the expected digests are computed from the same file, they do not name it either;
3. **expected digests**: per TP rank, :func:`harnesses.vllm.layout.expected_digests` of
   the HF tensors sliced and fused the way vLLM shards them (computed by this code, not by
   vLLM);
4. **load**: every worker runs :func:`worker_install` through ``LLM.collective_rpc``: vLLM's
   own in-place reload (``Worker.reload_weights(weights_path=DIR)``, vLLM's layerwise
   reload: ``model.load_weights`` with each parameter's ``weight_loader``, then the layer's
   ``process_weights_after_loading``) and one acknowledgement ``(rank, version, digest)``;
5. **acks**: exactly one ack per rank ``0..tp-1`` (a missing or duplicate rank is
   refused), each for this version, each rank's per-tensor digests equal to the expected
   ones (a mismatch is refused and names the rank and tensor);
6. **prefix cache**: ``LLM.reset_prefix_cache()``, then the proof: a prompt served under
   the previous version (so its blocks were cached before the update) is served again and
   must report ``num_cached_tokens == 0`` (a request served from a cache that predates the
   update is refused), and a same-version replay must report ``num_cached_tokens > 0``.

A refusal after step 4 rolls the engine back: the previous version's weights are
reinstalled through the same path, verified against their own expected digests, and the
prefix cache is reset, so the sampler stays on its previous version (recorded).

Where the digests come from (CPU): ``UnquantizedLinearMethod.process_weights_after_loading``
on CPU hands each linear weight to a packed GEMM kernel (oneDNN / sgl) and replaces
``layer.weight`` by an empty tensor (``dispatch_cpu_unquantized_gemm(layer,
remove_weight=True)``), so an installed linear weight cannot be read back afterwards.
:func:`worker_install` therefore wraps ``process_weights_after_loading`` of the
unquantized linear and embedding methods inside each worker and digests ``weight`` /
``bias`` of the layer **at load time**: after vLLM's ``weight_loader`` wrote the rank's
fused shard into the parameter, immediately before vLLM repacks it. Every other
parameter (norms, per-head ``q_norm`` / ``k_norm``; embeddings stay readable) is digested
as held after the reload. On CUDA nothing is repacked and the same hook digests the
parameters vLLM keeps.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from safetensors import safe_open
from safetensors.torch import load_file

from harnesses.vllm import layout
from harnesses.vllm.spec import RPC_DIR_ENV

WEIGHTS_FILE: Final = "model.safetensors"
PROOF_PROMPT_LEN: Final = 64
"""Tokens of the cache-proof prompt (two 32-token blocks: prefix caching reuses whole blocks)."""

_STATE: dict[str, Any] = {"patched": False, "record": None, "names": {}, "version": None}
"""Worker-process state (lives in each vLLM worker; the driver never reads it directly)."""


# --------------------------------------------------------------------------- worker side


def _patch_methods() -> None:
    """Wrap ``process_weights_after_loading`` of the unquantized linear / embedding methods."""
    if _STATE["patched"]:
        return
    from vllm.model_executor.layers.linear import (
        UnquantizedLinearMethod,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
    )

    def wrap(orig: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
        def process_weights_after_loading(self: Any, layer: Any) -> None:
            record = _STATE["record"]
            name = _STATE["names"].get(id(layer))
            if record is not None and name is not None:
                for pname in ("weight", "bias"):
                    p = getattr(layer, pname, None)
                    if p is not None and hasattr(p, "numel") and p.numel() > 0:
                        record[f"{name}.{pname}" if name else pname] = layout.tensor_digest(p)
            orig(self, layer)

        return process_weights_after_loading

    for cls in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod):
        target: Any = cls
        target.process_weights_after_loading = wrap(target.process_weights_after_loading)
    _STATE["patched"] = True


def worker_install(worker: Any, weights_dir: str, version: int) -> dict[str, Any]:
    """Run inside each vLLM worker (``LLM.collective_rpc``): reload, digest, acknowledge.

    Args:
        worker: the vLLM worker (``collective_rpc`` passes it first).
        weights_dir: directory holding ``model.safetensors`` in HF layout.
        version: the version being installed.

    Returns:
        The ack: ``{"rank": TP rank, "version", "digest": digest of the rank's digests,
        "digests": {vLLM parameter name: sha256}, "load_time_digests": names digested
        before repacking, "reload_s"}``.
    """
    from vllm.distributed import get_tensor_model_parallel_rank

    _patch_methods()
    model = worker.model_runner.get_model()
    _STATE["names"] = {id(m): n for n, m in model.named_modules()}
    record: dict[str, str] = {}
    _STATE["record"] = record
    t0 = time.perf_counter()
    try:
        worker.reload_weights(weights_path=weights_dir)
    finally:
        _STATE["record"] = None
    reload_s = time.perf_counter() - t0
    params = dict(model.named_parameters())
    digests: dict[str, str] = {}
    for name, p in params.items():
        if name in record:
            digests[name] = record[name]
        elif p.numel() > 0:
            digests[name] = layout.tensor_digest(p)
    _STATE["version"] = version
    return {"rank": int(get_tensor_model_parallel_rank()), "version": int(version),
            "digest": layout.digest_of_digests(digests), "digests": digests,
            "load_time_digests": sorted(k for k in digests if k in record),
            "reload_s": round(reload_s, 4)}


KERNEL_TOL: Final = 1e-3
"""Largest relative error of a GEMM kernel probe against the weights it should serve (FP32
packed kernels agree with ``x @ W.T`` to ~1e-6; a kernel serving other weights is judged
by which version it is nearer to, not by this tolerance alone)."""


def worker_kernel_probe(worker: Any, new_file: str, old_file: str,
                        spec: dict[str, Any], tp: int) -> dict[str, Any]:
    """Run inside each vLLM worker: which weights does each GEMM kernel compute with?

    The digests of :func:`worker_install` read parameters; on CPU vLLM computes linear
    layers and the LM head with packed copies made by ``process_weights_after_loading``,
    which the digests cannot see. This probe runs each such layer's own
    ``quant_method.apply(layer, x)`` (no bias) on a seeded ``x`` ``[2, in]`` and compares
    the result with ``x @ W.T`` for this rank's shard ``W`` of the new and of the previous
    HF weights (:func:`harnesses.vllm.layout.to_vllm_rank`), FP64 reference products.

    Args:
        worker: the vLLM worker.
        new_file: HF ``model.safetensors`` just installed.
        old_file: HF ``model.safetensors`` of the previous version.
        spec: :class:`harnesses.vllm.layout.LayoutSpec` fields.
        tp: TP size.

    Returns:
        ``{"rank", "layers": {module name: {"err_new", "err_old", "changed"}}}`` with
        relative errors ``max|y - x W.T| / max|x W.T|``.
    """
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    rank = int(get_tensor_model_parallel_rank())
    lspec = layout.LayoutSpec(**spec)
    new = layout.to_vllm_rank(load_file(new_file), lspec, tp, rank)
    old = layout.to_vllm_rank(load_file(old_file), lspec, tp, rank)
    model = worker.model_runner.get_model()
    gen = torch.Generator().manual_seed(1234)
    layers: dict[str, dict[str, Any]] = {}
    for name, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if qm is None or not isinstance(mod, LinearBase | ParallelLMHead):
            continue
        key = f"{name}.weight"
        if isinstance(mod, ParallelLMHead) and lspec.tie_word_embeddings:
            key = "model.embed_tokens.weight"
        w_new, w_old = new.get(key), old.get(key)
        if w_new is None or w_old is None:
            continue
        held = next((q for q in mod.parameters() if q.numel() > 0), None)
        device = held.device if held is not None else torch.device("cpu")
        dtype = held.dtype if held is not None else w_new.dtype
        x = torch.randn(2, w_new.shape[1], generator=gen, dtype=torch.float32)
        with torch.no_grad():
            y = qm.apply(mod, x.to(device, dtype), None).double().cpu()
        x = x.to(dtype).double()  # the input the kernel saw
        errs = {}
        for tag, w in (("err_new", w_new), ("err_old", w_old)):
            ref = x @ w.double().T
            errs[tag] = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
        layers[name] = {**errs, "changed": not torch.equal(w_new, w_old)}
    return {"rank": rank, "layers": layers}


def stale_kernels(probes: Sequence[Mapping[str, Any]]) -> list[str]:
    """The GEMM kernels that do not compute with the newly installed weights.

    A layer whose weights changed is stale when its output is at least as near to the
    previous weights' product as to the new one's; any layer is stale when its error
    against the new weights exceeds :data:`KERNEL_TOL`.

    Args:
        probes: the per-rank results of :func:`worker_kernel_probe`.

    Returns:
        ``"rank r: layer (rel err vs new e1, vs previous e0)"`` per stale kernel.
    """
    out = []
    for pr in sorted(probes, key=lambda p: int(p["rank"])):
        for name, e in sorted(pr["layers"].items()):
            nearer_old = bool(e["changed"]) and e["err_old"] <= e["err_new"]
            if nearer_old or e["err_new"] > KERNEL_TOL:
                out.append(f"rank {pr['rank']}: {name} (rel err vs new {e['err_new']:.3g}, "
                           f"vs previous {e['err_old']:.3g})")
    return out


# --------------------------------------------------------------------------- driver side


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class InstallRecord:
    """What one install attempt did.

    Attributes:
        version: the version asked for.
        previous_version: the version installed before the attempt.
        accepted: the update is installed (every check passed).
        reason: why it was refused (``None`` when accepted).
        check: the refusing check (``stale_version``, ``missing_tensor``, ``missing_ack``,
            ``duplicate_ack``, ``ack_version``, ``digest_mismatch``, ``warm_cache``) or
            ``None``.
        acks: ``(rank, version, digest)`` per ack received (in arrival order).
        expected_digest: per rank, the digest of the expected per-tensor digests.
        tensors_verified: per-rank tensors compared (sum over ranks).
        cache_reset: ``reset_prefix_cache()`` was called (and its return value).
        cached_first: ``num_cached_tokens`` of the first request after the update.
        cached_replay: ``num_cached_tokens`` of the same-version replay.
        installed_version: the version the sampler holds after the attempt.
        rollback: what the rollback did (``None`` when none was needed).
        timings: wall seconds per step.
    """

    version: int
    previous_version: int
    accepted: bool
    reason: str | None
    check: str | None
    acks: tuple[tuple[int, int, str], ...]
    expected_digest: tuple[str, ...]
    tensors_verified: int
    cache_reset: bool | None
    cached_first: int | None
    cached_replay: int | None
    installed_version: int
    rollback: Mapping[str, Any] | None
    timings: Mapping[str, float]

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``outputs.json``)."""
        d = dataclasses.asdict(self)
        d["acks"] = [{"rank": r, "version": v, "digest": g} for r, v, g in self.acks]
        d["expected_digest"] = list(self.expected_digest)
        d["rollback"] = dict(self.rollback) if self.rollback is not None else None
        d["timings"] = dict(self.timings)
        return d


def verify_acks(acks: Sequence[Mapping[str, Any]], expected: Sequence[Mapping[str, str]],
                version: int) -> tuple[str | None, str | None, int]:
    """Check the acks of one install against the expected per-rank digests.

    Args:
        acks: the workers' acks (:func:`worker_install` results), any order.
        expected: per TP rank (index = rank), vLLM parameter name -> expected sha256.
        version: the version being installed.

    Returns:
        ``(check, reason, tensors_compared)``: ``(None, None, n)`` when every rank
        acknowledged once, for ``version``, with exactly the expected digests; otherwise
        the first failing check (``duplicate_ack``, ``missing_ack``, ``ack_version``,
        ``digest_mismatch``) and a reason naming the rank and tensor.
    """
    tp = len(expected)
    ranks = [int(a["rank"]) for a in acks]
    dups = sorted({r for r in ranks if ranks.count(r) > 1})
    if dups:
        return ("duplicate_ack", f"duplicate acknowledgement from rank(s) {dups}: got ranks "
                f"{ranks} for TP {tp}", 0)
    missing = sorted(set(range(tp)) - set(ranks))
    extra = sorted(set(ranks) - set(range(tp)))
    if missing or extra:
        return ("missing_ack", f"missing acknowledgement from rank(s) {missing}"
                + (f" (unknown ranks {extra})" if extra else "")
                + f": got ranks {sorted(ranks)} for TP {tp}", 0)
    n = 0
    for ack in sorted(acks, key=lambda a: int(a["rank"])):
        r = int(ack["rank"])
        if int(ack["version"]) != version:
            return ("ack_version", f"rank {r} acknowledged version {ack['version']}, "
                    f"expected {version}", n)
        got: Mapping[str, str] = ack["digests"]
        want = expected[r]
        for name in sorted(set(want) | set(got)):
            n += 1
            if got.get(name) != want.get(name):
                what = ("not installed" if name not in got else
                        "not expected" if name not in want else
                        f"sha256 {str(got[name])[:12]} != expected {want[name][:12]}")
                return ("digest_mismatch", f"rank {r}: installed shard {name} is {what}", n)
        if ack["digest"] != layout.digest_of_digests(want):
            return ("digest_mismatch", f"rank {r}: acknowledged digest "
                    f"{str(ack['digest'])[:12]} != expected "
                    f"{layout.digest_of_digests(want)[:12]}", n)
    return None, None, n


def proof_prompt(vocab_size: int, avoid: Sequence[int]) -> list[int]:
    """The cache-proof prompt: :data:`PROOF_PROMPT_LEN` token ids, none in ``avoid``."""
    ids = [t for t in range(3, vocab_size) if t not in set(avoid)]
    return [ids[(7 * i) % len(ids)] for i in range(PROOF_PROMPT_LEN)]


class WeightSync:
    """The sampler's installed version and the install protocol (module docstring).

    Args:
        llm: the ``vllm.LLM`` (prefix caching on).
        spec: the model's layout.
        tp: the engine's TP size.
        workdir: where staged weight directories are written (one per attempt).
        base_dir: the directory the engine was started from (version ``0``).
        proof: the cache-proof prompt token ids.
    """

    def __init__(self, llm: Any, *, spec: layout.LayoutSpec, tp: int, workdir: Path,
                 base_dir: Path, proof: list[int]) -> None:
        self.llm = llm
        self.spec = spec
        self.tp = tp
        self.workdir = workdir
        self.proof = proof
        self.version = 0
        self.current_dir = base_dir
        self.current_expected = self.expected_for(base_dir / WEIGHTS_FILE)
        with safe_open(str(base_dir / WEIGHTS_FILE), framework="pt") as f:
            self.required: frozenset[str] = frozenset(f.keys())
        """Every HF tensor the model holds: the keys of the file the engine started from."""
        self.history: list[InstallRecord] = []
        self._n = 0

    def missing_tensors(self, weights_file: Path) -> list[str]:
        """The model's HF tensors (those of the version-0 file) that ``weights_file`` lacks."""
        with safe_open(str(weights_file), framework="pt") as f:
            have = set(f.keys())
        return sorted(self.required - have)

    def expected_for(self, weights_file: Path) -> list[dict[str, str]]:
        """Per-rank expected digests of an HF ``model.safetensors``."""
        return layout.expected_digests(load_file(str(weights_file)), self.spec, self.tp)

    def serve_proof(self) -> int:
        """Serve the cache-proof prompt once (1 token, greedy); its ``num_cached_tokens``."""
        from vllm import SamplingParams

        out = self.llm.generate([{"prompt_token_ids": self.proof}],
                                SamplingParams(max_tokens=1, temperature=0.0),
                                use_tqdm=False)
        return int(out[0].num_cached_tokens or 0)

    def _stage(self, weights_file: Path, version: int,
               tamper: Callable[[Path], None] | None) -> Path:
        self._n += 1
        d = self.workdir / f"{self._n:02d}-v{version}"
        d.mkdir(parents=True, exist_ok=True)
        if tamper is None:
            try:
                os.link(weights_file, d / WEIGHTS_FILE)
            except OSError:
                shutil.copyfile(weights_file, d / WEIGHTS_FILE)
        else:
            shutil.copyfile(weights_file, d / WEIGHTS_FILE)
            tamper(d / WEIGHTS_FILE)
        return d

    def _load(self, weights_dir: Path, version: int) -> list[dict[str, Any]]:
        acks: list[dict[str, Any]] = self.llm.collective_rpc(
            worker_install, kwargs={"weights_dir": str(weights_dir), "version": version})
        return acks

    def install(self, weights_file: Path, version: int, *,
                tamper: Callable[[Path], None] | None = None,
                acks_filter: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None
                = None, skip_cache_reset: bool = False) -> InstallRecord:
        """Install ``weights_file`` as ``version`` (the protocol of the module docstring).

        Args:
            weights_file: HF-layout ``model.safetensors`` (the expected digests come from it).
            version: the new version; must exceed :attr:`version`.
            tamper: rejection probes only: edits the staged copy vLLM loads (an incorrect
                shard reaches the engine).
            acks_filter: rejection probes only: edits the acks received (a lost or
                duplicated acknowledgement).
            skip_cache_reset: rejection probes only: the prefix cache is not reset.

        Returns:
            The :class:`InstallRecord` (also appended to :attr:`history`).
        """
        t: dict[str, float] = {}
        prev = self.version
        base = {"version": version, "previous_version": prev}
        if version <= prev:  # CHECK(stale_version)
            rec = InstallRecord(**base, accepted=False, check="stale_version",
                                reason=f"stale version: {version} is not greater than the "
                                       f"installed version {prev}", acks=(),
                                expected_digest=(), tensors_verified=0, cache_reset=None,
                                cached_first=None, cached_replay=None,
                                installed_version=prev, rollback=None, timings=t)
            self.history.append(rec)
            return rec
        missing = self.missing_tensors(weights_file)
        if missing:  # CHECK(missing_tensor): before the expected digests, which omit it
            return self._refuse_partial(base, prev, missing, weights_file, t)
        t0 = time.perf_counter()
        expected = self.expected_for(weights_file)
        t["expected_digests_s"] = round(time.perf_counter() - t0, 4)
        self.serve_proof()  # the proof prompt is cached under the previous version
        staged = self._stage(weights_file, version, tamper)
        missing = self.missing_tensors(staged / WEIGHTS_FILE)
        if missing:  # CHECK(missing_tensor): the copy vLLM would load
            return self._refuse_partial(base, prev, missing, staged / WEIGHTS_FILE, t)
        t0 = time.perf_counter()
        acks = self._load(staged, version)
        t["reload_s"] = round(time.perf_counter() - t0, 4)
        if acks_filter is not None:
            acks = acks_filter(acks)
        check, reason, n = verify_acks(acks, expected, version)
        reset: bool | None = None
        if not skip_cache_reset:
            reset = bool(self.llm.reset_prefix_cache())
        t0 = time.perf_counter()
        first = self.serve_proof()
        replay = self.serve_proof()
        t["cache_proof_s"] = round(time.perf_counter() - t0, 4)
        if check is None and first != 0:  # CHECK(warm_cache)
            check, reason = "warm_cache", (
                f"warm cache: the first request after the update was served "
                f"{first} cached tokens from a prefix cache that predates version {version}")
        rollback = None
        if check is not None:
            rollback = self._rollback()
        else:
            self.version, self.current_dir, self.current_expected = version, staged, expected
        rec = InstallRecord(
            **base, accepted=check is None, check=check, reason=reason,
            acks=tuple((int(a["rank"]), int(a["version"]), str(a["digest"])) for a in acks),
            expected_digest=tuple(layout.digest_of_digests(e) for e in expected),
            tensors_verified=n, cache_reset=reset, cached_first=first, cached_replay=replay,
            installed_version=self.version, rollback=rollback, timings=t)
        self.history.append(rec)
        return rec

    def _refuse_partial(self, base: dict[str, int], prev: int, missing: Sequence[str],
                        path: Path, t: Mapping[str, float]) -> InstallRecord:
        """The ``missing_tensor`` refusal: nothing reached the engine; no rollback needed."""
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        rec = InstallRecord(**base, accepted=False, check="missing_tensor",
                            reason=f"partial install: {path.name} lacks {len(missing)} "
                                   f"tensor(s) of the model: {missing[0]}{more}",
                            acks=(), expected_digest=(), tensors_verified=0,
                            cache_reset=None, cached_first=None, cached_replay=None,
                            installed_version=prev, rollback=None, timings=dict(t))
        self.history.append(rec)
        return rec

    def _rollback(self) -> dict[str, Any]:
        """Reinstall the current version's weights, verify them, reset the prefix cache."""
        t0 = time.perf_counter()
        acks = self._load(self.current_dir, self.version)
        check, reason, n = verify_acks(acks, self.current_expected, self.version)
        reset = bool(self.llm.reset_prefix_cache())
        return {"version": self.version, "verified": check is None, "problem": reason,
                "tensors_verified": n, "cache_reset": reset,
                "acks": [{"rank": int(a["rank"]), "version": int(a["version"]),
                          "digest": str(a["digest"])} for a in acks],
                "wall_s": round(time.perf_counter() - t0, 4)}

    def kernel_probe(self, previous_file: Path) -> dict[str, Any]:
        """Probe every rank's GEMM kernels against the current and ``previous_file`` weights.

        Returns:
            ``{"version", "layers_probed", "stale": [...], "worst_err_new", "ranks"}``
            (:func:`worker_kernel_probe`, :func:`stale_kernels`), for ``outputs.json``.
        """
        spec = dataclasses.asdict(self.spec)
        probes: list[dict[str, Any]] = self.llm.collective_rpc(
            worker_kernel_probe, kwargs={"new_file": str(self.current_dir / WEIGHTS_FILE),
                                         "old_file": str(previous_file), "spec": spec,
                                         "tp": self.tp})
        errs = [e["err_new"] for p in probes for e in p["layers"].values()]
        return {"version": self.version, "previous_file": str(previous_file),
                "layers_probed": sum(len(p["layers"]) for p in probes),
                "changed": sum(bool(e["changed"]) for p in probes
                               for e in p["layers"].values()),
                "stale": stale_kernels(probes), "worst_err_new": max(errs, default=0.0),
                "tolerance": KERNEL_TOL}

    def verify_current(self) -> tuple[str | None, str | None, int]:
        """Reinstall nothing; re-digest the current version's weights on every rank.

        Reloads the current weights (same version) and checks the acks: the installed
        shards are what the current version's expected digests say.
        """
        acks = self._load(self.current_dir, self.version)
        self.llm.reset_prefix_cache()
        return verify_acks(acks, self.current_expected, self.version)


def env_summary() -> dict[str, str]:
    """The ``VLLM_*`` and ``TORCH_COMPILE_DISABLE`` variables set (for ``outputs.json``).

    Leaves out :data:`harnesses.vllm.spec.RPC_DIR_ENV`, where the IPC sockets go: a
    private directory made afresh for each process (``PRIVATE_DIRS``), it changes no number.
    """
    return {k: v for k, v in os.environ.items()
            if (k.startswith("VLLM_") and k != RPC_DIR_ENV) or k == "TORCH_COMPILE_DISABLE"}
