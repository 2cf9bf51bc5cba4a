"""GPU kernels written in Triton (and one in CUDA C++), each checked against PyTorch.

=========================  ==========================================================
:func:`gelu`               GeLU (tanh approximation), fused forward and backward
:func:`gelu_torch`         the same formula in plain PyTorch operations (many kernels)
:func:`gelu_cuda`          GeLU as a CUDA C++ kernel built with ``load_inline`` (GPU only)
:func:`softmax`            row softmax, one row per program, forward and backward
:func:`rms_norm`           fused RMSNorm forward and backward (dx and dweight)
:func:`flash_attention`    FlashAttention-2: forward with saved log-sum-exp, backward by
                           recomputation, causal block skipping, autotuned on a GPU
:func:`flash_attention_torch`  the same algorithm in readable PyTorch loops
:class:`FlashAttentionTriton`  the autograd Functions of the two, ``apply(q, k, v, is_causal)``;
:class:`FlashAttentionTorch`   both save O and the log-sum-exp (natural-log units)
:func:`online_softmax`     softmax one block of columns at a time (FlashAttention's trick)
:func:`rope_qkv`           heads of a fused q/k/v projection with RoPE on q and k, the
                           backward writing one fused gradient (:mod:`lmfs.kernels.fused`)
:func:`swiglu`             ``silu(gate)·up`` on a fused gate/up projection, likewise
:func:`cross_entropy_rows` loss and logit gradient of a chunk of rows in one pass
:func:`linear_cross_entropy`  the head and its loss chunk by chunk, never keeping the logits
                           (:mod:`lmfs.kernels.loss`)
:func:`grouped_matmul`     rows grouped by expert, each group times its own matrix, in one
                           launch; dx and dw kernels for the backward (:mod:`lmfs.kernels.grouped_gemm`)
:func:`paged_decode_attention`  one decode token per sequence attending over a paged KV cache
                           through its block table (:mod:`lmfs.kernels.paged_attention`)
:class:`FusedDecode`       a dense model's decode step (and packed prefill) in about ten kernels a
                           layer: merged projections, fused norms, RoPE and cache writes
                           (:mod:`lmfs.kernels.decode`)
:func:`dequant_matmul`     activations times int8 / packed int4 group-quantised weights,
                           dequantised in registers (:mod:`lmfs.kernels.dequant_matmul`)
:func:`fuse_model`         a built ``TransformerLM`` made faster in place: fused projections,
                           the kernels above, the chunked loss (:mod:`lmfs.kernels.fused`)
=========================  ==========================================================

Without a CUDA GPU, importing this package switches Triton to its interpreter (``INTERPRET`` is
then true): the same kernels run on the CPU, slowly, which is enough to check them at small
sizes. The kernel modules keep their Triton kernels public (``lmfs.kernels.gelu.gelu_fwd_kernel``,
...) for lecture 06 to show. Benchmarks: ``python -m lmfs.benchmarks kernels`` and
``python -m lmfs.benchmarks attention``.
"""

from lmfs.kernels._triton import INTERPRET
from lmfs.kernels.flash_attention import (HEAD_DIMS, FlashAttentionTorch, FlashAttentionTriton, flash_attention,
                                          flash_attention_forward, flash_attention_torch, online_softmax)
from lmfs.kernels.fused import fuse_model, rope_qkv, swiglu
from lmfs.kernels.gelu import cuda_toolchain_problem, gelu, gelu_cuda, gelu_torch
from lmfs.kernels.grouped_gemm import grouped_matmul
from lmfs.kernels.decode import FusedDecode
from lmfs.kernels.dequant_matmul import dequant_matmul
from lmfs.kernels.loss import cross_entropy_rows, linear_cross_entropy
from lmfs.kernels.paged_attention import paged_decode_attention
from lmfs.kernels.rmsnorm import rms_norm
from lmfs.kernels.softmax import softmax

__all__ = ["INTERPRET", "HEAD_DIMS", "FlashAttentionTorch", "FlashAttentionTriton",
           "cross_entropy_rows", "cuda_toolchain_problem", "flash_attention",
           "flash_attention_forward", "flash_attention_torch", "fuse_model", "gelu", "gelu_cuda", "gelu_torch",
           "FusedDecode", "dequant_matmul", "grouped_matmul", "paged_decode_attention",
           "linear_cross_entropy", "online_softmax", "rms_norm", "rope_qkv", "softmax", "swiglu"]
