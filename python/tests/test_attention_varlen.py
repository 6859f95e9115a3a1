"""fusekit.attention_varlen (sequences packed without padding, flash_attn_varlen_func's layout):
forward and backward equal to fusekit.attention run on each sequence alone, for every option and
lengths including 0 and 1; against SDPA on a causal grouped-query batch; opcheck; autocast;
torch.compile; bad cu_seqlens named; the GPU against the CPU."""
import math

import pytest

torch = pytest.importorskip("torch", reason="the operator tests need PyTorch")
F = torch.nn.functional

import fusekit  # noqa: E402
from fusekit import ops  # noqa: E402
from helpers import rand  # noqa: E402


def cu_seqlens(lens, device="cpu"):
    return torch.tensor([0] + list(lens), dtype=torch.int32).cumsum(0).to(torch.int32).to(device)


def packed_inputs(q_lens, k_lens, h, hk, d, dtype=torch.float32, device="cpu", seed=0):
    tq, tk = sum(q_lens), sum(k_lens)
    q = rand((tq, h, d), dtype, device, seed, True)
    k = rand((tk, hk, d), dtype, device, seed + 1, True)
    v = rand((tk, hk, d), dtype, device, seed + 2, True)
    g = rand((tq, h, d), dtype, device, seed + 3)
    return q, k, v, g


def per_sequence(q, k, v, g, q_lens, k_lens, **options):
    """out, lse [H, total_q] and the gradients of fusekit.attention called on each sequence alone."""
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
    outs, lses = [], []
    q0 = k0 = 0
    for sq, sk in zip(q_lens, k_lens):
        if sq > 0:
            def dense(t, start, n):  # rows [start, start + n) of [total, H, D] as [1, H, n, D]
                return t[start:start + n].transpose(0, 1).unsqueeze(0)
            out, lse = fusekit.attention(dense(qs, q0, sq), dense(ks, k0, sk), dense(vs, k0, sk), return_lse=True,
                                         **options)
            outs.append(out[0].transpose(0, 1))
            lses.append(lse[0])
        q0, k0 = q0 + sq, k0 + sk
    out = torch.cat(outs) if outs else qs.new_zeros(qs.shape)
    lse = torch.cat(lses, dim=1) if lses else qs.new_zeros((qs.shape[1], 0))
    if outs:
        out.backward(g)
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (qs, ks, vs)]
    return out, lse, grads


CASES = [
    dict(q_lens=[3, 0, 1, 5, 2], k_lens=[4, 2, 0, 5, 1], h=2, hk=2, d=3),
    dict(q_lens=[5, 1, 0, 4], k_lens=[3, 1, 2, 6], h=4, hk=2, d=4, causal=True),
    dict(q_lens=[5, 2, 3], k_lens=[3, 6, 3], h=2, hk=1, d=4, causal=True, bottom_right=True),
    dict(q_lens=[6, 1, 7], k_lens=[6, 3, 7], h=4, hk=2, d=3, window=(2, 1), scale=0.8),
    dict(q_lens=[8, 2], k_lens=[8, 5], h=3, hk=1, d=2, causal=True, bottom_right=True, window=(3, -1)),
    dict(q_lens=[4, 3], k_lens=[5, 2], h=2, hk=2, d=4, softcap=1.5, scale=2.0),
    dict(q_lens=[1, 1, 1], k_lens=[1, 1, 1], h=1, hk=1, d=5),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_sequence_as_if_alone_on_the_cpu(case):
    """The CPU extension runs the spec: packed and per-sequence calls agree to the last bit, forward
    (out, lse) and backward (keys of a sequence without queries get no gradient)."""
    c = dict(CASES[case])
    q_lens, k_lens, h, hk, d = (c.pop(n) for n in ("q_lens", "k_lens", "h", "hk", "d"))
    q, k, v, g = packed_inputs(q_lens, k_lens, h, hk, d, seed=10 * case)
    out, lse = fusekit.attention_varlen(q, k, v, cu_seqlens(q_lens), cu_seqlens(k_lens), max(q_lens), max(k_lens),
                                        return_lse=True, **c)
    assert out.shape == q.shape and lse.shape == (h, sum(q_lens)) and lse.dtype == torch.float32
    ref_out, ref_lse, ref_grads = per_sequence(q, k, v, g, q_lens, k_lens, **c)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    out.backward(g)
    for name, t, want in zip("qkv", (q, k, v), ref_grads):
        torch.testing.assert_close(t.grad, want, rtol=0, atol=0, msg=lambda m: f"d{name}: {m}")


def test_matches_sdpa_per_sequence_causal_gqa():
    """Against PyTorch itself: each sequence through F.scaled_dot_product_attention (is_causal,
    enable_gqa), Sq = Sk so that both causal alignments agree."""
    lens, h, hk, d = [9, 1, 0, 17], 8, 2, 16
    q, k, v, g = packed_inputs(lens, lens, h, hk, d, seed=40)
    out = fusekit.attention_varlen(q, k, v, cu_seqlens(lens), cu_seqlens(lens), max(lens), max(lens), causal=True)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    parts, s0 = [], 0
    for n in lens:
        if n:
            dense = [t[s0:s0 + n].transpose(0, 1).unsqueeze(0) for t in (qr, kr, vr)]
            parts.append(F.scaled_dot_product_attention(*dense, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        s0 += n
    ref = torch.cat(parts)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.backward(g)
    ref.backward(g)
    for got, want in zip((q, k, v), (qr, kr, vr)):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


def test_opcheck_attention_varlen_and_its_backward():
    q_lens, k_lens = [3, 0, 2], [2, 4, 3]
    q, k, v, g = packed_inputs(q_lens, k_lens, 4, 2, 8, seed=50)
    cq, ck = cu_seqlens(q_lens), cu_seqlens(k_lens)
    torch.library.opcheck(ops.attention_varlen, (q, k, v, cq, ck, 3, 4, True, 0.3, True, 2, -1, 0.0, False))
    torch.library.opcheck(ops.attention_varlen, (q, k, v, cq, ck, 3, 4, False, 0.5, False, -1, -1, 1.2, True))
    out, lse = ops.attention_varlen(q.detach(), k.detach(), v.detach(), cq, ck, 3, 4, False, 0.5)
    torch.library.opcheck(ops.attention_backward_varlen, (g, q.detach(), k.detach(), v.detach(), out, lse, cq, ck, 3, 4,
                                                          False, 0.5, False, -1, -1, 0.0, False))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_runs_in_the_autocast_dtype(dtype, device):
    lens = [5, 0, 9]
    q, k, v, _ = packed_inputs(lens, lens, 2, 1, 64, device=device, seed=60)
    cq = cu_seqlens(lens, device)
    with torch.autocast(device, dtype=dtype):
        out = fusekit.attention_varlen(q, k, v, cq, cq, 9, 9, causal=True)
    assert out.dtype == dtype
    want = fusekit.attention_varlen(q.to(dtype), k.to(dtype), v.to(dtype), cq, cq, 9, 9, causal=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32


def test_compiles_without_graph_breaks_forward_and_backward():
    q_lens, k_lens = [4, 1, 6], [4, 3, 6]
    q, k, v, _ = packed_inputs(q_lens, k_lens, 4, 2, 8, seed=70)
    cq, ck = cu_seqlens(q_lens), cu_seqlens(k_lens)

    def f(q, k, v):
        return fusekit.attention_varlen(q, k, v, cq, ck, 6, 6, causal=True, bottom_right=True, softcap=2.0).sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    loss.backward()
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    f(*ref_in).backward()
    torch.testing.assert_close(loss, f(*ref_in).detach())
    for got, want in zip((q, k, v), ref_in):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)


def test_bad_cu_seqlens_name_themselves():
    q, k, v, _ = packed_inputs([2, 3], [2, 3], 2, 2, 4, seed=80)
    good = cu_seqlens([2, 3])
    with pytest.raises(fusekit.Error, match="attention_forward_varlen: argument 'cu_seqlens_q'.*i32"):
        fusekit.attention_varlen(q, k, v, good.long(), good, 3, 3)
    with pytest.raises(fusekit.Error, match="attention_forward_varlen: argument 'cu_seqlens_q'.*non-decreasing"):
        fusekit.attention_varlen(q, k, v, torch.tensor([0, 4, 3], dtype=torch.int32), good, 4, 3)
    with pytest.raises(fusekit.Error, match="attention_forward_varlen: argument 'cu_seqlens_k'.*5 as its last"):
        fusekit.attention_varlen(q, k, v, good, torch.tensor([0, 2, 4], dtype=torch.int32), 3, 3)
    with pytest.raises(fusekit.Error, match="attention_forward_varlen: argument 'max_seqlen_q'"):
        fusekit.attention_varlen(q, k, v, good, good, 2, 3)
    with pytest.raises(fusekit.Error, match="attention_forward_varlen: argument 'q'"):
        fusekit.attention_varlen(q.unsqueeze(0), k, v, good, good, 3, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, d", [(torch.float32, 32), (torch.bfloat16, 64), (torch.float16, 128)])
def test_the_gpu_matches_the_cpu(dtype, d):
    """The GPU kernels (bf16/f16 at D 64/128: the wgmma forward and backward on sm_90, else the
    warp-per-row forward and the mma.sync backward; f32: warp-per-row) against the
    CPU spec on the same inputs: lengths 0, 1, 7, 127, 300; GQA 4 over 1; causal bottom-right.
    Normwise relative error within 1e-4 (f32), 2e-2 (bf16), 4e-3 (f16), as the C++ tests hold it."""
    q_lens, k_lens = [0, 1, 7, 127, 300], [3, 1, 127, 7, 300]
    q, k, v, g = packed_inputs(q_lens, k_lens, 4, 1, d, dtype=dtype, seed=90)
    opts = dict(causal=True, bottom_right=True)
    out_c = fusekit.attention_varlen(q, k, v, cu_seqlens(q_lens), cu_seqlens(k_lens), 300, 300, **opts)
    out_c.backward(g)
    qg, kg, vg = (t.detach().cuda().requires_grad_() for t in (q, k, v))
    out_g = fusekit.attention_varlen(qg, kg, vg, cu_seqlens(q_lens, "cuda"), cu_seqlens(k_lens, "cuda"), 300, 300,
                                     **opts)
    out_g.backward(g.cuda())
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    for name, got, want in (("out", out_g, out_c), ("dq", qg.grad, q.grad), ("dk", kg.grad, k.grad),
                            ("dv", vg.grad, v.grad)):
        err = ((got.detach().cpu().double() - want.detach().double()).norm() / want.double().norm()).item()
        assert math.isfinite(err) and err <= tol, f"{name}: normwise relative error {err:.3g} > {tol}"
