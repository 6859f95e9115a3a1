"""torch.ops.fusekit.*: every fusekit op as a torch.library custom op.

Each op allocates its outputs with PyTorch (so the caching allocator and
``torch.cuda.max_memory_allocated()`` see them), runs on ``torch.cuda.current_stream()`` of its
inputs' device, has a fake implementation (shapes and dtypes only, for ``torch.compile``) and,
where fusekit has a backward, an autograd rule. A dtype or device the kernel cannot take is a
``fusekit.Error`` naming the argument; layouts are as docs/python.md states per op (softmax,
bias_act and every backward take any layout, copying where the kernel cannot read it).

Layout: ``_registry`` holds what every op shares (registration, ``call``, DLPack, stream and
allocator access, and every private PyTorch API fusekit uses); each family's ops, with their fake
implementations and autograd rules, are in a module of its own (``pointwise``, ``primitives``,
``quant``, ``glu``, ``lora``, ``qgemm``, ``mlp``, ``recsys``). Importing this package registers
them all; the names below are the ones other modules use as ``fusekit.ops.<name>``.
"""
from ._registry import call, call_first, needs_grad, use_torch_caching_allocator  # noqa: F401
from .pointwise import bias_act, bias_act_backward, convert  # noqa: F401
from .pointwise import qkv_rope, qkv_rope_backward, rope, rope_backward  # noqa: F401
from .primitives import (attention, attention_backward, attention_backward_varlen, attention_varlen,  # noqa: F401
                         batched_matmul, broadcast_binary, broadcast_binary_backward, conv2d, row_sum, softmax)
from .quant import pack, relu_packed, relu_packed_backward, unpack, weight_grad_from_packed  # noqa: F401
from .glu import glu, glu_backward, glu_swaps_halves, prepare_glu_weight, unprepare_glu_weight  # noqa: F401
from .glu import (glu_activate, glu_backward_from_preact, glu_mlp, glu_mlp_train, glu_preact_grad,  # noqa: F401
                  glu_prepared, glu_train)
from .lora import lora, lora_backward  # noqa: F401
from .qgemm import dequantize_weights, pack_weights, qgemm, quantize_weights  # noqa: F401
from .mlp import fused_mlp, fused_mlp_backward, fused_mlp_train  # noqa: F401
from .loss import linear_cross_entropy  # noqa: F401
from .recsys import (EMBEDDING_UPDATES, dense_optimizer_update_, embedding_bag, embedding_bag_backward,  # noqa: F401
                     embedding_bag_update_, interaction, interaction_backward, interaction_size, sigmoid_bce)
from .norm import add_rms_norm, rms_norm, rms_norm_backward  # noqa: F401
