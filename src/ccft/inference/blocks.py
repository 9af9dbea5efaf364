"""Block weights: the base's linear layers kept in the GGUF's own Q4_1 / Q8_0 blocks, multiplied from them.

The embedded model is a GGUF file whose linear layers are Q4_1 (blocks of 32 weights, an fp16 scale d
and an fp16 minimum m: ``w = d·q + m``, q in 0..15) and whose tied embedding / LM head is Q8_0 (blocks
of 32, an fp16 scale: ``w = d·q``, q in -128..127). ``ccft.core.models.convert_embedded`` dequantises
it into the fp32 folder the base loads, so the fp32 weights *are* the dequantised blocks: a matrix kept
as its blocks (20 or 34 bytes per 32 weights instead of 128) computes with the same weights.

* :class:`BlockMatrix`: one weight ``(n, k)`` as its raw blocks (``uint8 (n, k/32 · bytes per block)``),
  with ``matmul`` (``y = x · Wᵀ``, activations and outputs fp32) and ``dequantize``.
* :func:`fused_mlp`: ``silu(x · Wgᵀ) * (x · Wuᵀ)`` in one kernel call.
* :func:`read_gguf_blocks`: a GGUF file's Q4_1 / Q8_0 tensors under the HF names of a Llama model (q / k
  rows put back in HF's order, as transformers' GGUF loader does).
* :func:`attach_blocks`: point a lane's ``Linear`` layers (``weights.Linear.blocks``) at their blocks, after
  checking that the dequantised blocks equal the fp32 weights bit for bit.
* :func:`load_kernel`: the C++ kernel (``kernels/blocks.cpp``: AVX-512 or AVX2 + FMA where the CPU has
  them, plain C++ otherwise; OpenMP over output rows), compiled at first use with the system C++ compiler
  (``$CXX``, else ``g++``, ``c++``, ``clang++``; ``-O3 -march=native -fopenmp``) into
  ``<cache>/kernels/blocks-<hash of source, flags, compiler, target ISA>.so`` (``<cache>``:
  ``ccft.core.models.cache_root``) through a temporary file renamed into place, so concurrent processes
  share one build; a build is loaded only on a CPU that has every instruction set it records
  (:func:`missing_isa`). Without a compiler (or if the build fails) it returns None and logs one line; the
  engine then keeps the fp32 path.

``SharedPrefillEngine(block_weights=...)`` uses them for the base lane on the CPU (docs/inference.md, "Block
weights"); ``CCFT_BLOCK_WEIGHTS=0`` turns them off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ccft.core.errors import ConfigError

log = logging.getLogger(__name__)

#: weights per block (both formats)
BLOCK = 32
#: format name -> (kernel kind id, bytes per block)
FORMATS = {"Q8_0": (0, 34), "Q4_1": (1, 20)}
#: the kernel's kind id of each matrix format: the GGUF block formats, and ``"F32"`` (an fp32 matrix read in
#: place as blocks of 32 floats: the fused decode step of an fp32 lane, :func:`decode_step_plan`)
KINDS = {**{name: kind for name, (kind, _) in FORMATS.items()}, "F32": 2}
#: fp32 lanes run the fused decode step up to this many rows (above it the oneDNN layer loop is faster)
F32_FUSED_ROWS = 16
#: the kernel's ABI version (``ccft_blocks_abi`` in blocks.cpp)
ABI = 6
SOURCE = Path(__file__).resolve().parent / "kernels" / "blocks.cpp"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
#: above this many activation rows (prefill), ``matmul`` dequantises the matrix and calls ``torch.matmul``
DEQUANT_ROWS = 64

_lock = threading.Lock()
_kernel: dict[str, object] = {}  # "lib": the loaded kernel (or None after a failed build), per process


class StepArgs(ctypes.Structure):
    """The arguments of the fused decode step (``ccft_blocks_decode_step``), mirroring ``StepArgs`` in
    blocks.cpp field for field (its comment says what each one is); :class:`BlockKernel` checks that both
    have one size (``ccft_blocks_step_args_size``). Pointers are addresses (``int``) or None (null)."""

    _fields_ = (
        [(name, ctypes.c_int64) for name in ("L", "B", "D", "H", "h", "d", "I", "p")]
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "x",
                "cos",
                "sin",
                "norms",
                "weights",
                "kinds",
                "qkv_bias",
                "qk_norms",
                "prefix",
                "prefix_strides",
                "prefix_row",
                "key_start",
                "pool_k",
                "pool_v",
                "pool_strides",
                "write_pos",
                "tail_len",
            )
        ]
        + [("n_lora", ctypes.c_int64), ("lora_tables", ctypes.c_void_p), ("row_lora", ctypes.c_void_p)]
        + [("threads", ctypes.c_int64), ("row_prefix", ctypes.c_void_p)]
        + [("prefix_layer_stride", ctypes.c_int64)]
    )


class BlockKernel:
    """The loaded C++ kernel (``ctypes``): ``path`` of the ``.so``, ``avx2`` (built with AVX2 + FMA) and
    ``avx512`` (built with AVX-512F: its products run 16 weights per vector)."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        if lib.ccft_blocks_abi() != ABI:
            raise OSError(f"{path}: kernel ABI {lib.ccft_blocks_abi()} (expected {ABI})")
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.ccft_blocks_dequant.argtypes = [i32, ptr, i64, i64, ptr, i32]
        lib.ccft_blocks_matmul.argtypes = [i32, ptr, i64, i64, ptr, i64, i64, ptr, i64, i32]
        lib.ccft_blocks_mlp.argtypes = [i32, ptr, i32, ptr, i64, i64, ptr, i64, i64, ptr, i64, i32]
        lib.ccft_blocks_step_args_size.argtypes = []
        lib.ccft_blocks_step_args_size.restype = i64
        if lib.ccft_blocks_step_args_size() != ctypes.sizeof(StepArgs):
            raise OSError(
                f"{path}: the kernel's StepArgs has {lib.ccft_blocks_step_args_size()} bytes, "
                f"blocks.StepArgs {ctypes.sizeof(StepArgs)}"
            )
        lib.ccft_blocks_decode_step.argtypes = [ctypes.POINTER(StepArgs)]
        for fn in (
            lib.ccft_blocks_dequant,
            lib.ccft_blocks_matmul,
            lib.ccft_blocks_mlp,
            lib.ccft_blocks_decode_step,
        ):
            fn.restype = None
        self.lib, self.path = lib, path
        self.avx2 = bool(lib.ccft_blocks_features() & 1)
        self.avx512 = bool(lib.ccft_blocks_features() & 2)

    @property
    def isa(self) -> str:
        """The vector instructions the products use: ``"AVX-512"``, ``"AVX2+FMA"`` or ``"plain C++"``."""
        return "AVX-512" if self.avx512 else "AVX2+FMA" if self.avx2 else "plain C++"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


#: predefined macro of an instruction-set extension -> its name in /proc/cpuinfo's flags (the extensions the
#: kernel's vector paths, or code the compiler generates for ``-march=native``, may use)
ISA_MACROS = {
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__F16C__": "f16c",
    "__AVX512F__": "avx512f",
    "__AVX512BW__": "avx512bw",
    "__AVX512CD__": "avx512cd",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BF16__": "avx512_bf16",
    "__AVX512FP16__": "avx512_fp16",
    "__AVX512VBMI__": "avx512vbmi",
    "__AVXVNNI__": "avx_vnni",
    "__AMX_TILE__": "amx_tile",
    "__AMX_BF16__": "amx_bf16",
    "__AMX_INT8__": "amx_int8",
}


def cpu_features() -> frozenset[str] | None:
    """The running CPU's instruction-set flags (``/proc/cpuinfo``: x86 ``flags``, Arm ``Features``), or None
    where they cannot be read (then no build is refused for its ISA)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return None


def target_isa(compiler: str, flags: tuple[str, ...] = FLAGS) -> tuple[str, ...]:
    """The instruction-set extensions (:data:`ISA_MACROS` names) that ``compiler`` targets with ``flags``'
    machine options: what ``-march=native`` resolves to on this CPU (the compiler's predefined macros),
    sorted."""
    arch = [f for f in flags if f.startswith("-m")]
    r = subprocess.run(
        [compiler, *arch, "-dM", "-E", "-x", "c++", os.devnull], capture_output=True, text=True, check=False
    )
    defined = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("#define ")}
    return tuple(sorted(name for macro, name in ISA_MACROS.items() if macro in defined))


def kernel_path(compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """``<cache_root()>/kernels/blocks-<16 hex digits>.so``: the hash covers the source, the ``flags``, the
    compiler's path and version (``compiler --version``) and the instruction sets those flags target
    here (:func:`target_isa`), so any change builds a new file, and CPUs of different ISAs sharing one cache
    (a home folder on a cluster) each get their own build."""
    from ccft.core.models import cache_root

    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False).stdout
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update("\0".join((*flags, compiler, version, *target_isa(compiler, flags))).encode())
    return cache_root() / "kernels" / f"blocks-{h.hexdigest()[:16]}.so"


def isa_record(path: Path) -> Path:
    """The JSON beside a built kernel ``path`` that records the instruction sets it was compiled for."""
    return path.with_suffix(".isa.json")


def missing_isa(path: Path, features: frozenset[str] | None = None) -> list[str]:
    """The instruction sets the build at ``path`` was compiled for (:func:`isa_record`) that the running CPU
    (``features``, default :func:`cpu_features`) lacks; every recorded one when the record is missing or
    unreadable (a build of unknown target is not trusted), none when the CPU's flags cannot be read."""
    import json

    features = cpu_features() if features is None else features
    if features is None:
        return []
    try:
        isa = json.loads(isa_record(path).read_text())["isa"]
    except (OSError, ValueError, KeyError, TypeError):
        return ["(no ISA record)"]
    return sorted(set(isa) - features)


def build_kernel(compiler: str, flags: tuple[str, ...] = FLAGS) -> Path:
    """Compile ``kernels/blocks.cpp`` with ``compiler`` and ``flags`` (default :data:`FLAGS`; without
    ``-march=native`` the plain C++ path is built) into :func:`kernel_path` unless a build there is usable on
    this CPU; returns the path. Beside it, :func:`isa_record` names the instruction sets it targets. A file at
    that path whose record names an instruction set this CPU lacks (or has no record) is never loaded: it is
    rebuilt. The build writes temporary files and renames them (concurrent builds are safe).

    Raises:
        OSError: the compiler failed (its output in the message), or it targets instruction sets this CPU
            lacks (e.g. ``CXXFLAGS``-style machine options in ``flags``).
    """
    import json

    from ccft.core.io import atomic_write_file

    path = kernel_path(compiler, flags)
    if path.is_file() and not missing_isa(path):
        return path
    isa = target_isa(compiler, flags)
    features = cpu_features()
    lacking = sorted(set(isa) - features) if features is not None else []
    if lacking:
        raise OSError(f"{compiler} {' '.join(flags)} targets {', '.join(lacking)}, which this CPU lacks")

    def compile_to(tmp: str) -> None:
        r = subprocess.run(
            [compiler, *flags, "-o", tmp, str(SOURCE)], capture_output=True, text=True, check=False
        )
        if r.returncode != 0:
            raise OSError(f"{compiler} failed on {SOURCE.name}: {(r.stderr or r.stdout).strip()[-2000:]}")

    def record_to(tmp: str) -> None:
        Path(tmp).write_text(
            json.dumps({"isa": list(isa), "flags": list(flags), "compiler": compiler}) + "\n"
        )

    # the record first: a reader that finds the .so also finds what it was built for
    atomic_write_file(isa_record(path), record_to)
    return atomic_write_file(path, compile_to)


def load_kernel(*, fresh: bool = False) -> BlockKernel | None:
    """The block kernel, built on first use (once per process; see the module docstring), or None when no
    C++ compiler is found or the build or load fails (logged once, at WARNING, naming the fp32 fallback).
    A cached build is loaded only where its recorded instruction sets are all on this CPU (``build_kernel``).
    ``fresh``: look for the compiler and the built file again instead of reusing this process's answer."""
    with _lock:
        if fresh or "lib" not in _kernel:
            compiler = _compiler()
            if compiler is None:
                why = "no C++ compiler found (set CXX, or install g++)"
            else:
                try:
                    path = build_kernel(compiler)
                    lacking = missing_isa(path)
                    if (
                        lacking
                    ):  # never dlopen a build for another CPU: an illegal instruction kills the process
                        raise OSError(f"{path} was built for {', '.join(lacking)}, which this CPU lacks")
                    _kernel["lib"] = BlockKernel(path)
                    return _kernel["lib"]
                except OSError as e:
                    why = str(e)
            log.warning(
                "ccft block kernel unavailable (block weights, the fused decode step): using fp32 "
                "weights and PyTorch's ops: %s",
                why,
            )
            _kernel["lib"] = None
        return _kernel["lib"]


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


@dataclass(eq=False)
class BlockMatrix:
    """A weight ``W (n, k)`` kept as its GGUF blocks.

    Attributes:
        fmt: ``"Q4_1"`` or ``"Q8_0"`` (GGUF blocks), or ``"F32"`` (fp32 rows read in place: :func:`f32_view`).
        raw: ``uint8 (n, k / 32 · bytes per block)``, row i = the blocks of W's row i, in ggml's layout.
        n, k: W's shape (``k`` a multiple of 32).
        kernel: the loaded :class:`BlockKernel`.
    """

    fmt: str
    raw: torch.Tensor
    n: int
    k: int
    kernel: BlockKernel

    @property
    def kind(self) -> int:
        return KINDS[self.fmt]

    @property
    def nbytes(self) -> int:
        """Bytes of the blocks (what one product reads)."""
        return self.raw.numel()

    def dequantize(self) -> torch.Tensor:
        """``W`` as fp32 ``(n, k)``, computed by the kernel's own dequantisation."""
        out = torch.empty(self.n, self.k, dtype=torch.float32)
        self.kernel.lib.ccft_blocks_dequant(self.kind, _ptr(self.raw), self.n, self.k, _ptr(out), _threads())
        return out

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x · Wᵀ``: ``x (..., k)`` fp32 on the CPU -> ``(..., n)`` fp32. More than :data:`DEQUANT_ROWS`
        rows (prefill): the matrix is dequantised for the call and ``torch.matmul`` runs (faster at many
        rows). Under ``torch.compile`` the kernel runs as the ``ccft::block_matmul`` op (same arithmetic)."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.k)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        m = x2.shape[0]
        if m > DEQUANT_ROWS:
            return torch.matmul(x2, self.dequantize().T).view(*lead, self.n)
        if torch.compiler.is_compiling():
            return block_matmul_op(x2.contiguous(), self.raw, self.kind, self.n, self.k).view(*lead, self.n)
        y = torch.empty(m, self.n, dtype=torch.float32)
        self.kernel.lib.ccft_blocks_matmul(
            self.kind, _ptr(self.raw), self.n, self.k, _ptr(x2), m, x2.stride(0), _ptr(y), self.n, _threads()
        )
        return y.view(*lead, self.n)

    def rows(self, index: torch.Tensor) -> BlockMatrix:
        """The rows ``index`` (long ``(n',)``) of W as a new ``BlockMatrix`` (blocks copied, not
        re-quantised)."""
        return BlockMatrix(self.fmt, self.raw[index].contiguous(), int(index.numel()), self.k, self.kernel)


def concat(parts: list[BlockMatrix]) -> BlockMatrix | None:
    """``[W1; W2; ...]`` stacked by rows (e.g. packed [q; k; v]); None when their formats or ``k`` differ."""
    first = parts[0]
    if any(p.fmt != first.fmt or p.k != first.k for p in parts):
        return None
    raw = torch.cat([p.raw for p in parts], dim=0)
    return BlockMatrix(first.fmt, raw, sum(p.n for p in parts), first.k, first.kernel)


def fused_mlp(gate: BlockMatrix, up: BlockMatrix, x: torch.Tensor) -> torch.Tensor:
    """``silu(x · Wgᵀ) * (x · Wuᵀ)``: ``x (..., k)`` fp32 -> ``(..., n)``, gate and up ``(n, k)``, one kernel
    call (above :data:`DEQUANT_ROWS` rows: two ``matmul`` calls and torch's SiLU)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, gate.k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > DEQUANT_ROWS:
        return (torch.nn.functional.silu(gate.matmul(x2)) * up.matmul(x2)).view(*lead, gate.n)
    if torch.compiler.is_compiling():
        out = block_mlp_op(x2.contiguous(), gate.raw, gate.kind, up.raw, up.kind, gate.n, gate.k)
        return out.view(*lead, gate.n)
    y = torch.empty(m, gate.n, dtype=torch.float32)
    gate.kernel.lib.ccft_blocks_mlp(
        gate.kind,
        _ptr(gate.raw),
        up.kind,
        _ptr(up.raw),
        gate.n,
        gate.k,
        _ptr(x2),
        m,
        x2.stride(0),
        _ptr(y),
        gate.n,
        _threads(),
    )
    return y.view(*lead, gate.n)


#: the fused decode step's largest head dimension (``MAX_HEAD_DIM`` in blocks.cpp)
MAX_HEAD_DIM = 512
#: and its largest number of query heads per KV head (``MAX_GROUP`` in blocks.cpp)
MAX_GROUP = 64


def f32_view(weight: torch.Tensor, kernel: BlockKernel) -> BlockMatrix:
    """An fp32 matrix ``(n, k)`` (contiguous, ``k`` a multiple of 32) as a ``"F32"`` :class:`BlockMatrix` that
    reads it in place (no copy; it must outlive the view)."""
    n, k = weight.shape
    return BlockMatrix("F32", weight.detach().view(torch.uint8).view(n, 4 * k), n, k, kernel)


@dataclass(eq=False)
class DecodeStepPlan:
    """A lane's decoder layers as the fused decode step reads them (:func:`decode_step_plan`): per layer the
    two RMSNorm weights and the matrices of [q; k; v], o, gate, up and down, as pointer arrays built once.

    Attributes:
        kernel: the loaded :class:`BlockKernel`.  dims: ``(L, D, H, h, d, I)``.  eps: RMSNorm epsilon.
        scale: the attention's softmax scale.
        norms, weights, kinds: ``ctypes`` arrays (2L, 5L pointers; 5L kernel kinds, :data:`KINDS`).
        qkv_bias: ``ctypes`` array of L pointers, each layer's [q; k; v] bias ``((H + 2h) d,)`` (0: none;
            qwen2), or None when no layer has one.
        qk_norms: ``ctypes`` array of 2L pointers, each layer's per-head q and k RMSNorm weights ``(d,)``
            (qwen3), or None when no layer has them.
        max_rows: the most rows a step runs fused (more: the layer loop).
        keep: the tensors the pointers point into (held so they stay alive).
    """

    kernel: BlockKernel
    dims: tuple[int, int, int, int, int, int]
    eps: float
    scale: float
    norms: object
    weights: object
    kinds: object
    max_rows: int
    keep: list
    qkv_bias: object = None
    qk_norms: object = None


def _f32_vector(t: torch.Tensor | None, n: int) -> bool:
    """``t`` is an fp32 CPU tensor of ``n`` contiguous values (what the kernel reads at its address)."""
    return (
        t is not None
        and t.dtype == torch.float32
        and t.device.type == "cpu"
        and t.numel() == n
        and t.dim() == 1
        and t.is_contiguous()
    )


def decode_step_plan(lw) -> DecodeStepPlan | None:
    """The fused decode step's plan of lane ``lw`` (``weights.LaneWeights``, packed), or None when it cannot
    run it: not fp32 on the CPU, a family switch the kernel does not compute (``lw.arch``: anything but
    Llama's block with q/k/v biases (qwen2) and per-head q / k norms (qwen3)), a layer without [q; k; v]
    packed (``layer.qkv``), a bias on o, gate, up or down, a dimension that is not a multiple of 32, a head
    dimension above :data:`MAX_HEAD_DIM` or more than :data:`MAX_GROUP` query heads per KV head. Each matrix
    is read from its blocks
    (``Linear.blocks``) or, without them, in place from its fp32 weight (:func:`f32_view`). ``max_rows``:
    :data:`DEQUANT_ROWS` when some matrix is in blocks, :data:`F32_FUSED_ROWS` for an all-fp32 lane.
    The kernel is :func:`load_kernel`'s (the one the blocks were read with); None when it cannot be built."""
    if lw.device.type != "cpu" or lw.dtype != torch.float32 or lw.head_dim > MAX_HEAD_DIM:
        return None
    arch = lw.arch  # the family's switches (architectures.py): Llama's block, + q/k/v biases, q / k norms
    if not arch.llama_like or not arch.plain_rope(lw.head_dim):
        return None
    if not lw.layers or lw.heads % lw.kv_heads or lw.heads // lw.kv_heads > MAX_GROUP:
        return None
    kernel = load_kernel()
    if kernel is None:
        return None
    norms, weights, kinds, keep = [], [], [], []
    biases, qk_norms = [], []
    nqkv = (lw.heads + 2 * lw.kv_heads) * lw.head_dim
    quantised = False
    for layer in lw.layers:
        p = layer.proj
        mats = []
        for lin in (layer.qkv, p["o_proj"], p["gate_proj"], p["up_proj"], p["down_proj"]):
            if lin is None or (lin.bias is not None and lin is not layer.qkv):
                return None
            if lin.blocks is not None:
                mats.append(lin.blocks)
                quantised = True
            elif lin.weight is not None and lin.weight.dtype == torch.float32 and lin.weight.is_contiguous():
                if lin.weight.shape[1] % BLOCK:
                    return None
                mats.append(f32_view(lin.weight, kernel))
            else:
                return None
        for t in (layer.attn_norm, layer.mlp_norm):
            if t.dtype != torch.float32 or not t.is_contiguous():
                return None
            norms.append(t.data_ptr())
            keep.append(t)
        bias = layer.qkv.bias
        if bias is not None:
            if not _f32_vector(bias, nqkv):
                return None
            keep.append(bias)
        biases.append(0 if bias is None else bias.data_ptr())
        if (layer.q_norm is None) != (layer.k_norm is None):
            return None
        if layer.q_norm is not None:
            if not (_f32_vector(layer.q_norm, lw.head_dim) and _f32_vector(layer.k_norm, lw.head_dim)):
                return None
            keep += [layer.q_norm, layer.k_norm]
            qk_norms += [layer.q_norm.data_ptr(), layer.k_norm.data_ptr()]
        else:
            qk_norms += [0, 0]
        for m in mats:
            weights.append(m.raw.data_ptr())
            kinds.append(m.kind)
            keep.append(m.raw)
    i64 = ctypes.c_int64
    return DecodeStepPlan(
        kernel=kernel,
        dims=(lw.num_layers, lw.hidden, lw.heads, lw.kv_heads, lw.head_dim, mats[2].n),
        eps=float(lw.eps),
        scale=float(lw.scale),
        norms=(i64 * len(norms))(*norms),
        weights=(i64 * len(weights))(*weights),
        kinds=(ctypes.c_int32 * len(kinds))(*kinds),
        max_rows=DEQUANT_ROWS if quantised else F32_FUSED_ROWS,
        keep=keep,
        qkv_bias=(i64 * len(biases))(*biases) if any(biases) else None,
        qk_norms=(i64 * len(qk_norms))(*qk_norms) if any(qk_norms) else None,
    )


#: the order of an adapter's projections in its table (``Proj`` in blocks.cpp)
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_table(adapter, dims: tuple[int, int, int, int, int, int]) -> tuple | None:
    """A LoRA adapter (``weights.Adapter``) as the fused step reads it: ``(ptrs, ranks, scales, keep)``, per
    layer and projection (:data:`LORA_PROJECTIONS`) the pointers of A ``(r, in)`` and B ``(out, r)`` (0 when
    not adapted), the rank and the scaling; None when a matrix is not contiguous fp32 on the CPU. ``dims``:
    the lane's ``DecodeStepPlan.dims``, which fix each projection's ``in`` and ``out``. Built once per adapter
    (kept as ``adapter.step_table``); in-place edits of the weights are seen, new tensors are not
    (``weights.cast_adapter`` drops the table).

    Raises:
        RuntimeError: an A or B whose shape does not fit its projection (as the layer loop's matmul raises;
            the kernel would read past them).
    """
    table = adapter.step_table
    if table is not None:
        return table
    n_layers, hidden, heads, kv_heads, head_dim, inter = dims
    nq, nkv = heads * head_dim, kv_heads * head_dim
    io = {
        "q_proj": (hidden, nq),
        "k_proj": (hidden, nkv),
        "v_proj": (hidden, nkv),
        "o_proj": (nq, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    if len(adapter.layers) != n_layers:
        raise RuntimeError(f"adapter {adapter.name!r} has {len(adapter.layers)} layers, the lane {n_layers}")
    ptrs, ranks, scales, keep = [], [], [], []
    for per in adapter.layers:
        for name in LORA_PROJECTIONS:
            lw = per.get(name)
            if lw is None:
                ptrs += [0, 0]
                ranks.append(0)
                scales.append(0.0)
                continue
            for t in (lw.a, lw.b):
                if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
                    return None
            fan_in, fan_out = io[name]
            r = lw.a.shape[0] if lw.a.dim() == 2 else -1
            if tuple(lw.a.shape) != (r, fan_in) or tuple(lw.b.shape) != (fan_out, r) or r < 1:
                raise RuntimeError(
                    f"adapter {adapter.name!r} {name}: lora_A {tuple(lw.a.shape)} and lora_B "
                    f"{tuple(lw.b.shape)} do not fit the projection ({fan_in} -> {fan_out})"
                )
            ptrs += [lw.a.data_ptr(), lw.b.data_ptr()]
            ranks.append(int(lw.a.shape[0]))
            scales.append(float(lw.scaling))
            keep += [lw.a, lw.b]
    i64 = ctypes.c_int64
    table = (
        (i64 * len(ptrs))(*ptrs),
        (i64 * len(ranks))(*ranks),
        (ctypes.c_float * len(scales))(*scales),
        keep,
    )
    adapter.step_table = table
    return table


def decode_step_layers(
    plan: DecodeStepPlan,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    prefix_k: list[torch.Tensor] | torch.Tensor | None,
    prefix_v: list[torch.Tensor] | torch.Tensor | None,
    key_start: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    write_pos: torch.Tensor,
    tail_len: torch.Tensor,
    lora: list | None = None,
    prefix_row: torch.Tensor | None = None,
    row_views: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor | None:
    """Every decoder layer of one decode step in one kernel call (``ccft_blocks_decode_step``), for ``B``
    rows each reading one prefix row: the layer loop of ``model.decode_step_eager`` with the same fp32
    arithmetic in another summation order, LoRA deltas included.

    Args:
        x: ``(B, D)`` fp32 embeddings of the step's tokens; returned updated (the last layer's output).
        cos, sin: ``(B, d)`` RoPE of each row's position, ``sin`` with its first half negated
            (``model.rope``).
        prefix_k, prefix_v: per layer ``(P, h, p, d)`` fp32 views of the prefix rows' K/V (``d`` contiguous),
            or each one ``(L, P, h, p, d)`` view of every layer (``PrefixHandle.every_layer``).
        key_start: ``(B,)`` long, the first real prefix key of the prefix row each batch row reads.
        prefix_row: ``(B,)`` long, the prefix row each batch row reads (several rows may read one: agents
            sharing a context); None: row r reads prefix row r (``P = B``).
        row_views: instead of ``prefix_k`` / ``prefix_v`` / ``prefix_row`` (then None / unread): per
            batch row, ``(L, h, p_r, d)`` fp32 views of its prefix row's keys and values in every layer
            (e.g. ``PrefixHandle.every_layer()`` at that row), each layer a contiguous ``(h, p_r, d)``
            region, one layer stride for all: rows of several prefill handles (sessions with their own
            contexts and widths) in one step (docs/serving.md, "Several sessions in one decode step").
        pool_k, pool_v: ``(L, slots, h, capacity, d)`` fp32 tail pool (row r = slot r; same strides).
        write_pos: ``(B,)`` long, where each row's new K/V is written; tail_len: ``(B,)`` long, write_pos + 1.
        lora: ``model.LoraPlan.entries``: ``(adapter, rows)`` with rows None (every row) or a long tensor of
            rows (eager); each row applies at most one adapter.
    Returns:
        ``x``, or None (nothing computed) when an adapter cannot be read in place (:func:`lora_table`).
    Raises:
        ValueError: a tensor that is not fp32 / long on the CPU or whose last dimension is not contiguous;
            ``row_views`` not one per row, not contiguous regions or of different layer strides.
    """
    n_layers, hidden, heads, kv_heads, head_dim, inter = plan.dims
    b = x.shape[0]
    i64 = ctypes.c_int64
    tables, row_lora = [], None
    if lora:
        row_lora = [-1] * b
        for a, (adapter, sel) in enumerate(lora):
            table = lora_table(adapter, plan.dims)
            if table is None:
                return None
            tables += [ctypes.addressof(table[0]), ctypes.addressof(table[1]), ctypes.addressof(table[2])]
            for r in range(b) if sel is None else sel.tolist():
                row_lora[r] = a
        row_lora = (i64 * b)(*row_lora)
    lora_tables = (i64 * max(1, len(tables)))(*tables)
    x = x.contiguous()
    cos = cos.reshape(b, head_dim).contiguous()
    sin = sin.reshape(b, head_dim).contiguous()
    longs = [key_start, write_pos, tail_len] + ([] if prefix_row is None else [prefix_row])
    if any(t.dtype != torch.long or t.shape != (b,) for t in longs):
        raise ValueError("decode_step_layers: key_start, write_pos, tail_len, prefix_row must be long (B,)")
    key_start, write_pos, tail_len = (t.contiguous() for t in (key_start, write_pos, tail_len))
    regions, layer_stride = None, 0
    if row_views is not None:
        regions, layer_stride, width = _row_regions(row_views, b, n_layers, kv_heads, head_dim)
        ptrs, strides, rows = [0, 0], [0] * 6, b
    else:
        ptrs, strides, width, rows = _prefix_pointers(prefix_k, prefix_v, n_layers)
    if prefix_row is not None:
        prefix_row = prefix_row.contiguous()
        if b and not 0 <= int(prefix_row.min()) <= int(prefix_row.max()) < rows:
            raise ValueError(f"decode_step_layers: prefix_row outside the {rows} prefix rows")
    if pool_k.stride() != pool_v.stride() or pool_k.stride(-1) != 1:
        raise ValueError("decode_step_layers: the tail pool's keys and values need one layout, d contiguous")
    # the pointer arrays are held in locals for the call (a temporary's buffer could be freed before it)
    prefix = (i64 * len(ptrs))(*ptrs)
    prefix_strides = (i64 * len(strides))(*strides)
    pool_strides = (i64 * 4)(*pool_k.stride()[:4])
    args = StepArgs(
        L=n_layers,
        B=b,
        D=hidden,
        H=heads,
        h=kv_heads,
        d=head_dim,
        I=inter,
        p=width,
        eps=plan.eps,
        scale=plan.scale,
        x=x.data_ptr(),
        cos=cos.data_ptr(),
        sin=sin.data_ptr(),
        norms=ctypes.addressof(plan.norms),
        weights=ctypes.addressof(plan.weights),
        kinds=ctypes.addressof(plan.kinds),
        qkv_bias=None if plan.qkv_bias is None else ctypes.addressof(plan.qkv_bias),
        qk_norms=None if plan.qk_norms is None else ctypes.addressof(plan.qk_norms),
        prefix=ctypes.addressof(prefix),
        prefix_strides=ctypes.addressof(prefix_strides),
        prefix_row=None if prefix_row is None else prefix_row.data_ptr(),
        key_start=key_start.data_ptr(),
        pool_k=pool_k.data_ptr(),
        pool_v=pool_v.data_ptr(),
        pool_strides=ctypes.addressof(pool_strides),
        write_pos=write_pos.data_ptr(),
        tail_len=tail_len.data_ptr(),
        n_lora=len(tables) // 3,
        lora_tables=ctypes.addressof(lora_tables),
        row_lora=ctypes.addressof(row_lora) if row_lora is not None else None,
        threads=_threads(),
        row_prefix=None if regions is None else ctypes.addressof(regions),
        prefix_layer_stride=layer_stride,
    )
    plan.kernel.lib.ccft_blocks_decode_step(ctypes.byref(args))
    return x


def _row_regions(row_views, b: int, n_layers: int, kv_heads: int, head_dim: int):
    """``decode_step_layers``' ``row_views`` as the kernel reads them (``StepArgs.row_prefix``): a ctypes
    array of ``3 B`` int64 (per row its keys' and values' layer-0 addresses and its width), the common layer
    stride (floats) and the widest row.

    Raises:
        ValueError: not one pair per row, not fp32 ``(L, h, p_r, d)`` views whose layers are contiguous
            ``(h, p_r, d)`` regions, or layer strides that differ.
    """
    if len(row_views) != b:
        raise ValueError(f"decode_step_layers: row_views has {len(row_views)} rows, the step {b}")
    flat, layer_stride, widest = [], None, 0
    for k, v in row_views:
        width = k.shape[-2]
        for t in (k, v):
            contiguous = t.stride()[1:] == (width * head_dim, head_dim, 1)
            if t.dtype != torch.float32 or t.shape != (n_layers, kv_heads, width, head_dim) or not contiguous:
                raise ValueError(
                    "decode_step_layers: each of row_views must be an fp32 (L, h, p, d) view with "
                    f"contiguous (h, p, d) layers, got {tuple(t.shape)} strides {t.stride()}"
                )
            if layer_stride is None:
                layer_stride = t.stride(0)
            elif t.stride(0) != layer_stride:
                raise ValueError("decode_step_layers: row_views of different layer strides (not one arena)")
        flat += [k.data_ptr(), v.data_ptr(), width]
        widest = max(widest, width)
    return (ctypes.c_int64 * max(1, len(flat)))(*flat), layer_stride or 0, widest


def _prefix_pointers(prefix_k, prefix_v, n_layers: int) -> tuple[list[int], list[int], int, int]:
    """``decode_step_layers``' prefix arguments as the kernel reads them: per layer the keys' and values'
    addresses, their three outer strides (elements), and the width and number of prefix rows. One
    ``(L, P, h, p, d)`` view each gives every layer's address from its first (``stride(0)`` apart).

    Raises:
        ValueError: not fp32, ``d`` not contiguous, layers of different widths, or not ``n_layers`` layers.
    """
    layered = isinstance(prefix_k, torch.Tensor)
    parts = [(prefix_k, prefix_v)] if layered else list(zip(prefix_k, prefix_v, strict=True))
    width = parts[0][0].shape[-2]
    for k, v in parts:
        if k.dtype != torch.float32 or v.dtype != torch.float32 or k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("decode_step_layers: prefix K/V must be fp32 with d contiguous")
        if k.shape[-2] != width or v.shape[-2] != width:
            raise ValueError("decode_step_layers: every layer's prefix must have one width")
    if (prefix_k.shape[0] if layered else len(parts)) != n_layers:
        raise ValueError(f"decode_step_layers: the prefix K/V need {n_layers} layers")
    if layered:
        k, v = prefix_k, prefix_v
        kp, vp, ks, vs = k.data_ptr(), v.data_ptr(), k.stride(0) * 4, v.stride(0) * 4  # 4 bytes per fp32
        ptrs = [p for i in range(n_layers) for p in (kp + i * ks, vp + i * vs)]
        strides = [k.stride(1), k.stride(2), k.stride(3), v.stride(1), v.stride(2), v.stride(3)] * n_layers
        return ptrs, strides, width, k.shape[1]
    ptrs, strides = [], []
    for k, v in parts:
        ptrs += [k.data_ptr(), v.data_ptr()]
        strides += [k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2)]
    return ptrs, strides, width, parts[0][0].shape[0]


# The kernel as PyTorch ops, so that torch.compile (decode="compile") calls it inside a compiled step instead
# of breaking the graph at each ctypes call. Eager code calls the kernel directly (no dispatcher overhead).


@torch.library.custom_op("ccft::block_matmul", mutates_args=())
def block_matmul_op(x: torch.Tensor, raw: torch.Tensor, kind: int, n: int, k: int) -> torch.Tensor:
    """``x (m, k)`` contiguous fp32 · Wᵀ, W ``(n, k)`` the blocks ``raw`` of format ``kind`` -> ``(m, n)``
    (:meth:`BlockMatrix.matmul` under ``torch.compile``)."""
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("ccft::block_matmul: the block kernel is not available")
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    kernel.lib.ccft_blocks_matmul(kind, _ptr(raw), n, k, _ptr(x), x.shape[0], k, _ptr(y), n, _threads())
    return y


@block_matmul_op.register_fake
def _(x, raw, kind, n, k):
    return x.new_empty(x.shape[0], n)


@torch.library.custom_op("ccft::block_mlp", mutates_args=())
def block_mlp_op(
    x: torch.Tensor, gate: torch.Tensor, gate_kind: int, up: torch.Tensor, up_kind: int, n: int, k: int
) -> torch.Tensor:
    """``silu(x · Wgᵀ) * (x · Wuᵀ)``: ``x (m, k)`` contiguous fp32, gate, up ``(n, k)`` blocks -> ``(m, n)``
    (:func:`fused_mlp` under ``torch.compile``)."""
    kernel = load_kernel()
    if kernel is None:
        raise RuntimeError("ccft::block_mlp: the block kernel is not available")
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    m = x.shape[0]
    kernel.lib.ccft_blocks_mlp(
        gate_kind, _ptr(gate), up_kind, _ptr(up), n, k, _ptr(x), m, k, _ptr(y), n, _threads()
    )
    return y


@block_mlp_op.register_fake
def _(x, gate, gate_kind, up, up_kind, n, k):
    return x.new_empty(x.shape[0], n)


#: GGUF (llama.cpp) tensor name in a layer -> HF projection name
_LAYER_NAMES = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}


def _unpermute_rows(n: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q / k permutation (``convert_hf_to_gguf``'s ``permute``), as
    transformers' GGUF loader does: HF row i is GGUF row ``index[i]``."""
    idx = torch.arange(n)
    return idx.reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)


#: ``config.model_type`` -> the GGUF ``general.architecture`` llama.cpp's converter writes for it
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
}
#: a fused GGUF tensor (phi3) -> the parts it stacks, in row order
_FUSED_GGUF = {"attn_qkv": ("q_proj", "k_proj", "v_proj"), "ffn_up": ("gate_proj", "up_proj")}


def read_gguf_blocks(path: str | Path, config, kernel: BlockKernel) -> dict[str, BlockMatrix]:
    """The Q4_1 / Q8_0 linear weights of the GGUF file ``path`` by HF name, for a model of ``config``'s family
    (:data:`GGUF_ARCHITECTURES`: llama.cpp's ``llama`` for Llama and Mistral, ``qwen2``, ``qwen3``,
    ``gemma2``, ``gemma3``, ``phi3``).

    Keys: ``"layers.{i}.{proj}"`` (``weights.PROJECTIONS``; phi3's fused ``attn_qkv`` / ``ffn_up`` split into
    their parts' rows) and ``"lm_head"`` (``output.weight``, or the tied ``token_embd.weight`` when the file
    has no output tensor and ``config.tie_word_embeddings``). Only the ``llama`` architecture's q / k rows are
    in llama.cpp's permuted order (put back in HF's). Tensors in other formats (F32, F16, other
    quantisations) are left out: they keep the fp32 path.

    Raises:
        ConfigError: the file cannot be read as GGUF, or its architecture is not the model's.
    """
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"block weights: {path} cannot be read as GGUF ({e})") from None
    mtype = getattr(config, "model_type", None)
    want = GGUF_ARCHITECTURES.get(mtype)
    if want is None:
        raise ConfigError(f"block weights: no GGUF architecture is known for model_type={mtype!r}")
    arch = reader.fields.get("general.architecture")
    got = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else want
    if got != want:
        raise ConfigError(
            f"block weights: {path} is a {got!r} GGUF model, not {want!r} (model_type={mtype!r})"
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    inter = config.intermediate_size
    out: dict[str, BlockMatrix] = {}
    tensors = {t.name: t for t in reader.tensors}
    fused = want == "phi3"
    for name, t in tensors.items():
        fmt = t.tensor_type.name
        if fmt not in FORMATS:
            continue
        parts = name.split(".")
        keys = None
        if parts[0] == "blk" and len(parts) == 4 and parts[3] == "weight":
            if fused and parts[2] in _FUSED_GGUF:
                keys = [f"layers.{int(parts[1])}.{p}" for p in _FUSED_GGUF[parts[2]]]
            elif parts[2] in _LAYER_NAMES:
                keys = [f"layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"]
        elif name == "output.weight" or (
            name == "token_embd.weight"
            and "output.weight" not in tensors
            and getattr(config, "tie_word_embeddings", False)
        ):
            keys = ["lm_head"]
        if keys is None:
            continue
        k, n = (int(s) for s in t.shape[:2])  # ggml order: the contiguous dimension first
        raw = torch.from_numpy(t.data.reshape(n, -1).copy())
        if raw.shape[1] != k // BLOCK * FORMATS[fmt][1] or k % BLOCK:
            raise ConfigError(f"block weights: {path} {name} has {raw.shape[1]} bytes per row for k={k}")
        m = BlockMatrix(fmt, raw, n, k, kernel)
        if len(keys) > 1:
            sizes = (
                [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
                if len(keys) == 3
                else [inter] * 2
            )
            if sum(sizes) != n:
                raise ConfigError(f"block weights: {path} {name} has {n} rows, expected {sum(sizes)}")
            starts = [sum(sizes[:j]) for j in range(len(sizes))]
            for key, a, size in zip(keys, starts, sizes, strict=True):
                out[key] = m.rows(torch.arange(a, a + size))
            continue
        key = keys[0]
        if want == "llama" and key.endswith("q_proj"):
            m = m.rows(_unpermute_rows(n, heads))
        elif want == "llama" and key.endswith("k_proj"):
            m = m.rows(_unpermute_rows(n, kv_heads))
        out[key] = m
    return out


class BlockMismatchError(ConfigError):
    """The GGUF's dequantised blocks differ from the model's fp32 weights (another file, or edited ones)."""


def attach_blocks(lw, blocks: dict[str, BlockMatrix]) -> int:
    """Point ``lw``'s ``Linear`` layers (``weights.LaneWeights``: every layer's projections and the LM head)
    at their ``blocks`` (:func:`read_gguf_blocks`), each after checking that its dequantised blocks equal
    the fp32 weight bit for bit (``torch.equal``). Returns the number of layers attached; layers without
    blocks keep fp32. Nothing is attached unless every check passes.

    Raises:
        BlockMismatchError: a block matrix whose shape or dequantised values differ from the fp32 weight.
    """
    pairs = []
    for i, layer in enumerate(lw.layers):
        for name, lin in layer.proj.items():
            if f"layers.{i}.{name}" in blocks:
                pairs.append((f"layers.{i}.{name}", lin))
    if "lm_head" in blocks:
        pairs.append(("lm_head", lw.lm_head))
    for key, lin in pairs:
        b, w = blocks[key], lin.weight
        if tuple(w.shape) != (b.n, b.k) or w.dtype != torch.float32 or w.device.type != "cpu":
            raise BlockMismatchError(
                f"block weights: {key} is {b.fmt} ({b.n}, {b.k}) in the GGUF, but the model's weight is "
                f"{w.dtype} {tuple(w.shape)} on {w.device}"
            )
        if not torch.equal(b.dequantize(), w.detach()):
            raise BlockMismatchError(
                f"block weights: {key}'s dequantised {b.fmt} blocks differ from the model's fp32 weight; "
                "the GGUF is not the file these weights came from (or the weights were edited)"
            )
    for key, lin in pairs:
        lin.blocks = blocks[key]
    return len(pairs)


#: ``block_weights`` settings besides a GGUF path
SETTINGS = ("auto", "on", "off")
#: environment variable giving the default setting (``0`` / ``off``, ``1`` / ``on``, ``auto``)
ENV = "CCFT_BLOCK_WEIGHTS"


def default_setting() -> str:
    """``block_weights``'s default: ``$CCFT_BLOCK_WEIGHTS`` (``0``/``off``/``false`` -> ``"off"``,
    ``1``/``on``/``true`` -> ``"on"``, ``auto``), else ``"off"`` (docs/inference.md, "Block weights": faster
    at 1-16 rows, slower at 64 and in long prefills, and the demo and study have not been timed with it).

    Raises:
        ConfigError: any other value.
    """
    raw = os.environ.get(ENV, "").strip().lower()
    if raw == "auto":
        return "auto"
    if raw in ("", "0", "off", "false", "no"):
        return "off"
    if raw in ("1", "on", "true", "yes"):
        return "on"
    raise ConfigError(f"{ENV}={raw!r}; use auto, 1 / on / true (on) or 0 / off / false (off)")


def use_block_weights(base, lw, setting, *, decode_mode: str) -> Path | None:
    """Attach a base lane's block weights (``attach_blocks``) as ``setting`` says; returns the GGUF file used,
    or None (fp32 weights).

    Args:
        base: the ``ccft.Base`` (its ``name`` / ``path`` locate the GGUF, ``ccft.core.models.source_gguf``).
        lw: its ``weights.LaneWeights`` (the base lane), before packing.
        setting: ``"auto"`` (on when the kernel builds, the base was dequantised from a Q4_1 / Q8_0 GGUF
            whose blocks equal its fp32 weights, and the engine decodes fp32 on the CPU (eager, static or
            compile); otherwise off, with a log line when something was tried and failed), ``"on"``
            (the same, but every failure raises), ``"off"``, or a path to the GGUF file (as ``"on"``),
            or None (:func:`default_setting`).
        decode_mode: the engine's decode mode (the CUDA modes keep fp32; ``"compile"`` calls the kernel as
            the ``ccft::block_matmul`` / ``ccft::block_mlp`` ops).
    Raises:
        ConfigError: an unknown setting; with ``"on"`` or a path: a device, dtype or decode mode the
            kernel does not run, no GGUF found, no kernel, or no Q4_1 / Q8_0 tensor in the file.
        BlockMismatchError: with ``"on"`` or a path, blocks that differ from the fp32 weights.
    """
    setting = default_setting() if setting is None else setting
    path = None
    if isinstance(setting, (str, Path)) and str(setting) not in SETTINGS:
        path = Path(setting)
        if not path.is_file():
            raise ConfigError(f"block_weights={str(setting)!r}: use auto, on, off or an existing GGUF file")
        setting = "on"
    if setting not in SETTINGS:
        raise ConfigError(f"block_weights={setting!r}: use auto, on, off or a GGUF file path")
    if setting == "off":
        return None
    required = setting == "on"

    def refuse(why: str) -> None:
        if required:
            raise ConfigError(f"block_weights: {why}")

    if (
        lw.device.type != "cpu"
        or lw.dtype != torch.float32
        or decode_mode not in ("eager", "static", "compile")
    ):
        refuse(
            f"the block kernel runs fp32 on the CPU with decode eager, static or compile, not {lw.dtype} on "
            f"{lw.device} with decode={decode_mode!r}; use block_weights='off'"
        )
        return None
    if path is None:
        from ccft.core.models import source_gguf

        path = source_gguf(base.name) or (source_gguf(base.path) if base.path else None)
        if path is None:
            refuse(f"{base.name!r} was not dequantised from a GGUF file; pass the file as block_weights=PATH")
            return None
    kernel = load_kernel()
    if kernel is None:
        refuse("the block kernel could not be built (see the log); use block_weights='off'")
        return None
    blocks = read_gguf_blocks(path, lw.owner.config, kernel)
    if not blocks:
        refuse(f"{path} has no Q4_1 / Q8_0 linear weights")
        return None
    try:
        n = attach_blocks(lw, blocks)
    except BlockMismatchError as e:
        if required:
            raise
        log.warning("ccft block weights not used, fp32 weights kept: %s", e)
        return None
    log.info("ccft block weights: %d linear layers from %s (%s)", n, path.name, kernel.isa)
    return path


__all__ = [
    "BLOCK",
    "ENV",
    "SETTINGS",
    "FORMATS",
    "BlockKernel",
    "BlockMatrix",
    "BlockMismatchError",
    "GGUF_ARCHITECTURES",
    "DecodeStepPlan",
    "StepArgs",
    "attach_blocks",
    "build_kernel",
    "concat",
    "decode_step_layers",
    "decode_step_plan",
    "f32_view",
    "lora_table",
    "fused_mlp",
    "kernel_path",
    "cpu_features",
    "target_isa",
    "missing_isa",
    "isa_record",
    "load_kernel",
    "read_gguf_blocks",
    "default_setting",
    "use_block_weights",
]
