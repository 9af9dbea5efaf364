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


def jsonl(rows) -> str:
    """``rows`` as JSON Lines text."""
    return "".join(json.dumps(r) + "\n" for r in rows)


def short_sum_rows(path: Path, *, done_suffix: bool) -> Path:
    """24 short rows ("Qi: what is a plus b?" with 0-2 repeated sentences, "a plus b is c." and, with
    ``done_suffix``, 0-3 " Done."), of different prompt and response lengths, written to ``path`` (JSONL)."""
    rows = []
    for i in range(24):
        a, b = 3 * i + 1, 7 * i % 11 + 2
        extra = " Please think carefully." * (i % 3)
        response = f"{a} plus {b} is {a + b}." + (" Done." * (i % 4) if done_suffix else "")
        rows.append({"prompt": f"Q{i}: what is {a} plus {b}?{extra}", "response": response})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def short_run_overrides(base_dir, out, data, **kw) -> list[str]:
    """Recipe overrides (``key=value``) for a short CCFT run on CPU: 12 rows of ``data``, batch 3, 4 steps,
    lr 1e-2, seed 7, no chat template, no saving; ``kw`` adds or replaces keys."""
    ov = {
        "base": str(base_dir),
        "output_dir": str(out),
        "train_data": str(data),
        "train_rows": 12,
        "max_steps": 4,
        "per_device_train_batch_size": 3,
        "logging_steps": 1,
        "learning_rate": 1e-2,
        "method": "ccft",
        "use_cpu": "true",
        "disable_tqdm": "true",
        "lora_dropout": 0,
        "chat_template": "false",
        "save_strategy": "no",
        "seed": 7,
    }
    ov.update(kw)
    return [f"{k}={v}" for k, v in ov.items()]


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``folder`` with its size and mtime (folders: ``(-1, 0)``): equal snapshots before and
    after a command mean it wrote nothing there."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else (-1, 0)
        for p in sorted(folder.rglob("*"))
    }


@pytest.fixture(scope="session")
def gsm8k_rows():
    """GSM8K train rows as {prompt, response}."""
    rows = [json.loads(line) for line in (GSM8K / "train.jsonl").read_text().splitlines() if line.strip()]
    return [{"prompt": r["question"], "response": r["answer"]} for r in rows]


def ragged_prompts(gsm8k_rows, tokenizer, n: int, first: int, step: int) -> list[list[int]]:
    """``n`` real GSM8K prompts (no chat template) cut to ``first, first + step, ...`` tokens: ragged
    prefixes."""
    from ccft.core.tokens import tokenize_prompt

    ids = [tokenize_prompt(tokenizer, r["prompt"], chat_template=False) for r in gsm8k_rows[:n]]
    return [p[: first + step * i] for i, p in enumerate(ids)]


def perturb(model, seed: int, scale: float = 0.05) -> None:
    """Add seeded noise to every ``*proj.weight`` of ``model`` in place (a decoder that differs from the
    base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.add_(scale * torch.randn(p.shape, generator=g))


def make_lora(
    base, name: str, seed: int, r: int, handoff: int = 1, targets=None, *, method: str | None = "ccft"
):
    """A LoRA decoder ``name`` on ``base`` with random B too (``init_lora_weights=False``: an ignored adapter
    shows)."""
    import ccft

    torch.manual_seed(seed)
    cfg = {"r": r, "lora_alpha": 2 * r, "init_lora_weights": False}
    if targets:
        cfg["target_modules"] = targets
    dec = ccft.make_decoder(base, "lora", lora=cfg, method=method, adapter_name=name, handoff_tokens=handoff)
    dec.model.eval()
    return dec


def make_full(base, seed: int, handoff: int = 1, *, method: str | None = "ccft"):
    """A read-only full-weight decoder: a copy of ``base`` (make it before attaching adapters) with seeded
    noise."""
    import ccft

    dec = ccft.make_decoder(base, "full", method=method, handoff_tokens=handoff)
    dec.model.eval()
    dec.model.requires_grad_(False)
    perturb(dec.model, seed)
    return dec


#: block format of each weight :func:`make_block_folder` quantises by default (as the embedded model: linear
#: layers Q4_1, the LM head Q8_0)
BLOCK_FORMATS = {"proj": "Q4_1", "lm_head": "Q8_0"}


def make_block_folder(path: Path, tokenizer, *, formats: dict | None = None, seed: int = 0, **tiny) -> Path:
    """A tiny Llama as the embedded model is shipped and loaded, with no download: its weights quantised into
    GGUF blocks (``formats``: ``{"proj": "Q4_1" | "Q8_0", "lm_head": ...}``, default :data:`BLOCK_FORMATS`),
    written as ``path/model.gguf`` (llama.cpp's names, q / k rows in llama.cpp's order; the embedding F32),
    and the HF folder ``path/hf`` whose fp32 weights are those blocks dequantised by gguf-py (as transformers
    dequantises a GGUF), with ``CCFT_SOURCE.txt`` naming the GGUF (``ccft.core.models.source_gguf``).
    ``tiny``: arguments of :func:`make_tiny_folder`. Returns the HF folder."""
    from gguf import GGUFWriter
    from transformers import LlamaForCausalLM

    from families import write_block_gguf

    formats = {**BLOCK_FORMATS, **(formats or {})}
    hf = make_tiny_folder(path / "hf", tokenizer, seed=seed, **tiny)
    model = LlamaForCausalLM.from_pretrained(hf)
    cfg = model.config
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    names.update(gate_proj="ffn_gate", up_proj="ffn_up", down_proj="ffn_down")
    writer = GGUFWriter(str(path / "model.gguf"), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    tensors = [("token_embd.weight", model.model.embed_tokens.weight, None, None)]
    for i, layer in enumerate(model.model.layers):
        for hf_name, gg_name in names.items():
            mod = getattr(
                layer.self_attn if hf_name in ("q_proj", "k_proj", "v_proj", "o_proj") else layer.mlp, hf_name
            )
            heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(hf_name)
            tensors.append((f"blk.{i}.{gg_name}.weight", mod.weight, formats["proj"], heads))
        tensors.append((f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight, None, None))
        tensors.append((f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight, None, None))
    tensors.append(("output_norm.weight", model.model.norm.weight, None, None))
    tensors.append(("output.weight", model.lm_head.weight, formats["lm_head"], None))
    write_block_gguf(writer, tensors)
    model.save_pretrained(hf)
    (hf / "CCFT_SOURCE.txt").write_text(f"tiny Llama in GGUF blocks\nconverted from {path / 'model.gguf'}\n")
    return hf


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


# ------------------------------------------------- skips a machine could have run (CI: CCFT_FORBID_SKIPS)

#: test groups whose skips say what is missing, by the words of their skip reasons: ``kernel`` (the C++
#: block kernel: no compiler), ``toolchains`` (a MultiPL-E / MBXP language or the BFCL checker that
#: `make toolchains` installs), ``redis`` (a redis-server binary)
SKIP_GROUPS = {
    "kernel": ("C++ compiler",),
    "toolchains": (" unavailable", "make toolchains", "BFCL checker env absent"),
    "redis": ("redis-server",),
}
#: the groups that must not skip in this run: comma-separated names of SKIP_GROUPS (.ci/run sets it to what
#: its machine has: ``kernel`` where a C++ compiler is on PATH, ``toolchains`` after `make toolchains`
#: succeeded)
FORBID_ENV = "CCFT_FORBID_SKIPS"


def skip_group(reason: str) -> str | None:
    """The :data:`SKIP_GROUPS` group a skip reason belongs to, or None."""
    for group, words in SKIP_GROUPS.items():
        if any(w in reason for w in words):
            return group
    return None


def forbidden_skips(skips: list[tuple[str, str]], forbid: str) -> list[str]:
    """``nodeid: reason`` of each skip (``(nodeid, reason)``) whose group is named in ``forbid``."""
    groups = {g.strip() for g in forbid.split(",") if g.strip()}
    unknown = groups - set(SKIP_GROUPS)
    if unknown:
        raise ValueError(f"{FORBID_ENV}: unknown group(s) {sorted(unknown)}; use {', '.join(SKIP_GROUPS)}")
    return [f"{nodeid}: {reason}" for nodeid, reason in skips if skip_group(reason) in groups]


_SKIPS: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    """Collect every skip with its reason (under xdist the controller sees the workers' reports too)."""
    if report.skipped and isinstance(report.longrepr, tuple):
        _SKIPS.append((report.nodeid, str(report.longrepr[2]).removeprefix("Skipped: ")))


def pytest_sessionfinish(session):
    """Fail the run when a test of a group named in ``CCFT_FORBID_SKIPS`` skipped: CI's machine can run it,
    so the skip hides a broken install step (a green run with the kernel tests skipped proves nothing)."""
    forbid = os.environ.get(FORBID_ENV, "")
    if not forbid or hasattr(session.config, "workerinput"):  # the controller decides, once
        return
    bad = forbidden_skips(_SKIPS, forbid)
    if bad:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"{FORBID_ENV}={forbid}: {len(bad)} test(s) skipped that this machine should run:", *bad]
        if tr is not None:
            tr.ensure_newline()
            tr.write_sep("=", "skips this machine should run", red=True)
            tr.write_line("\n".join(lines), red=True)
        else:
            print("\n".join(lines))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


# ------------------------------------------------- 4-layer bases for the depth and compact-cache tests

DEEP_LAYERS = 4


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory, tokenizer) -> Path:
    """A 4-layer tiny Llama with clear logit margins (lm_head ×20): sharing depth, compact C_base."""
    return make_tiny_folder(
        tmp_path_factory.mktemp("deep"), tokenizer, seed=3, layers=DEEP_LAYERS, scale=20.0
    )


@pytest.fixture
def deep_base(deep_dir):
    import ccft

    return ccft.load_base(str(deep_dir))


@pytest.fixture(scope="module")
def deep_train_dir(tmp_path_factory, tokenizer) -> Path:
    """4 layers, lm_head scaled ×8 (a LoRA adapter can move the loss: see test_trainer.py's sharp_dir)."""
    return make_tiny_folder(
        tmp_path_factory.mktemp("deep_train"), tokenizer, seed=1, layers=DEEP_LAYERS, scale=8.0
    )


@pytest.fixture(scope="module")
def short_data(tmp_path_factory) -> Path:
    """Short summing rows without the done suffix (``short_sum_rows``)."""
    return short_sum_rows(tmp_path_factory.mktemp("short_data") / "rows.jsonl", done_suffix=False)


def two_step_config(base_dir, out, data, **kw):
    """(TrainConfig, raw recipe) of a 2-step short run (``short_run_overrides``) with ``kw`` on top."""
    from ccft.train.config import load_recipe

    cfg, _, raw = load_recipe(None, short_run_overrides(base_dir, out, data, **{"max_steps": 2, **kw}))
    return cfg, raw


def perturb_lora(model, seed=123, std=0.05):
    """Random ``lora_B`` weights (a fresh adapter's are zero, so it would not differ from the base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def grads(model):
    """Every parameter's gradient, cloned, by name."""
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


#: a tiny LoRA recipe for study runs (test_study, test_frontier): ``.format(base=, data=, chat=)``
TINY_RECIPE = """base: {base}
decoder_kind: lora
lora_r: 4
lora_alpha: 8
handoff_tokens: 1
train_data: {data}
train_rows: 8
max_steps: 6
per_device_train_batch_size: 2
learning_rate: 1.0e-2
seed: 3
logging_steps: 1
save_steps: 2
save_total_limit: 1
use_cpu: true
report_to: none
disable_tqdm: true
chat_template: {chat}
max_length: 384
"""


def reload_generates_the_same(run, base_dir):
    """The decoder of a finished ``run`` (``run_training``'s result) loaded from its folder on a fresh base:
    greedy prefillshare tokens on 3 training prompts equal the trained decoder's. Returns the loaded one."""
    import ccft

    loaded = ccft.load_decoder(run.output_dir, base=ccft.load_base(str(base_dir)))
    prompts = [list(run.trainer.train_dataset[i].prompt_ids) for i in range(3)]
    run.decoder.model.eval()
    want = ccft.generate(prompts, mode="prefillshare", decoder=run.decoder, max_new_tokens=4)
    got = ccft.generate(prompts, mode="prefillshare", decoder=loaded, max_new_tokens=4)
    assert [g.token_ids for g in got] == [g.token_ids for g in want]
    return loaded


def sixteen_step_losses(base_dir, out, **kw) -> list[float]:
    """The logged losses of a 16-step, batch-1, constant-LR run on 16 GSM8K rows with ``kw`` (recipe keys)
    on top; each is checked finite and there are 16 (the "loss goes down" tests compare their ends)."""
    import math

    from ccft.train.run import setup

    cfg, _ = two_step_config(
        base_dir,
        out,
        "gsm8k:train",
        train_rows=16,
        max_steps=16,
        per_device_train_batch_size=1,
        lr_scheduler_type="constant",
        **kw,
    )
    trainer = setup(cfg)[-1]
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 16 and all(math.isfinite(v) for v in losses)
    return losses


def forced_step_logits(eng, handle, decoders, n_rows: int, n_new: int, seed: int = 0):
    """Teacher-force ``n_new`` random tokens through every decoder on every row of ``handle`` in one engine
    run -> (forced tokens per row, request id per (decoder, row), per step ``{request id: logits}``)."""
    g = torch.Generator().manual_seed(seed)
    forced = torch.randint(3, 200, (n_rows, n_new), generator=g).tolist()
    rid = {
        (n, i): eng.add_request(handle, i, decoder=n, forced_tokens=forced[i])
        for n in decoders
        for i in range(n_rows)
    }
    steps = []
    while eng.active:
        steps.append({o.request_id: o.logits for o in eng.step(return_logits=True)})
    return forced, rid, steps
