"""python -m fusekit.bench.parity: each fusekit op timed through PyTorch against the same kernel
timed by the C++ benchmark (`fusekit bench`), on the C++ cases' shapes, dtypes and options.

The target: an op's speed through PyTorch within 3% of the same kernel measured by fusekit bench,
i.e. calling it from PyTorch adds no device work. What is timed is the call a user makes
(fusekit.softmax(x), ops.call("glu", ...), ...), so its output allocations and any copy, memset or
extra output the Python layer launches count. The C++ figure is the case's fused-path record.

Timing mirrors bench/harness.cpp Context::time_us: 3 warm-up calls; a 5-call probe sets the run
count (at least --min-runs, more until --min-ms of GPU time, at most 2000); batches of at most 64
calls are enqueued behind a spinning kernel (torch.cuda._sleep) so that the host is ahead of the
GPU, a CUDA event pair around each call; call k takes input set k mod rot, rot by the rule of
Context::rotations_for (the sets span 4x L2: inputs come from HBM). The figure is the median
per-call time. A batch whose spin ended before it was all enqueued (the GPU may have waited on the
host) is redone with a longer spin, counted in late_batches. Before timing, each case's call is
checked once: outputs shaped right and finite, and close to a float64 PyTorch reference; and one
call runs under torch.profiler, which lists its device activities: any that is PyTorch's own (an
ATen kernel or a copy) is device work the door added, reported as torch_device_work.

    fusekit bench --json-dir DIR
    python -m fusekit.bench.parity --cpp-json DIR --out DIR [--filter SUBSTRING]

Writes OUT/python_parity.json (schema fusekit-bench-parity/1) and one line per case as it runs.
Exit code 0 whatever the ratios (a measurement); 1 if a case failed to build, run or check.
"""
from __future__ import annotations

import argparse
import gc
import glob
import json
import math
import os
import platform
import time
from functools import partial
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

import fusekit
from fusekit import ops

SCHEMA, TOLERANCE, DEV = "fusekit-bench-parity/1", 0.03, "cuda"
L2_BYTES = 50 << 20  # the device's, set in main()
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DT = {F32: "f32", F16: "f16", BF16: "bf16"}
# Criteo Kaggle's 26 table sizes (fusekit::data::kKaggleCardinalities, as bench/recsys.cu uses them).
KAGGLE_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
               5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
ACT = {"identity": lambda z: z, "relu": torch.relu, "sigmoid": torch.sigmoid,
       "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}
GLU = {"sigmoid_tanh": lambda l, r: torch.sigmoid(l) * torch.tanh(r), "swiglu": lambda l, r: F.silu(l) * r,
       "geglu_tanh": lambda l, r: l * F.gelu(r, approximate="tanh")}
NOT_COVERED = [
    {"case": "primitives/row_sum/f32_8192x32768", "reason": "fusekit._C.row_sum has no torch op in fusekit.ops"},
    {"case": "primitives/batched_matmul/bf16_64x512x512x512", "reason": "batched_matmul has no Python binding"},
    {"case": "dlrm/train/*", "reason": "training runs of the C++ DLRM model, not one op; no Python equivalent"},
    {"case": "ceiling/*", "reason": "device ceilings (copy, cuBLAS GEMM, empty kernel), not fusekit ops"},
    {"case": "baseline and --breakdown records", "reason": "not the kernel a PyTorch user gets"},
]
PYTHON_ONLY = ["interaction, interaction_backward (the C++ bench times them only inside dlrm/train)",
               "sigmoid_bce", "embedding_bag_backward, dense_optimizer_update_ (parts of C++ baselines only)"]


def rotations_for(nbytes: int) -> int:
    """Context::rotations_for: how many input sets of `nbytes` together span 4x L2, in [1, 4096]."""
    return int(min(max(-(-4 * L2_BYTES // max(int(nbytes), 1)), 1), 4096))


def rand(shape, dtype, lo: float = -1.0, hi: float = 1.0) -> torch.Tensor:
    """Uniform in [lo, hi), as Context::random."""
    return torch.empty(shape, dtype=dtype, device=DEV).uniform_(lo, hi)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64, as Context::rel_err."""
    num, den = float((a.double() - b.double()).norm()), float(b.double().norm())
    return num / den if den > 0 else num


def ok(*pairs) -> None:
    """Asserts that each (tensor, shape) has that shape and only finite values."""
    for t, shape in pairs:
        if tuple(t.shape) != tuple(shape) or (t.is_floating_point() and not bool(torch.isfinite(t).all())):
            raise AssertionError(f"output of shape {list(t.shape)} (expected {list(shape)}) or not finite")


class Built(NamedTuple):
    run: Callable[[int], object]  # the timed call, on input set i
    rot: int
    check: Callable[[], dict]  # {what: (rel_err, bound)}; raises on a wrong shape or a non-finite value
    note: str = ""


class Spec(NamedTuple):
    family: str
    case: str  # the C++ record's case
    impl: str  # the C++ record's impl: the fused path
    call: str  # the Python call timed
    build: Callable[[], Built]


# ---- the cases' inputs and calls, family by family, as in bench/<family>.cu ----------------------

def add_mul_act(dt, act, rows, cols):
    sets = [(rand((rows, cols), dt, -2, 2), rand((rows, cols), dt, -2, 2), rand(cols, dt))
            for _ in range(rotations_for(3 * rows * cols * dt.itemsize))]
    run = lambda i: fusekit.bias_act(sets[i][0], sets[i][2], sets[i][1], act=act, alpha=0.5)  # noqa: E731

    def check():
        (x, r, b), y = sets[0], run(0)
        ok((y, x.shape))
        return {"y": (rel(y, ACT[act](x.double() + 0.5 * r.double() + b.double())), 1e-6 if dt == F32 else 2e-2)}
    return Built(run, len(sets), check)


def add_mul_act_bwd(dt, act, rows, cols):
    sets = [(rand((rows, cols), dt), fusekit.bias_act(rand((rows, cols), dt), act=act))  # (dy, y)
            for _ in range(rotations_for(4 * rows * cols * dt.itemsize))]
    run = lambda i: ops.call("bias_act_backward", sets[i][0], sets[i][1], act, 0.5, True, True)  # noqa: E731

    def check():
        (dy, y), (dx, db, dr) = sets[0], run(0)
        ok((dx, y.shape), (dr, y.shape), (db, (cols,)))
        yd, bound = y.double(), 1e-5 if dt == F32 else 1e-2
        dz = dy.double() * ((yd > 0).double() if act == "relu" else yd * (1 - yd))
        return {"dx": (rel(dx, dz), bound), "dr": (rel(dr, 0.5 * dz), bound), "db": (rel(db, dz.sum(0)), bound)}
    return Built(run, len(sets), check, "" if dt == F32 else "db written in dy's dtype (C++: f32)")


def softmax(rows, cols):
    x = rand((rows, cols), BF16, -8, 8)

    def check():
        y = fusekit.softmax(x)
        ok((y, x.shape))
        return {"y[:16]": (rel(y[:16], torch.softmax(x[:16].double(), -1)), 2 ** -8)}
    return Built(lambda i: fusekit.softmax(x), 1, check)


def attention(b, h, s, d, causal):
    q, k, v = (rand((b, h, s, d), BF16) for _ in range(3))
    run = lambda i: fusekit.attention(q, k, v, causal=causal)  # noqa: E731

    def check():
        out = run(0)
        ok((out, q.shape))
        ref = F.scaled_dot_product_attention(*(t[:1, :2].double() for t in (q, k, v)), is_causal=causal)
        return {"out[0, :2]": (rel(out[:1, :2], ref), 2e-2)}
    return Built(run, 1, check)


def glu_sets(dt, m, n, k, backward):
    """(x, w, b, dy) sets, w [2N, K] and b [2N] in the prepared layout (as nn.GLUFeedForward keeps them)."""
    return [(rand((m, k), dt), rand((2 * n, k), dt, -30 / k, 30 / k), rand(2 * n, dt, -0.5, 0.5),
             rand((m, n), dt) if backward else None)
            for _ in range(rotations_for((m * k + 2 * n * k + m * n) * dt.itemsize))]


def glu_ref(kind, x, w, b):
    c = x @ w.t() + b  # prepared: columns 2j and 2j + 1 of C are L[:, j] and R[:, j]
    return GLU[kind](c[:, 0::2], c[:, 1::2])


def glu(backward, kind, dt, tf32, m, n, k):
    sets = glu_sets(dt, m, n, k, backward)
    if backward:
        run = lambda i: ops.call("glu_backward", sets[i][3], *sets[i][:3], kind, tf32)  # noqa: E731
    else:
        run = lambda i: ops.call("glu", *sets[i][:3], kind, tf32)  # noqa: E731

    def check():
        (x, w, b, dy), out = sets[0], run(0)
        if not backward:
            ok((out, (m, n)))
            return {"out[:128]": (rel(out[:128], glu_ref(kind, x[:128].double(), w.double(), b.double())),
                                  5e-3 if dt == F32 else 1e-2)}
        ok(*zip(out, (x.shape, w.shape, b.shape)))
        xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
        glu_ref(kind, xr, wr, br).backward(dy.double())
        return {name: (rel(o, t.grad), 2e-2) for name, o, t in zip(("dx", "dw", "db"), out, (xr, wr, br))}
    return Built(run, len(sets), check)


def lora_layer(n, k, r):
    """(w, a, b, bias) as bench/lora.cu makes them (bf16; act relu, scale 2 in every case)."""
    return rand((n, k), BF16, -30 / k, 30 / k), rand((r, k), BF16, -30 / k, 30 / k), rand((n, r), BF16), \
        rand(n, BF16, -0.5, 0.5)


def lora_fwd(m, n, k, r):
    (w, a, b, bias), xs = lora_layer(n, k, r), [rand((m, k), BF16) for _ in range(rotations_for((m * k + m * n) * 2))]
    run = lambda i: fusekit.lora(xs[i], w, a, b, bias, scale=2.0, act="relu")  # noqa: E731

    def check():
        y, x = run(0), xs[0][:256].double()
        ok((y, (m, n)))
        ref = torch.relu(x @ w.double().t() + bias.double() + 2.0 * (x @ a.double().t()) @ b.double().t())
        return {"y[:256]": (rel(y[:256], ref), 2e-2)}
    return Built(run, len(xs), check)


def lora_bwd(m, n, k, r):
    w, a, b, bias = lora_layer(n, k, r)
    sets = [(rand((m, k), BF16), rand((m, n), BF16)) for _ in range(rotations_for((2 * m * k + 2 * m * n) * 2))]
    y, t, _ = ops.call("lora", sets[0][0], w, bias, a, b, "relu", 2.0, True)  # the saved y and t, of set 0 (as C++)
    run = lambda i: ops.call("lora_backward", sets[i][1], y, sets[i][0], w, a, b, t, "relu", 2.0, False)  # noqa: E731

    def check():
        (x, dy), (dx, da, db, _) = sets[0], run(0)
        ok((dx, x.shape), (da, a.shape), (db, b.shape))
        g = dy.double() * (y > 0).double()
        u = g @ b.double()
        return {"dx": (rel(dx, g @ w.double() + 2.0 * u @ a.double()), 3e-2),
                "da": (rel(da, 2.0 * u.t() @ x.double()), 3e-2),
                "db": (rel(db, 2.0 * g.t() @ (x.double() @ a.double().t())), 3e-2)}
    return Built(run, len(sets), check)


_QW: dict = {}


def qgemm(dt, m, n, k):
    """W4A16, group 128; copies of the quantized weight rotate (made once per shape, as bench/qgemm.cu)."""
    if (dt, n, k) not in _QW:
        _QW.clear()
        q = ops.quantize_weights(rand((n, k), dt), 128)
        rot = rotations_for(sum(t.numel() * t.element_size() for t in q) + 128 * (k + n) * dt.itemsize)
        _QW[(dt, n, k)] = [tuple(t.clone() for t in q) for _ in range(rot)]
    qs, x = _QW[(dt, n, k)], rand((m, k), dt)
    run = lambda i: ops.call("qgemm", x, *qs[i], n, k, 128)  # noqa: E731

    def check():
        y = run(0)
        ok((y, (m, n)))
        return {"y": (rel(y, x.double() @ ops.dequantize_weights(*qs[0], n, k, 128).double().t()), 5e-3)}
    return Built(run, len(qs), check)


def pack_unpack(op, bits, k, c):
    """bf16 x packed group-wise (group 256, bf16 statistics); one set (155 MB: beyond 4x L2)."""
    x = rand((k, c), BF16, -3, 3)
    p = fusekit.pack(x, bits, 256)
    run = (lambda i: fusekit.pack(x, bits, 256)) if op == "pack" else (lambda i: fusekit.unpack(p))

    def check():
        q, xhat = (run(0), None) if op == "pack" else (p, run(0))
        xhat = fusekit.unpack(q) if xhat is None else xhat
        ok((q.words, p.words.shape), (xhat, x.shape))
        return {"round trip": (rel(xhat, x), 1.1 / ((1 << bits) - 1) + 2 ** -9)}
    return Built(run, 1, check)


def relu_packed(backward, rows, cols):
    x, dy = rand((rows, cols), BF16), rand((rows, cols), BF16)
    mask = fusekit.relu_packed(x)[1]
    if backward:
        run = lambda i: ops.call("relu_packed_backward", dy, mask)  # noqa: E731
    else:
        run = lambda i: fusekit.relu_packed(x)  # noqa: E731

    def check():
        out = run(0)
        ok((out, x.shape) if backward else (out[0], x.shape), (mask, mask.shape) if backward else (out[1], mask.shape))
        return {"dx": (rel(out, torch.where(x > 0, dy, 0)), 0.0)} if backward else {"y": (rel(out[0], x.relu()), 0.0)}
    return Built(run, 1, check)


def weight_grad(k, cin, cout, bits):
    rot = rotations_for(k * cout * 2 + k * cin * bits // 8 + k * ((cin + 255) // 256) * 4)
    sets = [(rand((k, cout), BF16), fusekit.pack(rand((k, cin), BF16, -2, 3), bits, 256)) for _ in range(rot)]
    run = lambda i: fusekit.weight_grad_from_packed(*sets[i], torch.bfloat16)  # noqa: E731

    def check():
        (dy, p), dw = sets[0], run(0)
        ok((dw, (cout, cin)))
        return {"dw": (rel(dw, dy.double().t() @ fusekit.unpack(p).double()), 1e-2)}
    return Built(run, rot, check)


def fused_mlp(train, batch, width_in, hidden, layers, width_out):
    """bf16, relu on the hidden layers and identity at the output; train: forward_train + backward."""
    widths = [width_in] + [hidden] * layers + [width_out]
    ws = [rand((o, i), BF16, -1.7 / math.sqrt(i), 1.7 / math.sqrt(i)) for i, o in zip(widths, widths[1:])]
    bs, acts = [rand(o, BF16, -0.5, 0.5) for o in widths[1:]], ",".join(["relu"] * layers + ["identity"])
    io = batch * (2 * width_in + 2 * width_out if train else width_in + width_out) * 2
    sets = [(rand((batch, width_in), BF16, -2, 2), rand((batch, width_out), BF16) if train else None)
            for _ in range(rotations_for(io))]

    def run(i):
        x, dy = sets[i]
        if not train:
            return ops.call("fused_mlp", x, ws, bs, acts)
        y, saved = ops.call("fused_mlp_train", x, ws, bs, acts)
        return y, ops.call("fused_mlp_backward", dy, x, saved, y, ws, bs, acts)

    def check():
        x, out = sets[0][0], run(0)
        y, ref = out[0] if train else out, x[:4096]
        for w, b, act in zip(ws, bs, acts.split(",")):  # every layer rounded to bf16, as the kernel does
            ref = ACT[act](ref.double() @ w.double().t() + b.double()).to(BF16)
        ok((y, (batch, width_out)))
        if train:
            ok((out[1][0], x.shape), *((d, w.shape) for d, w in zip(out[1][1] + out[1][2], ws + bs)))
        return {"y[:4096]": (rel(y[:4096], ref), 2e-2)}
    return Built(run, len(sets), check)


def bag_input(rows, batch, bag):
    """(raw i32 [T*B], None, None) one-hot, hashed in the kernel; or (None, indices, offsets) CSR."""
    if bag == 0:
        return torch.randint(-2 ** 31, 2 ** 31, (len(rows) * batch,), dtype=torch.int32, device=DEV), None, None
    idx = torch.cat([torch.randint(0, r, (batch * bag,), device=DEV) for r in rows])
    return None, idx, torch.arange(0, len(rows) * batch * bag + 1, bag, device=DEV)


def bag_forward(weights, rows, inp):
    """(out, keys, bags): bench/recsys.cu's fused forward (sum pooling, hash "reference")."""
    raw, idx, off = inp
    return ops.call("embedding_bag", weights, idx, off, raw, rows, "sum", "reference", "dense_gradient", 0.0, 0.0, None)


def embedding_fwd(rows, dim, batch, bag):
    weights, nt = rand((sum(rows), dim), F32, -0.05, 0.05), len(rows)
    sets = [bag_input(rows, batch, bag) for _ in range(rotations_for(2 * batch * nt * dim * 4))]
    if bag == 0:
        run = lambda i: bag_forward(weights, rows, sets[i])[0]  # noqa: E731
    else:
        run = lambda i: fusekit.embedding_bags(weights, sets[i][1], sets[i][2], rows)  # noqa: E731

    def check():  # each entry's stacked row, by PyTorch: base[t] + row (raw: u32 value % rows[t])
        (raw, idx, _), (out, keys, _) = sets[0], bag_forward(weights, rows, sets[0])
        t = torch.arange(nt, device=DEV).repeat_interleave(batch * max(bag, 1))
        local = idx if raw is None else (raw.long() & 0xFFFFFFFF) % torch.tensor(rows, device=DEV)[t]
        g = torch.tensor([0] + rows[:-1], device=DEV).cumsum(0)[t] + local
        ref = weights[g].double().view(nt, batch, max(bag, 1), dim).sum(2).transpose(0, 1)
        user = run(0)
        ok((out, (batch, nt, dim)), (user, out.shape))
        return {"out": (rel(user, ref), 1e-6), "keys": (float((keys.long() != g).sum()), 0.0)}
    return Built(run, len(sets), check)


def embedding_bwd(update, rows, dim, batch, bag):
    """The optimizer step on the touched rows (lr 0.01, eps 1e-8; Adagrad's state [rows, D])."""
    nt, lr, eps = len(rows), 0.01, 1e-8
    weights = rand((sum(rows), dim), F32, -0.05, 0.05)
    state = rand((sum(rows), dim), F32, 0.0, 0.1) if update == "adagrad" else None
    sets = [(*bag_forward(weights, rows, bag_input(rows, batch, bag))[1:], rand((batch, nt, dim), F32, -1e-2, 1e-2))
            for _ in range(rotations_for(batch * nt * dim * 4))]  # (keys, bags, dout)
    run = lambda i: ops.call("embedding_bag_update_", weights, state, sets[i][2], sets[i][0], sets[i][1],  # noqa: E731
                             None, rows, update, lr, eps, "sum")

    def check():  # one step on set 0: each touched row moves by the update of its summed gradient
        (keys, bags, dout), k = sets[0], sets[0][0].long()
        w0, s0 = weights[k].double(), None if state is None else state[k].double()
        run(0)
        uk, inv = torch.unique(k, return_inverse=True)
        g = dout.transpose(0, 1).reshape(nt * batch, dim)[bags.long()].double()
        g = torch.zeros(uk.numel(), dim, dtype=torch.float64, device=DEV).index_add_(0, inv, g)[inv]
        step = lr * g if state is None else lr * g / ((s0 + g * g).sqrt() + eps)
        ok((weights, weights.shape))
        return {"update": (rel(w0 - weights[k].double(), step), 1e-4)}
    return Built(run, len(sets), check)


def specs() -> list:
    """Every fused record of bench/*.cu with a PyTorch path: (family, case, impl, call, builder)."""
    s = []
    add = lambda fam, case, call, build, impl="fused": s.append(Spec(fam, case, impl, call, build))  # noqa: E731
    for dt, act, rows, cols in ((F32, "relu", 65536, 1024), (BF16, "sigmoid", 65536, 1024), (F32, "relu", 128, 512),
                                (BF16, "gelu_tanh", 65536, 1024)):
        add("pointwise", f"add_mul_act/{act}_{DT[dt]}_{rows}x{cols}",
            f"fusekit.bias_act(x, b, r, act={act!r}, alpha=0.5)", partial(add_mul_act, dt, act, rows, cols))
    for dt, act in ((BF16, "relu"), (F32, "sigmoid")):
        add("pointwise", f"add_mul_act_bwd/{act}_{DT[dt]}_65536x1024",
            f"ops.call('bias_act_backward', dy, y, {act!r}, 0.5, True, True)",
            partial(add_mul_act_bwd, dt, act, 65536, 1024))
    for rows, cols in ((8192, 32768), (64, 1 << 20)):
        add("primitives", f"softmax/bf16_{rows}x{cols}", "fusekit.softmax(x)", partial(softmax, rows, cols))
    for d in (128, 64):
        for c in (False, True):
            add("primitives", f"attention_fwd/bf16_b4_h16_s4096_d{d}{'_causal' if c else ''}",
                f"fusekit.attention(q, k, v, causal={c})", partial(attention, 4, 16, 4096, d, c))
    glu_shapes = [("sigmoid_tanh", BF16, False, 1024, 2048, 2048), ("sigmoid_tanh", F32, True, 1024, 2048, 2048),
                  ("swiglu", BF16, False, 1024, 2048, 2048), ("geglu_tanh", BF16, False, 1024, 2048, 2048),
                  ("swiglu", BF16, False, 4096, 8192, 8192), ("sigmoid_tanh", BF16, False, 4096, 8192, 8192)]
    for bwd, shapes in ((False, glu_shapes), (True, [glu_shapes[0], glu_shapes[4]])):
        for kind, dt, tf32, m, n, k in shapes:
            add("glu", f"glu_{'bwd' if bwd else 'fwd'}/{kind}_{'tf32' if tf32 else DT[dt]}_M{m}_N{n}_K{k}",
                f"ops.call({'glu_backward' if bwd else 'glu'!r}, {'dy, ' if bwd else ''}x, w_prepared, b_prepared, "
                f"{kind!r}, {tf32})", partial(glu, bwd, kind, dt, tf32, m, n, k))
    lora_shapes = ((8192, 16), (8192, 32), (8192, 48), (8192, 64), (2048, 16), (2048, 64))
    for m, r in lora_shapes:
        add("lora", f"lora_fwd/bf16_M{m}_N4096_K4096_r{r}", "fusekit.lora(x, w, a, b, bias, scale=2.0, act='relu')",
            partial(lora_fwd, m, 4096, 4096, r))
    for m, r in lora_shapes:
        add("lora", f"lora_bwd/bf16_M{m}_N4096_K4096_r{r}",
            "ops.call('lora_backward', dy, y, x, w, a, b, t, 'relu', 2.0, False)", partial(lora_bwd, m, 4096, 4096, r))
    for dt in (F16, BF16):
        for n, k in ((4096, 4096), (11008, 4096), (8192, 8192)):
            for m in (1, 16, 64, 128):
                add("qgemm", f"{DT[dt]}_M{m}_N{n}_K{k}_g128", "ops.call('qgemm', x, packed, scale, zero, n, k, 128)",
                    partial(qgemm, dt, m, n, k), impl="w4_mma")
    for bits in (2, 4, 8):
        add("quant", f"pack/K100864_C768_b{bits}", f"fusekit.pack(x, {bits}, 256)",
            partial(pack_unpack, "pack", bits, 100864, 768))
        add("quant", f"unpack/K100864_C768_b{bits}", "fusekit.unpack(packed)",
            partial(pack_unpack, "unpack", bits, 100864, 768))
    add("quant", "relu_fwd_packed/65536x4096_bf16", "fusekit.relu_packed(x)", partial(relu_packed, False, 65536, 4096))
    add("quant", "relu_bwd_packed/65536x4096_bf16", "ops.call('relu_packed_backward', dy, mask)",
        partial(relu_packed, True, 65536, 4096))
    for k in (8192, 100864):
        for bits in (2, 4, 8):
            add("quant", f"weight_grad_packed/K{k}_CIN768_COUT768_b{bits}",
                "fusekit.weight_grad_from_packed(dy, packed, torch.bfloat16)", partial(weight_grad, k, 768, 768, bits))
    add("mlp", "fused_mlp/bf16_w64_l4_B1048576", "ops.call('fused_mlp', x, ws, bs, 'relu,relu,relu,relu,identity')",
        partial(fused_mlp, False, 1 << 20, 64, 64, 4, 16))
    add("mlp", "fused_mlp_train/bf16_w64_l4_B1048576", "ops.call('fused_mlp_train', x, ws, bs, acts), then "
        "ops.call('fused_mlp_backward', dy, x, hidden, y, ws, bs, acts)", partial(fused_mlp, True, 1 << 20, 64, 64, 4, 16))
    fwd = "ops.call('embedding_bag', weights, None, None, raw, rows, 'sum', 'reference', 'dense_gradient', 0, 0, None)"
    upd = "ops.call('embedding_bag_update_', weights, state, dout, keys, bags, None, rows, {!r}, 0.01, 1e-8, 'sum')"
    for batch in (2048, 32768):
        add("recsys", f"embedding_fwd/kaggle26_d16_b{batch}_onehot", fwd, partial(embedding_fwd, KAGGLE_ROWS, 16, batch, 0))
        for u in ("sgd", "adagrad"):
            add("recsys", f"embedding_bwd_{u}/kaggle26_d16_b{batch}_onehot", upd.format(u),
                partial(embedding_bwd, u, KAGGLE_ROWS, 16, batch, 0))
    add("recsys", "embedding_fwd/t8_r1M_d64_b4096_bag20", "fusekit.embedding_bags(weights, indices, offsets, rows)",
        partial(embedding_fwd, [1 << 20] * 8, 64, 4096, 20))
    add("recsys", "embedding_bwd_sgd/t8_r1M_d64_b4096_bag20", upd.format("sgd"),
        partial(embedding_bwd, "sgd", [1 << 20] * 8, 64, 4096, 20))
    return s


class Timer:
    """Context::time_us through PyTorch (see the module docstring)."""

    def __init__(self, min_runs: int, min_ms: float):
        self.min_runs, self.min_ms = min_runs, min_ms
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
        measured = 20e6 / (a.elapsed_time(b) * 1e6)
        rated = getattr(torch.cuda.get_device_properties(DEV), "clock_rate", 0) / 1e6  # kHz: the top clock
        # Cycles per ns such that a spin lasts at least as long as asked at any clock.
        self.cycles_per_ns = max(measured, rated) if 0.3 < rated < 5 else 1.25 * measured

    def median_us(self, run, rot: int):
        new = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        for i in range(3):
            run(i % rot)
        a, b = new(), new()
        a.record()
        t0 = time.perf_counter()
        for i in range(5):
            run(i % rot)
        host_ns = (time.perf_counter() - t0) / 5 * 1e9  # enqueueing one call
        b.record()
        b.synchronize()
        runs = int(min(max(math.ceil(self.min_ms / max(1e-3, a.elapsed_time(b) / 5)), self.min_runs), 2000))
        per_call_ns, events, done, late = max(60e3, 2 * host_ns + 20e3), [(new(), new()) for _ in range(runs)], 0, 0
        while done < runs:
            batch = min(64, runs - done)
            torch.cuda._sleep(int((batch * per_call_ns + 2e6) * self.cycles_per_ns))
            held = torch.cuda.Event()
            held.record()
            for k in range(done, done + batch):
                events[k][0].record()
                run(k % rot)
                events[k][1].record()
            if held.query() and late < 8:  # the spin ended first: the GPU may have waited on the host
                late, per_call_ns = late + 1, 2 * per_call_ns
                torch.cuda.synchronize()
                continue
            done += batch
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in events)
        return 1000.0 * ms[len(ms) // 2], {"runs": runs, "rotations": rot, "late_batches": late,
                                            "host_us_per_call": round(host_ns / 1e3, 2)}


def load_cpp(path: str) -> dict:
    """{(family, case, impl): record} from `fusekit bench --json-dir` output (or one --json file)."""
    recs = {}
    for f in sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]:
        try:
            with open(f) as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            continue
        for r in data if isinstance(data, list) else []:
            if isinstance(r, dict) and r.get("family", "ceiling") != "ceiling" and "case" in r and "impl" in r:
                recs[(r["family"], r["case"], r["impl"])] = r
    return recs


# Device work that is PyTorch's, not a fusekit op's: an ATen kernel or a copy. (Memsets are not
# counted: fusekit's ops launch their own, e.g. LoRA's tile counters and the embedding backward's.)
_FOREIGN = ("at::", "Memcpy", "memcpy")


def device_work(run) -> tuple[list, list]:
    """(every device activity of one call, those that are PyTorch's own), by torch.profiler: the
    Python door adds no device work when the second list is empty."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(0)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    return names, sorted({n for n in names if any(f in n for f in _FOREIGN)})


def measure(spec: Spec, timer: Timer, cpp: dict, device: str, cpp_dir: str) -> dict:
    """One case: build, check, time, and set against the C++ record."""
    row = {"family": spec.family, "cpp_case": spec.case, "cpp_impl": spec.impl, "python_call": spec.call}
    built = spec.build()
    row["check"] = {k: {"rel_err": e, "bound": b} for k, (e, b) in built.check().items()}
    row["check_ok"] = all(c["rel_err"] <= c["bound"] for c in row["check"].values())
    names, foreign = device_work(built.run)
    row["device_activities"], row["torch_device_work"] = len(names), [n[:160] for n in foreign]
    row["torch_median_us"], info = timer.median_us(built.run, built.rot)
    row.update(info)
    notes, rec = [built.note] if built.note else [], cpp.get((spec.family, spec.case, spec.impl))
    if rec is None:
        notes.append(f"no C++ record {spec.family}/{spec.case} impl {spec.impl} in {cpp_dir}: torch time alone")
    else:
        row["cpp_median_us"], row["ratio"] = rec["median_us"], row["torch_median_us"] / rec["median_us"]
        row["within_3pct"] = abs(row["ratio"] - 1.0) <= TOLERANCE
        if rec.get("device") != device:
            notes.append(f"the C++ record is from another device: {rec.get('device')}")
    if notes:
        row["note"] = "; ".join(notes)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpp-json", required=True, help="the directory `fusekit bench --json-dir` wrote")
    ap.add_argument("--out", required=True, help="directory for python_parity.json")
    ap.add_argument("--filter", default="", help="substring of 'family/case' (as fusekit bench --filter)")
    ap.add_argument("--min-runs", type=int, default=50, help="timed calls per case, at least (C++ default 50)")
    ap.add_argument("--min-ms", type=float, default=100.0, help="GPU time to measure per case (C++ default 100)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not fusekit.build_info()["cuda"]:
        print("fusekit.bench.parity: needs a CUDA device and a CUDA build of fusekit")
        return 2
    global L2_BYTES
    L2_BYTES = torch.cuda.get_device_properties(DEV).L2_cache_size
    cpp, device, t0, failures = load_cpp(args.cpp_json), torch.cuda.get_device_name(), time.time(), 0
    os.makedirs(args.out, exist_ok=True)
    doc = {"schema": SCHEMA, "device": device, "torch": torch.__version__, "fusekit": fusekit.build_info(),
           "python": platform.python_version(), "cpp_json": os.path.abspath(args.cpp_json), "tolerance": TOLERANCE,
           "timing": {"method": "as bench/harness.cpp Context::time_us: median of per-call CUDA event times, calls "
                                "behind a spinning kernel, rotating input sets spanning 4x L2",
                      "min_runs": args.min_runs, "min_ms": args.min_ms, "l2_bytes": L2_BYTES},
           "results": [], "not_covered": NOT_COVERED, "python_ops_without_cpp_case": PYTHON_ONLY}
    with torch.cuda.stream(torch.cuda.Stream()):  # a stream of its own, as the C++ bench
        timer = Timer(args.min_runs, args.min_ms)
        doc["timing"]["spin_cycles_per_ns"] = timer.cycles_per_ns
        for spec in specs():
            key = f"{spec.family}/{spec.case}"
            if args.filter and args.filter not in key:
                continue
            try:
                row = measure(spec, timer, cpp, device, args.cpp_json)
                failures += not row["check_ok"]
            except Exception as e:  # noqa: BLE001  recorded; the exit code says so
                failures += 1
                row = {"family": spec.family, "cpp_case": spec.case, "cpp_impl": spec.impl, "python_call": spec.call,
                       "error": f"{type(e).__name__}: {e}"[:500]}
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            if "error" in row:
                line = f"ERROR {row['error']}"
            else:
                cpp_us = f"{row['cpp_median_us']:10.2f}" if "ratio" in row else f"{'n/a':>10}"
                line = f"cpp {cpp_us} us  torch {row['torch_median_us']:10.2f} us"
                if "ratio" in row:
                    line += f"  ratio {row['ratio']:.3f}  {'ok' if row['within_3pct'] else 'OUTSIDE 3%'}"
                line += f"  kernels {row['device_activities']}"
                line += f"  TORCH WORK {row['torch_device_work']}" if row["torch_device_work"] else ""
                line += "" if row["check_ok"] else "  CHECK FAILED " + json.dumps(row["check"])
            print(f"{key:<56} {line}", flush=True)
            doc["results"].append(row)
            doc["seconds"] = time.time() - t0
            with open(os.path.join(args.out, "python_parity.json"), "w") as f:  # after every case
                json.dump(doc, f, indent=1)
    _QW.clear()
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
