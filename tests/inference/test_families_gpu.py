"""Every supported family on a GPU: CUDA-graph decode (``gpu`` marker; run by ``scripts/gpu_check.sh``).

Tiny random bases of each family (``tests/families.py``), built in memory with a stub tokenizer (nothing to
download), fp32 with TF32 off: greedy generation of the base, a LoRA decoder and a full-weight decoder on one
shared prefill, with the captured step (``decode="cuda_graph"``, gather and Triton prefix attention), equals
the reference path (``ccft.generate``: transformers' forward).
"""

from __future__ import annotations

import pytest
import torch
from test_inference_gpu import StubTokenizer, _no_tf32  # noqa: F401 - the autouse fixture applies here too

from families import FAMILIES, MODEL_FAMILIES, TARGETS_BY_FAMILY, family_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N_NEW = 6


def _base(family):
    import transformers

    import ccft

    torch.manual_seed(0)
    cfg = family_config(family, StubTokenizer())
    model = getattr(transformers, FAMILIES[family][1])(cfg).float().cuda().eval()
    model.requires_grad_(False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
        model.lm_head.weight.mul_(4.0)
    return ccft.Base(
        model=model, tokenizer=StubTokenizer(), fingerprint=f"gpu-{family}", name=family, path=""
    )


@pytest.mark.parametrize("attention", ["triton", "gather"])
@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_cuda_graph_greedy_equals_reference(family, attention):
    import ccft
    from ccft.inference import SharedPrefillEngine

    if attention == "triton":
        pytest.importorskip("triton")
    base = _base(family)
    full = ccft.make_decoder(base, "full", method="ccft")
    full.model.eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in full.model.named_parameters():
            if name.endswith("proj.weight"):
                p.add_(0.05 * torch.randn_like(p))
    lora = {"r": 4, "init_lora_weights": False}
    if family in TARGETS_BY_FAMILY:
        lora["target_modules"] = TARGETS_BY_FAMILY[family]
    torch.manual_seed(10)
    math = ccft.make_decoder(base, "lora", lora=lora, method="ccft", adapter_name="math")
    math.model.eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (4 + 5 * i,), generator=g).tolist() for i in range(3)]
    eng = SharedPrefillEngine(
        base,
        decoders={"math": math, "full": full},
        decode="cuda_graph",
        attention=attention,
        fill=float("nan"),
    )
    with eng.prefill(prompts) as h:
        for name, dec in (("base", None), ("math", math), ("full", full)):
            got = eng.generate(h, decoder=name, max_new_tokens=N_NEW)
            if dec is None:
                ref = ccft.generate(prompts, mode="base", base=base, max_new_tokens=N_NEW)
            else:
                ref = ccft.generate(prompts, mode="prefillshare", decoder=dec, max_new_tokens=N_NEW)
            assert [x.token_ids for x in got] == [x.token_ids for x in ref], name
