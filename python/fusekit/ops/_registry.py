"""What every family's ops share: registration as torch.library custom ops with their autograd
rules, call() and its eager fast path, DLPack and argument helpers, and access to torch's current
stream and caching allocator.

Every private PyTorch API fusekit uses is used here and nowhere else, each behind a hasattr check
that falls back to the public API with a one-line warning saying what the fallback costs:
``torch._C._len_torch_dispatch_stack`` and ``torch._C._are_functorch_transforms_active`` (is a
dispatch mode or a functorch transform active? without them every call takes the registered op),
``torch._C._cuda_getCurrentRawStream`` (``torch.cuda.current_stream(device).cuda_stream``),
``torch._C._cuda_cudaCachingAllocator_raw_alloc`` / ``_raw_delete``
(``torch.cuda.caching_allocator_alloc`` / ``caching_allocator_delete``) and Inductor's
``lowering.make_fallback`` (see register_inductor_fallbacks). Where an op's tensors are
in its argument list comes from the implementation's type hints, the same ones torch.library infers
the schema from.
"""
from __future__ import annotations

import inspect
import types
import typing
import warnings
from typing import Optional

import torch
from torch import Tensor

from .. import _C

_LIB = "fusekit"


def _missing(private: str, fallback: str, cost: str) -> None:
    warnings.warn(f"fusekit: torch {torch.__version__} has no {private}; using {fallback} instead ({cost})",
                  RuntimeWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------
# torch internals, each with its public fallback
# ---------------------------------------------------------------------------------------------

_PLAIN = (Tensor, torch.nn.Parameter)
_is_compiling, _grad_enabled = torch.compiler.is_compiling, torch.is_grad_enabled
_dispatch_modes = _functorch_active = _raw_stream = None  # bound by _bind_torch_internals()


def _always() -> bool:
    return True


def _bind_torch_internals() -> None:
    """Binds the private functions call() and _stream() use, or their fallbacks (with a warning)."""
    global _dispatch_modes, _functorch_active, _raw_stream
    c = torch._C
    if hasattr(c, "_len_torch_dispatch_stack") and hasattr(c, "_are_functorch_transforms_active"):
        _dispatch_modes, _functorch_active = c._len_torch_dispatch_stack, c._are_functorch_transforms_active
    else:
        _missing("torch._C._len_torch_dispatch_stack / _are_functorch_transforms_active",
                 "the registered op for every call", "correct, but the dispatcher's round trips cost several "
                 "microseconds of host time a call")
        _dispatch_modes, _functorch_active = _always, _always  # as if always traced: the registered op
    if hasattr(c, "_cuda_getCurrentRawStream"):
        _raw_stream = c._cuda_getCurrentRawStream
    else:
        _raw_stream = _public_raw_stream


_warned_stream = False


def _public_raw_stream(device: int) -> int:
    global _warned_stream
    if not _warned_stream:  # here, not at import: a torch without CUDA has no CUDA tensors to ask about
        _warned_stream = True
        _missing("torch._C._cuda_getCurrentRawStream", "torch.cuda.current_stream(device).cuda_stream",
                 "a stream object made per op call, about a microsecond")
    return torch.cuda.current_stream(device).cuda_stream


_bind_torch_internals()


def _stream(t: Tensor) -> int:
    """The raw cudaStream_t of torch's current stream on t's device (0 for host tensors)."""
    return _raw_stream(t.get_device()) if t.is_cuda else 0


def use_torch_caching_allocator() -> None:
    """Hands fusekit._C PyTorch's caching allocator for every device buffer it allocates (scratch
    included): torch.cuda.max_memory_allocated() counts it, CUDA graph capture pools it, and a
    block goes back ordered on the stream it was allocated on, as torch's own tensors do. Nothing
    to do without CUDA in fusekit or in torch."""
    if not _C.build_info()["cuda"] or not torch.backends.cuda.is_built():
        return
    c = torch._C
    if hasattr(c, "_cuda_cudaCachingAllocator_raw_alloc") and hasattr(c, "_cuda_cudaCachingAllocator_raw_delete"):
        _C.set_memory_source(c._cuda_cudaCachingAllocator_raw_alloc, c._cuda_cudaCachingAllocator_raw_delete)
        return
    _missing("torch._C._cuda_cudaCachingAllocator_raw_alloc / _raw_delete",
             "torch.cuda.caching_allocator_alloc / caching_allocator_delete", "a few microseconds more per buffer")
    _C.set_memory_source(lambda size, stream: torch.cuda.caching_allocator_alloc(size, None, stream),
                         torch.cuda.caching_allocator_delete)


# ---------------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------------

_IMPL = {}  # name -> the implementation torch.ops.fusekit.<name> runs
_IMPL_FIRST = {}  # name -> an implementation for call_first() that returns None for an unused output
_OPS = {}
_TENSOR_ARGS = {}  # name -> positions of its Tensor, Optional[Tensor] and list[Tensor] arguments
_RETURNS = {}  # name -> how many outputs it returns


def _holds_tensors(hint) -> bool:
    """Whether an argument of this type hint is a Tensor, Optional[Tensor] or list[Tensor]."""
    if hint is Tensor:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        return Tensor in args
    return origin is list and args == (Tensor,)


def _signature(fn) -> tuple:
    """(positions of the tensor arguments, number of outputs) of an op from its type hints."""
    hints = typing.get_type_hints(fn)
    tensors = tuple(i for i, p in enumerate(inspect.signature(fn).parameters) if _holds_tensors(hints[p]))
    ret = hints.get("return", type(None))
    outputs = len(typing.get_args(ret)) if typing.get_origin(ret) is tuple else (0 if ret is type(None) else 1)
    return tensors, outputs


def _custom_op(name: str, mutates_args: tuple = (), first=None):
    """Registers `fn` as torch.ops.fusekit.<name>, and keeps it and where its tensors are for call().
    `first`, where given, is what call_first() runs in eager mode: `fn` without the empty tensors
    that `fn` returns for outputs not written (the caller keeps only the first)."""
    def wrap(fn):
        _IMPL[name] = fn
        _IMPL_FIRST[name] = first or fn
        _OPS[name] = torch.library.custom_op(f"{_LIB}::{name}", mutates_args=mutates_args)(fn)
        _TENSOR_ARGS[name], _RETURNS[name] = _signature(fn)
        return _OPS[name]
    return wrap


_INDUCTOR_FALLBACKS = False  # register_inductor_fallbacks() has run


def register_inductor_fallbacks() -> None:
    """Registers every fusekit op with Inductor as the extern kernel (fallback) Inductor makes of a
    custom op when it first lowers one, with the layout constraint it would choose, ahead of any
    compile. On first sight Inductor (torch 2.11) formats the op's arguments into a log message
    whether or not that log is on, and the text of an argument holds the whole graph of extern
    kernels it comes from: where fusekit ops feed each other layer after layer (a patched decoder
    stack, whose layers hand each other add_rms_norm's outputs) that text doubles with every layer,
    and a 12-layer model's compile never finishes. Without Inductor's lowering module (or its
    make_fallback), a warning, and nothing registered."""
    global _INDUCTOR_FALLBACKS
    if _INDUCTOR_FALLBACKS:
        return
    _INDUCTOR_FALLBACKS = True
    try:
        from torch._inductor import lowering
        from torch._library.utils import get_layout_constraint_tag
        make, constraint, known = lowering.make_fallback, lowering.tag_to_layout_constraint, lowering.lowerings
    except (ImportError, AttributeError):
        _missing("torch._inductor.lowering.make_fallback", "Inductor's own registration on first sight",
                 "a compiled model whose layers chain fusekit ops may take very long to compile")
        return
    for name in _OPS:
        packet = getattr(torch.ops.fusekit, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if op not in known:
                make(op, layout_constraint=constraint(get_layout_constraint_tag(op, with_default=True)), warn=False)


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
    unused = (None,) * (_RETURNS[name] - 1)

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


def _bwd(ctx, name: str, *args):
    """A backward op from an autograd rule: the implementation itself under call()'s eager path,
    the registered op when torch (compile, AOT autograd, opcheck) traces the rule."""
    if getattr(ctx, "fusekit_eager", False):
        return _IMPL[name](*args)
    return getattr(torch.ops.fusekit, name).default(*args)


# ---------------------------------------------------------------------------------------------
# autocast
# ---------------------------------------------------------------------------------------------

_AUTOCAST = set()  # ops with an autocast rule: call() hands them to the dispatcher under autocast
_AUTOCAST_DEVICES = ("cpu", "cuda")
_AUTOCAST_LIB = None  # the torch.library.Library that holds the rules (kept alive with the module)

if hasattr(torch, "get_autocast_dtype"):
    _autocast_dtype = torch.get_autocast_dtype
else:  # torch 2.4
    def _autocast_dtype(device_type: str):
        return torch.get_autocast_cpu_dtype() if device_type == "cpu" else torch.get_autocast_gpu_dtype()


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch 2.4 asks per device by name
        return torch.is_autocast_cpu_enabled() if device_type == "cpu" else torch.is_autocast_enabled()


def _autocast(name: str, policy: str = "lower_precision", device_types: tuple = _AUTOCAST_DEVICES,
              keep_f32: tuple = ()) -> None:
    """Op `name` under torch.autocast follows one of torch's autocast policies, on the dispatcher's
    Autocast keys of `device_types` (so that torch.compile and every other path through
    torch.ops.fusekit.<name> see it too); on other devices autocast leaves the op alone.
    "lower_precision", as torch's matmuls (autocast's lower-precision list): its floating tensor
    arguments on autocast's device are cast to torch.get_autocast_dtype(device). "fp32", as torch's
    norms and losses (autocast's fp32 list): its floating tensor arguments on that device other than
    f64 are cast to f32. Either cast is one autograd records (gradients reach the arguments in
    their own dtypes); then the op runs with autocast off. `keep_f32` names arguments that stay f32
    when they are (the kernel reads them in f32, as rope's cos and sin tables); their other
    floating dtypes are cast as the rest."""
    global _AUTOCAST_LIB
    if policy not in ("lower_precision", "fp32"):
        raise ValueError(f"_autocast: policy {policy!r} is neither 'lower_precision' nor 'fp32'")
    if _AUTOCAST_LIB is None:
        _AUTOCAST_LIB = torch.library.Library(_LIB, "IMPL")
    op, positions = getattr(torch.ops.fusekit, name).default, _TENSOR_ARGS[name]
    params = list(inspect.signature(_IMPL[name]).parameters)
    kept = frozenset(params.index(a) for a in keep_f32)

    def rule(device_type: str):
        def cast(t):
            if isinstance(t, Tensor) and t.is_floating_point() and t.device.type == device_type:
                if policy == "fp32":
                    return t if t.dtype == torch.float64 else t.float()
                return t.to(_autocast_dtype(device_type))
            return t

        def cast_arg(i, t):
            if i in kept and isinstance(t, Tensor) and t.dtype == torch.float32:
                return t
            return cast(t)

        def run(*args):
            args = list(args)
            for i in positions:
                a = args[i]
                args[i] = [cast(t) for t in a] if type(a) is list else cast_arg(i, a)
            with torch.autocast(device_type, enabled=False):
                return op(*args)
        return run

    for device_type in device_types:
        _AUTOCAST_LIB.impl(name, rule(device_type), "AutocastCUDA" if device_type == "cuda" else "AutocastCPU")
    _AUTOCAST.add(name)


def _under_autocast(name: str, args: tuple) -> bool:
    """Whether autocast is on for the device of op `name`'s first tensor argument (ops with a rule only)."""
    if name not in _AUTOCAST:
        return False
    for i in _TENSOR_ARGS[name]:
        a = args[i]
        if type(a) is list:
            a = a[0] if a else None
        if a is not None:
            return _autocast_enabled(a.device.type)
    return False


# ---------------------------------------------------------------------------------------------
# call(): how a plain function or module runs an op
# ---------------------------------------------------------------------------------------------

_REGISTERED, _WITH_GRAD, _PLAIN_CALL = 0, 1, 2


def _route(name: str, args: tuple) -> int:
    """How call() runs op `name` on these arguments: the registered op while torch traces or
    transforms (torch.compile and export, a fake, functional, proxy or any other dispatch mode,
    functorch), under autocast for an op with an autocast rule, and for anything but plain tensors where the op takes tensors (a subclass: its
    own rules; a wrong type: the schema's error names the argument); else the implementation
    itself, with a gradient recorded or not. A plain loop over the op's tensor arguments only:
    this runs on every call."""
    if _is_compiling() or _dispatch_modes() or _functorch_active() or _under_autocast(name, args):
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


def needs_grad(*tensors: Optional[Tensor]) -> bool:
    """Whether autograd records a gradient of an op taking these tensors."""
    if not _grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


# ---------------------------------------------------------------------------------------------
# tensors as fusekit._C takes them, and checks several families make
# ---------------------------------------------------------------------------------------------

def _rows(t: Tensor, op: str, arg: str) -> Tensor:
    """[..., cols] as the [rows, cols] view the kernels take (no copy; an error when there is none)."""
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1]) if t.dim() > 0 else t.view(1, 1)
    except RuntimeError:
        raise _C.Error(f"fk::{op}: argument '{arg}': expected a tensor whose leading dimensions "
                       f"can be flattened without a copy, got shape {list(t.shape)} strides {list(t.stride())}")


def _input(t: Tensor) -> Tensor:
    """An input as the kernels take it: t itself when its rows are row-major and its leading
    dimensions flatten without a copy, else a contiguous copy. PyTorch's own ops take any layout
    (a transposed or expanded tensor, such as the gradient `.sum()` hands a backward); so does
    fusekit, paying one copy where the layout demands it."""
    if t.dim() > 0 and t.stride(-1) != 1:
        return t.contiguous()
    if t.dim() > 2:
        try:
            t.view(-1, t.shape[-1])
        except RuntimeError:
            return t.contiguous()
    return t


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


def _unit_rows(t: Tensor) -> Tensor:
    """t as the kernels that read any strides but the last one take it: t itself where its rows
    (last dimension) are contiguous, else a contiguous copy (an expanded or transposed-in-the-last-
    dimension gradient, say)."""
    return t.contiguous() if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1 else t


def _empty_in_order(like: Tensor, order: list[int]) -> Tensor:
    """An uninitialised tensor of like's shape, dtype and device whose dimensions lie in memory in
    `order` (outermost first; [] or the identity: contiguous), densely: the strides of a contiguous
    tensor of the permuted shape, seen back in like's order. Not a view (an op may return it)."""
    if not order or order == list(range(like.dim())):
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    shape, strides, step = like.shape, [0] * like.dim(), 1
    for d in reversed(order):
        strides[d] = step
        step *= max(shape[d], 1)
    return torch.empty_strided(shape, strides, dtype=like.dtype, device=like.device)


def _d(t: Optional[Tensor]):
    """_dlpack(t), or None for an absent optional tensor."""
    return None if t is None else _dlpack(t)


_DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def _dtype_name(dt: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dt, str(dt))


# Activations whose derivative comes from the output (y saved); the others (gelu, silu) need the
# pre-activation z (bias_act, lora).
_FROM_OUTPUT = frozenset(("identity", "relu", "sigmoid", "tanh"))


def _derivative_from_output(act: str) -> bool:
    return act in _FROM_OUTPUT


def _not_kept(op: str):
    return _C.Error(f"fk::{op}: argument 'for_backward': expected True when a gradient is recorded "
                    "(the backward needs what the forward keeps), got False")
