"""CUDA-graph decode and the Triton kernel on a GPU (``gpu`` marker; run by ``scripts/gpu_check.sh``).

Self-contained: a tiny random Llama built in memory and a stub tokenizer, so the check needs no
downloaded or embedded model. fp32 with TF32 off: the captured graphs equal the eager path and the
reference (``ccft.generate`` / ``ccft.decoder_forward``) within 1e-5, for every decoder, batch
bucket and interleaving (K4); outputs are copied out of the graph before the next replay and the
prefix is bit-identical afterwards (K1); captures are bounded.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N_NEW = 8


class StubTokenizer:
    pad_token_id = 0
    eos_token_id = 2
    bos_token_id = 1
    chat_template = None
    special_tokens_map = {"eos_token": "<2>"}

    def __len__(self):
        return 256

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)

    def get_vocab(self):
        return {f"t{i}": i for i in range(256)}


@pytest.fixture(autouse=True)
def _no_tf32():
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _base(scale=30.0, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    import ccft

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).float().cuda().eval()
    model.requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return ccft.Base(model=model, tokenizer=StubTokenizer(), fingerprint="gpu-test", name="tiny", path="")


def _decoders(base):
    import ccft

    full = ccft.make_decoder(base, "full", method="ccft")
    full.model.eval()
    full.model.requires_grad_(False)
    g = torch.Generator(device="cuda").manual_seed(5)
    with torch.no_grad():
        for name, p in full.model.named_parameters():
            if name.endswith("proj.weight"):
                p.add_(0.05 * torch.randn(p.shape, generator=g, device="cuda"))
    decs = {"full": full}
    for i, name in enumerate(("math", "code")):
        torch.manual_seed(10 + i)
        d = ccft.make_decoder(
            base, "lora", lora={"r": 4 + 4 * i, "init_lora_weights": False}, method="ccft", adapter_name=name
        )
        d.model.eval()
        decs[name] = d
    return decs


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (3 + 7 * i % 40,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("attention", ["triton", "gather"])
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_cuda_graph_greedy_equals_reference(attention, batch):
    _greedy_equals_reference("cuda_graph", attention, batch)


@pytest.mark.parametrize("attention", ["triton", "gather"])
def test_compiled_graph_greedy_equals_reference(attention):
    """decode='compiled_graph' (the torch.compile'd step captured as CUDA graphs) equals the reference."""
    torch._dynamo.reset()
    _greedy_equals_reference("compiled_graph", attention, 3)


def test_cuda_graph_unpacked_greedy_equals_reference():
    """pack_weights=False (q/k/v and gate/up as separate matmuls, the CUDA default before packing) equals
    the reference too."""
    _greedy_equals_reference("cuda_graph", "triton", 3, pack_weights=False)


def _greedy_equals_reference(decode, attention, batch, pack_weights=None):
    import ccft
    from ccft.inference import SharedPrefillEngine

    if attention == "triton":
        pytest.importorskip("triton")
    base = _base()
    decs = _decoders(base)
    prompts = _prompts(batch)
    eng = SharedPrefillEngine(
        base, decoders=decs, decode=decode, attention=attention, fill=float("nan"), pack_weights=pack_weights
    )
    assert eng.pack_weights is (pack_weights is not False)  # packed by default on CUDA for captured steps
    with eng.prefill(prompts) as h:
        snap = h.snapshot()
        for name in ("base", "math", "code", "math", "full"):  # A, B, A on one handle
            got = eng.generate(h, decoder=name, max_new_tokens=N_NEW)
            if name == "base":
                ref = ccft.generate(prompts, mode="base", base=base, max_new_tokens=N_NEW)
            else:
                ref = ccft.generate(prompts, mode="prefillshare", decoder=decs[name], max_new_tokens=N_NEW)
            assert [g.token_ids for g in got] == [r.token_ids for r in ref], name
        assert all(torch.equal(a, b) for a, b in zip(snap, h.snapshot(), strict=True))
    runner = eng.lanes["base"].runner
    assert 0 < runner.captures <= 8


@pytest.mark.parametrize("attention", ["triton", "gather"])
def test_cuda_graph_depth_and_compact_equal_reference(attention):
    """Decoders at sharing depth m (own prompt K/V below layer m) and on the compact (int8) C_base, captured
    as CUDA graphs, each alone and all in one step: greedy tokens equal the reference path's."""
    import ccft
    from ccft.inference import SharedPrefillEngine

    if attention == "triton":
        pytest.importorskip("triton")
    base = _base()
    decs = _decoders(base)
    decs["math"].share_from_layer = 1
    decs["full"].share_from_layer = 2
    decs["code"].cache_format = "int8"
    prompts = _prompts(3)
    refs = {
        name: [
            g.token_ids for g in ccft.generate(prompts, mode="prefillshare", decoder=d, max_new_tokens=N_NEW)
        ]
        for name, d in decs.items()
    }
    eng = SharedPrefillEngine(
        base, decoders=decs, decode="cuda_graph", attention=attention, fill=float("nan")
    )
    with eng.prefill(prompts) as h:
        for name in decs:
            assert [g.token_ids for g in eng.generate(h, decoder=name, max_new_tokens=N_NEW)] == refs[name], (
                name
            )
        ids = {
            (name, i): eng.add_request(h, i, decoder=name, max_new_tokens=N_NEW)
            for name in decs
            for i in range(3)
        }
        done = {}
        while eng.active:
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.generation.token_ids
        assert all(done[rid] == refs[name][i] for (name, i), rid in ids.items())


def test_cuda_graph_teacher_forced_logits_mixed_batch():
    """Rows of base + two adapters in one captured step, plus the full lane; logits == decoder_forward."""
    import ccft
    from ccft.core.tokens import right_pad
    from ccft.inference import SharedPrefillEngine

    base = _base(scale=1.0)
    decs = _decoders(base)
    prompts = _prompts(4, seed=1)
    cache = ccft.compute_base_cache(base, prompts)
    g = torch.Generator().manual_seed(0)
    forced = torch.randint(3, 256, (len(prompts), N_NEW), generator=g).tolist()
    eng = SharedPrefillEngine(base, decoders=decs, decode="cuda_graph", fill=float("nan"))
    h = eng.prefill(prompts)
    names = ("base", "math", "code", "full")
    rid = {(n, i): eng.add_request(h, i, decoder=n, forced_tokens=forced[i]) for n in names for i in range(4)}
    steps, kept = [], []
    while eng.active:
        outs = {o.request_id: o for o in eng.step(return_logits=True)}
        steps.append(outs)
        kept.append({r: o.logits.clone() for r, o in outs.items()})
    h.release()
    for s, k in zip(steps, kept, strict=True):  # nothing returned was overwritten by a later replay (K1)
        assert all(torch.equal(s[r].logits, k[r]) for r in s)
    ids, mask = right_pad([cache.tail_ids[i].tolist() + forced[i] for i in range(4)], 0)
    for n in names:
        with torch.no_grad():
            if n == "base":
                with base.base_weights() as m:
                    ref = ccft.decoder_forward(m, cache, ids.cuda(), mask.cuda())
            else:
                ref = ccft.decoder_forward(decs[n], cache, ids.cuda(), mask.cuda())
        for i in range(4):
            got = torch.stack([s[rid[n, i]].logits for s in steps])
            torch.testing.assert_close(got, ref[i, :N_NEW], atol=1e-5, rtol=0)


def test_captures_are_bounded_and_reused():
    from ccft.inference import SharedPrefillEngine

    base = _base()
    eng = SharedPrefillEngine(base, decode="cuda_graph", max_batch=8)
    prompts = _prompts(8, seed=2)
    with eng.prefill(prompts) as h:
        eng.generate(h, max_new_tokens=40, ignore_eos=True)
        first = eng.lanes["base"].runner.captures
        eng.generate(h, max_new_tokens=40, ignore_eos=True)  # same buckets: replays only
        assert eng.lanes["base"].runner.captures == first
        eng.generate(h, rows=[0, 1, 2], max_new_tokens=40, ignore_eos=True)  # a smaller batch bucket
    # batch buckets {8, 4} x tail widths {16, 32, 64}
    assert first <= 3 and eng.lanes["base"].runner.captures <= 6


def test_triton_kernel_on_cuda_equals_gather():
    pytest.importorskip("triton")
    from test_inference_attention import CASES, make_case, reference, static_meta

    from ccft.inference.attention import merge, tail_attention
    from ccft.inference.kv import bucket
    from ccft.inference.triton_kernels import prefix_attention_triton

    for case in CASES:
        arena, regions, rows, q, tk, tv, tail_len = make_case(*case, device="cuda")
        kv_heads, d = case[1], case[3]
        scale = d**-0.5
        q, tk, tv, tail_len = q.cuda(), tk.cuda(), tv.cuda(), tail_len.cuda()
        ref = reference(arena, regions, rows, q, tk, tv, tail_len, scale)
        b = bucket(len(rows))
        qp = torch.cat([q, torch.randn(b - len(rows), *q.shape[1:], device="cuda")])
        meta = static_meta(regions, rows, b, kv_heads, device="cuda")
        out, lse = prefix_attention_triton(
            qp, arena.k[0].view(-1, d), arena.v[0].view(-1, d), meta, kv_heads, scale
        )
        ot, lt = tail_attention(q, tk, tv, tail_len, scale)
        torch.testing.assert_close(merge(out[: len(rows)], lse[: len(rows)], ot, lt), ref, atol=1e-5, rtol=0)


def test_graphs_recaptured_after_buffers_grow():
    """Growing the prefix arena / tail pool drops the lane's graphs (and their memory pool); the next
    captures take a fresh pool and still equal the reference (regression: capturing into the dead
    pool's handle tripped the caching allocator's use-count assertion)."""
    import ccft
    from ccft.inference import SharedPrefillEngine

    base = _base()
    eng = SharedPrefillEngine(base, decode="cuda_graph", max_batch=16)
    small = _prompts(1, seed=3)
    with eng.prefill(small) as h:
        got = eng.generate(h, max_new_tokens=N_NEW)
    runner = eng.lanes["base"].runner
    first = runner.captures
    gens = (eng.lanes["base"].pool.generation, eng.arena.generation)
    big = [p * 6 for p in _prompts(16, seed=4)]  # more rows and longer prefixes: both buffers grow
    with eng.prefill(big) as h:
        got = eng.generate(h, max_new_tokens=3 * N_NEW)
    assert (eng.lanes["base"].pool.generation, eng.arena.generation) != gens
    assert runner.captures > first
    ref = ccft.generate(big, mode="base", base=base, max_new_tokens=3 * N_NEW)
    assert [g.token_ids for g in got] == [r.token_ids for r in ref]
    with eng.prefill(small) as h:  # and back to a small bucket on the grown buffers
        got = eng.generate(h, max_new_tokens=N_NEW)
    assert [g.token_ids for g in got] == [
        r.token_ids for r in ccft.generate(small, mode="base", base=base, max_new_tokens=N_NEW)
    ]


def test_scheduler_shared_prefill_store_and_suffixes_on_cuda():
    """Serving path on CUDA: prefix store + chunked prefill, per-agent suffixes in the tail, captured decode;
    every request equals the reference on its whole prompt, and the no-share baseline equals each
    decoder's own prefill (``ccft.generate(mode="full-ft")``)."""
    import dataclasses

    import ccft
    from ccft.inference import SharedPrefillEngine
    from ccft.serving import PrefixKVStore, Scheduler, ServeRequest

    base = _base()
    decs = _decoders(base)
    g = torch.Generator().manual_seed(7)
    ctx = [torch.randint(3, 256, (40 + 9 * t,), generator=g).tolist() for t in range(2)]
    ctx[1][:40] = ctx[0]  # the second turn extends the first: store hits
    reqs = [
        ServeRequest(
            name,
            c + torch.randint(3, 256, (3 + i,), generator=g).tolist(),
            shared_len=len(c),
            max_new_tokens=N_NEW,
        )
        for c in ctx
        for i, name in enumerate(("base", "math", "code", "full"))
    ]
    for share in (True, False):
        eng = SharedPrefillEngine(base, decoders=decs, decode="cuda_graph", fill=float("nan"))
        sched = Scheduler(eng, share=share, store=PrefixKVStore(block_tokens=16))
        tickets = [sched.submit(r) for r in reqs[:4]]
        sched.run_until_idle()
        tickets += [sched.submit(r) for r in reqs[4:]]
        sched.run_until_idle()
        for t, r in zip(tickets, reqs, strict=True):
            p = [list(r.prompt_ids)]
            if r.decoder == "base":
                ref = ccft.generate(p, mode="base", base=base, max_new_tokens=N_NEW)[0]
            elif share:
                ref = ccft.generate(p, mode="prefillshare", decoder=decs[r.decoder], max_new_tokens=N_NEW)[0]
            else:  # the decoder on its own prefill (the reference path's full-ft mode, same weights)
                own = dataclasses.replace(decs[r.decoder], method="full-ft")
                ref = ccft.generate(p, mode="full-ft", decoder=own, max_new_tokens=N_NEW)[0]
            assert t.state == "done" and t.result.token_ids == ref.token_ids, (share, r.decoder)
        assert sched.stats()["prefix_hit_tokens"] > 0 and sched.live_bytes == 0
