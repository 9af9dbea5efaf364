"""Shared fixtures: tiny random Llama bases (fp32) with the embedded SmolLM2 tokenizer, real GSM8K rows."""

from __future__ import annotations

import json
import os
from pathlib import Path

# Hermetic: nothing in the suite may reach a hub (set before transformers/datasets/lm-eval are imported;
# subprocesses inherit it).
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ[_var] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "src" / "ccft" / "resources" / "gsm8k"

# `make test` runs pytest-xdist workers (Makefile, PYTEST_PARALLEL): they share the cores instead of each
# taking two threads on a 2-core machine.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))


# ------------------------------------------------------------------ loopback only (in this process)


def _loopback_only(address) -> None:
    """Raise ``OSError`` unless ``address`` (a connect() argument) is a Unix socket or a loopback host."""
    import ipaddress

    if not isinstance(address, tuple):  # AF_UNIX path / abstract name
        return
    host = address[0]
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:  # a name other than localhost (not resolved here: that could send a DNS query)
        loopback = False
    if not loopback:
        raise OSError(
            f"tests send no traffic beyond loopback: connect to {address!r} refused (tests/conftest.py)"
        )


@pytest.fixture(autouse=True, scope="session")
def loopback_only():
    """Every socket.connect/connect_ex in the test process goes to loopback or a Unix socket (hub clients,
    lm-eval, datasets run in-process): anything else raises OSError instead of sending a packet."""
    import socket

    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guarded_connect(self, address):
        _loopback_only(address)
        return connect(self, address)

    def guarded_connect_ex(self, address):
        _loopback_only(address)
        return connect_ex(self, address)

    socket.socket.connect, socket.socket.connect_ex = guarded_connect, guarded_connect_ex
    try:
        yield _loopback_only
    finally:
        socket.socket.connect, socket.socket.connect_ex = connect, connect_ex


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny models
    are latency-bound, and one thread avoids the large slowdown of OpenMP barriers when other processes
    share the cores. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The embedded SmolLM2 converted to an HF folder (tokenizer used by the tiny models)."""
    from ccft.core.models import convert_embedded

    return convert_embedded("smollm2-135m-instruct", quiet=True)


@pytest.fixture(scope="session")
def tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


def make_tiny_folder(
    path: Path,
    tokenizer,
    *,
    seed: int = 0,
    layers: int = 2,
    kv_heads: int = 2,
    hidden: int = 64,
    heads: int = 4,
    rope_theta: float = 10000.0,
    scale: float = 1.0,
) -> Path:
    """Save a random tiny Llama (GQA, RoPE) with ``tokenizer`` to ``path``. ``scale`` > 1 sharpens logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
        rope_theta=rope_theta,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).float()
    if scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(scale)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer) -> Path:
    return make_tiny_folder(tmp_path_factory.mktemp("tiny_base"), tokenizer)


@pytest.fixture
def tiny_base(tiny_dir):
    """A fresh ccft.Base over the tiny folder (fresh per test: LoRA decoders attach to it)."""
    from ccft import load_base

    return load_base(str(tiny_dir))


@pytest.fixture(scope="session")
def gsm8k_rows():
    """GSM8K train rows as {prompt, response}."""
    rows = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines() if line.strip()]
    return [{"prompt": r["question"], "response": r["answer"]} for r in rows]


def ragged_prompts(gsm8k_rows, tokenizer, n: int, first: int, step: int) -> list[list[int]]:
    """``n`` real GSM8K prompts (no chat template) cut to ``first, first + step, ...`` tokens: ragged prefixes."""
    from ccft.core.tokens import tokenize_prompt

    ids = [tokenize_prompt(tokenizer, r["prompt"], chat_template=False) for r in gsm8k_rows[:n]]
    return [p[: first + step * i] for i, p in enumerate(ids)]


def perturb(model, seed: int, scale: float = 0.05) -> None:
    """Add seeded noise to every ``*proj.weight`` of ``model`` in place (a decoder that differs from the base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.add_(scale * torch.randn(p.shape, generator=g))


def make_lora(
    base, name: str, seed: int, r: int, handoff: int = 1, targets=None, *, method: str | None = "ccft"
):
    """A LoRA decoder ``name`` on ``base`` with random B too (``init_lora_weights=False``: an ignored adapter shows)."""
    import ccft

    torch.manual_seed(seed)
    cfg = {"r": r, "lora_alpha": 2 * r, "init_lora_weights": False}
    if targets:
        cfg["target_modules"] = targets
    dec = ccft.make_decoder(base, "lora", lora=cfg, method=method, adapter_name=name, handoff_tokens=handoff)
    dec.model.eval()
    return dec


def make_full(base, seed: int, handoff: int = 1, *, method: str | None = "ccft"):
    """A read-only full-weight decoder: a copy of ``base`` (make it before attaching adapters) with seeded noise."""
    import ccft

    dec = ccft.make_decoder(base, "full", method=method, handoff_tokens=handoff)
    dec.model.eval()
    dec.model.requires_grad_(False)
    perturb(dec.model, seed)
    return dec


# ------------------------------------------------------------------ order independence


def pytest_addoption(parser):
    parser.addoption(
        "--reverse",
        action="store_true",
        default=False,
        help="run the collected tests in reverse order (checks that no test depends on state an "
        "earlier test built; works without pytest-randomly)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse"):
        items.reverse()
