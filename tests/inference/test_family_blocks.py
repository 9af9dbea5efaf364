"""Block weights (GGUF Q4_1 / Q8_0, docs/inference.md "Block weights") on every supported family.

A tiny base of each family is quantised into a GGUF under llama.cpp's names and architecture
(``tests/families.py``: ``make_family_block_folder``), its HF weights the dequantised blocks; the engine reads
every linear layer from the blocks (phi3's fused ``attn_qkv`` / ``ffn_up`` split into their parts) and its
greedy tokens and logits equal the fp32 engine's on the same weights, a LoRA decoder included.
"""

from __future__ import annotations

import pytest
import torch

import ccft
from ccft.core.errors import ConfigError
from ccft.inference import SharedPrefillEngine
from ccft.inference.blocks import load_kernel, read_gguf_blocks
from conftest import make_lora, ragged_prompts
from families import MODEL_FAMILIES, TARGETS_BY_FAMILY, make_family_block_folder

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def kernel():
    k = load_kernel()
    if k is None:
        pytest.skip("no C++ compiler: the block kernel cannot be built")
    return k


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_block_engine_equals_fp32(family, kernel, tmp_path, tokenizer, gsm8k_rows):
    hf = make_family_block_folder(tmp_path, tokenizer, family, seed=2)
    base = ccft.load_base(str(hf))
    lora = make_lora(base, "math", 3, 4, 1, TARGETS_BY_FAMILY.get(family))
    blocks = SharedPrefillEngine(base, {"math": lora}, block_weights="on")
    fp32 = SharedPrefillEngine(base, {"math": lora}, block_weights="off")
    assert blocks.block_weights == tmp_path / "model.gguf"
    lw = blocks.lanes["base"].weights
    assert lw.lm_head.blocks is not None
    assert all(lin.blocks is not None for layer in lw.layers for lin in layer.proj.values())
    prompts = ragged_prompts(gsm8k_rows, tokenizer, 3, 5, 6)
    out = {}
    for name, eng in (("blocks", blocks), ("fp32", fp32)):
        with eng.prefill(prompts) as h:
            ids = [
                eng.add_request(h, i, decoder=d, max_new_tokens=4) for d in ("base", "math") for i in range(3)
            ]
            steps = []
            while eng.active:
                steps.append({o.request_id: o for o in eng.step(return_logits=True)})
        out[name] = [[s[r] for s in steps if r in s] for r in ids]
    for a, b in zip(out["blocks"], out["fp32"], strict=True):
        assert [o.token_id for o in a] == [o.token_id for o in b]
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x.logits, y.logits, atol=1e-4, rtol=1e-4)


def test_a_gguf_of_another_family_is_refused(kernel, tmp_path, tokenizer):
    hf = make_family_block_folder(tmp_path, tokenizer, "qwen3")
    cfg = ccft.load_base(str(hf)).config
    cfg.model_type = "qwen2"
    with pytest.raises(ConfigError, match="is a 'qwen3' GGUF model, not 'qwen2'"):
        read_gguf_blocks(tmp_path / "model.gguf", cfg, kernel)
