"""The layers of a LLaMA block at the LM benchmark's shapes (python -m fusekit.bench.lm's models,
batch x context tokens), fused against the expression Hugging Face's modeling code runs, eager and
under torch.compile: forward, and forward + backward (cases *_train). bf16 operands throughout, as
a model with bf16 parameters runs them. Cases with `memory` also report each path's peak memory
above what was allocated before the call."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import fusekit

# (label, tokens, hidden, heads, kv heads, intermediate, context, vocabulary)
SHAPES = (("small", 64 * 1024, 768, 12, 12, 2048, 1024, 32000),
          ("1b", 8 * 2048, 2048, 32, 8, 5632, 2048, 32000))
EPS = 1e-6


def hf_rms_norm(x, w):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def hf_add_rms_norm(x, r, w):
    s = x + r
    return hf_rms_norm(s, w), s


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def hf_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def hf_qkv_rope(x, wq, wk, wv, cos, sin):
    """Hugging Face LLaMA attention's inputs: the three projections viewed as [B, H, T, D], rope on q, k."""
    b, t, d = x.shape[0], x.shape[1], cos.shape[-1]
    q, k, v = (F.linear(x, w).view(b, t, -1, d).transpose(1, 2) for w in (wq, wk, wv))
    return (*hf_rope(q, k, cos, sin), v)


def hf_mlp(x, gw, uw, dw):
    return F.linear(F.silu(F.linear(x, gw)) * F.linear(x, uw), dw)


def hf_linear_ce(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def _train(fn, *args, grad=None):
    """A forward and backward: the sum of each output against a fixed random gradient."""
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    grads = grad if grad is not None else [None] * len(outs)
    torch.autograd.backward([o for o in outs], [g if g is not None else torch.ones_like(o) for o, g in zip(outs, grads)])


def llm_cases(randn, compiled):
    for label, m, d, heads, kv, f, ctx, vocab in SHAPES:
        b = m // ctx
        hd = d // heads
        x, r, w = randn(m, d), randn(m, d), (1 + 0.1 * randn(d)).requires_grad_()
        xg, rg = x.clone().requires_grad_(), r.clone().requires_grad_()
        dy = randn(m, d)
        rms = lambda x, w: fusekit.rms_norm(x, w, eps=EPS)  # noqa: E731
        yield dict(name=f"llm_rms_norm/{label}_M{m}_N{d}/bf16", bytes=2 * m * d * 2,
                   fusekit=lambda x=x, w=w: rms(x, w),
                   peers={"eager": lambda x=x, w=w: hf_rms_norm(x, w), "compile": (compiled(hf_rms_norm), (x, w))})
        yield dict(name=f"llm_rms_norm_train/{label}_M{m}_N{d}/bf16",
                   fusekit=lambda: _train(rms, xg, w, grad=[dy]),
                   peers={"eager": lambda: _train(hf_rms_norm, xg, w, grad=[dy]),
                          "compile": (lambda c=compiled(hf_rms_norm): _train(c, xg, w, grad=[dy]), ())})
        add = lambda x, r, w: fusekit.add_rms_norm(x, r, w, eps=EPS)  # noqa: E731
        yield dict(name=f"llm_add_rms_norm/{label}_M{m}_N{d}/bf16", bytes=4 * m * d * 2,
                   fusekit=lambda x=x, r=r, w=w: add(x, r, w),
                   peers={"eager": lambda x=x, r=r, w=w: hf_add_rms_norm(x, r, w),
                          "compile": (compiled(hf_add_rms_norm), (x, r, w))})
        yield dict(name=f"llm_add_rms_norm_train/{label}_M{m}_N{d}/bf16",
                   fusekit=lambda: _train(add, xg, rg, w, grad=[dy, dy]),
                   peers={"eager": lambda: _train(hf_add_rms_norm, xg, rg, w, grad=[dy, dy]),
                          "compile": (lambda c=compiled(hf_add_rms_norm): _train(c, xg, rg, w, grad=[dy, dy]), ())})

        # rotary on q, k as Hugging Face's attention hands them: [B, H, T, D] views of [B, T, H, D]
        q = randn(b, ctx, heads, hd).transpose(1, 2)
        k = randn(b, ctx, kv, hd).transpose(1, 2)
        pos = torch.arange(ctx, device=q.device, dtype=torch.float32)
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=q.device, dtype=torch.float32) / hd))
        emb = torch.cat([torch.outer(pos, inv)] * 2, -1)[None].expand(b, ctx, hd)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
        rope = fusekit.apply_rotary_pos_emb
        yield dict(name=f"llm_rope/{label}_B{b}_H{heads}_KV{kv}_T{ctx}_D{hd}/bf16", bytes=2 * 2 * (q.numel() + k.numel()),
                   fusekit=lambda: rope(q, k, cos, sin),
                   peers={"eager": lambda: hf_rope(q, k, cos, sin), "compile": (compiled(hf_rope), (q, k, cos, sin))})
        yield dict(name=f"llm_rope_train/{label}_B{b}_H{heads}_KV{kv}_T{ctx}_D{hd}/bf16",
                   fusekit=lambda: _train(rope, qg, kg, cos, sin),
                   peers={"eager": lambda: _train(hf_rope, qg, kg, cos, sin),
                          "compile": (lambda c=compiled(hf_rope): _train(c, qg, kg, cos, sin), ())})

        # the attention's inputs: q, k, v projections and rope (fusekit: qkv_rope)
        xa = randn(b, ctx, d)
        xag = xa.clone().requires_grad_()
        wq = randn(heads * hd, d, scale=d ** -0.5).requires_grad_()
        wk, wv = (randn(kv * hd, d, scale=d ** -0.5).requires_grad_() for _ in range(2))
        go = [randn(b, n, ctx, hd) for n in (heads, kv, kv)]
        qkv = lambda x, wq, wk, wv: fusekit.functional.qkv_rope(x, wq, wk, wv, cos, sin, hd)  # noqa: E731
        hf_qkv = lambda x, wq, wk, wv: hf_qkv_rope(x, wq, wk, wv, cos, sin)  # noqa: E731
        qkv_flops = 2 * m * d * (heads + 2 * kv) * hd
        yield dict(name=f"llm_qkv_rope/{label}_M{m}_K{d}_H{heads}_KV{kv}_D{hd}/bf16", flops=qkv_flops,
                   fusekit=lambda: qkv(xa, wq, wk, wv),
                   peers={"eager": lambda: hf_qkv(xa, wq, wk, wv), "compile": (compiled(hf_qkv), (xa, wq, wk, wv))})
        yield dict(name=f"llm_qkv_rope_train/{label}_M{m}_K{d}_H{heads}_KV{kv}_D{hd}/bf16", flops=3 * qkv_flops,
                   fusekit=lambda: _train(qkv, xag, wq, wk, wv, grad=go),
                   peers={"eager": lambda: _train(hf_qkv, xag, wq, wk, wv, grad=go),
                          "compile": (lambda c=compiled(hf_qkv): _train(c, xag, wq, wk, wv, grad=go), ())})

        # the MLP
        gw, uw = randn(f, d, scale=d ** -0.5).requires_grad_(), randn(f, d, scale=d ** -0.5).requires_grad_()
        dw = randn(d, f, scale=f ** -0.5).requires_grad_()
        flops = 2 * m * d * f * 3
        for recompute in (False, True):
            mlp = lambda x, gw, uw, dw, rc=recompute: fusekit.glu_mlp(x, gw, uw, dw, recompute=rc)  # noqa: E731
            tag = "_recompute" if recompute else ""
            if not recompute:
                yield dict(name=f"llm_mlp/{label}_M{m}_K{d}_N{f}/bf16", flops=flops,
                           fusekit=lambda: mlp(x, gw, uw, dw),
                           peers={"eager": lambda: hf_mlp(x, gw, uw, dw), "compile": (compiled(hf_mlp), (x, gw, uw, dw))})
            yield dict(name=f"llm_mlp_train{tag}/{label}_M{m}_K{d}_N{f}/bf16", flops=3 * flops, memory=True,
                       fusekit=lambda mlp=mlp: _train(mlp, xg, gw, uw, dw, grad=[dy]),
                       peers={"eager": lambda: _train(hf_mlp, xg, gw, uw, dw, grad=[dy]),
                              "compile": (lambda c=compiled(hf_mlp): _train(c, xg, gw, uw, dw, grad=[dy]), ())})

    # the LM head and loss (forward + backward; the fused op computes both in its forward)
    for label, m, d, vocab in (("small", 64 * 1024, 768, 32000), ("1b", 8 * 2048, 2048, 32000),
                               ("llama3", 8 * 1024, 2048, 128256)):
        h = randn(m, d).requires_grad_()
        w = randn(vocab, d, scale=d ** -0.5).requires_grad_()
        t = torch.randint(0, vocab, (m,), device=h.device)
        t[::7] = -100
        yield dict(name=f"llm_linear_ce_train/{label}_M{m}_H{d}_V{vocab}/bf16", flops=3 * 2 * m * d * vocab, memory=True,
                   fusekit=lambda h=h, w=w, t=t: fusekit.linear_cross_entropy(h, w, t).backward(),
                   peers={"eager": lambda h=h, w=w, t=t: hf_linear_ce(h, w, t).backward(),
                          "compile": (lambda h=h, w=w, t=t, c=compiled(hf_linear_ce): c(h, w, t).backward(), ())})
