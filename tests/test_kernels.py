"""lmfs.kernels against PyTorch: every kernel, forward and backward.

Without a GPU the Triton kernels run in Triton's interpreter, so sizes stay small (and include
lengths that are not multiples of the block sizes, to exercise the masks). Tests marked ``gpu``
use larger sizes, 16-bit dtypes and the autotuned paths.
"""

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE, forward_backward, randn

from lmfs.kernels import (
    HEAD_DIMS,
    INTERPRET,
    FlashAttentionTorch,
    FlashAttentionTriton,
    cuda_toolchain_problem,
    flash_attention,
    flash_attention_forward,
    flash_attention_torch,
    gelu,
    gelu_cuda,
    gelu_torch,
    online_softmax,
    rms_norm,
    softmax,
)
from lmfs.kernels.flash_attention import BACKWARDS, DEFAULT_BACKWARD, autotune_choices
from lmfs.kernels.rmsnorm import backward_choice
from lmfs.nn.attention import attention_reference, causal_mask
from lmfs.nn.layers import RMSNorm

LOW_PRECISION = [torch.bfloat16, torch.float16]


def assert_all_close(ours, expected, atol=1e-5, rtol=1e-4):
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


# ----------------------------------------------------------------------------------------------
# GeLU, softmax, RMSNorm (float32; interpreter-sized)


@pytest.mark.parametrize("shape", [(1000,), (3, 37, 21)])  # not multiples of the 1024 block
def test_gelu_forward_backward(shape):
    x = randn(*shape) * 3
    ref = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731
    out, grads, dy = forward_backward(gelu, x)
    ref_out, ref_grads, _ = forward_backward(ref, x, grad_out=dy)
    assert_all_close([out, *grads], [ref_out, *ref_grads])


def test_gelu_torch_is_the_tanh_gelu():
    x = randn(500) * 4
    torch.testing.assert_close(gelu_torch(x), F.gelu(x, approximate="tanh"), atol=1e-6, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's NumPy, harmlessly
def test_gelu_saturates_without_nan():
    x = torch.tensor([-1e4, -50.0, 0.0, 50.0, 1e4], device=DEVICE)
    torch.testing.assert_close(gelu(x), F.gelu(x, approximate="tanh"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without a GPU")
def test_gelu_cuda_without_gpu_says_why():
    assert "CUDA GPU" in cuda_toolchain_problem()
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        gelu_cuda(torch.randn(4))


@pytest.mark.parametrize("shape", [(5, 7, 100), (3, 1), (2, 129)])
def test_softmax_forward_backward(shape):
    x = randn(*shape) * 5
    out, grads, dy = forward_backward(softmax, x)
    ref_out, ref_grads, _ = forward_backward(lambda t: torch.softmax(t, dim=-1), x, grad_out=dy)
    assert_all_close([out, *grads], [ref_out, *ref_grads], atol=1e-6)


def test_softmax_large_logits_are_stable():
    x = torch.tensor([[1000.0, 999.0, -1000.0], [-500.0, -501.0, -502.0]], device=DEVICE)
    torch.testing.assert_close(softmax(x), torch.softmax(x, dim=-1))


def test_softmax_rejects_rows_too_long_for_one_program():
    with pytest.raises(ValueError, match="rows of 40000 elements"):
        softmax(torch.zeros(1, 40000, device=DEVICE))


# 30 rows: more tiles than programs; 3 rows: fewer; 37 × 300: a partial last tile and a row
# length that is no power of two.
@pytest.mark.parametrize("shape", [(6, 5, 96), (3, 1, 50), (37, 300)])
def test_rms_norm_forward_backward(shape):
    x, w = randn(*shape), 1 + 0.1 * randn(shape[-1], seed=1)
    out, grads, dy = forward_backward(lambda a, b: rms_norm(a, b, 1e-5), x, w)
    ref = lambda a, b: F.rms_norm(a, (shape[-1],), b, eps=1e-5)  # noqa: E731
    ref_out, ref_grads, _ = forward_backward(ref, x, w, grad_out=dy)
    assert_all_close([out, *grads], [ref_out, *ref_grads])


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_rms_norm_16_bit_backward_small(dtype):
    """16-bit x, w and dy: float32 statistics and partial sums, results rounded once to 16 bits."""
    x, w = randn(9, 72, dtype=dtype), (1 + 0.1 * randn(72, seed=1)).to(dtype)
    out, grads, dy = forward_backward(lambda a, b: rms_norm(a, b, 1e-5), x, w)
    ref = lambda a, b: F.rms_norm(a, (72,), b, eps=1e-5)  # noqa: E731
    ref_out, ref_grads, _ = forward_backward(ref, x.float(), w.float(), grad_out=dy.float())
    for a, b in zip([out, *grads], [ref_out, *ref_grads]):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=3e-2)
    assert backward_choice()  # the (fixed or autotuned) launch configuration, as a line of text


def test_rms_norm_matches_lmfs_module():
    norm = RMSNorm(64).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * randn(64, seed=2))
    x = randn(4, 9, 64)
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps), norm(x), atol=1e-5, rtol=1e-5)


def test_rms_norm_rejects_mismatched_weight():
    with pytest.raises(ValueError, match="weight must be 1-D"):
        rms_norm(torch.zeros(2, 8, device=DEVICE), torch.ones(7, device=DEVICE))


def test_kernel_input_errors_name_the_fix():
    x = torch.zeros(4, 8, device=DEVICE)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        softmax(x.double())
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        gelu([1.0, 2.0])
    with pytest.raises(TypeError, match="cast them to one dtype"):
        rms_norm(x, torch.ones(8, device=DEVICE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="move all inputs to one device"):
        rms_norm(x, torch.ones(8, device="meta"))


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_16_bit_inputs_small(dtype):
    """Interpreter: 16-bit loads are upcast before arithmetic (its bf16 maths is wrong otherwise)."""
    x, w = randn(16, 48, dtype=dtype), (1 + 0.1 * randn(48, seed=1)).to(dtype)
    ref = x.float()
    torch.testing.assert_close(gelu(x).float(), F.gelu(ref, approximate="tanh"), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(softmax(x).float(), torch.softmax(ref, dim=-1), atol=1e-2, rtol=2e-2)
    torch.testing.assert_close(rms_norm(x, w).float(), F.rms_norm(ref, (48,), w.float(), eps=1e-5),
                               atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------------------------
# Online softmax and FlashAttention (float32; interpreter-sized)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16, 100])
def test_online_softmax_equals_softmax(block_size):
    x = randn(5, 17) * 10
    torch.testing.assert_close(online_softmax(x, block_size), torch.softmax(x, dim=-1))


def sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [16, 32])
def test_flash_attention_matches_sdpa(head_dim, causal, backward):
    # T = 48 is not a multiple of the interpreter's blocks (64 query rows, 32 keys): the online
    # softmax runs over a full and a partial key block, through the unmasked and the masked loop.
    q, k, v = (randn(1, 2, 48, head_dim, seed=s) for s in range(3))
    out, grads, do = forward_backward(lambda *t: flash_attention(*t, causal=causal, backward=backward), q, k, v)
    ref_out, ref_grads, _ = forward_backward(lambda *t: sdpa(*t, causal), q, k, v, grad_out=do)
    assert_all_close([out, *grads], [ref_out, *ref_grads])


# The interpreter's blocks: forward and dQ 64 query rows × 32 keys, dK/dV and atomic 32 × 64.
# T = 1 and 17: shorter than any block; 32, 64: exactly one or two blocks; 33, 65: one row past
# a block (a partial block of one row); 100: several query blocks, causal skipping.
@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T", [1, 17, 32, 33, 64, 65, 100])
def test_flash_attention_sequence_lengths(T, causal, backward):
    q, k, v = (randn(2, 1, T, 16, seed=s) for s in range(3))
    out, grads, do = forward_backward(lambda *t: flash_attention(*t, causal=causal, backward=backward), q, k, v)
    ref_out, ref_grads, _ = forward_backward(lambda *t: sdpa(*t, causal), q, k, v, grad_out=do)
    assert_all_close([out, *grads], [ref_out, *ref_grads])


def test_flash_attention_backward_schemes_agree():
    q, k, v = (randn(1, 2, 70, 32, seed=s) for s in range(3))
    results = [forward_backward(lambda *t, b=b: flash_attention(*t, causal=True, backward=b), q, k, v)[:2]
               for b in BACKWARDS]
    (out_a, grads_a), (out_b, grads_b) = results
    torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)  # one forward kernel for both
    assert_all_close(grads_a, grads_b, atol=1e-6, rtol=1e-5)
    assert DEFAULT_BACKWARD in BACKWARDS
    assert set(autotune_choices()) == {"fwd", "dkdv", "dq", "atomic"}


@pytest.mark.parametrize("scale", [-0.3, 0.0])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_negative_and_zero_scale(scale, causal):
    # The kernels take a scale ≥ 0; a negative one runs as softmax(Q·(−K)ᵀ·|scale|). (PyTorch's
    # CPU SDPA returns NaN for a causal mask with such scales, so the reference is written out.)
    q, k, v = (randn(1, 2, 40, 16, seed=s) for s in range(3))
    mask = causal_mask(40, device=DEVICE) if causal else 0.0

    def reference(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) * scale + mask, dim=-1) @ v

    for backward in BACKWARDS:
        out, grads, do = forward_backward(
            lambda *t: flash_attention(*t, causal=causal, sm_scale=scale, backward=backward), q, k, v)
        ref_out, ref_grads, _ = forward_backward(reference, q, k, v, grad_out=do)
        assert_all_close([out, *grads], [ref_out, *ref_grads])


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_saves_the_log_sum_exp(causal):
    q, k, v = (randn(1, 2, 40, 16, seed=s) for s in range(3))
    out, lse = flash_attention_forward(q, k, v, causal=causal)
    scores = q @ k.transpose(-2, -1) / math.sqrt(16)
    if causal:
        scores = scores + causal_mask(40, device=DEVICE)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, sdpa(q, k, v, causal), atol=1e-5, rtol=1e-4)


def test_flash_attention_scale_and_strided_inputs():
    # (B, T, H, D) transposed to (B, H, T, D) is not contiguous; a custom scale is honoured.
    q, k, v = (randn(1, 33, 2, 32, seed=s).transpose(1, 2) for s in range(3))
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(flash_attention(q, k, v, sm_scale=0.3), expected, atol=1e-5, rtol=1e-4)


def test_flash_attention_16_bit_forward_small():
    q, k, v = (randn(1, 2, 40, 32, seed=s, dtype=torch.bfloat16) for s in range(3))
    expected = sdpa(q.float(), k.float(), v.float(), True)
    torch.testing.assert_close(flash_attention(q, k, v, causal=True).float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_flash_attention_16_bit_backward_small(dtype, backward):
    """Interpreter: 16-bit inputs are upcast on load; gradients come back in the inputs' dtype."""
    q, k, v = (randn(1, 2, 40, 32, seed=s, dtype=dtype) for s in range(3))
    out, grads, do = forward_backward(lambda *t: flash_attention(*t, causal=True, backward=backward), q, k, v)
    ref_out, ref_grads, _ = forward_backward(lambda *t: sdpa(*t, True), q.float(), k.float(), v.float(),
                                             grad_out=do.float())
    for a, b in zip([out, *grads], [ref_out, *ref_grads]):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2)


def test_flash_attention_errors_name_the_fix():
    q = torch.zeros(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim 24 is not supported.*16, 32, 64, 128"):
        z = torch.zeros(1, 2, 8, 24, device=DEVICE)
        flash_attention(z, z, z)
    with pytest.raises(ValueError, match=r"\(batch, heads, seq_len, head_dim\)"):
        flash_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="one shape"):
        flash_attention(q, q[:, :1], q)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        flash_attention(q.double(), q.double(), q.double())
    with pytest.raises(ValueError, match="move all inputs to one device"):
        flash_attention(q, torch.zeros(1, 2, 8, 16, device="meta"), q)
    with pytest.raises(ValueError, match="backward must be one of 'split', 'atomic'"):
        flash_attention(q, q, q, backward="fast")
    assert HEAD_DIMS == (16, 32, 64, 128)


@pytest.mark.skipif(not INTERPRET, reason="a GPU runs the real autotuner")
def test_autotuned_launches_under_the_interpreter(monkeypatch):
    """The GPU's code path (pruning, grids that depend on the chosen blocks, the atomic kernel's
    zeroed dQ between trials, RMSNorm's program count) run here with a stand-in timer."""
    import importlib

    import triton

    fa, rn = (importlib.import_module(f"lmfs.kernels.{m}") for m in ("flash_attention", "rmsnorm"))
    timings = iter(range(1000, 0, -1))  # each candidate "faster" than the one before: the last one wins

    def fake_bench(kernel_call, quantiles):
        kernel_call()
        t = float(next(timings))
        return [t, t, t]

    def autotuned(fn, kernel, table, reset_to_zero=None):
        return fa._autotuned(fn, kernel, table, reset_to_zero, do_bench=fake_bench)

    for name, fn, kernel, table, reset in [("_fwd", fa.attn_fwd, "fwd", fa._FWD_CONFIGS, None),
                                           ("_dkdv", fa._attn_bwd_dkdv, "dkdv", fa._DKDV_CONFIGS, None),
                                           ("_dq", fa._attn_bwd_dq, "dq", fa._DQ_CONFIGS, None),
                                           ("_atomic", fa._attn_bwd_atomic, "atomic", fa._DKDV_CONFIGS, ["DQ"])]:
        monkeypatch.setattr(fa, name, autotuned(fn, kernel, table, reset))
    for name in ("_FWD_BLOCKS", "_DQ_BLOCKS", "_DKDV_BLOCKS", "_ATOMIC_BLOCKS"):
        monkeypatch.setattr(fa, name, {})
    for backward in BACKWARDS:
        q, k, v = (randn(1, 2, 70, 32, seed=s, dtype=torch.bfloat16) for s in range(3))
        fn = lambda *t: fa.flash_attention(*t, causal=True, backward=backward, autotune_candidates=2)  # noqa: E731
        out, grads, do = forward_backward(fn, q, k, v)
        ref_out, ref_grads, _ = forward_backward(lambda *t: sdpa(*t, True), q.float(), k.float(), v.float(),
                                                 grad_out=do.float())
        for a, b in zip([out, *grads], [ref_out, *ref_grads]):
            torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2)
        chosen = {name: getattr(getattr(fa, name), "best_config") for name in ("_fwd", "_dkdv", "_dq", "_atomic")
                  if hasattr(getattr(fa, name), "best_config")}
        assert chosen["_fwd"].kwargs == {"BLOCK_M": 64, "BLOCK_N": 64, "SPLIT": 1}  # the 2nd of 2 candidates, D = 32

    monkeypatch.setattr(rn, "_bwd", triton.autotune(
        [triton.Config({"ROWS": r, "PROGRAMS_PER_SM": p, "STAGES": s}, num_warps=w, num_stages=s)
         for r, w, p, s in rn._BWD_CANDIDATES],
        key=["BLOCK_SIZE", "ROWS_BUCKET"], prune_configs_by={"early_config_prune": rn._bwd_prune},
        do_bench=fake_bench)(rn.rmsnorm_bwd_kernel))
    monkeypatch.setattr(rn, "_BWD_FIXED", {})
    monkeypatch.setattr(rn, "INTERPRET", False)
    monkeypatch.setattr(rn, "sm_count", lambda device: 3)
    x, w = randn(37, 300), 1 + 0.1 * randn(300, seed=1)
    out, grads, dy = forward_backward(lambda a, b: rms_norm(a, b, 1e-5), x, w)
    ref_out, ref_grads, _ = forward_backward(lambda a, b: F.rms_norm(a, (300,), b, eps=1e-5), x, w, grad_out=dy)
    assert_all_close([out, *grads], [ref_out, *ref_grads])
    assert "ROWS=" in rn.backward_choice()


@pytest.mark.skipif(torch.cuda.is_available(), reason="only a machine without a GPU needs the interpreter")
def test_kernels_run_after_triton_was_imported_without_the_interpreter():
    """torch's FLOP counter imports Triton; a learner's kernel imports it before lmfs, without
    TRITON_INTERPRET. lmfs.kernels then imports Triton again for the interpreter, and its kernels
    run on the CPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys, torch\n"
            "from torch.utils.flop_counter import FlopCounterMode\n"
            "import triton.language as tl\n"
            "assert type(tl.sum).__name__ == 'JITFunction'\n"
            "from lmfs.kernels import softmax\n"
            "x = torch.randn(3, 10)\n"
            "torch.testing.assert_close(softmax(x), torch.softmax(x, -1))\n"
            "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@pytest.mark.skipif(not INTERPRET, reason="the CPU is refused only when kernels are compiled for a GPU")
def test_interpreter_refuses_other_devices():
    q = torch.zeros(1, 1, 8, 16, device="meta")
    with pytest.raises(ValueError, match="run on the CPU"):
        flash_attention(q, q, q)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_torch_matches_sdpa(causal):
    q, k, v = (randn(2, 2, 48, 16, seed=s) for s in range(3))
    fn = lambda *t: flash_attention_torch(*t, causal=causal, block_size=16)  # noqa: E731
    out, grads, do = forward_backward(fn, q, k, v)
    ref_out, ref_grads, _ = forward_backward(lambda *t: sdpa(*t, causal), q, k, v, grad_out=do)
    assert_all_close([out, *grads], [ref_out, *ref_grads])


def test_flash_attention_torch_partial_blocks_and_shape_errors():
    q, k, v = (randn(1, 1, 21, 8, seed=s) for s in range(3))  # 21 = 2 blocks of 8 + 5
    torch.testing.assert_close(flash_attention_torch(q, k, v, causal=True, block_size=8), sdpa(q, k, v, True),
                               atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="one shape"):
        flash_attention_torch(q, k[:, :, :3], v)


@pytest.mark.parametrize("function", [FlashAttentionTriton, FlashAttentionTorch])
@pytest.mark.parametrize("is_causal", [False, True])
def test_autograd_functions_take_qkv_causal_and_save_natural_log_sum_exp(function, is_causal):
    """The public Functions: ``apply(q, k, v, is_causal)`` equals SDPA forward and backward, and what
    they save for the backward is O and the log-sum-exp in natural-log units (torch.logsumexp's)."""
    q, k, v = (randn(1, 2, 70, 32, seed=s) for s in range(3))  # 70: a partial block for both
    out, grads, do = forward_backward(lambda *t: function.apply(*t, is_causal), q, k, v)
    ref_out, ref_grads, _ = forward_backward(lambda *t: sdpa(*t, is_causal), q, k, v, grad_out=do)
    assert_all_close([out, *grads], [ref_out, *ref_grads])

    out = function.apply(*(t.clone().requires_grad_() for t in (q, k, v)), is_causal)
    saved_o, saved_lse = out.grad_fn.saved_tensors[-2:]
    scores = q @ k.transpose(-2, -1) / math.sqrt(32) + (causal_mask(70, device=DEVICE) if is_causal else 0.0)
    torch.testing.assert_close(saved_o, out.detach())
    torch.testing.assert_close(saved_lse, torch.logsumexp(scores, dim=-1), atol=1e-5, rtol=1e-5)


def test_autotune_candidates_is_checked():
    q = randn(1, 1, 16, 16)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="autotune_candidates must be a positive int"):
            flash_attention(q, q, q, autotune_candidates=bad)
    # The interpreter uses fixed blocks, so any count gives the same result.
    torch.testing.assert_close(flash_attention(q, q, q, autotune_candidates=1), flash_attention(q, q, q))


def test_lecture06_exercise_checkers_accept_right_and_reject_wrong_answers():
    from lmfs.exercises.lecture06 import check_online_softmax, check_row_logsumexp

    assert check_online_softmax(online_softmax) > 0
    with pytest.raises(AssertionError, match="online softmax: wrong result"):
        # forgets to rescale the running sum when the maximum grows
        def no_rescale(x, block_size):
            m = x.amax(dim=-1, keepdim=True)
            return torch.exp(x - m) / torch.exp(x - m)[..., :block_size].sum(dim=-1, keepdim=True)
        check_online_softmax(no_rescale)
    with pytest.raises(AssertionError, match="online softmax: wrong result"):
        check_online_softmax(lambda x, b: torch.exp(x) / torch.exp(x).sum(dim=-1, keepdim=True))  # overflows

    assert check_row_logsumexp(lambda x: torch.logsumexp(x, dim=-1)) > 0
    with pytest.raises(AssertionError, match="row log-sum-exp: wrong result"):
        check_row_logsumexp(lambda x: torch.log(torch.exp(x).sum(dim=-1)))  # unstable: inf for large logits
    with pytest.raises(AssertionError, match="row log-sum-exp: wrong result"):
        check_row_logsumexp(lambda x: x.amax(dim=-1))  # the maximum alone


# ----------------------------------------------------------------------------------------------
# GPU: real sizes, 16-bit dtypes, autotuned flash attention, the CUDA C++ GeLU


def assert_within_reference_error(ours, lowp, exact, atol=1e-4):
    """``ours`` may be off from the exact result by at most twice what plain PyTorch in the same
    dtype is off (the criterion of the FlashAttention repository), plus a small ``atol``."""
    for a, b, e in zip(ours, lowp, exact):
        err = (a.double() - e).abs().max().item()
        base = (b.double() - e).abs().max().item()
        assert err <= 2 * base + atol, f"error {err:.3g} vs PyTorch's {base:.3g} in the same dtype"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION])
def test_elementwise_and_row_kernels_gpu(dtype):
    x = randn(1000, 3000, dtype=dtype, device="cuda")  # 3000 columns: a masked tail in every row
    w = (1 + 0.1 * randn(3000, seed=1, device="cuda")).to(dtype)
    cases = [(gelu, lambda t: F.gelu(t, approximate="tanh"), (x,)),
             (softmax, lambda t: torch.softmax(t, dim=-1), (x,)),
             (lambda a, b: rms_norm(a, b, 1e-5), lambda a, b: F.rms_norm(a, (3000,), b, eps=1e-5), (x, w))]
    for ours_fn, torch_fn, inputs in cases:
        ours, ours_grads, dy = forward_backward(ours_fn, *inputs)
        lowp, lowp_grads, _ = forward_backward(torch_fn, *inputs, grad_out=dy)
        exact, exact_grads, _ = forward_backward(torch_fn, *(t.double() for t in inputs), grad_out=dy.double())
        assert_within_reference_error([ours, *ours_grads], [lowp, *lowp_grads], [exact, *exact_grads])


@pytest.mark.gpu
@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float16, 64),
                                            (torch.float32, 32)])
def test_flash_attention_gpu(dtype, head_dim, causal, backward):
    B, H, T = 2, 4, 1000  # T not a multiple of any block size
    q, k, v = (randn(B, H, T, head_dim, dtype=dtype, device="cuda", seed=s) for s in range(3))
    mask = causal_mask(T, device="cuda") if causal else None

    def naive(*t):  # written-out attention in the inputs' dtype (lmfs.nn's reference)
        return attention_reference(*t, None if mask is None else mask.to(t[0].dtype))

    def float64_attention(q, k, v):  # the exact answer: the same maths in float64 throughout
        scores = q @ k.transpose(-2, -1) / math.sqrt(head_dim)
        return torch.softmax(scores if mask is None else scores + mask.double(), dim=-1) @ v

    ours, ours_grads, do = forward_backward(lambda *t: flash_attention(*t, causal=causal, backward=backward), q, k, v)
    lowp, lowp_grads, _ = forward_backward(naive, q, k, v, grad_out=do)
    exact, exact_grads, _ = forward_backward(float64_attention, q.double(), k.double(), v.double(),
                                             grad_out=do.double())
    assert_within_reference_error([ours, *ours_grads], [lowp, *lowp_grads], [exact, *exact_grads])


@pytest.mark.gpu
@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])  # 128: the forward splits its 256-row blocks in two tiles
def test_flash_attention_short_and_ragged_gpu(causal, backward, head_dim):
    """Lengths below one block and one row past a block, with the autotuned blocks."""
    for T in (1, 65, 129, 257):
        q, k, v = (randn(2, 3, T, head_dim, dtype=torch.bfloat16, device="cuda", seed=s) for s in range(3))
        ours, ours_grads, do = forward_backward(lambda *t: flash_attention(*t, causal=causal, backward=backward),
                                                q, k, v)
        exact, exact_grads, _ = forward_backward(lambda *t: sdpa(*t, causal), q.double(), k.double(), v.double(),
                                                 grad_out=do.double())
        for a, e in zip([ours, *ours_grads], [exact, *exact_grads]):
            assert (a.double() - e).abs().max().item() < 5e-2, (T, causal, backward)


@pytest.mark.gpu
@pytest.mark.parametrize("n_cols", [64, 1024, 4096, 12288])
def test_rms_norm_row_lengths_gpu(n_cols):
    """Each row length picks its own tile shapes (rows per tile, warps): check a few."""
    x = randn(2000, n_cols, dtype=torch.bfloat16, device="cuda")
    w = (1 + 0.1 * randn(n_cols, seed=1, device="cuda")).to(torch.bfloat16)
    ref = lambda a, b: F.rms_norm(a, (n_cols,), b, eps=1e-5)  # noqa: E731
    ours, ours_grads, dy = forward_backward(lambda a, b: rms_norm(a, b, 1e-5), x, w)
    lowp, lowp_grads, _ = forward_backward(ref, x, w, grad_out=dy)
    exact, exact_grads, _ = forward_backward(ref, x.double(), w.double(), grad_out=dy.double())
    assert_within_reference_error([ours, *ours_grads], [lowp, *lowp_grads], [exact, *exact_grads])


@pytest.mark.gpu
def test_flash_attention_long_sequence_gpu():
    q, k, v = (randn(1, 2, 4096, 128, dtype=torch.bfloat16, device="cuda", seed=s) for s in range(3))
    out, lse = flash_attention_forward(q, k, v, causal=True)
    expected = sdpa(q.float(), k.float(), v.float(), True)
    assert (out.float() - expected).abs().max().item() < 2e-2
    assert torch.isfinite(lse).all()


@pytest.mark.gpu
def test_flash_attention_torch_gpu():
    q, k, v = (randn(2, 2, 300, 64, device="cuda", seed=s) for s in range(3))
    torch.testing.assert_close(flash_attention_torch(q, k, v, causal=True), sdpa(q, k, v, True),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_kernels_refuse_cpu_tensors_on_a_gpu_machine():
    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1 is set: the interpreter accepts CPU tensors")
    with pytest.raises(ValueError, match="run on a CUDA GPU"):
        gelu(torch.zeros(4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_cuda(dtype):
    problem = cuda_toolchain_problem()
    if problem:
        pytest.skip(problem)
    x = randn(3, 1000, 7, dtype=dtype, device="cuda")
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gelu_cuda(x), F.gelu(x, approximate="tanh"), **tol)
