"""What differs between the decoder families the engine runs, declared once (docs/models.md).

Every family the engine supports is a pre-norm decoder of the Llama shape (embedding, L blocks of
attention + gated MLP with RMSNorm, final norm, LM head, RoPE); what differs is a handful of switches,
listed per family in :data:`FAMILIES` and resolved against one model's ``config`` by :func:`architecture`.
The engine's layer loop (``model.py``), the fused CPU decode step (``blocks.decode_step_plan``: it runs the
switches it implements and leaves the rest to the layer loop) and the static / CUDA-graph step read the
resulting :class:`Architecture`; nothing else in the engine branches on ``model_type``.

Families (the transformers classes they reproduce, checked against those classes' forward in
tests/inference/test_families.py):

* ``llama`` (LlamaForCausalLM; its rope scalings ``linear``, ``llama3``, ``yarn``), ``mistral``
  (MistralForCausalLM), ``qwen2`` (Qwen2ForCausalLM: biases on q/k/v, carried by the projections).
* ``qwen3`` (Qwen3ForCausalLM): per-head RMSNorm on q and k after the projection, before RoPE.
* ``gemma3_text`` (Gemma3ForCausalLM) and ``gemma2`` (Gemma2ForCausalLM): embeddings times sqrt(D),
  RMSNorm as ``x̂ · (1 + w)`` computed in fp32, a norm after attention and after the MLP as well as before
  each, GELU-tanh gating, softmax scale ``query_pre_attn_scalar^-1/2``, final-logit soft-capping
  ``c · tanh(z / c)``; gemma3 adds per-head (1 + w) norms on q and k and a second RoPE (its local layers').
* ``phi3`` (Phi3ForCausalLM): fused ``qkv_proj`` and ``gate_up_proj`` (read as row views, no copy; a LoRA
  adapter on them becomes one per part with the same A and B's rows), partial RoPE.

Refused by name, before anything is allocated (``IncompatibleModelError``), because the engine would not
reproduce it exactly: another ``model_type``; an activation other than the family's; attention-logit
soft-capping (``attn_logit_softcapping``: the split prefix/tail attention merges plain softmax parts);
RoPE whose frequencies depend on the sequence length (``dynamic``); ``pretraining_tp`` > 1.

Sliding-window attention (mistral's ``sliding_window``, gemma's local layers, qwen's ``use_sliding_window``)
and phi3's ``longrope`` are reproduced by a bound, not by a windowed kernel: within ``sliding_window``
positions a window masks nothing, and below ``original_max_position_embeddings`` longrope uses its short
factors in every forward, so :attr:`Architecture.max_positions` is the smallest of these and
``max_position_embeddings``; the engine refuses a prompt + ``max_new_tokens`` beyond it and names the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from ccft.core.errors import IncompatibleModelError


@dataclass(frozen=True)
class Family:
    """The switches of one decoder family (``model_type``).

    Attributes:
        model_type: the transformers ``config.model_type``.
        qk_norm: a per-head RMSNorm on q and k (``self_attn.q_norm`` / ``k_norm``, weights ``(d,)``), after
            the projection and before RoPE (qwen3, gemma3).
        norm_offset: RMSNorm scales by ``norm_offset + w`` (gemma: 1.0), the product taken in fp32 before the
            cast back (gemma's order; llama's casts, then multiplies by ``w``).
        sandwich_norms: a norm on the attention output and on the MLP output before each residual add, and
            the MLP's input norm is ``pre_feedforward_layernorm`` (gemma).
        embed_scale: embeddings are multiplied by ``sqrt(hidden_size)`` in the model dtype (gemma).
        fused_projections: ``qkv_proj`` and ``gate_up_proj`` instead of separate projections (phi3).
        activations: the ``hidden_act`` / ``hidden_activation`` values reproduced (first: the default).
        query_scalar: the config field whose ``^-1/2`` is the softmax scale instead of ``head_dim^-1/2``.
        multi_rope: one RoPE per layer type (``rotary_emb(x, positions, layer_type)``: gemma3).
    """

    model_type: str
    qk_norm: bool = False
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embed_scale: bool = False
    fused_projections: bool = False
    activations: tuple[str, ...] = ("silu",)
    query_scalar: str | None = None
    multi_rope: bool = False


_GELU = ("gelu_pytorch_tanh",)
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama"),
        Family("mistral"),
        Family("qwen2"),
        Family("qwen3", qk_norm=True),
        Family(
            "gemma2",
            norm_offset=1.0,
            sandwich_norms=True,
            embed_scale=True,
            activations=_GELU,
            query_scalar="query_pre_attn_scalar",
        ),
        Family(
            "gemma3_text",
            qk_norm=True,
            norm_offset=1.0,
            sandwich_norms=True,
            embed_scale=True,
            activations=_GELU,
            query_scalar="query_pre_attn_scalar",
            multi_rope=True,
        ),
        Family("phi3", fused_projections=True),
    )
}
#: the families the engine runs (``config.model_type``)
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
#: the activation names the layer loop computes: ``silu`` and transformers' ``gelu_pytorch_tanh``
#: (``F.gelu(approximate="tanh")``)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class Architecture:
    """One model's forward as the engine computes it: its :class:`Family` resolved against its config.

    Attributes:
        family: the family's switches.
        activation: ``"silu"`` or ``"gelu_tanh"`` (the MLP's gate).
        attn_scale: the softmax scale (``head_dim^-1/2``, or ``query_pre_attn_scalar^-1/2``).
        final_softcap: ``c`` of the final-logit soft-capping ``c · tanh(z / c)``, or None.
        max_positions: the most positions one row may span (prompt + generation) for the forward to be exact
            (see the module docstring), or None when the config names no bound.
        max_positions_field: the config field that sets ``max_positions`` (named in the engine's refusal).
        layer_rope: per layer, the layer type whose RoPE it reads (gemma3: ``"sliding_attention"`` /
            ``"full_attention"``), or None per layer for a single RoPE.
        rotary_dim: the leading dimensions of a head that RoPE rotates (``head_dim`` unless partial:
            ``partial_rotary_factor · head_dim``, phi3); the rest pass through.
    """

    family: Family
    activation: str
    attn_scale: float
    final_softcap: float | None
    max_positions: int | None
    max_positions_field: str
    layer_rope: tuple[str | None, ...]
    rotary_dim: int

    @property
    def model_type(self) -> str:
        return self.family.model_type

    @property
    def rope_types(self) -> tuple[str | None, ...]:
        """The distinct RoPE tables a forward computes, in a fixed order (index: :meth:`rope_index`)."""
        return tuple(dict.fromkeys(self.layer_rope))

    def rope_index(self, layer: int) -> int:
        return self.rope_types.index(self.layer_rope[layer])

    @property
    def llama_like(self) -> bool:
        """True when every layer is Llama's arithmetic (optionally with q/k/v biases and per-head q/k norms):
        SiLU, plain RMSNorm, no sandwich norms, no embedding scale, one RoPE over the whole head."""
        f = self.family
        return (
            self.activation == "silu" and f.norm_offset == 0.0 and not f.sandwich_norms and not f.embed_scale
        )

    def plain_rope(self, head_dim: int) -> bool:
        """One RoPE over the whole head (what the fused CPU step computes)."""
        return len(self.rope_types) == 1 and self.rotary_dim == head_dim


def _rope_parameters(config) -> list[dict]:
    rope = getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) or v is None for v in rope.values()):
        return [v for v in rope.values() if v]  # per layer type (gemma3)
    return [rope] if isinstance(rope, dict) else []


def architecture(config) -> Architecture:
    """The :class:`Architecture` of ``config`` (a transformers ``PretrainedConfig``).

    Raises:
        IncompatibleModelError: the family is not supported, or the config sets something the engine would
            not reproduce exactly; the message names every such field and what to use instead.
    """
    problems = []
    mtype = getattr(config, "model_type", None)
    family = FAMILIES.get(mtype)
    if family is None:
        raise IncompatibleModelError(
            f"the inference engine cannot run this model: model_type={mtype!r} (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}). Use ccft.generate (the reference path) instead."
        )
    act_field = "hidden_activation" if getattr(config, "hidden_activation", None) else "hidden_act"
    act = getattr(config, act_field, None) or family.activations[0]
    if act not in family.activations:
        problems.append(f"{act_field}={act!r} (supported for {mtype}: {', '.join(family.activations)})")
    if getattr(config, "pretraining_tp", 1) not in (1, None):
        problems.append(f"pretraining_tp={config.pretraining_tp}")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        problems.append(
            f"attn_logit_softcapping={config.attn_logit_softcapping} (soft-capped attention scores are not "
            "reproduced; set it to None only if the model was trained without it)"
        )
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("use_bidirectional_attention=True (the engine's attention is causal)")
    limits: list[tuple[int, str]] = []
    mpe = getattr(config, "max_position_embeddings", None)
    if mpe is not None:
        limits.append((int(mpe), "max_position_embeddings"))
    for rope in _rope_parameters(config):
        rtype = str(rope.get("rope_type", "default"))
        if "dynamic" in rtype:
            problems.append(f"rope_type={rtype!r} (its frequencies depend on the sequence length)")
        if rtype == "longrope":
            orig = rope.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None
            )
            if orig is None:
                problems.append("rope_type='longrope' without original_max_position_embeddings")
            else:  # short factors at every position below it
                limits.append((int(orig), "original_max_position_embeddings (longrope)"))
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is not None and (layer_types is None or "sliding_attention" in layer_types):
        limits.append((int(window), "sliding_window"))
    if problems:
        raise IncompatibleModelError(
            "the inference engine cannot run this model: "
            + "; ".join(problems)
            + ". Use ccft.generate (the reference path) instead."
        )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    scalar = getattr(config, family.query_scalar, None) if family.query_scalar else None
    n_layers = config.num_hidden_layers
    if family.multi_rope:
        layer_rope = tuple(layer_types)
    else:
        layer_rope = (None,) * n_layers
    limit, field = min(limits) if limits else (None, "max_position_embeddings")
    factors = {float(r.get("partial_rotary_factor", 1.0) or 1.0) for r in _rope_parameters(config)}
    factor = (
        factors.pop() if len(factors) == 1 else float(getattr(config, "partial_rotary_factor", 1.0) or 1.0)
    )
    return Architecture(
        family=family,
        activation=ACTIVATIONS[act],
        attn_scale=float((scalar if scalar else head_dim) ** -0.5),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        max_positions=limit,
        max_positions_field=field,
        layer_rope=layer_rope,
        rotary_dim=int(head_dim * factor),
    )


__all__ = ["Family", "FAMILIES", "SUPPORTED_MODEL_TYPES", "Architecture", "architecture"]
