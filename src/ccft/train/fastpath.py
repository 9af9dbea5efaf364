"""Training paths for CCFT with LoRA decoders: the two-pass reference and the one-pass token-gated path.

CCFT needs, per row, the base's K/V for ``prompt[:n-k]`` and the decoder's computation over the tail
(``prompt[n-k:] + response + EOS``). With a LoRA decoder the base and the decoder share one weight
copy, so there are two ways to get there:

``two-pass`` (the reference, ``decoder.decoder_forward``)
    1. prefill ``prompt[:n-k]`` under ``torch.no_grad`` with the adapters disabled -> ``C_base``;
    2. run the decoder over the tail on a read-only ``PrefixCache`` of ``C_base``.
    FLOPs per step ≈ 2·P (no-grad prefill) + 4·R (forward + activation backward), P/R = prompt/tail
    tokens × parameters; activations are kept for the tail only.

``one-pass`` (``one_pass_forward``)
    One forward over ``prompt[:n-k] + tail`` in the Full-FT layout, with the LoRA deltas gated off on
    the prefix columns (``LoraTokenGate``: the output of every ``lora_A`` is zeroed there). The prefix
    then computes exactly with θ_base, so its K/V at every layer *is* ``C_base``, and causal attention
    keeps it from seeing the tail. This is what PEFT's activated LoRA (``alora_invocation_tokens``)
    does at inference, without turning the adapter into an aLoRA one (an aLoRA adapter would stay off
    on the tail during ordinary decoding, where no invocation sequence is present).
    FLOPs per step ≈ 2·(P+R) forward + 2·(P+R) backward: autograd also runs the dense backward
    through the prefix rows (their gradient is zero, but the matrix products are not skipped), and
    activations are kept for P+R tokens. So it is Full-FT's cost, never below two-pass's; it exists
    for equivalence testing and for decoders where a second forward call is the bottleneck.

``resolve_train_path`` picks the path (``auto`` -> ``DEFAULT_LORA_PATH``, measured by
``benchmarks/train_bench.py``) and refuses a one-pass request that would not be exact.

Shape notation: b batch, p prefix length (longest ``n - k``), t tail length, v vocab, r LoRA rank.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ccft.core.errors import ConfigError

TRAIN_PATHS = ("auto", "two-pass", "one-pass")
#: What ``train_path=auto`` uses for CCFT with LoRA decoders. Chosen by measurement
#: (``ccft bench train``, docs/training.md): two-pass is faster and uses less memory at every
#: prompt:response ratio measured, as its FLOP count predicts.
DEFAULT_LORA_PATH = "two-pass"


# ------------------------------------------------------------------ validity


def _lora_layers(model) -> list:
    from peft.tuners.lora.layer import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def one_pass_unsupported(model, adapter: str | None = None) -> str | None:
    """Why the token-gated one-pass path would not equal the two-pass path for ``model``, or None.

    Exact only for plain LoRA on linear layers: no DoRA / aLoRA / other variants (their delta is not
    ``B(A(x))``), no LoRA bias, no merged weights, no ``modules_to_save`` or trainable token indices
    (those change the prefix computation too).
    """
    try:
        from peft import PeftModel
        from peft.tuners.lora.layer import Linear as LoraLinear
    except ImportError:  # pragma: no cover - peft is a dependency
        return "peft is not installed"
    if not isinstance(model, PeftModel):
        return "the decoder is not a LoRA (PEFT) model"
    adapter = adapter or model.active_adapter
    cfg = model.peft_config.get(adapter)
    if cfg is None:
        return f"adapter {adapter!r} is not loaded"
    if (
        getattr(cfg, "peft_type", None) is not None
        and str(getattr(cfg.peft_type, "value", cfg.peft_type)) != "LORA"
    ):
        return f"adapter {adapter!r} is {cfg.peft_type}, not LoRA"
    if getattr(cfg, "modules_to_save", None):
        return f"modules_to_save={cfg.modules_to_save} trains whole modules that also run on the prompt"
    if getattr(cfg, "trainable_token_indices", None):
        return "trainable_token_indices changes the prompt's embeddings"
    if getattr(cfg, "alora_invocation_tokens", None):
        return "the adapter is an aLoRA adapter already"
    found = False
    for layer in _lora_layers(model):
        if adapter not in layer.lora_A:
            continue
        found = True
        if not isinstance(layer, LoraLinear):
            return f"LoRA on {type(layer).__name__} layers (only linear layers are gated)"
        if adapter in getattr(layer, "lora_variant", {}):
            return f"LoRA variant {type(layer.lora_variant[adapter]).__name__} (DoRA, aLoRA, ...)"
        if getattr(layer.lora_B[adapter], "bias", None) is not None:
            return "lora_bias=True (a gated-off B(0) would still add its bias)"
        if getattr(layer, "merged", False):
            return "the adapter is merged into the base weights"
    if not found:
        return f"no LoRA layer carries adapter {adapter!r}"
    return None


def resolve_train_path(
    requested: str,
    *,
    method: str,
    decoder_kind: str,
    model=None,
    share_from_layer: int = 0,
    cache_format: str = "native",
) -> str:
    """The path a run uses: ``two-pass`` or ``one-pass`` for CCFT, ``self-prefill`` for Full-FT.

    ``auto`` gives ``DEFAULT_LORA_PATH`` for LoRA decoders when the one-pass path is exact for them
    (else two-pass) and two-pass for full-weight decoders (the only CCFT path: the base is a second
    weight copy). At sharing depth ``share_from_layer`` > 0 CCFT is two-pass: the one-pass gate keeps LoRA
    off on the whole prompt, so the prompt's K/V would be C_base in every layer (``ccft.core.depth``). So is
    CCFT on the compact C_base (``cache_format`` ``int8``; ``ccft.core.compact``): one-pass never
    materialises C_base, so there is nothing to quantise.
    Raises ConfigError for an unknown value or a one-pass request that would be inexact.
    """
    if requested not in TRAIN_PATHS:
        raise ConfigError(f"train_path={requested!r}; use one of {', '.join(TRAIN_PATHS)}")
    if method == "full-ft":
        return "self-prefill"
    if share_from_layer:
        if requested == "one-pass":
            raise ConfigError(
                f"train_path=one-pass cannot train at share_from_layer={share_from_layer} (it gates LoRA "
                "off on the whole prompt); use train_path=auto or two-pass"
            )
        return "two-pass"
    if cache_format != "native":
        if requested == "one-pass":
            raise ConfigError(
                f"train_path=one-pass cannot train on cache_format={cache_format} (it never materialises "
                "C_base, so its K/V cannot be quantised); use train_path=auto or two-pass"
            )
        return "two-pass"
    if decoder_kind != "lora":
        if requested == "one-pass":
            raise ConfigError(
                "train_path=one-pass needs a LoRA decoder (decoder_kind=lora): a full-weight "
                "decoder is a second weight copy, so the base prefill is always a separate pass; "
                "use train_path=auto or two-pass"
            )
        return "two-pass"
    why = one_pass_unsupported(model) if model is not None else None
    if requested == "one-pass":
        if why:
            raise ConfigError(
                f"train_path=one-pass would not equal the two-pass reference: {why}; "
                "use train_path=auto or two-pass"
            )
        return "one-pass"
    if requested == "auto":
        return DEFAULT_LORA_PATH if not why else "two-pass"
    return requested


# ------------------------------------------------------------------ the token gate


class LoraTokenGate:
    """Per-token on/off switch for the active LoRA adapter of a ``PeftModel``.

    While entered, a forward hook on every ``lora_A`` module of the adapter replaces its output
    ``(b, s, r)`` by 0 where ``gate (b, s)`` is False, so those positions compute exactly with the base
    weights (``result + B(0)·scaling == result``) and send no gradient into the adapter. Keep the gate
    entered until the backward has run when gradient checkpointing recomputes the forward there.

    Usage::

        with LoraTokenGate(peft_model) as gate:
            gate.set(mask)          # (b, s) bool
            loss = ...; loss.backward()
    """

    def __init__(self, model, adapter: str | None = None):
        why = one_pass_unsupported(model, adapter)
        if why:
            raise ConfigError(f"cannot gate this decoder's LoRA per token: {why}")
        self.model = model
        self.adapter = adapter or model.active_adapter
        self.gate: torch.Tensor | None = None
        self._handles: list = []

    def _hook(self, module, inputs, output):
        g = self.gate
        if g is None:
            return None
        if output.shape[:-1] != g.shape:
            raise RuntimeError(
                f"LoRA token gate of shape {tuple(g.shape)} does not match a LoRA input of "
                f"shape {tuple(output.shape[:-1])}; set the gate for this forward"
            )
        return torch.where(g.unsqueeze(-1), output, output.new_zeros(()))

    def set(self, gate: torch.Tensor | None) -> None:
        """``gate (b, s)``: True where the adapter is on. None: adapter on everywhere."""
        self.gate = None if gate is None else gate.bool()

    def __enter__(self) -> "LoraTokenGate":
        for layer in _lora_layers(self.model):
            if self.adapter in layer.lora_A:
                self._handles.append(layer.lora_A[self.adapter].register_forward_hook(self._hook))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.gate = None


# ------------------------------------------------------------------ the one-pass forward


def one_pass_layout(
    prefix_ids: torch.Tensor, prefix_mask: torch.Tensor, tail_ids: torch.Tensor, tail_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask, position_ids, gate)``, each ``(b, p + t)``, for one forward over prefix + tail.

    The layout and positions are those of ``decoder.full_forward``: prefix left-padded, tail right-padded,
    tail positions continue each row's real prefix length; ``gate`` is True on the tail columns.
    """
    p, t = prefix_ids.shape[1], tail_ids.shape[1]
    ids = torch.cat([prefix_ids, tail_ids], dim=1)
    mask = torch.cat([prefix_mask, tail_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    positions[:, p:] = prefix_mask.sum(-1, keepdim=True) + torch.arange(t, device=ids.device)
    gate = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
    gate[:, p:] = True
    return ids, mask, positions, gate


def one_pass_forward(
    model,
    prefix_ids: torch.Tensor,
    prefix_mask: torch.Tensor,
    tail_ids: torch.Tensor,
    tail_mask: torch.Tensor | None = None,
    *,
    gate: LoraTokenGate | None = None,
    logits_to_keep: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Decoder logits over the tail ``(b, t, v)`` from ONE forward, LoRA gated off on ``prompt[:n-k]``.

    Equals ``decoder_forward(model, C_base, tail_ids, tail_mask)`` (same positions, same masks; fp32
    agreement to rounding). ``gate``: an entered ``LoraTokenGate`` of ``model`` to reuse (the trainer
    keeps one entered across forward and backward); default: one for this call only. ``logits_to_keep``:
    default the t tail positions; an empty index tensor projects none (``ccft.train.loss``).
    """
    if tail_mask is None:
        tail_mask = torch.ones_like(tail_ids)
    ids, mask, positions, g = one_pass_layout(prefix_ids, prefix_mask, tail_ids, tail_mask)
    t = tail_ids.shape[1]
    with contextlib.ExitStack() as stack:
        if gate is None:
            gate = stack.enter_context(LoraTokenGate(model))
        gate.set(g)
        keep = t if logits_to_keep is None else logits_to_keep
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=keep
        )
    return out.logits[:, -t:]


@contextlib.contextmanager
def gate_for_step(model, enabled: bool) -> Iterator[LoraTokenGate | None]:
    """A ``LoraTokenGate`` kept entered for a whole training step (forward, backward, checkpoint
    recompute)."""
    if not enabled:
        yield None
        return
    with LoraTokenGate(model) as gate:
        yield gate


__all__ = [
    "TRAIN_PATHS",
    "DEFAULT_LORA_PATH",
    "LoraTokenGate",
    "one_pass_forward",
    "one_pass_layout",
    "one_pass_unsupported",
    "resolve_train_path",
    "gate_for_step",
]
