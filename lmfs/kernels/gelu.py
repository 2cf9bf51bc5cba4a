"""GeLU (tanh approximation) three ways: written-out PyTorch, a Triton kernel, a CUDA C++ kernel.

    gelu(x) = ½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))

Each element is independent, so the ideal kernel reads every input once and writes every output
once: 2 × n × bytes per element, and the arithmetic is free next to that memory traffic.
:func:`gelu_torch` spells the formula out in PyTorch operations; eager PyTorch launches one kernel
per operation and each one reads and writes a whole tensor, so it moves several times the
minimum. :func:`gelu` is one fused Triton kernel (forward, and a second one for the backward);
:func:`gelu_cuda` is the same idea in CUDA C++, compiled at first use with ``load_inline``.

>>> x = torch.randn(1000)
>>> torch.allclose(gelu(x), torch.nn.functional.gelu(x, approximate="tanh"), atol=1e-6)
True
"""

from __future__ import annotations

import functools
import inspect
import math

import torch

from lmfs.kernels._triton import check_tensors, tl, triton

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
BLOCK_SIZE = 1024  # elements per program: 4 warps × 32 threads × 8 elements


def gelu_torch(x: torch.Tensor) -> torch.Tensor:
    """The formula in plain PyTorch operations (several kernels and tensor round trips when eager)."""
    return 0.5 * x * (1.0 + torch.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x**3)))


@triton.jit
def _tanh(u):
    # tanh(u) = 2·sigmoid(2u) − 1, which saturates cleanly to ±1 for large |u|.
    return 2.0 * tl.sigmoid(2.0 * u) - 1.0


@triton.jit
def gelu_fwd_kernel(x_ptr, y_ptr, n, BLOCK_SIZE: tl.constexpr):
    # Each program owns BLOCK_SIZE consecutive elements; consecutive threads touch consecutive
    # addresses, so loads and stores are coalesced. int64: n may exceed 2^31.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n  # the last program may hang over the end
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)  # compute in fp32 whatever the storage
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # √(2/π)·(x + 0.044715x³)
    y = 0.5 * x * (1.0 + _tanh(inner))
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gelu_bwd_kernel(x_ptr, dy_ptr, dx_ptr, n, BLOCK_SIZE: tl.constexpr):
    # Recompute tanh from x instead of saving it: reading x again costs the same as reading a
    # saved tanh, and the forward then stores nothing extra.
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    dy = tl.load(dy_ptr + offsets, mask=mask).to(tl.float32)
    t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
    # d/dx ½x(1+t) = ½(1+t) + ½x·(1−t²)·√(2/π)·(1 + 3·0.044715·x²)
    dgelu = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * x * x)
    tl.store(dx_ptr + offsets, (dy * dgelu).to(dx_ptr.dtype.element_ty), mask=mask)


class GeLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        gelu_fwd_kernel[(triton.cdiv(n, BLOCK_SIZE),)](x, y, n, BLOCK_SIZE=BLOCK_SIZE)
        ctx.save_for_backward(x)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        n = x.numel()
        gelu_bwd_kernel[(triton.cdiv(n, BLOCK_SIZE),)](x, dy, dx, n, BLOCK_SIZE=BLOCK_SIZE)
        return dx


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GeLU (tanh approximation) of any-shaped ``x`` with fused Triton kernels, differentiable.

    Same as ``torch.nn.functional.gelu(x, approximate="tanh")``.
    """
    check_tensors("gelu", x=x)
    return GeLUFunction.apply(x)


# ----------------------------------------------------------------------------------------------
# CUDA C++: the same kernel written per thread instead of per block, compiled by nvcc at first use.

CUDA_SOURCE = r"""
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

// 16-bit values to and from float, spelled out (PyTorch builds extensions with the implicit
// conversions of __half and __nv_bfloat16 switched off).
__device__ inline float to_float(float v) { return v; }
__device__ inline float to_float(__half v) { return __half2float(v); }
__device__ inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline void store(float* p, float v) { *p = v; }
__device__ inline void store(__half* p, float v) { *p = __float2half(v); }
__device__ inline void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }

// One thread per element. scalar_t is float, __half or __nv_bfloat16; the maths runs in float.
template <typename scalar_t>
__global__ void gelu_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, int64_t n) {
    int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i < n) {  // the last block may hang over the end
        float v = to_float(x[i]);
        float inner = 0.7978845608028654f * (v + 0.044715f * v * v * v);
        store(y + i, 0.5f * v * (1.0f + tanhf(inner)));
    }
}

// The launch: as many blocks of 1,024 threads (the most a block may have) as n needs.
// dtype: 0 float32, 1 float16, 2 bfloat16.
void gelu_launch(const void* x, void* y, int64_t n, int dtype, cudaStream_t stream) {
    const int threads = 1024;
    const int64_t blocks = (n + threads - 1) / threads;
    if (dtype == 0) {
        gelu_kernel<<<blocks, threads, 0, stream>>>(static_cast<const float*>(x), static_cast<float*>(y), n);
    } else if (dtype == 1) {
        gelu_kernel<<<blocks, threads, 0, stream>>>(static_cast<const __half*>(x), static_cast<__half*>(y), n);
    } else {
        gelu_kernel<<<blocks, threads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x),
                                                    static_cast<__nv_bfloat16*>(y), n);
    }
}
"""

# The C++ side, compiled by the host compiler: checks, output allocation and the stream come from
# PyTorch. Keeping PyTorch's (large) headers out of the .cu file above lets nvcc compile only the
# kernel, which makes the first build several times faster.
CPP_SOURCE = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

void gelu_launch(const void* x, void* y, int64_t n, int dtype, cudaStream_t stream);

torch::Tensor gelu(torch::Tensor x) {
    TORCH_CHECK(x.is_cuda(), "gelu_cuda: x must be a CUDA tensor");
    const auto type = x.scalar_type();
    const int dtype = type == at::kFloat ? 0 : type == at::kHalf ? 1 : type == at::kBFloat16 ? 2 : -1;
    TORCH_CHECK(dtype >= 0, "gelu_cuda: x must be float32, float16 or bfloat16");
    x = x.contiguous();
    auto y = torch::empty_like(x);
    const int64_t n = x.numel();
    if (n == 0) return y;  // a launch with zero blocks is an error
    gelu_launch(x.data_ptr(), y.data_ptr(), n, dtype, c10::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return y;
}
"""


def cuda_toolchain_problem() -> str | None:
    """Why :func:`gelu_cuda` cannot be built here, or ``None`` when it can.

    ``load_inline`` needs a CUDA GPU, the CUDA compiler ``nvcc`` (a CUDA toolkit, found through
    ``CUDA_HOME``) and the ``ninja`` build tool.
    """
    from torch.utils import cpp_extension

    if not torch.cuda.is_available():
        return "gelu_cuda needs a CUDA GPU (torch sees none); use gelu (Triton) or F.gelu on this machine"
    if cpp_extension.CUDA_HOME is None:
        return ("gelu_cuda needs the CUDA toolkit's nvcc to compile, and none was found; install a CUDA "
                "toolkit matching torch.version.cuda and set CUDA_HOME")
    if not cpp_extension.is_ninja_available():
        return "gelu_cuda needs the ninja build tool for load_inline: pip install ninja"
    return None


@functools.cache
def _cuda_module():
    from torch.utils.cpp_extension import load_inline

    # no_implicit_headers (torch >= 2.7): do not prepend torch/types.h to the CUDA source.
    quick = {"no_implicit_headers": True} if "no_implicit_headers" in inspect.signature(load_inline).parameters else {}
    return load_inline(name="lmfs_gelu_cuda_v2", cpp_sources=CPP_SOURCE, cuda_sources=CUDA_SOURCE,
                       functions=["gelu"], extra_cuda_cflags=["-O3"], **quick)


def gelu_cuda(x: torch.Tensor) -> torch.Tensor:
    """GeLU (tanh approximation) by a CUDA C++ kernel; forward only, GPU only.

    The first call compiles the extension (seconds to a minute); later calls reuse it.
    """
    problem = cuda_toolchain_problem()
    if problem:
        raise RuntimeError(problem)
    check_tensors("gelu_cuda", x=x)
    return _cuda_module().gelu(x)
