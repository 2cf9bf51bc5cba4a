"""lmfs.kernels.grouped_gemm against a loop of PyTorch matmuls and PyTorch's own grouped matmul,
and the MoE benchmark harness at its tiny CPU shape.

Without a GPU the kernels run in Triton's interpreter, so sizes stay small. K and M are not
multiples of the blocks (16 under the interpreter), and the groups are ragged: empty ones, one
of a single row, one spanning several row tiles.
"""

import pytest
import torch
from helpers import DEVICE, forward_backward, randn

from lmfs.kernels import grouped_matmul
from lmfs.kernels.grouped_gemm import grouped_matmul_reference, torch_grouped_matmul, torch_grouped_mm

SIZES = [0, 1, 37, 0, 16, 5]  # empty groups (first and inside), one row, several tiles, exactly one tile


def _inputs(sizes, K, M, dtype):
    x = randn(sum(sizes), K, dtype=dtype, seed=0)
    w = randn(len(sizes), K, M, dtype=dtype, seed=1)
    return x, w, torch.tensor(sizes, device=DEVICE)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
@pytest.mark.parametrize("K,M", [(40, 24), (16, 33)])
def test_grouped_matmul_matches_loop_of_matmuls(dtype, tol, K, M):
    x, w, sizes = _inputs(SIZES, K, M, dtype)
    out, (dx, dw), grad_out = forward_backward(lambda a, b: grouped_matmul(a, b, sizes), x, w)
    # The reference computes in float32 from the same (possibly 16-bit) inputs.
    ref, (rdx, rdw), _ = forward_backward(lambda a, b: grouped_matmul_reference(a, b, sizes), x.float(), w.float(),
                                          grad_out=grad_out.float())
    assert out.dtype == dtype and out.shape == (sum(SIZES), M)
    assert dx.dtype == dtype and dw.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(dx.float(), rdx, atol=tol, rtol=tol)
    torch.testing.assert_close(dw.float(), rdw, atol=tol * 4, rtol=tol)  # sums over up to 37 rows
    assert dw[0].abs().max() == 0 and dw[3].abs().max() == 0  # empty groups get no gradient


def test_grouped_matmul_rows_of_each_group_use_its_own_weight():
    """Independent of the reference: with w[e] = (e + 1)·I every row comes back times its group's number."""
    sizes = [3, 0, 18, 1]
    x = randn(sum(sizes), 20)
    w = torch.stack([(e + 1) * torch.eye(20) for e in range(len(sizes))]).to(DEVICE)
    factor = torch.repeat_interleave(torch.arange(1.0, 5.0), torch.tensor(sizes)).to(DEVICE)
    torch.testing.assert_close(grouped_matmul(x, w, torch.tensor(sizes)), x * factor[:, None])


def test_grouped_matmul_all_groups_empty():
    x, w = randn(0, 24), randn(3, 24, 8)
    out, (dx, dw), _ = forward_backward(lambda a, b: grouped_matmul(a, b, torch.tensor([0, 0, 0])), x, w)
    assert out.shape == (0, 8) and dx.shape == (0, 24)
    assert dw.shape == (3, 24, 8) and dw.abs().max() == 0


@pytest.mark.parametrize("gather_x,gather_dy", [(True, False), (False, True), (True, True)])
def test_weight_grad_reads_rows_through_indices(gather_x, gather_dy):
    """``_weight_grad`` with ``rows`` (x read through indices) and ``dy_rows`` (dy read through
    indices, as the fused MoE reads its output's gradient per token) against the loop of matmuls
    on gathered copies; the sources have other row counts than the product, indices repeat."""
    from lmfs.kernels.grouped_gemm import _group_offsets, _weight_grad

    sizes, K, M = [0, 21, 3, 0, 17], 20, 33
    N = sum(sizes)
    g = torch.Generator().manual_seed(2)
    x_rows, dy_rows = torch.randint(7, (N,), generator=g).to(DEVICE), torch.randint(9, (N,), generator=g).to(DEVICE)
    x, dy = randn(7 if gather_x else N, K, seed=3), randn(9 if gather_dy else N, M, seed=4)
    x_full, dy_full = x[x_rows] if gather_x else x, dy[dy_rows] if gather_dy else dy
    offsets = _group_offsets(torch.tensor(sizes, device=DEVICE))
    got = _weight_grad(x, dy, offsets, len(sizes), 0, rows=x_rows if gather_x else None,
                       dy_rows=dy_rows if gather_dy else None)
    want = torch.stack([a.T @ b for a, b in zip(x_full.split(sizes), dy_full.split(sizes))])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_torch_grouped_matmul_peer():
    """PyTorch's grouped matmul where this torch has one (checked against our kernel, forward and
    backward); otherwise the wrapper must say so. Row strides are multiples of 16 bytes, as it needs."""
    x, w, sizes = _inputs(SIZES, 32, 24, torch.float32)
    if torch_grouped_mm() is None:
        with pytest.raises(RuntimeError, match="no grouped matmul"):
            torch_grouped_matmul(x, w, sizes)
        return
    ours, (dx, dw), grad_out = forward_backward(lambda a, b: grouped_matmul(a, b, sizes), x, w)
    theirs, (tdx, tdw), _ = forward_backward(lambda a, b: torch_grouped_matmul(a, b, sizes), x, w, grad_out=grad_out)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dx, tdx, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dw, tdw, atol=1e-4, rtol=1e-4)


def test_grouped_matmul_rejects_bad_input():
    x, w = randn(6, 16), randn(2, 16, 8)
    with pytest.raises(ValueError, match="sum to the 6 rows"):
        grouped_matmul(x, w, torch.tensor([2, 3]))
    with pytest.raises(ValueError, match="one entry per group"):
        grouped_matmul(x, w, torch.tensor([6]))
    with pytest.raises(TypeError, match="integers"):
        grouped_matmul(x, w, torch.tensor([3.0, 3.0]))
    with pytest.raises(ValueError, match="one K"):
        grouped_matmul(x, randn(2, 8, 8), torch.tensor([3, 3]))
    with pytest.raises(TypeError, match="cast them to one dtype"):
        grouped_matmul(x, w.half(), torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="autotune_candidates"):
        grouped_matmul(x, w, torch.tensor([3, 3]), autotune_candidates=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark is a benchmark, not a test")
def test_moe_benchmark_runs_on_cpu(capsys):
    from lmfs.benchmarks.moe import main

    result = main(["--device", "cpu", "--tokens", "16", "--repeats", "1"])
    rows = result["rows"]
    assert {"loop", "lmfs triton", "dense SwiGLU"} <= set(rows)
    assert any(name.startswith("HF ") for name in rows)  # transformers is installed here
    for name, row in rows.items():
        assert row["tokens_per_s"] > 0
        if name != "dense SwiGLU":  # every MoE computes the loop's output from the same weights
            assert row["max_abs_diff"] < 1e-4, name
    assert result["ratios"]["lmfs triton / loop"] > 0
    out = capsys.readouterr().out
    assert "lmfs triton / loop" in out and "TFLOP/s / dense" in out


def test_use_triton_experts_keeps_the_moe_layers_function():
    from lmfs.kernels.grouped_gemm import experts_matmul, use_triton_experts
    from lmfs.nn import TransformerConfig, TransformerLM
    from lmfs.nn.moe import grouped_matmul as torch_path

    config = TransformerConfig(vocab_size=40, context_length=8, d_model=16, n_layers=1, n_heads=2,
                               moe_experts=4, moe_top_k=2, moe_expert_dim=24, moe_dispatch="sorted")
    torch.manual_seed(0)
    model = TransformerLM(config).to(DEVICE)
    idx = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    expected = model(idx, idx)[1]
    expected.backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    experts = model.moe_layers()[0].experts
    assert use_triton_experts(model) is model and experts.matmul is experts_matmul
    loss = model(idx, idx)[1]
    loss.backward()
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip([p.grad for p in model.parameters()], expected_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)

    use_triton_experts(model, enabled=False)
    assert experts.matmul is torch_path
    with pytest.raises(ValueError, match="holds no lmfs.nn.moe.Experts"):
        use_triton_experts(torch.nn.Linear(2, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_grouped_matmul_bf16_at_benchmark_width_on_gpu(path):
    """The compiled, autotuned Triton kernel and the CUDA ``grouped_mm`` path of ``lmfs.nn.moe``
    in bfloat16 at the benchmark's expert width, ragged groups (empty ones included), forward and
    backward, against float32 matmuls per group."""
    from lmfs.nn.moe import grouped_matmul as moe_grouped_matmul

    sizes = [0, 700, 1, 2048, 0, 333, 64, 1000]
    x = randn(sum(sizes), 1024, dtype=torch.bfloat16, seed=0)
    w = randn(len(sizes), 1024, 512, dtype=torch.bfloat16, seed=1) / 32
    sizes = torch.tensor(sizes, device="cuda")
    fn = grouped_matmul if path == "triton" else moe_grouped_matmul
    out, (dx, dw), grad_out = forward_backward(lambda a, b: fn(a, b, sizes), x, w)
    ref, (rdx, rdw), _ = forward_backward(lambda a, b: grouped_matmul_reference(a, b, sizes), x.float(), w.float(),
                                          grad_out=grad_out.float())
    assert out.dtype == torch.bfloat16
    for got, want in ((out, ref), (dx, rdx), (dw, rdw)):
        scale = want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= 2e-2 * scale, path
