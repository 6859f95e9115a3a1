"""fusekit: fused GPU kernels for training and inference, as PyTorch operators and modules.

``fusekit._C`` holds the ops on DLPack arrays (no PyTorch needed); with torch importable,
``fusekit.ops`` registers each as ``torch.ops.fusekit.*`` (a ``torch.library`` custom op with its
fake and autograd rules) and this package exposes the plain functions (``fusekit.softmax(x)``,
``fusekit.glu(x, w, kind="swiglu")``, ...).
"""
# PyTorch first, when it is there: the extension links libcublas by its soname, and the copy
# torch loads (its own wheel's) must be the one the process holds, not the system toolkit's
# loaded ahead of it (torch then crashes inside its own cuBLAS calls).
try:
    import torch as _torch  # noqa: F401
except ImportError:  # the bindings alone: arrays through DLPack
    _torch = None

from . import _C  # noqa: E402
from ._C import Error, build_info, cuda_device_count  # noqa: E402

__version__ = build_info()["version"]

if _torch is not None:
    from . import ops  # registers torch.ops.fusekit.*
    # Every device buffer fusekit allocates (scratch included) comes from PyTorch's caching
    # allocator: torch.cuda.max_memory_allocated() counts it, CUDA graph capture pools it.
    ops.use_torch_caching_allocator()
    from .functional import (add_rms_norm, apply_rotary_pos_emb, attention, attention_varlen,  # noqa: F401
                             batched_matmul, bias_act, broadcast_binary, check_bags, conv2d, convert,
                             dense_optimizer_update_, embedding_bags, glu, glu_mlp, interaction, linear_cross_entropy,
                             lora, outer, pack, relu_packed, rms_norm, rope, row_sum, sigmoid_bce, softmax, unpack,
                             weight_grad_from_packed)
    from . import nn  # noqa: F401,E402  (fusekit.nn after `import fusekit`, as torch.nn after `import torch`)
    from .nn import load_quantized, quantize  # noqa: F401,E402
    from .patch import patch, patch_llama, unpatch  # noqa: F401,E402
    from .hf_attention import hf_attention_forward, register_hf_attention  # noqa: F401,E402
    from .compress import compress_saved_tensors  # noqa: F401,E402

__all__ = ["Error", "build_info", "cuda_device_count"]
