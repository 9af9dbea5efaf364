"""Inference: one shared prefill, many decoders, static caches, captured decode (docs/design.md, "Layers").

``SharedPrefillEngine`` (``engine``) runs the base once per batch of prompts into a read-only prefix
arena (``handles.PrefixHandle``, ``kv``) and decodes any number of decoders (LoRA adapters on the
base's single weight copy, or full-weight models; ``lanes``) on it, with a step-level API for
schedulers (``requests``). Its decode attention is split at the shared prefix (``attention``;
Triton kernel in ``triton_kernels``); the static decode step (``planner``) is captured as CUDA
graphs on GPUs (``graphs``). ``ccft.generate`` is the slow reference it equals. Log-probabilities:
per step for the rows that ask (``add_request(logprobs=k)``), and of a prompt's own tokens
(``scoring.prompt_logprobs``, what ``ccft serve`` returns for ``echo``).
"""

from ccft.core.sampling import DecodeParams, SamplingParams
from ccft.inference.engine import SharedPrefillEngine
from ccft.inference.handles import BASE, PrefixHandle
from ccft.inference.kv import CapacityError
from ccft.inference.requests import StepError, StepOutput

__all__ = [
    "SharedPrefillEngine",
    "PrefixHandle",
    "SamplingParams",
    "DecodeParams",
    "StepOutput",
    "StepError",
    "CapacityError",
    "BASE",
]
