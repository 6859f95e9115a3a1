"""torch.ops.fusekit.*: every fusekit op as a torch.library custom op.

Each op allocates its outputs with PyTorch (so the caching allocator and
``torch.cuda.max_memory_allocated()`` see them), runs on ``torch.cuda.current_stream()`` of its
inputs' device, has a fake implementation (shapes and dtypes only, for ``torch.compile``) and,
where fusekit has a backward, an autograd rule. Inputs are taken as they are: a dtype, device or
layout the kernel cannot take is a ``fusekit.Error`` naming the argument, never a silent copy.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _C

_LIB = "fusekit"


def _stream(t: Tensor) -> int:
    """The raw cudaStream_t of torch's current stream on t's device (0 for host tensors)."""
    return torch._C._cuda_getCurrentRawStream(t.get_device()) if t.is_cuda else 0


_IMPL = {}  # name -> the implementation torch.ops.fusekit.<name> runs
_OPS = {}
_TENSOR_ARGS = {}  # name -> positions of its Tensor, Optional[Tensor] and list[Tensor] arguments
_TENSOR_TYPES = (torch._C.OptionalType.ofTensor(), torch._C.ListType.ofTensors())


def _schema(name: str):
    return getattr(torch.ops.fusekit, name).default._schema


_IMPL_FIRST = {}  # name -> an implementation for call_first() that returns None for an unused output


def _custom_op(name: str, mutates_args: tuple = (), first=None):
    """Registers `fn` as torch.ops.fusekit.<name>, and keeps it and where its tensors are for call().
    `first`, where given, is what call_first() runs in eager mode: `fn` without the empty tensors
    that `fn` returns for outputs not written (the caller keeps only the first)."""
    def wrap(fn):
        _IMPL[name] = fn
        _IMPL_FIRST[name] = first or fn
        _OPS[name] = torch.library.custom_op(f"{_LIB}::{name}", mutates_args=mutates_args)(fn)
        _TENSOR_ARGS[name] = tuple(i for i, a in enumerate(_schema(name).arguments)
                                   if any(a.type.isSubtypeOf(t) for t in _TENSOR_TYPES))
        return _OPS[name]
    return wrap


_EAGER = {}  # name -> the op's autograd.Function for call()
_EAGER_FIRST = {}  # name -> the one for call_first(), where the op has several outputs


def _autograd(name: str, backward, setup_context, eager: bool = True):
    """The op's autograd rule, for torch.ops.fusekit.<name> and (eager) for call()'s eager path
    alike. An op taking lists of tensors keeps to the registered op: autograd.Function does not
    see tensors inside a list."""
    _OPS[name].register_autograd(backward, setup_context=setup_context)
    if eager:
        _eager_functions(name, _IMPL[name], _IMPL_FIRST[name], backward, setup_context)


def _eager_functions(name: str, impl, impl_first, backward, setup_context) -> None:
    """Op `name` in eager mode as autograd.Functions that run its implementation and its own
    rule, without the dispatcher's round trips through Python. One class per op: apply takes the
    op's arguments as they are, so the rule's gradients map onto them unchanged. The second class
    (for an op with several outputs) hands autograd only the first: the others, kept for the
    backward, are one output fewer to track."""
    unused = (None,) * (len(_schema(name).returns) - 1)

    def forward(ctx, *args):
        out = impl(*args)
        ctx.fusekit_eager = True
        setup_context(ctx, args, out)
        return out

    def forward_first(ctx, *args):
        out = impl_first(*args)
        ctx.fusekit_eager = True
        setup_context(ctx, args, out)
        return out[0]

    def backward_first(ctx, grad):
        return backward(ctx, grad, *unused)

    def function(suffix: str, fwd, bwd):
        return type(f"{name}{suffix}", (torch.autograd.Function,),
                    {"forward": staticmethod(fwd), "backward": staticmethod(bwd), "__module__": __name__})

    _EAGER[name] = function("_eager", forward, backward)
    if unused:
        _EAGER_FIRST[name] = function("_eager_first", forward_first, backward_first)


_PLAIN = (Tensor, torch.nn.Parameter)
_is_compiling, _grad_enabled = torch.compiler.is_compiling, torch.is_grad_enabled
_dispatch_modes, _functorch_active = torch._C._len_torch_dispatch_stack, torch._C._are_functorch_transforms_active


def _bwd(ctx, name: str, *args):
    """A backward op from an autograd rule: the implementation itself under call()'s eager path,
    the registered op when torch (compile, AOT autograd, opcheck) traces the rule."""
    if getattr(ctx, "fusekit_eager", False):
        return _IMPL[name](*args)
    return getattr(torch.ops.fusekit, name).default(*args)


_REGISTERED, _WITH_GRAD, _PLAIN_CALL = 0, 1, 2


def _route(name: str, args: tuple) -> int:
    """How call() runs op `name` on these arguments: the registered op while torch traces or
    transforms (torch.compile and export, a fake, functional, proxy or any other dispatch mode,
    functorch) and for anything but plain tensors where the op takes tensors (a subclass: its
    own rules; a wrong type: the schema's error names the argument); else the implementation
    itself, with a gradient recorded or not. A plain loop over the op's tensor arguments only:
    this runs on every call."""
    if _is_compiling() or _dispatch_modes() or _functorch_active():
        return _REGISTERED
    grad = False
    for i in _TENSOR_ARGS[name]:
        a = args[i]
        if type(a) in _PLAIN:
            if a.requires_grad:
                grad = True
        elif type(a) is list:
            for t in a:
                if type(t) not in _PLAIN:
                    return _REGISTERED
                if t.requires_grad:
                    grad = True
        elif a is not None:
            return _REGISTERED
    return _WITH_GRAD if grad and _grad_enabled() else _PLAIN_CALL


def call(name: str, *args):
    """Runs op `name` as torch.ops.fusekit.<name> would, by the cheapest way that records what is
    needed (_route): traced, the registered op (its fake); in eager mode, the implementation
    itself, inside the op's autograd.Function when a gradient is to be recorded (the
    dispatcher's round trips through Python cost more than a small kernel runs)."""
    route = _route(name, args)
    if route == _PLAIN_CALL:
        return _IMPL[name](*args)
    if route == _WITH_GRAD:
        eager = _EAGER.get(name)
        if eager is not None:
            return eager.apply(*args)
    return getattr(torch.ops.fusekit, name).default(*args)  # without a rule: torch says so at backward


def call_first(name: str, *args):
    """call(name, *args)[0], for an op with several outputs of which the caller keeps the first."""
    route = _route(name, args)
    if route == _PLAIN_CALL:
        return _IMPL_FIRST[name](*args)[0]
    if route == _WITH_GRAD:
        eager = _EAGER_FIRST.get(name)
        if eager is not None:
            return eager.apply(*args)
    return getattr(torch.ops.fusekit, name).default(*args)[0]


def _rows(t: Tensor, op: str, arg: str) -> Tensor:
    """[..., cols] as the [rows, cols] view the kernels take (no copy; an error when there is none)."""
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1]) if t.dim() > 0 else t.view(1, 1)
    except RuntimeError:
        raise _C.Error(f"fk::{op}: argument '{arg}': expected a tensor whose leading dimensions "
                       f"can be flattened without a copy, got shape {list(t.shape)} strides {list(t.stride())}")


def _same_device(op: str, **tensors: Optional[Tensor]) -> None:
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if first is None:
            first = t.device
        elif t.device != first:
            raise _C.Error(f"fk::{op}: argument '{name}': expected a tensor on {first} (as the first "
                           f"tensor argument), got {t.device}")


# A tensor as fusekit._C takes it: a DLPack capsule of the same memory (torch's C exporter: about a
# microsecond, where Tensor.__dlpack__ costs several).
_dlpack = torch.utils.dlpack.to_dlpack


def _d(t: Optional[Tensor]):
    """_dlpack(t), or None for an absent optional tensor."""
    return None if t is None else _dlpack(t)


_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _dtype_name(dt: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dt, str(dt))


_FROM_OUTPUT = frozenset(("identity", "relu", "sigmoid", "tanh"))


def _derivative_from_output(act: str) -> bool:
    return act in _FROM_OUTPUT


# ---------------------------------------------------------------------------------------------
# pointwise: y = act(x + alpha * r + b)
# ---------------------------------------------------------------------------------------------

def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd records a gradient of an op taking these tensors."""
    if not _grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def _not_kept(op: str):
    return _C.Error(f"fk::{op}: argument 'for_backward': expected True when a gradient is recorded "
                    "(the backward needs what the forward keeps), got False")


def _bias_act(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], act: str, alpha: float,
              for_backward: bool) -> tuple:
    """bias_act, with None for z where it is not written."""
    # (devices are checked by the op: y and z are allocated on x's)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    z = None if act in _FROM_OUTPUT or not for_backward else torch.empty_like(y)
    xs, ys, zs = x, y, z  # as [rows, cols] views; a 2-D x (the common case) as it is
    if x.dim() != 2:
        xs, ys = _rows(x, "bias_act_forward", "x"), _rows(y, "bias_act_forward", "y")
        zs = None if z is None else _rows(z, "bias_act_forward", "preact")
    _C.bias_act_forward(_dlpack(xs), None if residual is None else _dlpack(_rows(residual, "bias_act_forward", "r")),
                        _d(bias), _dlpack(ys), _d(zs), act, alpha, _stream(x))
    return y, z


@_custom_op("bias_act", first=_bias_act)
def bias_act(x: Tensor, bias: Optional[Tensor], residual: Optional[Tensor], act: str, alpha: float,
             for_backward: bool) -> tuple[Tensor, Tensor]:
    """(y, z): y = act(x + alpha * residual + bias) over x's last dimension; z, the pre-activation,
    when for_backward and act's derivative needs it (gelu, silu), else an empty tensor."""
    y, z = _bias_act(x, bias, residual, act, alpha, for_backward)
    return y, (x.new_empty(0) if z is None else z)


@bias_act.register_fake
def _(x, bias, residual, act, alpha, for_backward):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, (torch.empty_like(y) if for_backward and not _derivative_from_output(act) else x.new_empty(0))


@_custom_op("bias_act_backward")
def bias_act_backward(dy: Tensor, saved: Tensor, act: str, alpha: float, with_bias: bool,
                      with_residual: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dbias, dresidual) from dy and what bias_act saved (y, or z for gelu / silu); dbias and
    dresidual are empty tensors when not asked for."""
    _same_device("bias_act_backward", dy=dy, saved=saved)
    dy = dy.contiguous() if dy.stride(-1) != 1 else dy  # autograd hands out expanded gradients
    dx = torch.empty_like(dy, memory_format=torch.contiguous_format)
    cols = dy.shape[-1] if dy.dim() else 1
    db = dy.new_empty(cols) if with_bias else dy.new_empty(0)
    dr = torch.empty_like(dx) if with_residual else dy.new_empty(0)
    _C.bias_act_backward(_d(_rows(dy, "bias_act_backward", "dy")), _d(_rows(saved, "bias_act_backward", "saved")),
                         not _derivative_from_output(act), _d(_rows(dx, "bias_act_backward", "dx")),
                         _d(_rows(dr, "bias_act_backward", "dr")) if with_residual else None,
                         _d(db) if with_bias else None, act, alpha, _stream(dy))
    return dx, db, dr


@bias_act_backward.register_fake
def _(dy, saved, act, alpha, with_bias, with_residual):
    dx = torch.empty_like(dy, memory_format=torch.contiguous_format)
    cols = dy.shape[-1] if dy.dim() else 1
    return dx, dy.new_empty(cols if with_bias else 0), (torch.empty_like(dx) if with_residual else dy.new_empty(0))


def _bias_act_setup(ctx, inputs, output):
    _, bias, residual, act, alpha, for_backward = inputs
    if not for_backward:
        raise _not_kept("bias_act_forward")
    ctx.act, ctx.alpha, ctx.with_bias, ctx.with_residual = act, alpha, bias is not None, residual is not None
    ctx.save_for_backward(output[0] if act in _FROM_OUTPUT else output[1])


def _bias_act_backward(ctx, dy, dz):
    (saved,) = ctx.saved_tensors
    dx, db, dr = _bwd(ctx, "bias_act_backward", dy, saved, ctx.act, ctx.alpha, ctx.with_bias, ctx.with_residual)
    return dx, (db if ctx.with_bias else None), (dr if ctx.with_residual else None), None, None, None


_autograd("bias_act", _bias_act_backward, _bias_act_setup)


# ---------------------------------------------------------------------------------------------
# primitives: softmax, attention forward
# ---------------------------------------------------------------------------------------------

@_custom_op("softmax")
def softmax(x: Tensor) -> Tensor:
    """softmax over the last dimension (one online pass per row)."""
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    xs, ys = (x, y) if x.dim() == 2 else (_rows(x, "softmax", "x"), _rows(y, "softmax", "y"))
    _C.softmax(_dlpack(xs), _dlpack(ys), _stream(x))
    return y


@softmax.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return y * (dy - (dy * y).sum(-1, keepdim=True))


_autograd("softmax", _softmax_backward, _softmax_setup)


@_custom_op("attention")
def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse): softmax(scale q kᵀ) v per (batch, head), q [B, H, Sq, D], k, v [B, H, Sk, D];
    lse [B, H, Sq] f32, the log-sum-exp of each row. Forward only (fusekit has no backward)."""
    _same_device("attention_forward", q=q, k=k, v=v)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    _C.attention_forward(_d(q), _d(k), _d(v), _d(out), _d(lse), causal, scale, _stream(q))
    return out, lse


@attention.register_fake
def _(q, k, v, causal, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:-1], dtype=torch.float32)


@_custom_op("broadcast_binary")
def broadcast_binary(x: Tensor, y: Tensor, op: str) -> Tensor:
    """z = f(x, y) with NumPy broadcasting, f add, mul or mul_relu (relu(x * y) fused); x, y
    contiguous, one dtype; fp32 arithmetic, one rounding."""
    _same_device("broadcast_binary", x=x, y=y)
    z = x.new_empty(torch.broadcast_shapes(x.shape, y.shape))
    _C.broadcast_binary(op, _d(x), _d(y), _d(z), _stream(x))
    return z


@broadcast_binary.register_fake
def _(x, y, op):
    return x.new_empty(torch.broadcast_shapes(x.shape, y.shape))


@_custom_op("broadcast_binary_backward")
def broadcast_binary_backward(x: Tensor, y: Tensor, dz: Tensor, op: str, need_dx: bool,
                              need_dy: bool) -> tuple[Tensor, Tensor]:
    """(dx, dy): dz times f's partial derivative, summed over the broadcast dimensions in a fixed
    order; an empty tensor for a gradient not asked for."""
    dz = dz.contiguous() if not dz.is_contiguous() else dz
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    dy = torch.empty_like(y) if need_dy else y.new_empty(0)
    _C.broadcast_binary_backward(op, _d(x), _d(y), _d(dz), _d(dx) if need_dx else None, _d(dy) if need_dy else None,
                                 _stream(x))
    return dx, dy


@broadcast_binary_backward.register_fake
def _(x, y, dz, op, need_dx, need_dy):
    return (torch.empty_like(x) if need_dx else x.new_empty(0)), (torch.empty_like(y) if need_dy else y.new_empty(0))


def _broadcast_binary_setup(ctx, inputs, output):
    x, y, op = inputs
    ctx.op, ctx.need = op, (x.requires_grad, y.requires_grad)
    ctx.save_for_backward(x, y)


def _broadcast_binary_bwd(ctx, dz):
    x, y = ctx.saved_tensors
    dx, dy = _bwd(ctx, "broadcast_binary_backward", x, y, dz, ctx.op, *ctx.need)
    return (dx if ctx.need[0] else None), (dy if ctx.need[1] else None), None


_autograd("broadcast_binary", _broadcast_binary_bwd, _broadcast_binary_setup)


@_custom_op("row_sum")
def row_sum(x: Tensor, out_dtype: torch.dtype) -> Tensor:
    """out [...] = the sum over x's last dimension (fp32 accumulation, a fixed order), in
    out_dtype (f32 or x's dtype)."""
    out = x.new_empty(x.shape[:-1], dtype=out_dtype)
    _C.row_sum(_d(_rows(x, "row_sum", "x")), _d(out.view(-1)), _stream(x))
    return out


@row_sum.register_fake
def _(x, out_dtype):
    return x.new_empty(x.shape[:-1], dtype=out_dtype)


def _row_sum_setup(ctx, inputs, output):
    ctx.shape, ctx.dtype = inputs[0].shape, inputs[0].dtype


def _row_sum_bwd(ctx, dout):
    return dout.to(ctx.dtype).unsqueeze(-1).expand(ctx.shape), None


_autograd("row_sum", _row_sum_bwd, _row_sum_setup)


def _conv2d_shape(x: Tensor, w: Tensor, padding: str) -> tuple:
    h, wd = x.shape[2], x.shape[3]
    if padding == "valid":
        h, wd = h - w.shape[2] + 1, wd - w.shape[3] + 1
    return (x.shape[0], w.shape[0], h, wd)


@_custom_op("conv2d")
def conv2d(x: Tensor, w: Tensor, padding: str) -> Tensor:
    """Cross-correlation, stride 1, NCHW: x [N, C, H, W], w [O, C, KH, KW]; padding valid, same
    (PyTorch's) or same_end (all after). Forward only."""
    _same_device("conv2d", x=x, w=w)
    if x.dim() != 4 or w.dim() != 4:
        raise _C.Error(f"fk::conv2d: argument '{'x' if x.dim() != 4 else 'w'}': expected a rank-4 tensor, got shape "
                       f"{list(x.shape if x.dim() != 4 else w.shape)}")
    y = x.new_empty(_conv2d_shape(x, w, padding))
    _C.conv2d(_d(x), _d(w), _d(y), padding, _stream(x))
    return y


@conv2d.register_fake
def _(x, w, padding):
    return x.new_empty(_conv2d_shape(x, w, padding))


@_custom_op("batched_matmul")
def batched_matmul(a: Tensor, b: Tensor, impl: str, out_dtype: torch.dtype) -> Tensor:
    """c [B, M, N] = a [B, M, K] @ b [B, K, N], fp32 accumulation, c in out_dtype (f32 or the
    operands'); impl cublas or cute (fusekit's tensor-core kernel, bf16 / f16). Forward only."""
    _same_device("batched_matmul", a=a, b=b)
    c = a.new_empty((a.shape[0], a.shape[1], b.shape[-1]), dtype=out_dtype)
    _C.batched_matmul(_d(a), _d(b), _d(c), impl, _stream(a))
    return c


@batched_matmul.register_fake
def _(a, b, impl, out_dtype):
    return a.new_empty((a.shape[0], a.shape[1], b.shape[-1]), dtype=out_dtype)


@_custom_op("convert")
def convert(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x in another floating dtype (f32, bf16, f16), rounded to nearest even."""
    y = torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)
    _C.convert(_d(x), _d(y), _stream(x))
    return y


@convert.register_fake
def _(x, dtype):
    return torch.empty_like(x, dtype=dtype, memory_format=torch.contiguous_format)


def _convert_setup(ctx, inputs, output):
    ctx.dtype = inputs[0].dtype


def _convert_bwd(ctx, dy):
    return _bwd(ctx, "convert", dy.contiguous(), ctx.dtype), None


_autograd("convert", _convert_bwd, _convert_setup)


# ---------------------------------------------------------------------------------------------
# quant: packed activations, 1-bit ReLU masks, the weight gradient from packed bits
# ---------------------------------------------------------------------------------------------

def _packed_shapes(rows: int, cols: int, bits: int, group: int):
    groups = (cols + group - 1) // group if group > 0 else 0
    words = group * bits // 32 if group > 0 else 0
    return (rows, groups, words), (rows, groups)


@_custom_op("pack")
def pack(x: Tensor, bits: int, group: int, stochastic: bool, seed: int, offset: int,
         stats_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """(words i32 [rows, groups, group*bits/32], scale, min [rows, groups]): x [rows, cols]
    quantized group-wise to `bits` (1, 2, 4, 8) and packed (docs/quant-format.md)."""
    if x.dim() != 2:
        raise _C.Error(f"fk::pack: argument 'x': expected a matrix [rows, cols], got shape {list(x.shape)}")
    wshape, sshape = _packed_shapes(x.shape[0], x.shape[1], bits, group)
    words = x.new_empty(wshape, dtype=torch.int32)
    scale = x.new_empty(sshape, dtype=stats_dtype)
    mn = x.new_empty(sshape, dtype=stats_dtype)
    _C.pack(_d(x), _d(words), _d(scale), _d(mn), bits, group, stochastic, seed, offset, _stream(x))
    return words, scale, mn


@pack.register_fake
def _(x, bits, group, stochastic, seed, offset, stats_dtype):
    wshape, sshape = _packed_shapes(x.shape[0], x.shape[1], bits, group)
    return (x.new_empty(wshape, dtype=torch.int32), x.new_empty(sshape, dtype=stats_dtype),
            x.new_empty(sshape, dtype=stats_dtype))


@_custom_op("unpack")
def unpack(words: Tensor, scale: Tensor, min: Tensor, cols: int, bits: int, group: int,
           dtype: torch.dtype) -> Tensor:
    """x̂ [rows, cols] = q * scale + min, from what pack returned."""
    out = scale.new_empty((words.shape[0], cols), dtype=dtype)
    _C.unpack(_d(words), _d(scale), _d(min), words.shape[0], cols, bits, group, _d(out), _stream(words))
    return out


@unpack.register_fake
def _(words, scale, min, cols, bits, group, dtype):
    return scale.new_empty((words.shape[0], cols), dtype=dtype)


@_custom_op("relu_packed")
def relu_packed(x: Tensor) -> tuple[Tensor, Tensor]:
    """(y, mask): y = relu(x), mask i32 [ceil(numel / 32)] with bit i set where x_i > 0."""
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    mask = x.new_empty(((x.numel() + 31) // 32,), dtype=torch.int32)
    _C.relu_forward_packed(_d(x), _d(y), _d(mask), _stream(x))
    return y, mask


@relu_packed.register_fake
def _(x):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty(((x.numel() + 31) // 32,), dtype=torch.int32))


@_custom_op("relu_packed_backward")
def relu_packed_backward(dy: Tensor, mask: Tensor) -> Tensor:
    dy = dy.contiguous() if not dy.is_contiguous() else dy
    dx = torch.empty_like(dy)
    _C.relu_backward_packed(_d(dy), _d(mask), _d(dx), _stream(dy))
    return dx


@relu_packed_backward.register_fake
def _(dy, mask):
    return torch.empty_like(dy, memory_format=torch.contiguous_format)


def _relu_packed_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _relu_packed_bwd(ctx, dy, dmask):
    (mask,) = ctx.saved_tensors
    return _bwd(ctx, "relu_packed_backward", dy, mask)


_autograd("relu_packed", _relu_packed_bwd, _relu_packed_setup)


@_custom_op("weight_grad_from_packed")
def weight_grad_from_packed(dy: Tensor, words: Tensor, scale: Tensor, min: Tensor, cols: int,
                            x_dtype: torch.dtype, bits: int, group: int, dw_dtype: torch.dtype) -> Tensor:
    """dW [COUT, CIN] = dyᵀ · unpack(x): dy [K, COUT] bf16, x packed from [K, CIN]."""
    dw = dy.new_empty((dy.shape[1], cols), dtype=dw_dtype)
    _C.weight_grad_from_packed(_d(dy), _d(words), _d(scale), _d(min), words.shape[0], cols,
                               _dtype_name(x_dtype), bits, group, _d(dw), 0.0, _stream(dy))
    return dw


@weight_grad_from_packed.register_fake
def _(dy, words, scale, min, cols, x_dtype, bits, group, dw_dtype):
    return dy.new_empty((dy.shape[1], cols), dtype=dw_dtype)


# ---------------------------------------------------------------------------------------------
# glu: out = glu(x wᵀ + b), w [2N, K] in the prepared (row-interleaved) layout
# ---------------------------------------------------------------------------------------------

def prepare_glu_weight(w: Tensor) -> Tensor:
    """PyTorch layout [2N, ...] (gate rows, then up rows) -> fusekit's: row 2n = w[n], 2n + 1 = w[N + n]."""
    n = w.shape[0] // 2
    return torch.stack((w[:n], w[n:]), dim=1).reshape(w.shape)


def unprepare_glu_weight(w: Tensor) -> Tensor:
    n = w.shape[0] // 2
    pairs = w.reshape(n, 2, *w.shape[1:])
    return torch.cat((pairs[:, 0], pairs[:, 1]), dim=0)


@_custom_op("glu")
def glu(x: Tensor, w: Tensor, bias: Optional[Tensor], kind: str, allow_tf32: bool) -> Tensor:
    """out [M, N] = glu(L, R), [L, R] = x wᵀ + b; w [2N, K] and bias [2N] prepared."""
    _same_device("glu_forward", x=x, w=w, bias=bias)
    out = x.new_empty((x.shape[0], w.shape[0] // 2))
    _C.glu_forward(_d(x), _d(w), _d(bias), _d(out), kind, allow_tf32, _stream(x))
    return out


@glu.register_fake
def _(x, w, bias, kind, allow_tf32):
    return x.new_empty((x.shape[0], w.shape[0] // 2))


@_custom_op("glu_backward")
def glu_backward(dy: Tensor, x: Tensor, w: Tensor, bias: Optional[Tensor], kind: str,
                 allow_tf32: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw, dbias), dw and dbias prepared; dbias empty without a bias."""
    dy = dy.contiguous() if not dy.is_contiguous() else dy
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    db = torch.empty_like(bias) if bias is not None else w.new_empty(0)
    _C.glu_backward(_d(dy), _d(x), _d(w), _d(bias), _d(dx), _d(dw), _d(db) if bias is not None else None, kind, allow_tf32,
                    _stream(dy))
    return dx, dw, db


@glu_backward.register_fake
def _(dy, x, w, bias, kind, allow_tf32):
    return torch.empty_like(x), torch.empty_like(w), (torch.empty_like(bias) if bias is not None else w.new_empty(0))


def _glu_setup(ctx, inputs, output):
    x, w, bias, kind, allow_tf32 = inputs
    ctx.kind, ctx.allow_tf32, ctx.with_bias = kind, allow_tf32, bias is not None
    ctx.save_for_backward(x, w, bias)


def _glu_bwd(ctx, dy):
    x, w, bias = ctx.saved_tensors
    dx, dw, db = _bwd(ctx, "glu_backward", dy, x, w, bias, ctx.kind, ctx.allow_tf32)
    return dx, dw, (db if ctx.with_bias else None), None, None


_autograd("glu", _glu_bwd, _glu_setup)


# ---------------------------------------------------------------------------------------------
# lora: y = act(x Wᵀ + b + s (x Aᵀ) Bᵀ), W frozen
# ---------------------------------------------------------------------------------------------

def _lora_kept(x: Tensor, a: Tensor, act: str, for_backward: bool):
    """The shapes of (t, z) lora keeps: t [M, r] and, for gelu / silu, z [M, N]; none unless for_backward."""
    return ((x.shape[0], a.shape[0]) if for_backward else (0,)), for_backward and not _derivative_from_output(act)


@_custom_op("lora")
def lora(x: Tensor, w: Tensor, bias: Optional[Tensor], a: Tensor, b: Tensor, act: str, scale: float,
         for_backward: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(y, t, z): y = act(x Wᵀ + bias + t Bᵀ); when for_backward, t = scale x Aᵀ [M, r] and, for
    gelu / silu, z the pre-activation, kept for the backward (else empty tensors)."""
    _same_device("lora_forward", x=x, w=w, bias=bias, a=a, b=b)
    y = x.new_empty((x.shape[0], w.shape[0]))
    t_shape, with_z = _lora_kept(x, a, act, for_backward)
    t = x.new_empty(t_shape)
    z = torch.empty_like(y) if with_z else x.new_empty(0)
    _C.lora_forward(_d(x), _d(w), _d(bias), _d(a), _d(b), _d(y), _d(t) if for_backward else None,
                    _d(z) if with_z else None, act, scale, _stream(x))
    return y, t, z


@lora.register_fake
def _(x, w, bias, a, b, act, scale, for_backward):
    y = x.new_empty((x.shape[0], w.shape[0]))
    t_shape, with_z = _lora_kept(x, a, act, for_backward)
    return y, x.new_empty(t_shape), (torch.empty_like(y) if with_z else x.new_empty(0))


@_custom_op("lora_backward")
def lora_backward(dy: Tensor, saved: Tensor, x: Tensor, w: Tensor, a: Tensor, b: Tensor, t: Tensor, act: str,
                  scale: float, with_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, da, db, dbias); dbias empty without a bias. W is frozen: no dW."""
    dy = dy.contiguous() if not dy.is_contiguous() else dy
    dx, da, db = torch.empty_like(x), torch.empty_like(a), torch.empty_like(b)
    dbias = dy.new_empty(w.shape[0]) if with_bias else dy.new_empty(0)
    _C.lora_backward(_d(dy), _d(saved), not _derivative_from_output(act), _d(x), _d(w), _d(a), _d(b), _d(t), _d(dx), _d(da),
                     _d(db), _d(dbias) if with_bias else None, act, scale, _stream(dy))
    return dx, da, db, dbias


@lora_backward.register_fake
def _(dy, saved, x, w, a, b, t, act, scale, with_bias):
    return (torch.empty_like(x), torch.empty_like(a), torch.empty_like(b),
            dy.new_empty(w.shape[0] if with_bias else 0))


def _lora_setup(ctx, inputs, output):
    x, w, bias, a, b, act, scale, for_backward = inputs
    if not for_backward:
        raise _not_kept("lora_forward")
    y, t, z = output
    ctx.act, ctx.scale, ctx.with_bias = act, scale, bias is not None
    ctx.save_for_backward(y if _derivative_from_output(act) else z, x, w, a, b, t)


def _lora_bwd(ctx, dy, dt, dz):
    saved, x, w, a, b, t = ctx.saved_tensors
    dx, da, db, dbias = _bwd(ctx, "lora_backward", dy, saved, x, w, a, b, t, ctx.act, ctx.scale, ctx.with_bias)
    return dx, None, (dbias if ctx.with_bias else None), da, db, None, None, None


_autograd("lora", _lora_bwd, _lora_setup)


# ---------------------------------------------------------------------------------------------
# qgemm: y = x w̃ᵀ from 4-bit weights (W4A16)
# ---------------------------------------------------------------------------------------------

@_custom_op("qgemm")
def qgemm(x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, n: int, k: int, group: int) -> Tensor:
    """y [M, n] = x [M, k] · w̃ᵀ, w̃ the 4-bit weight quantize_weights made (docs/qgemm.md)."""
    _same_device("qgemm", x=x, packed=packed, scale=scale, zero=zero)
    y = x.new_empty((x.shape[0], n))
    _C.qgemm(_d(x), _d(packed), _d(scale), _d(zero), n, k, group, _d(y), _stream(x))
    return y


@qgemm.register_fake
def _(x, packed, scale, zero, n, k, group):
    return x.new_empty((x.shape[0], n))


def quantize_weights(w: Tensor, group: int = 128) -> tuple[Tensor, Tensor, Tensor]:
    """(packed, scale, zero) of w [N, K] (f16 / bf16) in qgemm's layout, on w's device. The
    quantization runs on the host (once, at model load); the results are copied by PyTorch."""
    packed, scale, zero = _C.quantize_weights(w.detach().cpu(), group)
    return tuple(torch.from_dlpack(t).to(w.device) for t in (packed, scale, zero))


def dequantize_weights(packed: Tensor, scale: Tensor, zero: Tensor, n: int, k: int, group: int) -> Tensor:
    out = scale.new_empty((n, k))
    _C.dequantize_weights(_d(packed), _d(scale), _d(zero), n, k, group, _d(out), _stream(packed))
    return out


# ---------------------------------------------------------------------------------------------
# mlp: a whole narrow MLP in one kernel (bf16 / f16; widths <= 128, hidden 16/32/64/128)
# ---------------------------------------------------------------------------------------------

def _acts(acts: str) -> list:
    return acts.split(",") if acts else []


@_custom_op("fused_mlp")
def fused_mlp(x: Tensor, weights: list[Tensor], biases: list[Tensor], acts: str) -> Tensor:
    """y = act_L(... act_0(x W_0ᵀ + b_0) ...), inference (nothing saved); acts comma-separated
    (identity, relu, sigmoid), one per layer."""
    y = x.new_empty((x.shape[0], weights[-1].shape[0]))
    _C.fused_mlp_forward(_d(x), [_d(w) for w in weights], [_d(b) for b in biases], _acts(acts), _d(y), None,
                         _stream(x))
    return y


@fused_mlp.register_fake
def _(x, weights, biases, acts):
    return x.new_empty((x.shape[0], weights[-1].shape[0]))


def _hidden_shape(x: Tensor, weights: list) -> tuple:
    return (len(weights) - 1, x.shape[0], weights[0].shape[0])


@_custom_op("fused_mlp_train")
def fused_mlp_train(x: Tensor, weights: list[Tensor], biases: list[Tensor], acts: str) -> tuple[Tensor, Tensor]:
    """(y, hidden): the forward that also keeps every hidden layer's output for the backward."""
    y = x.new_empty((x.shape[0], weights[-1].shape[0]))
    hidden = x.new_empty(_hidden_shape(x, weights))
    _C.fused_mlp_forward(_d(x), [_d(w) for w in weights], [_d(b) for b in biases], _acts(acts), _d(y), _d(hidden),
                         _stream(x))
    return y, hidden


@fused_mlp_train.register_fake
def _(x, weights, biases, acts):
    return x.new_empty((x.shape[0], weights[-1].shape[0])), x.new_empty(_hidden_shape(x, weights))


@_custom_op("fused_mlp_backward")
def fused_mlp_backward(dy: Tensor, x: Tensor, hidden: Tensor, y: Tensor, weights: list[Tensor],
                       biases: list[Tensor], acts: str) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """(dx, dW_l, db_l): dW and db in f32 (master-gradient precision), summed in a fixed order."""
    dy = dy.contiguous() if not dy.is_contiguous() else dy
    dx = torch.empty_like(x)
    dws = [w.new_empty(w.shape, dtype=torch.float32) for w in weights]
    dbs = [b.new_empty(b.shape, dtype=torch.float32) for b in biases]
    _C.fused_mlp_backward(_d(dy), _d(x), _d(hidden), _d(y), [_d(w) for w in weights], [_d(b) for b in biases],
                          _acts(acts), _d(dx), [_d(t) for t in dws], [_d(t) for t in dbs], _stream(dy))
    return dx, dws, dbs


@fused_mlp_backward.register_fake
def _(dy, x, hidden, y, weights, biases, acts):
    return (torch.empty_like(x), [w.new_empty(w.shape, dtype=torch.float32) for w in weights],
            [b.new_empty(b.shape, dtype=torch.float32) for b in biases])


def _fused_mlp_setup(ctx, inputs, output):
    x, weights, biases, acts = inputs
    y, hidden = output
    ctx.acts, ctx.n = acts, len(weights)
    ctx.save_for_backward(x, hidden, y, *weights, *biases)


def _fused_mlp_bwd(ctx, dy, dhidden):
    x, hidden, y, *rest = ctx.saved_tensors
    weights, biases = rest[: ctx.n], rest[ctx.n:]
    dx, dws, dbs = _bwd(ctx, "fused_mlp_backward", dy, x, hidden, y, list(weights), list(biases), ctx.acts)
    return dx, [d.to(w.dtype) for d, w in zip(dws, weights)], [d.to(b.dtype) for d, b in zip(dbs, biases)], None


_autograd("fused_mlp_train", _fused_mlp_bwd, _fused_mlp_setup, eager=False)


# ---------------------------------------------------------------------------------------------
# recsys: embedding bags (the optimizer fused into the backward), interaction, loss
# ---------------------------------------------------------------------------------------------

# The embedding bags' backward: "dense_gradient" hands autograd a dense [total_rows, D] gradient
# (nn.EmbeddingBag's sparse=False); the others apply the update to the table rows the batch
# touched, inside the backward, and hand autograd no gradient for the weights (FBGEMM's TBE).
EMBEDDING_UPDATES = ("dense_gradient", "sgd", "adagrad", "rowwise_adagrad")


def _bags_batch(indices: Optional[Tensor], offsets: Optional[Tensor], raw: Optional[Tensor], tables: int) -> int:
    if raw is not None:
        return raw.shape[0] // tables
    if offsets is None:
        raise _C.Error("fk::embedding_bag_forward: argument 'offsets': expected i64 [T * B + 1] with indices, "
                       "or raw values instead of both, got neither")
    return (offsets.shape[0] - 1) // tables


def _bags_nnz(indices: Optional[Tensor], raw: Optional[Tensor]) -> int:
    return raw.shape[0] if raw is not None else (indices.shape[0] if indices is not None else 0)


@_custom_op("embedding_bag")
def embedding_bag(weights: Tensor, indices: Optional[Tensor], offsets: Optional[Tensor], raw: Optional[Tensor],
                  table_rows: list[int], pooling: str, hash: str, update: str, lr: float, eps: float,
                  state: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(out [B, T, D] f32, keys, bags i32 [nnz]): out[b, t] = the sum (or mean) over bag t * B + b
    of rows of table t, the T tables stacked in weights [sum(table_rows), D]. Input: CSR indices
    (row within the table) and offsets [T * B + 1], table-major; or raw i32 [T * B], one value per
    bag hashed to a row (hash "seed" or "reference"). keys / bags are what the backward reads.
    update, lr, eps and state say what the backward does (EMBEDDING_UPDATES)."""
    _same_device("embedding_bag_forward", weights=weights, indices=indices, offsets=offsets, raw=raw, state=state)
    tables = len(table_rows)
    nnz = _bags_nnz(indices, raw)
    out = weights.new_empty((_bags_batch(indices, offsets, raw, tables), tables, weights.shape[-1]))
    keys = weights.new_empty((nnz,), dtype=torch.int32)
    bags = torch.empty_like(keys)
    _C.embedding_bag_forward(_d(weights), _d(indices), _d(offsets), _d(raw), table_rows, _d(out), _d(keys), _d(bags),
                             pooling, hash, False, _stream(weights))
    return out, keys, bags


@embedding_bag.register_fake
def _(weights, indices, offsets, raw, table_rows, pooling, hash, update, lr, eps, state):
    tables = len(table_rows)
    keys = weights.new_empty((_bags_nnz(indices, raw),), dtype=torch.int32)
    return (weights.new_empty((_bags_batch(indices, offsets, raw, tables), tables, weights.shape[-1])), keys,
            torch.empty_like(keys))


def _embedding_workspace(keys: Tensor, dim: int) -> Optional[Tensor]:
    if not keys.is_cuda:
        return None
    return keys.new_empty((_C.embedding_bag_backward_workspace_bytes(keys.shape[0], dim),), dtype=torch.uint8)


@_custom_op("embedding_bag_backward")
def embedding_bag_backward(dout: Tensor, keys: Tensor, bags: Tensor, offsets: Optional[Tensor], table_rows: list[int],
                           pooling: str) -> Tensor:
    """The dense gradient of the stacked tables [sum(table_rows), D]: each touched row the sum of
    its bags' dout (over the bag size for mean pooling), summed in a fixed order; every other row 0."""
    dout = dout.contiguous() if not dout.is_contiguous() else dout
    dw = dout.new_empty((sum(table_rows), dout.shape[-1]))
    _C.embedding_bag_backward_update(_d(keys), _d(bags), _d(dout), _d(offsets if pooling == "mean" else None), _d(dw),
                                     None, _d(_embedding_workspace(keys, dout.shape[-1])), table_rows, "dense_gradient",
                                     0.0, 0.0, pooling, _stream(dout))
    return dw


@embedding_bag_backward.register_fake
def _(dout, keys, bags, offsets, table_rows, pooling):
    return dout.new_empty((sum(table_rows), dout.shape[-1]))


@_custom_op("embedding_bag_update_", mutates_args=("weights", "state"))
def embedding_bag_update_(weights: Tensor, state: Optional[Tensor], dout: Tensor, keys: Tensor, bags: Tensor,
                          offsets: Optional[Tensor], table_rows: list[int], update: str, lr: float, eps: float,
                          pooling: str) -> None:
    """The optimizer step on the rows the batch touched, in place: sgd, adagrad (state [rows, D])
    or rowwise_adagrad (state [rows]); each row's gradient summed in a fixed order first."""
    dout = dout.contiguous() if not dout.is_contiguous() else dout
    _C.embedding_bag_backward_update(_d(keys), _d(bags), _d(dout), _d(offsets if pooling == "mean" else None),
                                     _d(weights), _d(state), _d(_embedding_workspace(keys, dout.shape[-1])), table_rows,
                                     update, lr, eps, pooling, _stream(dout))
    for t in (weights, state):  # as a torch in-place op would: a tensor saved before this is stale
        if t is not None:
            torch.autograd.graph.increment_version(t)


def _embedding_bag_setup(ctx, inputs, output):
    weights, indices, offsets, raw, table_rows, pooling, hash, update, lr, eps, state = inputs
    _, keys, bags = output
    ctx.table_rows, ctx.pooling, ctx.update, ctx.lr, ctx.eps = table_rows, pooling, update, lr, eps
    ctx.save_for_backward(keys, bags, offsets)
    if update != "dense_gradient":  # what the backward updates in place (not saved: no version check)
        ctx.weights, ctx.state = weights, state


def _embedding_bag_bwd(ctx, dout, dkeys, dbags):
    keys, bags, offsets = ctx.saved_tensors
    if ctx.update == "dense_gradient":
        dw = _bwd(ctx, "embedding_bag_backward", dout, keys, bags, offsets, ctx.table_rows, ctx.pooling)
    else:
        _bwd(ctx, "embedding_bag_update_", ctx.weights, ctx.state, dout, keys, bags, offsets, ctx.table_rows,
             ctx.update, ctx.lr, ctx.eps, ctx.pooling)
        dw = None
    return dw, None, None, None, None, None, None, None, None, None, None


_autograd("embedding_bag", _embedding_bag_bwd, _embedding_bag_setup)


@_custom_op("dense_optimizer_update_", mutates_args=("param", "state"))
def dense_optimizer_update_(param: Tensor, grad: Tensor, state: Optional[Tensor], adagrad: bool, lr: float,
                            eps: float) -> None:
    """One SGD or Adagrad step over a whole f32 parameter, in place (state: Adagrad's sum of squares)."""
    _same_device("dense_optimizer_update", param=param, grad=grad, state=state)
    _C.dense_optimizer_update(_d(param), _d(grad), _d(state), adagrad, lr, eps, _stream(param))
    for t in (param, state):
        if t is not None:
            torch.autograd.graph.increment_version(t)


def interaction_size(kind: str, self_interaction: bool, features: int, dim: int):
    """Columns of the interaction's output (works on symbolic sizes too)."""
    if kind == "dot":
        return dim + features * (features - 1) // 2 + (features if self_interaction else 0)
    if kind == "cat":
        return features * dim
    if kind == "outer":
        return (features * dim) ** 2
    raise _C.Error(f"fk::interaction_forward: argument 'kind': expected dot, cat or outer, got {kind}")


def _interaction_workspace(z: Tensor, kind: str) -> Optional[Tensor]:
    """[B, F, F] f32 for the batched-GEMM dot interaction, where the fused one's shared memory
    cannot hold a sample (large F D); None otherwise."""
    if not z.is_cuda or kind != "dot" or _C.interaction_dot_fused_fits(z.shape[1], z.shape[2]):
        return None
    return z.new_empty((z.shape[0], z.shape[1], z.shape[1]))


@_custom_op("interaction")
def interaction(z: Tensor, kind: str, self_interaction: bool) -> Tensor:
    """r [B, I] from z [B, F, D] f32: dot (z[:, 0] then the dot products of the pairs (i, j), j < i
    (j <= i with self_interaction), in the DLRM reference's order), cat or outer."""
    if z.dim() != 3:
        raise _C.Error(f"fk::interaction_forward: argument 'z': expected [B, F, D], got shape {list(z.shape)}")
    r = z.new_empty((z.shape[0], interaction_size(kind, self_interaction, z.shape[1], z.shape[2])))
    _C.interaction_forward(_d(z), _d(r), kind, self_interaction, _d(_interaction_workspace(z, kind)), _stream(z))
    return r


@interaction.register_fake
def _(z, kind, self_interaction):
    return z.new_empty((z.shape[0], interaction_size(kind, self_interaction, z.shape[1], z.shape[2])))


@_custom_op("interaction_backward")
def interaction_backward(z: Tensor, dr: Tensor, kind: str, self_interaction: bool) -> Tensor:
    dr = dr.contiguous() if dr.stride(-1) != 1 else dr
    dz = torch.empty_like(z)
    _C.interaction_backward(_d(z), _d(dr), _d(dz), kind, self_interaction, False, _d(_interaction_workspace(z, kind)),
                            _stream(z))
    return dz


@interaction_backward.register_fake
def _(z, dr, kind, self_interaction):
    return torch.empty_like(z)


def _interaction_setup(ctx, inputs, output):
    z, kind, self_interaction = inputs
    ctx.kind, ctx.self_interaction = kind, self_interaction
    ctx.save_for_backward(z)


def _interaction_bwd(ctx, dr):
    (z,) = ctx.saved_tensors
    return _bwd(ctx, "interaction_backward", z, dr, ctx.kind, ctx.self_interaction), None, None


_autograd("interaction", _interaction_bwd, _interaction_setup)


@_custom_op("sigmoid_bce")
def sigmoid_bce(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(loss, dlogits): loss = mean BCE of sigmoid(logits) against labels (f32 [B]), summed in
    double in a fixed order; dlogits = (sigmoid(logits) - labels) / B, from the same pass."""
    _same_device("sigmoid_bce_forward_backward", logits=logits, labels=labels)
    acc = torch.zeros((_C.sigmoid_bce_accumulator_bytes,), dtype=torch.uint8, device=logits.device)
    dlogits = torch.empty_like(logits)
    _C.sigmoid_bce_forward_backward(_d(logits), _d(labels), _d(dlogits), _d(acc), None, _stream(logits))
    return acc[:8].view(torch.float64)[0].to(torch.float32), dlogits


@sigmoid_bce.register_fake
def _(logits, labels):
    return logits.new_empty(()), torch.empty_like(logits)


def _sigmoid_bce_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _sigmoid_bce_bwd(ctx, dloss, ddlogits):
    (dlogits,) = ctx.saved_tensors
    return dlogits * dloss, None


_autograd("sigmoid_bce", _sigmoid_bce_bwd, _sigmoid_bce_setup)
