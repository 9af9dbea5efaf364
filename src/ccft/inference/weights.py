"""The engine's view of a decoder model: plain tensors, no module calls in the hot loop.

The families it reads (Llama, Mistral, Qwen2/3, Gemma2/3, Phi-3) and what differs between them are
declared once in ``architectures.py``; ``LaneWeights.arch`` carries the resolved switches.

A *lane* is one set of base weights: the base model together with every LoRA decoder attached
to it (PEFT adapters on the base's single weight copy), or one full-weight decoder. Nothing is
copied: ``LaneWeights`` holds references to the model's own parameters, and each LoRA
``Adapter`` references the adapter's ``lora_A`` / ``lora_B`` weights, so the engine computes
``W x + B (A x) * scaling`` itself, per row, with the right adapter for each row (rows of several
decoders share one base matmul).

Shape notation: D hidden size, H query heads, h KV heads, d head dim, V vocab, r LoRA rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ccft.core.decoder import FUSED_PROJECTIONS
from ccft.core.errors import IncompatibleModelError
from ccft.inference.architectures import SUPPORTED_MODEL_TYPES, Architecture, architecture

#: the projections the engine computes per block (a LoRA adapter may target any of them; phi3's fused
#: ``qkv_proj`` / ``gate_up_proj`` are read as their parts, :data:`FUSED`)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
#: a fused projection (phi3) -> the parts it stacks, in row order (the rule LoRA targets follow too)
FUSED = FUSED_PROJECTIONS


try:  # bound once: the op lookup costs more than the call on a decode step's small matrices
    _ONEDNN_LINEAR = torch.ops.mkldnn._linear_pointwise.default
    _ONEDNN_BINARY = torch.ops.mkldnn._linear_pointwise.binary
except (AttributeError, RuntimeError):  # pragma: no cover - PyTorch built without oneDNN
    _ONEDNN_LINEAR = _ONEDNN_BINARY = None


@dataclass
class Linear:
    """``y = x @ weight.T + bias``; ``weight (out, in)`` (None for a packed [q; k; v] kept only as blocks).

    ``packed``: the same weight prepacked for oneDNN (CPU), used instead of ``weight`` when set.
    ``blocks``: the same weight as GGUF Q4_1 / Q8_0 blocks (``blocks.BlockMatrix``; fp32 activations on
    the CPU), used instead of ``weight`` when set (``blocks.attach_blocks``).
    """

    weight: torch.Tensor | None
    bias: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    blocks: object | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocks is not None:
            y = self.blocks.matmul(x)
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            return _ONEDNN_LINEAR(x, self.packed, self.bias, "none", [], "")
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(self(x))`` (one fused oneDNN call when packed)."""
        if self.packed is not None and self.blocks is None:
            return _ONEDNN_LINEAR(x, self.packed, self.bias, "swish", [], "")
        return torch.nn.functional.silu(self(x))

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``self(x) * other`` (one fused oneDNN call when packed)."""
        if self.packed is not None and self.blocks is None:
            return _ONEDNN_BINARY(x, other, self.packed, self.bias, "mul")
        return self(x) * other

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``other + self(x)`` (one fused oneDNN call when packed)."""
        if self.packed is not None and self.blocks is None:
            return _ONEDNN_BINARY(x, other, self.packed, self.bias, "add")
        return other + self(x)


def onednn_available() -> bool:
    """True when PyTorch's oneDNN prepacked linear (CPU) can be used."""
    return (
        torch.backends.mkldnn.is_available()
        and _ONEDNN_LINEAR is not None
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def prepack(lin: Linear) -> Linear:
    """A copy of ``lin`` with its weight prepacked for oneDNN (no batch-size hint: good for 1..64 rows);
    ``lin`` itself where oneDNN cannot pack it (not on the CPU, another dtype, or bf16 on a CPU without the
    instructions oneDNN's bf16 kernels need, e.g. AVX2 only) or where it computes from its blocks."""
    if (
        lin.blocks is not None
        or lin.weight.device.type != "cpu"
        or lin.weight.dtype not in (torch.float32, torch.bfloat16)
        or not onednn_available()
    ):
        return lin
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach().contiguous())
    except (
        RuntimeError
    ):  # oneDNN's bf16 path needs AVX-512 (or AVX-NE-CONVERT): on an AVX2 CPU the plain linear
        return lin
    return Linear(lin.weight, lin.bias, packed)


@dataclass
class LayerWeights:
    """One block's weights. Norm weights are the scale each norm multiplies by (gemma's ``1 + w``, made once
    in fp32 when the lane is built; llama's ``w`` itself)."""

    attn_norm: torch.Tensor  # (D,)
    mlp_norm: torch.Tensor  # (D,) the MLP's input norm (gemma: pre_feedforward_layernorm)
    proj: dict[str, Linear]  # PROJECTIONS -> Linear
    qkv: Linear | None = None  # packed [q; k; v] ((H + 2h) d, D), when the lane is packed
    gate_up: Linear | None = None  # packed [gate; up] (2 I, D), when the lane is packed
    q_norm: torch.Tensor | None = None  # (d,) per-head norm of q (qwen3, gemma3)
    k_norm: torch.Tensor | None = None  # (d,) per-head norm of k
    post_attn_norm: torch.Tensor | None = None  # (D,) norm of the attention output (gemma)
    post_mlp_norm: torch.Tensor | None = None  # (D,) norm of the MLP output (gemma)


@dataclass
class LoraWeights:
    """One adapted projection: ``delta = (x @ a.T) @ b.T * scaling``; ``a (r, in)``, ``b (out, r)``."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float
    #: a part of a fused projection (phi3): ``b`` is rows ``b_rows`` of the PEFT parameter ``b_fused``
    b_fused: torch.Tensor | None = None
    b_rows: tuple[int, int] | None = None


@dataclass
class Adapter:
    """A LoRA decoder's weights on its lane: ``layers[i][proj]`` for each adapted projection."""

    name: str
    layers: list[dict[str, LoraWeights]]
    #: the fused decode step's pointer table of these weights (``blocks.lora_table``), built on first use
    step_table: object | None = None


@dataclass
class LaneWeights:
    """Everything the engine's forward reads, as references into one model's parameters.

    Attributes:
        embed: ``(V, D)`` token embedding.  lm_head: ``(V, D)`` (tied models: the same tensor).
        layers: per-layer norms and projections.  norm: ``(D,)`` final RMSNorm.
        rotary: the model's own rotary-embedding module (``cos, sin = rotary(x, positions)``; gemma3:
            ``rotary(x, positions, layer_type)``), so every RoPE variant the model supports is reproduced
            exactly (cos / sin span the rotary part of a head: ``d`` or, partial RoPE, fewer).
        eps: RMSNorm epsilon.  heads, kv_heads, head_dim, hidden: attention geometry.
        arch: the family's switches (``architectures.Architecture``).
        adapters: LoRA adapters on this lane, in registration order (index = adapter id).
        block_step: the fused decode step's plan (``blocks.decode_step_plan``: every layer in one kernel call,
            from the blocks or the fp32 weights) of an fp32 CPU lane (set by ``pack``), else None.
    """

    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: Linear
    rotary: torch.nn.Module
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    owner: torch.nn.Module
    arch: Architecture
    adapters: list[Adapter] = field(default_factory=list)
    block_step: object | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def scale(self) -> float:
        """The attention's softmax scale (``head_dim^-1/2``; gemma: ``query_pre_attn_scalar^-1/2``)."""
        return self.arch.attn_scale

    @property
    def embed_scale(self) -> float | None:
        """The factor embeddings are multiplied by (gemma: ``sqrt(hidden)``), else None."""
        return self.hidden**0.5 if self.arch.family.embed_scale else None

    def adapter_index(self, name: str) -> int:
        for i, a in enumerate(self.adapters):
            if a.name == name:
                return i
        raise KeyError(name)


def _packed(parts: list[Linear]) -> Linear:
    """``[W1; W2; ...]`` (biases ``[b1; b2; ...]``, zeros for a part without) as one Linear: from the blocks
    when every part has blocks of one format (no fp32 copy), else an fp32 copy of the weights."""
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat(
            [p.bias.detach() if p.bias is not None else p.weight.new_zeros(p.weight.shape[0]) for p in parts]
        ).contiguous()
    if all(p.blocks is not None for p in parts):
        from ccft.inference.blocks import concat

        stacked = concat([p.blocks for p in parts])
        if stacked is not None:
            return Linear(None, bias, None, stacked)
    weight = torch.cat([p.weight.detach() for p in parts], dim=0).contiguous()
    return Linear(weight, bias)


def pack(lw: LaneWeights) -> LaneWeights:
    """Prepare a lane for CPU decode: [q;k;v] packed per layer and every matmul weight (and the
    lm_head) prepacked for oneDNN when available (else [gate;up] packed too).

    Fewer, larger matrix products, in oneDNN's blocked layout, run much closer to memory bandwidth
    on CPUs than per-projection ``F.linear`` (about 2x at batch 1 and 16 on a 2-core EPYC). The
    packed copies cost one extra copy of the lane's weights, shared by every decoder of the lane;
    the model's own parameters are untouched. They are a snapshot: later in-place edits of the
    model's weights are not seen (LoRA adapter weights are read live). Projections computed from
    their blocks (``blocks.attach_blocks``) are not copied: [q;k;v] stacks their blocks.
    """
    onednn = lw.device.type == "cpu" and lw.dtype in (torch.float32, torch.bfloat16) and onednn_available()
    for layer in lw.layers:
        p = layer.proj
        layer.qkv = prepack(_packed([p["q_proj"], p["k_proj"], p["v_proj"]]))
        blocks = p["gate_proj"].blocks is not None and p["up_proj"].blocks is not None
        # gate and up stay separate: silu(gate x) and (up x) * that are fused oneDNN calls, or one call of the
        # block kernel (blocks.fused_mlp)
        if onednn or blocks:
            for name in ("gate_proj", "up_proj"):
                p[name] = prepack(p[name])
        else:
            layer.gate_up = _packed([p["gate_proj"], p["up_proj"]])
        for name in ("o_proj", "down_proj"):
            p[name] = prepack(p[name])
    lw.lm_head = prepack(lw.lm_head)
    if lw.device.type == "cpu" and lw.dtype == torch.float32:
        from ccft.inference.blocks import decode_step_plan

        lw.block_step = decode_step_plan(lw)
    return lw


def _causal_lm_parts(model: torch.nn.Module):
    """(causal LM, its inner decoder model) for a PreTrainedModel or a PeftModel wrapping one."""
    lm = model
    if hasattr(lm, "get_base_model"):
        lm = lm.get_base_model()
    inner = getattr(lm, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(lm, "lm_head"):
        raise IncompatibleModelError(
            f"{type(lm).__name__} is not a decoder-only causal LM (model.layers, lm_head); the engine "
            f"supports {', '.join(SUPPORTED_MODEL_TYPES)}; use ccft.generate for others"
        )
    return lm, inner


def check_supported(config) -> None:
    """Raise IncompatibleModelError unless the engine's own forward reproduces this architecture exactly
    (``architectures.architecture``: the family and every field it refuses, by name)."""
    architecture(config)


def _base_linear(module: torch.nn.Module) -> Linear:
    layer = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    if not isinstance(layer, torch.nn.Linear):
        raise IncompatibleModelError(f"expected a torch.nn.Linear projection, found {type(layer).__name__}")
    return Linear(layer.weight, layer.bias)


def _norm_scale(module: torch.nn.Module, offset: float) -> torch.Tensor:
    """The scale a norm module multiplies by: its weight (llama), or ``offset + w`` in fp32 (gemma's
    ``(1 + w.float())``, made once: a snapshot, as ``pack``'s copies are)."""
    w = module.weight
    return w if not offset else (offset + w.detach().float()).contiguous()


def _module_projections(block, arch: Architecture, i: int) -> dict[str, torch.nn.Module]:
    """``name -> module`` of the block's projections (phi3: the fused modules under their own names)."""
    attn, mlp = block.self_attn, block.mlp
    if arch.family.fused_projections:
        return {
            "qkv_proj": attn.qkv_proj,
            "o_proj": attn.o_proj,
            "gate_up_proj": mlp.gate_up_proj,
            "down_proj": mlp.down_proj,
        }
    return {name: getattr(attn if name in _ATTN else mlp, name) for name in PROJECTIONS}


def _split_rows(lin: Linear, sizes: list[int]) -> list[Linear]:
    """A fused projection's parts as row views of its weight (and bias): no copy."""
    ws = torch.split(lin.weight, sizes, dim=0)
    bs = torch.split(lin.bias, sizes, dim=0) if lin.bias is not None else [None] * len(sizes)
    return [Linear(w, b) for w, b in zip(ws, bs, strict=True)]


def _part_sizes(name: str, heads: int, kv_heads: int, head_dim: int, inter: int) -> list[int]:
    if name == "qkv_proj":
        return [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    return [inter, inter]


def lane_weights(model: torch.nn.Module, *, allow_adapters: bool = True) -> LaneWeights:
    """References to ``model``'s weights (base weights of PEFT-wrapped projections; no copy).

    Args:
        allow_adapters: False for a full-weight decoder, whose forward must be its weights alone.
    Raises:
        IncompatibleModelError: not a supported family (``architectures.architecture``), LoRA merged into the
            weights, or LoRA layers inside a full-weight decoder.
    """
    lm, inner = _causal_lm_parts(model)
    config = lm.config
    arch = architecture(config)
    fam = arch.family
    if not allow_adapters and any(len(getattr(m, "lora_A", {})) for m in lm.modules()):
        raise IncompatibleModelError(
            "this full-weight decoder contains LoRA layers (e.g. it was copied from a base that already had "
            "adapters attached); merge them (merge_and_unload) or create the full decoder before "
            "attaching LoRA"
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    inter = config.intermediate_size
    off = fam.norm_offset
    layers = []
    for i, block in enumerate(inner.layers):
        proj = {}
        for name, mod in _module_projections(block, arch, i).items():
            if getattr(mod, "merged", False):
                raise IncompatibleModelError(
                    f"layer {i} {name}: a LoRA adapter is merged into the base weights; "
                    "unmerge it (model.unmerge_adapter()) so the base weights are θ_base"
                )
            lin = _base_linear(mod)
            if name in FUSED:
                parts = _split_rows(lin, _part_sizes(name, heads, kv_heads, head_dim, inter))
                proj.update(zip(FUSED[name], parts, strict=True))
            else:
                proj[name] = lin
        attn = block.self_attn
        mlp_in = block.pre_feedforward_layernorm if fam.sandwich_norms else block.post_attention_layernorm
        layers.append(
            LayerWeights(
                _norm_scale(block.input_layernorm, off),
                _norm_scale(mlp_in, off),
                proj,
                q_norm=_norm_scale(attn.q_norm, off) if fam.qk_norm else None,
                k_norm=_norm_scale(attn.k_norm, off) if fam.qk_norm else None,
                post_attn_norm=_norm_scale(block.post_attention_layernorm, off)
                if fam.sandwich_norms
                else None,
                post_mlp_norm=_norm_scale(block.post_feedforward_layernorm, off)
                if fam.sandwich_norms
                else None,
            )
        )
    lm_head = lm.lm_head
    if hasattr(lm_head, "get_base_layer"):
        lm_head = lm_head.get_base_layer()
    norm = inner.norm
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return LaneWeights(
        embed=_embedding_weight(inner.embed_tokens),
        layers=layers,
        norm=_norm_scale(norm, off),
        lm_head=Linear(lm_head.weight, lm_head.bias),
        rotary=inner.rotary_emb,
        eps=float(eps if eps is not None else getattr(config, "rms_norm_eps", 1e-6)),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        hidden=config.hidden_size,
        owner=lm,
        arch=arch,
    )


def _embedding_weight(module) -> torch.Tensor:
    layer = module.get_base_layer() if hasattr(module, "get_base_layer") else module
    return layer.weight


def lora_adapter(model: torch.nn.Module, adapter_name: str) -> Adapter:
    """The LoRA weights of adapter ``adapter_name`` on a PEFT-wrapped decoder (references, no copy).

    On a fused projection (phi3's ``qkv_proj``, ``gate_up_proj``) the adapter's ``B (A x)`` is read as one
    adapter per part: the same ``A`` and the rows of ``B`` of that part (views), so each part's delta is
    exactly the fused delta's rows.

    Raises:
        IncompatibleModelError: a LoRA variant the engine does not reproduce (DoRA, LoRA bias, adapted
            embeddings or lm_head, modules_to_save), or an adapter that adapts nothing.
    """
    lm, inner = _causal_lm_parts(model)
    arch = architecture(lm.config)
    config = lm.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    for label, mod in (("embed_tokens", inner.embed_tokens), ("lm_head", lm.lm_head)):
        if adapter_name in getattr(mod, "lora_A", {}) or adapter_name in getattr(mod, "lora_embedding_A", {}):
            raise IncompatibleModelError(
                f"adapter {adapter_name!r} adapts {label}; the engine supports LoRA on "
                f"{', '.join(PROJECTIONS)} only"
            )
        if adapter_name in getattr(mod, "modules_to_save", {}):
            raise IncompatibleModelError(
                f"adapter {adapter_name!r} trains {label} fully (modules_to_save); "
                "the engine supports plain LoRA on the projections only"
            )
    layers, found = [], 0
    for i, block in enumerate(inner.layers):
        per = {}
        for name, mod in _module_projections(block, arch, i).items():
            lora_a = getattr(mod, "lora_A", None)
            if lora_a is None or adapter_name not in lora_a:
                continue
            if adapter_name in getattr(mod, "lora_variant", {}) or getattr(mod, "use_dora", {}).get(
                adapter_name
            ):
                raise IncompatibleModelError(
                    f"adapter {adapter_name!r} layer {i} {name} is a LoRA variant (e.g. DoRA); "
                    "the engine reproduces plain LoRA only"
                )
            b = mod.lora_B[adapter_name]
            if getattr(b, "bias", None) is not None:
                raise IncompatibleModelError(
                    f"adapter {adapter_name!r} has lora_bias; not supported by the engine"
                )
            a, scaling = lora_a[adapter_name].weight, float(mod.scaling[adapter_name])
            if name in FUSED:
                sizes = _part_sizes(name, heads, kv_heads, head_dim, config.intermediate_size)
                start = 0
                for part, size in zip(FUSED[name], sizes, strict=True):
                    rows = (start, start + size)
                    per[part] = LoraWeights(a, b.weight[rows[0] : rows[1]], scaling, b.weight, rows)
                    start += size
            else:
                per[name] = LoraWeights(a, b.weight, scaling)
            found += 1
        layers.append(per)
    if not found:
        raise IncompatibleModelError(f"adapter {adapter_name!r} adapts none of {', '.join(PROJECTIONS)}")
    return Adapter(adapter_name, layers)


def cast_adapter(adapter: Adapter, dtype: torch.dtype) -> Adapter:
    """Cast ``adapter``'s LoRA weights (every ``a``, ``b``) to ``dtype`` in place and return it.

    The tensors are the PEFT modules' own ``lora_A`` / ``lora_B`` parameters: their data is swapped
    (``param.data = param.data.to(dtype)``), so the decoder's PEFT forward (``ccft.generate``, the
    reference path) then runs in ``dtype`` too and the engine keeps reading them live. PEFT loads
    and creates adapters in fp32 on a bf16/fp16 base (``autocast_adapter_dtype``); the engine's
    forward multiplies them with activations in the base dtype, which needs one dtype
    (docs/design.md, fault class K11).
    """
    with torch.no_grad():
        for layer in adapter.layers:
            for lw in layer.values():
                for t in (lw.a, lw.b if lw.b_fused is None else lw.b_fused):
                    if t.dtype != dtype:
                        t.data = t.data.to(dtype)
                if lw.b_fused is not None:  # the part's rows of the (now cast) fused parameter
                    lw.b = lw.b_fused[lw.b_rows[0] : lw.b_rows[1]]
    adapter.step_table = None  # new tensors: the fused step's pointers are built again
    return adapter


def adapter_tensors(adapter: Adapter) -> list[torch.Tensor]:
    """Every weight tensor of ``adapter`` (``a``, ``b`` of each adapted projection, in layer order)."""
    return [t for layer in adapter.layers for _, lw in sorted(layer.items()) for t in (lw.a, lw.b)]


__all__ = [
    "Linear",
    "LayerWeights",
    "LoraWeights",
    "Adapter",
    "LaneWeights",
    "lane_weights",
    "lora_adapter",
    "cast_adapter",
    "adapter_tensors",
    "check_supported",
    "SUPPORTED_MODEL_TYPES",
    "FUSED",
    "pack",
    "prepack",
    "onednn_available",
    "PROJECTIONS",
]
