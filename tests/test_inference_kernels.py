"""The inference kernels against PyTorch: dequantise-matmul and paged decode attention.

Without a GPU the kernels run in Triton's interpreter, so sizes stay small and include lengths
that are not multiples of the blocks (to exercise the masks). Tests marked ``gpu`` use real sizes
in bfloat16 and the autotuned paths.
"""

import math

import pytest
import torch
from helpers import DEVICE, randn

from lmfs.inference.kv_cache import paged_attention_reference
from lmfs.inference.quantize import dequantize_weight, quantize_weight
from lmfs.kernels.dequant_matmul import dequant_matmul, dequant_matmul_reference
from lmfs.kernels.paged_attention import paged_decode_attention, paged_decode_attention_op

# Tolerances against a float32 reference: the output's rounding to its dtype dominates.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 1e-2), torch.bfloat16: (1e-1, 2e-2)}


# ---------------------------------------------------------------------------------------------
# dequant_matmul


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dequant_matmul_matches_dequantize_then_matmul(bits, symmetric, dtype):
    # M, N, K not multiples of the blocks; K spans several groups of 16.
    M, N, K = 5, 37, 80
    w = randn(N, K, seed=1) * 0.1
    x = randn(M, K, seed=2, dtype=dtype)
    qw = quantize_weight(w, bits=bits, group_size=16, symmetric=symmetric)
    y = dequant_matmul(x, qw)
    assert y.dtype == dtype and y.shape == (M, N)
    reference = x.float() @ dequantize_weight(qw).T
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(y.float(), reference, atol=atol, rtol=rtol)
    # and the module's own PyTorch path agrees with it
    torch.testing.assert_close(dequant_matmul_reference(x.float(), qw), reference)


def test_dequant_matmul_is_not_the_unquantised_product():
    """The kernel really uses the codes: int4 differs from the float weight by the rounding."""
    w, x = randn(32, 64, seed=3), randn(4, 64, seed=4)
    qw = quantize_weight(w, bits=4, group_size=32)
    y = dequant_matmul(x, qw)
    assert (y - x @ w.T).abs().max() > 1e-2
    torch.testing.assert_close(y, x @ dequantize_weight(qw).T, atol=1e-4, rtol=1e-4)


def test_dequant_matmul_errors():
    qw = quantize_weight(randn(8, 32), bits=8, group_size=16)
    with pytest.raises(ValueError, match="expected x"):
        dequant_matmul(randn(3, 16), qw)
    with pytest.raises(TypeError, match="dtype"):
        dequant_matmul(randn(3, 32).to(torch.int32), qw)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("M", [1, 16, 300])
def test_dequant_matmul_gpu(bits, M):
    N, K = 4096, 2048
    w = randn(N, K, seed=5) * 0.02
    x = randn(M, K, seed=6, dtype=torch.bfloat16)
    qw = quantize_weight(w, bits=bits, group_size=128)
    y = dequant_matmul(x, qw, autotune_candidates=3)
    reference = x.float() @ dequantize_weight(qw).T
    torch.testing.assert_close(y.float(), reference, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------
# paged_decode_attention


def paged_cache(seq_lens, block_size, n_kv_heads, head_dim, dtype=torch.float32, seed=0):
    """A pool of KV blocks with each sequence's blocks scattered in a random order over it, and
    the block tables that find them. Returns (k_cache, v_cache, block_tables, seq_lens)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(need)
    num_blocks = sum(need) + 3  # some pool blocks belong to nobody
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = order[used:used + n].int()
        used += n
    k = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, n_kv_heads, head_dim, generator=g)
    return (k.to(DEVICE, dtype), v.to(DEVICE, dtype), tables.to(DEVICE),
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE))


def brute_force_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=None):
    """One sequence, one query head at a time: collect its keys and values block by block from
    the table, then softmax attention in float64."""
    B, n_heads, head_dim = q.shape
    block_size, n_kv_heads = k_cache.shape[1], k_cache.shape[2]
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(B, n_heads, head_dim, dtype=torch.float64)
    for b in range(B):
        n = int(seq_lens[b])
        keys, values = [], []
        for i in range(math.ceil(n / block_size)):
            block = int(block_tables[b, i])
            rows = min(block_size, n - i * block_size)
            keys.append(k_cache[block, :rows].double().cpu())
            values.append(v_cache[block, :rows].double().cpu())
        keys, values = torch.cat(keys), torch.cat(values)  # (n, n_kv_heads, head_dim)
        for h in range(n_heads):
            kv = h // (n_heads // n_kv_heads)
            weights = torch.softmax(keys[:, kv] @ q[b, h].double().cpu() * scale, dim=0)
            out[b, h] = weights @ values[:, kv]
    return out


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (6, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("config", [None, (16, 4, 2)])  # one wide step per sequence; many narrow ones
def test_paged_decode_attention_matches_brute_force(n_heads, n_kv_heads, block_size, config):
    head_dim, seq_lens = 24, [1, 37, 70]  # head_dim not a power of two; lengths spanning 1 to many blocks
    k, v, tables, lens = paged_cache(seq_lens, block_size, n_kv_heads, head_dim)
    q = randn(len(seq_lens), n_heads, head_dim, seed=7)
    out = paged_decode_attention(q, k, v, tables, lens, num_splits=1, config=config)
    expected = brute_force_attention(q, k, v, tables, lens)
    torch.testing.assert_close(out.double().cpu(), expected, atol=1e-5, rtol=1e-5)


def test_paged_decode_attention_scale_and_low_precision():
    k, v, tables, lens = paged_cache([5, 40], 8, 2, 32, dtype=torch.bfloat16, seed=1)
    q = randn(2, 4, 32, seed=8, dtype=torch.bfloat16)
    out = paged_decode_attention(q, k, v, tables, lens, scale=0.5)
    assert out.dtype == torch.bfloat16
    expected = brute_force_attention(q, k, v, tables, lens, scale=0.5)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-2, rtol=2e-2)


def test_paged_decode_attention_matches_the_engine_reference():
    k, v, tables, lens = paged_cache([3, 33], 16, 2, 16, seed=2)
    q = randn(2, 8, 16, seed=9)
    torch.testing.assert_close(paged_decode_attention(q, k, v, tables, lens),
                               paged_attention_reference(q, k, v, tables, lens), atol=1e-5, rtol=1e-5)
    # The operator torch.compile sees (the engine's compiled decode step) computes the same.
    torch.testing.assert_close(paged_decode_attention_op(q, k, v, tables, lens, 0.3),
                               paged_attention_reference(q, k, v, tables, lens, scale=0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (8, 2), (6, 1)])  # MHA, GQA, MQA
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_decode_attention_split_matches_reference(dtype, n_heads, n_kv_heads, block_size):
    """Flash-decoding: the context cut into 2 or 8 pieces merges to the unsplit result. Lengths give
    empty splits (1 token in 8 pieces), uneven ones (37, 70) and whole ones (128)."""
    k, v, tables, lens = paged_cache([1, 37, 70, 128], block_size, n_kv_heads, 24, dtype=dtype, seed=4)
    q = randn(4, n_heads, 24, seed=11, dtype=dtype)
    expected = paged_attention_reference(q, k, v, tables, lens)
    atol, rtol = TOL[dtype]
    for splits, config in ((2, None), (8, None), (2, (16, 4, 2))):  # the last: several steps per split
        out = paged_decode_attention(q, k, v, tables, lens, num_splits=splits, config=config)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (8, 2), (16, 2)])  # MHA, GQA groups of 4 and 8
def test_paged_decode_attention_large_batch_short_context(n_heads, n_kv_heads):
    """Rollout-like: many sequences, each a few tokens to a few blocks long (lengths 1 .. 40, so
    every position of a 16-token block ends some sequence), in a table as wide as a long context
    (unused columns point at block 0); the tile is the one chosen from the shapes."""
    g = torch.Generator().manual_seed(13)
    seq_lens = [1 + i for i in torch.randperm(40, generator=g).tolist()]
    k, v, tables, lens = paged_cache(seq_lens, 16, n_kv_heads, 16, dtype=torch.bfloat16, seed=6)
    tables = torch.cat([tables, torch.zeros(40, 29, dtype=tables.dtype, device=tables.device)], dim=1)  # 32 columns
    q = randn(40, n_heads, 16, seed=14, dtype=torch.bfloat16)
    out = paged_decode_attention(q, k, v, tables, lens)
    expected = paged_attention_reference(q.float(), k.float(), v.float(), tables, lens)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double().cpu(), brute_force_attention(q, k, v, tables, lens), atol=2e-2, rtol=2e-2)


def test_choose_config_depends_on_shapes_only():
    import lmfs.kernels.paged_attention as pa
    assert pa.choose_config(64, 512, 1) == (128, 4, 2)     # rollouts: tiles of 128 tokens of 64 dims
    assert pa.choose_config(128, 4096, 1) == (64, 4, 2)    # 16 KB tiles at head_dim 128 too
    assert pa.choose_config(64, 512, 8) == (64, 4, 2)      # batch 1: a split's 64 tokens, one step
    assert pa.choose_config(64, 40, 8) == (16, 4, 2)       # never under tl.dot's 16
    k, v, tables, lens = paged_cache([5], 4, 1, 8)
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(randn(1, 2, 8), k, v, tables, lens, config=(24, 4, 2))


def test_choose_splits_fills_the_gpu_and_a_zero_length_row_is_zero():
    h200 = torch.device("cuda")
    import lmfs.kernels.paged_attention as pa
    counts = pa.sm_count
    try:
        pa.sm_count = lambda device: 132
        assert pa.choose_splits(1, 8, 2048, h200) == 32        # 8 programs -> 256
        assert pa.choose_splits(1, 8, 256, h200) == 4          # no piece under 64 tokens
        assert pa.choose_splits(64, 8, 2048, h200) == 1        # 512 programs fill 132 SMs already
        assert pa.choose_splits(4, 8, 2048, h200) == 8         # 33 rounded down to a power of two
    finally:
        pa.sm_count = counts
    k, v, tables, _ = paged_cache([9, 9], 4, 2, 16, seed=5)
    lens = torch.tensor([0, 9], dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(randn(2, 4, 16, seed=12), k, v, tables, lens, num_splits=4)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].abs().sum() > 0
    with pytest.raises(ValueError, match="power of two"):
        paged_decode_attention(randn(2, 4, 16), k, v, tables, lens, num_splits=3)


def test_paged_decode_attention_errors():
    k, v, tables, lens = paged_cache([5], 4, 3, 8)
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        paged_decode_attention(randn(1, 4, 8), k, v, tables, lens)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(randn(1, 6, 16), k, v, tables, lens)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(randn(1, 6, 8), k, v, tables, lens[None])


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,n_kv_heads", [(32, 8), (32, 32), (16, 1)])
def test_paged_decode_attention_gpu(n_heads, n_kv_heads):
    seq_lens = [1, 17, 500, 2048, 4000]
    k, v, tables, lens = paged_cache(seq_lens, 16, n_kv_heads, 128, dtype=torch.bfloat16, seed=3)
    q = randn(len(seq_lens), n_heads, 128, seed=10, dtype=torch.bfloat16)
    expected = brute_force_attention(q, k, v, tables, lens)
    for splits, config in ((None, None), (1, None), (16, None), (1, (128, 8, 3)), (4, (16, 4, 4))):
        out = paged_decode_attention(q, k, v, tables, lens, num_splits=splits, config=config)
        torch.testing.assert_close(out.double().cpu(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("n_heads,n_kv_heads", [(8, 8), (32, 8)])  # the rollout model's MHA; the 1B model's GQA
def test_paged_decode_attention_large_batch_gpu(n_heads, n_kv_heads):
    """256 sequences of 1 .. 300 tokens in a 512-token table, head_dim 64: the rollout shape."""
    seq_lens = [1 + (37 * i) % 300 for i in range(256)]
    k, v, tables, lens = paged_cache(seq_lens, 16, n_kv_heads, 64, dtype=torch.bfloat16, seed=15)
    tables = torch.nn.functional.pad(tables, (0, 32 - tables.shape[1]))
    q = randn(256, n_heads, 64, seed=16, dtype=torch.bfloat16)
    expected = paged_attention_reference(q.float(), k.float(), v.float(), tables, lens)
    torch.testing.assert_close(paged_decode_attention(q, k, v, tables, lens).float(), expected, atol=2e-2, rtol=2e-2)
