"""Rollout capture: determinism, layout, behavior logprobs, storage and its validation."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from qualify import registry
from qualify.contract import SamplingSpec
from qualify.errors import ContractError, HarnessError, ReferenceDataError
from qualify.protocol import ROLLOUT_FILE, ROLLOUT_KEYS, ROLLOUT_META_FILE
from qualify.reference.rollout import Rollout, build_rollout
from qualify.reference.sampling import (
    HfRolloutBackend,
    RolloutBackend,
    get_backend,
    rollout_backend,
)

PAD, EOS, BOS = 0, 2, 1
PROMPTS = [[1, 17, 45, 200, 33], [1, 90, 12], [1, 250, 251, 252, 253, 254, 99], [1, 5, 300, 6]]
CONTRACT_SAMPLING = SamplingSpec(
    engine="hf", temperature=0.9, top_p=0.95, top_k=64, max_new_tokens=10,
    samples_per_prompt=2, seed=2026, logprobs_mode="processed",
)


def tiny_actor(seed: int = 1234, attn: str = "sdpa") -> Qwen3ForCausalLM:
    """Tiny Qwen3 with peaked logits (so top-k/top-p bite) and an EOS that is often sampled."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(  # type: ignore[call-arg]
        vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, pad_token_id=PAD,
        eos_token_id=EOS, bos_token_id=BOS, attn_implementation=attn,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
        hidden = model.model(torch.randint(3, 384, (8, 12))).last_hidden_state.reshape(-1, 64)
        mean = hidden.mean(0)
        model.lm_head.weight[EOS] = mean / mean.norm() ** 2 * 8.0
    return model


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads; on a busy 2-core box they lose 10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def actor() -> Qwen3ForCausalLM:
    return tiny_actor()


@pytest.fixture(scope="module")
def rollout(actor: Qwen3ForCausalLM) -> Rollout:
    return HfRolloutBackend(actor).sample(
        PROMPTS, CONTRACT_SAMPLING, pad_token_id=PAD, eos_token_id=EOS
    )


@pytest.fixture(scope="module")
def saved(rollout: Rollout, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rollout.save(tmp_path_factory.mktemp("rollout"))


# --- backend registry -------------------------------------------------------------------


def test_registry_resolves_hf_lazily(actor: Qwen3ForCausalLM) -> None:
    assert rollout_backend("hf") is HfRolloutBackend
    assert registry.get_rollout_backend("vllm").entry == "harnesses.vllm.rollout:VllmRolloutBackend"
    backend = HfRolloutBackend(actor)
    assert isinstance(backend, RolloutBackend)
    assert backend.name == "hf"
    assert isinstance(get_backend("hf", model=actor), HfRolloutBackend)


def test_model_may_be_given_to_sample(actor: Qwen3ForCausalLM, rollout: Rollout) -> None:
    late = get_backend("hf").sample(PROMPTS, CONTRACT_SAMPLING, pad_token_id=PAD,
                                    eos_token_id=EOS, model=actor)
    assert torch.equal(late.responses, rollout.responses)
    with pytest.raises(ValueError, match="no model"):
        HfRolloutBackend().sample(PROMPTS, CONTRACT_SAMPLING, pad_token_id=PAD, eos_token_id=EOS)


def test_registry_unknown_name_suggests_and_lists() -> None:
    with pytest.raises(ContractError, match=r"'hff'.*did you mean 'hf'.*known backends: hf, vllm"):
        rollout_backend("hff")


@pytest.mark.parametrize(
    ("target", "message"),
    [
        pytest.param("qualify._no_such_module:X", "cannot import", id="module-missing"),
        pytest.param("qualify.reference.rollout:ROLLOUT_SCHEMA_VERSION", "is not a class",
                     id="not-a-class"),
    ],
)
def test_registry_broken_entries(monkeypatch: pytest.MonkeyPatch, target: str,
                                 message: str) -> None:
    registry.ROLLOUT_BACKENDS.register(
        "broken", registry.EngineSpec(name="broken", kind="rollout", entry=target))
    try:
        with pytest.raises(HarnessError, match=message):
            rollout_backend("broken")
    finally:
        registry._reset_for_tests()


def test_hf_backend_rejects_tp_and_bf16(actor: Qwen3ForCausalLM) -> None:
    with pytest.raises(ContractError, match=r"sampling\.tp"):
        HfRolloutBackend(actor).sample(PROMPTS, dataclasses.replace(CONTRACT_SAMPLING, tp=2),
                                       pad_token_id=PAD, eos_token_id=EOS)
    bf16 = tiny_actor().to(torch.bfloat16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="FP32"):
        HfRolloutBackend(bf16).sample(PROMPTS, CONTRACT_SAMPLING, pad_token_id=PAD,
                                      eos_token_id=EOS)


# --- determinism and layout -------------------------------------------------------------


def test_sampling_is_deterministic_with_the_seed(actor: Qwen3ForCausalLM, rollout: Rollout) -> None:
    again = HfRolloutBackend(actor).sample(
        PROMPTS, CONTRACT_SAMPLING, pad_token_id=PAD, eos_token_id=EOS
    )
    for key in ROLLOUT_KEYS:
        assert torch.equal(getattr(again, key), getattr(rollout, key)), key
    assert again.meta() == rollout.meta()


def test_layout_invariants(rollout: Rollout) -> None:
    n, big_r = CONTRACT_SAMPLING.samples_per_prompt, CONTRACT_SAMPLING.max_new_tokens
    b, big_p = len(PROMPTS) * n, max(map(len, PROMPTS))
    assert rollout.prompts.shape == (b, big_p)
    assert rollout.responses.shape == (b, big_r)
    assert rollout.attention_mask.shape == (b, big_p + big_r)
    assert rollout.behavior_logprobs.dtype == torch.float32
    assert rollout.group_index.tolist() == [i // n for i in range(b)]
    # the fixture's EOS bias gives both finish reasons
    assert set(rollout.finish_reasons) == {"eos", "length"}
    for i in range(b):
        q = PROMPTS[i // n]
        pad = big_p - len(q)
        assert rollout.prompts[i].tolist() == [PAD] * pad + q
        assert rollout.attention_mask[i, :big_p].tolist() == [0] * pad + [1] * len(q)
        length = int(rollout.response_mask[i].sum())
        assert rollout.response_mask[i].tolist() == [1] * length + [0] * (big_r - length)
        assert rollout.responses[i, length:].eq(PAD).all()
        assert rollout.behavior_logprobs[i, length:].eq(0).all()
        assert (rollout.behavior_logprobs[i, :length] <= 0).all()
        ended = rollout.responses[i, length - 1].item() == EOS
        assert rollout.finish_reasons[i] == ("eos" if ended else "length")
        assert rollout.eos_terminated[i].item() == int(ended)
        if not ended:
            assert length == big_r
        assert EOS not in rollout.responses[i, : length - 1].tolist()
        # positions: 0 on left padding, then 0, 1, 2, ... over real tokens, frozen after
        pos = rollout.position_ids[i].tolist()
        assert pos[: pad + 1] == [0] * (pad + 1)
        assert pos[pad : pad + len(q) + length] == list(range(len(q) + length))
        assert all(x == len(q) + length - 1 for x in pos[pad + len(q) + length :])
    meta = rollout.meta()
    assert meta["sampler"]["name"] == "hf"
    assert meta["sampler"]["details"]["warpers"] == [
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper",
    ]


# --- behavior logprobs ------------------------------------------------------------------


def _sample(actor: Qwen3ForCausalLM, **changes: Any) -> Rollout:
    spec = dataclasses.replace(CONTRACT_SAMPLING, **changes)
    return HfRolloutBackend(actor).sample(PROMPTS[:2], spec, pad_token_id=PAD, eos_token_id=EOS)


def test_processed_equals_raw_without_warpers(actor: Qwen3ForCausalLM) -> None:
    plain = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_new_tokens": 6}
    processed = _sample(actor, logprobs_mode="processed", **plain)
    raw = _sample(actor, logprobs_mode="raw", **plain)
    assert torch.equal(processed.responses, raw.responses)  # the mode never changes sampling
    assert processed.meta()["sampler"]["details"]["warpers"] == []
    torch.testing.assert_close(processed.behavior_logprobs, raw.behavior_logprobs,
                               rtol=0, atol=1e-6)


def _warp(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Independent sampling distribution: temperature, then top-k, then top-p (descending form).

    A token survives top-p if the mass of the strictly more probable tokens is < top_p.
    """
    z = logits / temperature
    if top_k:
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = z.softmax(-1).sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    return torch.log_softmax(z, dim=-1)


def _teacher_forced(actor: Qwen3ForCausalLM, r: Rollout, row: int) -> tuple[torch.Tensor, int]:
    """Unpadded teacher-forced logits ``[len, V]`` of a row's response tokens, and ``len``."""
    q = r.prompts[row][r.attention_mask[row, : r.prompt_length].bool()]
    length = int(r.response_mask[row].sum())
    ids = torch.cat([q, r.responses[row, :length]])
    with torch.no_grad():
        logits = actor(ids[None]).logits[0].float()
    return logits[len(q) - 1 : len(q) - 1 + length], length


@pytest.mark.parametrize("mode", ["processed", "raw"])
def test_behavior_logprobs_match_teacher_forcing(actor: Qwen3ForCausalLM, rollout: Rollout,
                                                 mode: str) -> None:
    r = rollout if mode == "processed" else _sample(actor, logprobs_mode="raw")
    s = CONTRACT_SAMPLING
    for row in range(r.batch_size):
        logits, length = _teacher_forced(actor, r, row)
        dist = (_warp(logits, s.temperature, s.top_k, s.top_p) if mode == "processed"
                else torch.log_softmax(logits, dim=-1))
        want = dist.gather(-1, r.responses[row, :length, None]).squeeze(-1)
        assert torch.isfinite(want).all(), "a sampled token outside the sampling distribution"
        torch.testing.assert_close(r.behavior_logprobs[row, :length], want, rtol=0, atol=1e-5)


def test_processed_is_temperature_scaled_raw(actor: Qwen3ForCausalLM) -> None:
    """Without truncation, processed = log_softmax(logits / T) and raw = log_softmax(logits)."""
    plain = {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "max_new_tokens": 6}
    processed = _sample(actor, logprobs_mode="processed", **plain)
    raw = _sample(actor, logprobs_mode="raw", **plain)
    assert torch.equal(processed.responses, raw.responses)
    for row in range(processed.batch_size):
        logits, length = _teacher_forced(actor, processed, row)
        tok = processed.responses[row, :length, None]
        scaled = torch.log_softmax(logits / 0.7, -1).gather(-1, tok).squeeze(-1)
        unscaled = torch.log_softmax(logits, -1).gather(-1, tok).squeeze(-1)
        torch.testing.assert_close(processed.behavior_logprobs[row, :length], scaled,
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(raw.behavior_logprobs[row, :length], unscaled,
                                   rtol=0, atol=1e-5)


# --- build_rollout ----------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    n_prompts=st.integers(1, 3),
    n=st.integers(1, 3),
    big_r=st.integers(1, 6),
)
def test_build_rollout_layout_property(data: st.DataObject, n_prompts: int, n: int,
                                       big_r: int) -> None:
    ids = st.integers(0, 9)  # includes PAD (0) and EOS (2) as sampled tokens
    prompts = [data.draw(st.lists(ids, min_size=1, max_size=5)) for _ in range(n_prompts)]
    generated = []
    for _ in range(n_prompts * n):
        seq = data.draw(st.lists(ids, min_size=1, max_size=big_r))
        if EOS not in seq:  # a response without EOS runs to max_new_tokens
            seq = seq + data.draw(st.lists(st.sampled_from([0, 1, 3]), min_size=big_r - len(seq),
                                           max_size=big_r - len(seq)))
        generated.append(seq)
    spec = dataclasses.replace(CONTRACT_SAMPLING, samples_per_prompt=n, max_new_tokens=big_r)
    lps = [[-0.5] * len(g) for g in generated]
    r = build_rollout(prompts=prompts, generated=generated, logprobs=lps, sampling=spec,
                      pad_token_id=PAD, eos_token_id=EOS, sampler="test", sampler_version="0")
    for i, g in enumerate(generated):
        cut = g.index(EOS) + 1 if EOS in g else len(g)
        assert r.responses[i, :cut].tolist() == g[:cut]
        assert int(r.response_mask[i].sum()) == cut
        assert r.eos_terminated[i].item() == int(EOS in g)
    assert torch.equal(r.position_ids, (r.attention_mask.cumsum(1) - 1).clamp(min=0))


def test_build_rollout_rejects_bad_input() -> None:
    spec = dataclasses.replace(CONTRACT_SAMPLING, samples_per_prompt=1, max_new_tokens=2)
    with pytest.raises(ValueError, match="3 response tokens"):
        build_rollout(prompts=[[1]], generated=[[5, 6, 7]], logprobs=[[-1.0] * 3], sampling=spec,
                      pad_token_id=PAD, eos_token_id=EOS, sampler="t", sampler_version="0")
    with pytest.raises(ValueError, match="2 prompts x 1 samples"):
        build_rollout(prompts=[[1], [1]], generated=[[5, 6]], logprobs=[[-1.0] * 2],
                      sampling=spec, pad_token_id=PAD, eos_token_id=EOS, sampler="t",
                      sampler_version="0")


# --- storage ----------------------------------------------------------------------------


def test_save_load_roundtrip(rollout: Rollout, saved: Path) -> None:
    loaded = Rollout.load(saved)
    for key in ROLLOUT_KEYS:
        assert torch.equal(getattr(loaded, key), getattr(rollout, key)), key
    assert loaded.meta() == rollout.meta()
    assert sorted(p.name for p in saved.iterdir()) == [ROLLOUT_META_FILE, ROLLOUT_FILE]
    with pytest.raises(ReferenceDataError, match="already stored"):
        rollout.save(saved)


Mutation = Callable[[dict[str, torch.Tensor], dict[str, Any]], None]


def _set(key: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> Mutation:
    def mutate(t: dict[str, torch.Tensor], _m: dict[str, Any]) -> None:
        t[key] = fn(t[key].clone())
    return mutate


def _masked(key: str, value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    del key

    def fn(x: torch.Tensor) -> torch.Tensor:
        x[:, -1] = value  # last column: padding for EOS-terminated rows
        return x
    return fn


def _drop(key: str) -> Mutation:
    def mutate(t: dict[str, torch.Tensor], _m: dict[str, Any]) -> None:
        del t[key]
    return mutate


def _meta(path: str, value: Any) -> Mutation:
    def mutate(_t: dict[str, torch.Tensor], m: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = m
        for p in parents:
            node = node[p]
        node[last] = value
    return mutate


def _flip_finish(_t: dict[str, torch.Tensor], m: dict[str, Any]) -> None:
    m["finish_reasons"] = ["eos" if f == "length" else "length" for f in m["finish_reasons"]]


def _extra(t: dict[str, torch.Tensor], _m: dict[str, Any]) -> None:
    t["values"] = torch.zeros(1)


def _first_column(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        x[:, 0] = value  # column 0 always holds a valid response token
        return x
    return fn


def _shift_padding(x: torch.Tensor) -> torch.Tensor:
    x[:, 0] = 1 - x[:, 0]
    return x


CORRUPTIONS: list[Any] = [
    pytest.param(_drop("group_index"), ROLLOUT_FILE, "group_index: missing", id="missing-tensor"),
    pytest.param(_extra, ROLLOUT_FILE, "values: unexpected tensor", id="extra-tensor"),
    pytest.param(_set("behavior_logprobs", lambda x: x.double()), ROLLOUT_FILE,
                 "behavior_logprobs: dtype torch.float64", id="wrong-dtype"),
    pytest.param(_set("responses", lambda x: x[:, :-1].contiguous()), ROLLOUT_FILE,
                 "attention_mask: shape", id="wrong-shape"),
    pytest.param(_set("response_mask", lambda x: x * 2), ROLLOUT_FILE,
                 "response_mask: values other than 0 and 1", id="mask-not-binary"),
    pytest.param(_set("attention_mask", _shift_padding), ROLLOUT_FILE,
                 "attention_mask: prompt part is not left-padded", id="prompt-not-left-padded"),
    pytest.param(_set("responses", _masked("responses", 7)), ROLLOUT_FILE,
                 "responses: padding positions", id="response-padding-not-pad"),
    pytest.param(_set("position_ids", lambda x: x + 1), ROLLOUT_FILE,
                 "position_ids: not clamp", id="position-ids"),
    pytest.param(_set("behavior_logprobs", _masked("behavior_logprobs", -1.0)), ROLLOUT_FILE,
                 "behavior_logprobs: non-zero on padding", id="logprob-on-padding"),
    pytest.param(_set("behavior_logprobs", _first_column(0.5)), ROLLOUT_FILE,
                 "behavior_logprobs: not finite and <= 0", id="positive-logprob"),
    pytest.param(_set("eos_terminated", lambda x: 1 - x), ROLLOUT_FILE,
                 "eos_terminated: disagrees", id="eos-flag"),
    pytest.param(_set("group_index", lambda x: x.flip(0)), ROLLOUT_FILE,
                 "group_index: not arange", id="group-index"),
    pytest.param(_flip_finish, ROLLOUT_META_FILE, "finish_reasons: ", id="finish-reasons"),
    pytest.param(_meta("batch_size", 99), ROLLOUT_META_FILE, "batch_size: 99 but",
                 id="batch-size"),
    pytest.param(_meta("settings.samples_per_prompt", 3), ROLLOUT_META_FILE,
                 "settings.samples_per_prompt: 3 does not divide B=8", id="samples-per-prompt"),
    pytest.param(_meta("unknown", 1), ROLLOUT_META_FILE, "Additional properties",
                 id="json-unknown-field"),
    pytest.param(_meta("logprobs_mode", "warped"), ROLLOUT_META_FILE, "logprobs_mode: ",
                 id="json-bad-enum"),
    pytest.param(_meta("seed", 7), ROLLOUT_META_FILE, "seed: 7 differs", id="json-seed"),
]


@pytest.mark.parametrize(("mutate", "file", "message"), CORRUPTIONS)
def test_load_rejects_corruption(saved: Path, tmp_path: Path, mutate: Mutation, file: str,
                                 message: str) -> None:
    tensors = load_file(saved / ROLLOUT_FILE)
    meta = json.loads((saved / ROLLOUT_META_FILE).read_text())
    mutate(tensors, meta)
    save_file(tensors, tmp_path / ROLLOUT_FILE)
    (tmp_path / ROLLOUT_META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ReferenceDataError) as info:
        Rollout.load(tmp_path)
    text = str(info.value)
    assert text.startswith(str(tmp_path / file)), text
    assert message in text, text


@pytest.mark.parametrize(
    ("file", "content", "message"),
    [
        pytest.param(ROLLOUT_FILE, b"not safetensors", "not a readable safetensors",
                     id="garbage-tensors"),
        pytest.param(ROLLOUT_META_FILE, b"{", "not valid JSON", id="garbage-json"),
    ],
)
def test_load_rejects_unreadable_files(saved: Path, tmp_path: Path, file: str, content: bytes,
                                       message: str) -> None:
    for name in (ROLLOUT_FILE, ROLLOUT_META_FILE):
        (tmp_path / name).write_bytes((saved / name).read_bytes())
    (tmp_path / file).write_bytes(content)
    with pytest.raises(ReferenceDataError, match=message):
        Rollout.load(tmp_path)


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ReferenceDataError, match=r"rollout\.safetensors: missing"):
        Rollout.load(tmp_path)


# --- the vllm backend seam (no engine started here) ---------------------------------------


def test_vllm_backend_resolves_without_importing_vllm() -> None:
    """``rollout_backend("vllm")`` imports the harness module, never the engine."""
    import os
    import subprocess
    import sys

    from qualify.candidate.launch import launch_env

    code = ("import sys; from qualify.reference.sampling import rollout_backend; "
            "cls = rollout_backend('vllm'); b = cls(); "
            "assert 'vllm' not in sys.modules, 'vllm imported'; print(cls.__name__, b.name)")
    out = subprocess.run([sys.executable, "-c", code], env=launch_env(None), check=True,
                         capture_output=True, text=True, timeout=120, cwd=os.getcwd())
    assert out.stdout.split() == ["VllmRolloutBackend", "vllm"]


def test_vllm_backend_rejects_a_model_object_before_starting_anything(
        actor: Qwen3ForCausalLM) -> None:
    from harnesses.vllm.rollout import VllmRolloutBackend

    vllm_sampling = dataclasses.replace(CONTRACT_SAMPLING, engine="vllm")
    with pytest.raises(ValueError, match="model directory"):
        VllmRolloutBackend().sample(PROMPTS, vllm_sampling, pad_token_id=PAD, eos_token_id=EOS,
                                    model=actor)
    with pytest.raises(ValueError, match="model directory"):
        VllmRolloutBackend().sample(PROMPTS, vllm_sampling, pad_token_id=PAD, eos_token_id=EOS)
    with pytest.raises(ValueError, match="empty prompt"):
        VllmRolloutBackend("unused").sample([[1], []], vllm_sampling, pad_token_id=PAD,
                                            eos_token_id=EOS)


def test_capture_rollout_hf_fallback_path() -> None:
    """``engine = "hf"`` keeps the HF sampler: the verified actor directory at FP32/sdpa."""
    from qualify.contract import load_contract
    from qualify.models import bundle as models
    from qualify.models import roles
    from qualify.reference.sampling import capture_rollout
    from qualify.resources import contracts_dir

    bundle = models.prepare_models(load_contract(contracts_dir() / "tiny-qwen3.toml"))
    got = capture_rollout(CONTRACT_SAMPLING, PROMPTS, actor_dir=bundle.actor_dir,
                          pad_token_id=PAD, eos_token_id=EOS)
    model = roles.load_actor(bundle.actor_dir, dtype=torch.float32, attn_implementation="sdpa")
    direct = HfRolloutBackend(model).sample(PROMPTS, CONTRACT_SAMPLING, pad_token_id=PAD,
                                            eos_token_id=EOS)
    assert got.sampler == "hf"
    assert got.sampler_details["attn_implementation"] == "sdpa"
    assert torch.equal(got.responses, direct.responses)
    assert torch.equal(got.behavior_logprobs, direct.behavior_logprobs)


@pytest.mark.parametrize(
    ("tp", "cores", "per_rank", "expected"),
    [
        pytest.param(1, [0, 1], 1, "0", id="tp1"),
        pytest.param(2, [0, 1], 1, "0|1", id="tp2"),
        pytest.param(1, [0, 1], 2, "0,1", id="tp1-two-cores"),
        pytest.param(2, [4, 2, 3, 5], 2, "2,3|4,5", id="tp2-sorted"),
    ],
)
def test_cpu_threads_bind(tp: int, cores: list[int], per_rank: int, expected: str) -> None:
    from harnesses.vllm.engine import cpu_threads_bind

    assert cpu_threads_bind(tp, cores, per_rank=per_rank) == expected


def test_cpu_threads_bind_needs_a_core_per_rank() -> None:
    from harnesses.vllm.engine import cpu_threads_bind

    with pytest.raises(ValueError, match="needs 2 cores"):
        cpu_threads_bind(2, [0])
    with pytest.raises(ValueError, match="must be >= 1"):
        cpu_threads_bind(0, [0])


def test_threads_bind_is_set_only_where_vllm_applies_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 1 runs vLLM's engine in this process, which ignores VLLM_CPU_OMP_THREADS_BIND."""
    import importlib.util

    from harnesses.vllm.engine import configure_env

    for key in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING",
                "TORCH_COMPILE_DISABLE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in configure_env(1)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    assert configure_env(2)["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    # the upstream fact the rule rests on: only the multiprocessing executor (the TP > 1
    # workers) binds threads; if a vLLM upgrade binds them elsewhere, revisit the rule
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vllm is not installed")
    root = Path(spec.origin).parent
    binders = sorted(str(f.relative_to(root)) for f in root.rglob("*.py")
                     if "OMPProcessManager(" in f.read_text("utf-8", errors="replace"))
    assert binders == ["v1/executor/multiproc_executor.py"], binders


def test_build_llm_rejects_a_head_size_the_cpu_backend_lacks(tmp_path: Path) -> None:
    """Checked from ``config.json`` before vllm is imported or any variable is set."""
    from harnesses.vllm.engine import build_llm

    (tmp_path / "config.json").write_text(json.dumps(
        {"hidden_size": 48, "num_attention_heads": 2, "head_dim": 24}))
    with pytest.raises(ValueError, match="head_dim 24"):
        build_llm(tmp_path)
    with pytest.raises(ValueError, match="logprobs_mode"):
        build_llm(tmp_path, logprobs_mode="logits")  # type: ignore[arg-type]


def test_contract_rejects_hf_sampler_with_tp() -> None:
    from qualify.contract import loads_contract
    from qualify.resources import contracts_dir

    text = (contracts_dir() / "tiny-qwen3.toml").read_text()
    head, sep, tail = text.partition("[sampling]\n")
    assert 'engine = "vllm"\ntp = 1\n' in tail.split("\n[")[0]  # vLLM is the committed default
    with pytest.raises(ContractError, match=r"sampling\.tp: the hf sampler"):
        loads_contract(head + sep + tail.replace('engine = "vllm"\ntp = 1\n',
                                                 'engine = "hf"\ntp = 2\n', 1))
    hf = loads_contract(head + sep + tail.replace('engine = "vllm"\n', 'engine = "hf"\n', 1))
    assert hf.sampling.engine == "hf"


def test_the_hf_backend_is_registered_by_its_module() -> None:
    """The registry's ``hf`` entry names the class where it lives (no alias module)."""
    assert registry.get_rollout_backend("hf").entry == "qualify.reference.sampling:HfRolloutBackend"
    assert rollout_backend("hf") is HfRolloutBackend
