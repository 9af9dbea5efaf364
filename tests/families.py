"""Tiny random bases of every family the engine supports, built offline from transformers' config classes.

``make_family_folder(path, tokenizer, family)`` saves one (fp32, 2 layers, GQA, the embedded SmolLM2
tokenizer) with what makes the family differ switched on: q/k/v biases (qwen2), per-head q/k norms (qwen3,
gemma3), (1 + w) norms with non-zero w, sandwich norms, embedding scaling, GELU-tanh, a query scalar that is
not the head dim and final-logit soft-capping (gemma2 / gemma3), a local and a global RoPE (gemma3), fused
projections and partial RoPE (phi3), and llama's rope scalings. Norm weights are perturbed away from their
initial values so that a norm read wrongly (w instead of 1 + w, the wrong norm, none) changes the logits.
"""

from __future__ import annotations

from pathlib import Path

import torch

#: family name -> (config class, model class, extra config fields); "llama-*": llama with a rope scaling
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-linear": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    ),
    "llama-yarn": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": 5.0,
            "sliding_window": 4096,
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 5.0,
            "sliding_window": 4096,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 100000.0},
            },
        },
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    ),
}
#: the model families (llama's rope scalings apart)
MODEL_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"]
#: LoRA target modules where a family's differ from the default (phi3's projections are fused)
TARGETS_BY_FAMILY = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}


def family_config(
    family: str,
    tokenizer,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    **overrides,
):
    import transformers

    cfg_name, _, extra = FAMILIES[family]
    kw = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=family.startswith("gemma"),
    )
    if family == "qwen2":
        kw["attention_bias"] = True  # Qwen2 has q/k/v biases always; the field is ignored there
    if "rope_parameters" not in extra:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    kw.update(extra)
    if family.startswith("llama"):
        kw["attention_bias"] = False
    kw.update(overrides)  # config fields set for one test (e.g. a released checkpoint's layout)
    return getattr(transformers, cfg_name)(**kw)


def make_family_folder(
    path: Path, tokenizer, family: str, *, seed: int = 0, scale: float = 1.0, **shape
) -> Path:
    """Save a random tiny ``family`` base (fp32) with ``tokenizer`` to ``path``; ``scale`` > 1 sharpens the
    logits (the LM head, or the tied embedding, times ``scale``)."""
    import transformers

    torch.manual_seed(seed)
    cfg = family_config(family, tokenizer, **shape)
    model = getattr(transformers, FAMILIES[family][1])(cfg).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # away from 1 (llama) / 0 (gemma): a norm read wrongly shows in the logits
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
        if scale != 1.0:
            model.lm_head.weight.mul_(scale)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


#: HF projection -> llama.cpp tensor name (phi3: its fused projections)
_GGUF_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
    "qkv_proj": "attn_qkv",
    "gate_up_proj": "ffn_up",
}


def gguf_permute(w, heads: int):
    """llama.cpp's q / k row order (``convert_hf_to_gguf``'s ``permute``) of ``w (n, ...)``."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_block_gguf(writer, tensors) -> None:
    """Write ``tensors`` — ``(gguf name, parameter, block format or None, heads or None)`` — with gguf-py's
    ``writer`` and close it: a format's tensors quantised (and the parameter overwritten in place with the
    dequantised blocks, as transformers dequantises a GGUF), rows permuted as llama.cpp's ``llama`` converter
    does where ``heads`` is given; the others F32."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    with torch.no_grad():
        for name, param, fmt, heads in tensors:
            w = param.detach().numpy().astype(np.float32)
            if fmt is None:
                writer.add_tensor(name, w)
                continue
            qtype = GGMLQuantizationType[fmt]
            blocks = quantize(w, qtype)
            param.copy_(torch.from_numpy(dequantize(blocks, qtype).reshape(w.shape)))
            if heads is not None:
                blocks = gguf_permute(blocks, heads)
            writer.add_tensor(name, blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def make_family_block_folder(path: Path, tokenizer, family: str, *, fmt: str = "Q4_1", seed: int = 0) -> Path:
    """A tiny ``family`` base whose linear layers (and LM head, or the tied embedding) are GGUF blocks: the
    GGUF ``path/model.gguf`` under llama.cpp's tensor names and architecture (q / k rows permuted for
    ``llama`` only, as llama.cpp's converter does), and the HF folder ``path/hf`` whose weights are those
    blocks dequantised, with ``CCFT_SOURCE.txt`` naming the GGUF. Returns the HF folder."""
    import transformers
    from gguf import GGUFWriter

    from ccft.inference.blocks import GGUF_ARCHITECTURES

    hf = make_family_folder(path / "hf", tokenizer, family, seed=seed)
    model = getattr(transformers, FAMILIES[family][1]).from_pretrained(hf)
    cfg = model.config
    arch = GGUF_ARCHITECTURES[cfg.model_type]
    writer = GGUFWriter(str(path / "model.gguf"), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    tied = cfg.tie_word_embeddings
    tensors = [("token_embd.weight", model.model.embed_tokens.weight, "Q8_0" if tied else None, None)]
    for i, layer in enumerate(model.model.layers):
        for mod_name, mod in [*layer.self_attn.named_children(), *layer.mlp.named_children()]:
            if mod_name not in _GGUF_NAMES or not isinstance(mod, torch.nn.Linear):
                continue
            heads = None
            if arch == "llama":
                heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(mod_name)
            tensors.append((f"blk.{i}.{_GGUF_NAMES[mod_name]}.weight", mod.weight, fmt, heads))
    if not tied:
        tensors.append(("output.weight", model.lm_head.weight, "Q8_0", None))
    write_block_gguf(writer, tensors)
    model.save_pretrained(hf)
    (hf / "CCFT_SOURCE.txt").write_text(
        f"tiny {family} in GGUF blocks\nconverted from {path / 'model.gguf'}\n"
    )
    return hf
