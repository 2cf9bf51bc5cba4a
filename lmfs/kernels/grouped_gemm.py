"""Grouped matrix multiplication in Triton: the expert feed-forwards of a mixture of experts.

    y[rows of group e] = x[rows of group e] · w[e]        x: (N, K), w: (E, K, M), y: (N, M)

After routing, a mixture-of-experts layer sorts its (token, expert) pairs by expert, so the rows
of ``x`` come in E consecutive groups of ``group_sizes[e]`` rows (some of them empty), and every
group is multiplied by its own weight matrix. A loop over experts launches E small matmuls, each
too small to fill a GPU, with a Python round trip between them. Here one launch does them all:

* **Tiles of all groups in one grid.** Group e is cut into ``ceil(size_e / BLOCK_M)`` row tiles;
  the grid has one program per (row tile, column tile), the column tiles of one row tile next
  to each other (so they run together and share its rows through L2). A program finds its group
  from the tile offsets ``cumsum(ceil(size / BLOCK_M))``: its group is the number of groups whose
  tiles all come before its own tile. The offsets are computed inside the kernel from the E group sizes
  (a vector of E numbers, one ``tl.cumsum``), because the autotuner picks ``BLOCK_M`` per shape and
  a map computed beforehand would have to be redone for every candidate.
* **Ragged ends.** A group's last tile usually holds fewer than ``BLOCK_M`` rows; the rows past
  its end belong to the next group, so its loads and stores are masked there. The grid is sized
  for the most tiles E groups of N rows can need, ``(N + E·(BLOCK_M − 1)) // BLOCK_M``, without
  reading the sizes back to the host (which would wait for the GPU); programs past the last tile
  return at once.
* **fp32 accumulation.** Each program accumulates its (BLOCK_M, BLOCK_N) tile in float32 over
  K in steps of ``BLOCK_K``; 16-bit operands go to the tensor cores as they are.

The backward of ``y = x·w[e]`` per group needs two products:

    dx[rows of e] = dy[rows of e] · w[e]ᵀ   the same kernel, with w's strides swapped (no copy)
    dw[e]        = x[rows of e]ᵀ · dy[rows of e]    a second kernel, one program per
                   (group, K tile, M tile), looping over that group's rows

An empty group gets ``dw[e] = 0``. :func:`grouped_matmul_reference` (a loop of PyTorch matmuls)
checks both, and :func:`torch_grouped_matmul` calls PyTorch's own grouped matmul, the peer in
``python -m lmfs.benchmarks moe``.

>>> x, w, sizes = torch.randn(7, 20), torch.randn(3, 20, 5), torch.tensor([2, 0, 5])
>>> torch.allclose(grouped_matmul(x, w, sizes), grouped_matmul_reference(x, w, sizes), atol=1e-4)
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lmfs.kernels._triton import INTERPRET, autotune_bench, check_tensors, config_str, n_candidates, tl, triton


@triton.jit
def _find_tile(offsets_ptr, tile, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """``(group, first row, end row)`` of row tile ``tile``; ``group == E`` past the last tile.

    ``offsets`` holds the E + 1 group boundaries (0, size_0, size_0 + size_1, ..., N)."""
    groups = tl.arange(0, BLOCK_E)
    real = groups < E
    starts = tl.load(offsets_ptr + groups, mask=real, other=0)
    ends = tl.load(offsets_ptr + groups + 1, mask=real, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M  # row tiles per group (0 for empty ones)
    tile_ends = tl.cumsum(tiles, axis=0)  # the tile offsets: group g owns [tile_ends[g] − tiles[g], tile_ends[g])
    group = tl.sum((real & (tile_ends <= tile)).to(tl.int32), axis=0)
    this = groups == group  # picks the group's entries out of the vectors
    first_tile = tl.sum(tl.where(this, tile_ends - tiles, 0), axis=0)
    start = tl.sum(tl.where(this, starts, 0), axis=0) + (tile - first_tile) * BLOCK_M
    end = tl.sum(tl.where(this, ends, 0), axis=0)
    return group, start, end


@triton.jit
def _tile_coords(offsets_ptr, E, M, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output tile: ``(group, rows, row_ok, cols, col_ok)``, rows (BLOCK_M,) of the
    grouped rows, cols (BLOCK_N,) of the M output columns, masked past their ends (a group's last
    tile is ragged: later rows belong to the next group). ``group == E``: this program has no tile
    (the grid is sized for the worst case).

    The grid is one-dimensional with the column tile varying fastest: a GPU starts programs in
    order of their id, so the ``cdiv(M, BLOCK_N)`` programs that share one row tile run at the
    same time and all but the first find its A rows in L2. (Row tiles first, the A operand, far
    larger than a group's weights, would come from memory once per column tile.)"""
    n_col_tiles = tl.cdiv(M, BLOCK_N)
    tile = tl.program_id(0) // n_col_tiles
    group, start, end = _find_tile(offsets_ptr, tile, E, BLOCK_M, BLOCK_E)
    rows = start + tl.arange(0, BLOCK_M)
    cols = (tl.program_id(0) % n_col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    return group, rows, rows < end, cols, cols < M


@triton.jit
def _tile_product(acc, a_ptr, a_rows, row_ok, stride_a, b_ptr, stride_bk, stride_bm, cols, col_ok, K,
                  UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc + a[a_rows, :K] · b[:K, cols]``: the K loop of one output tile, ``BLOCK_K`` at a time.

    ``a`` has unit column stride and row stride ``stride_a``; ``a_rows`` (BLOCK_M,) are the rows
    the tile reads, in any order (a gather costs nothing extra here); ``b`` is read through its
    strides, so a transposed view works. Masked rows and columns read zeros."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_a + ks[None, :]  # int64: rows·K may exceed 2^31
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bm
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0  # the last K step is partial when BLOCK_K does not divide K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter gets 16-bit arithmetic wrong; a GPU keeps 16-bit dot operands
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit(do_not_specialize=["N", "ROWS_BUCKET", "N_CANDIDATES"])
def grouped_matmul_kernel(x_ptr, w_ptr, y_ptr, offsets_ptr, N, K, M, E, stride_we, stride_wk, stride_wm,
                          ROWS_BUCKET, N_CANDIDATES, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of ``y = x[group rows] · w[group]``. ``x`` is (N, K) and ``y``
    (N, M), both contiguous; ``w`` is read through its strides, so a transposed view works.
    ``N``, ``ROWS_BUCKET`` and ``N_CANDIDATES`` only feed the autotuner's key and pruning."""
    group, rows, row_ok, cols, col_ok = _tile_coords(offsets_ptr, E, M, BLOCK_E, BLOCK_M, BLOCK_N)
    if group >= E:
        return
    acc = _tile_product(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), x_ptr, rows, row_ok, K,
                        w_ptr + group.to(tl.int64) * stride_we, stride_wk, stride_wm, cols, col_ok, K,
                        UPCAST, PRECISION, BLOCK_K)
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * M + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["ROWS_BUCKET", "N_CANDIDATES"])
def grouped_matmul_dw_kernel(x_ptr, dy_ptr, dw_ptr, offsets_ptr, x_rows_ptr, dy_rows_ptr, K, M, ROWS_BUCKET,
                             N_CANDIDATES, GATHER_X: tl.constexpr, GATHER_DY: tl.constexpr, UPCAST: tl.constexpr,
                             PRECISION: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_R: tl.constexpr):
    """One (BLOCK_K, BLOCK_N) tile of ``dw[e] = x[rows of e]ᵀ · dy[rows of e]``: a sum over the
    group's rows, ``BLOCK_R`` at a time. x: (N, K), dy: (N, M), dw: (E, K, M), contiguous.
    With ``GATHER_X``, row ``r`` of the product reads row ``x_rows[r]`` of x (x then has any
    number of rows), and with ``GATHER_DY`` row ``dy_rows[r]`` of dy: the gathered copies a
    mixture of experts would otherwise write (of its input, and of its output's gradient) never are."""
    group = tl.program_id(2)
    start = tl.load(offsets_ptr + group)
    end = tl.load(offsets_ptr + group + 1)
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < M
    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)  # stays zero for an empty group
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < end
        x_rows = rows
        dy_rows = rows
        if GATHER_X:
            x_rows = tl.load(x_rows_ptr + rows, mask=row_ok, other=0)
        if GATHER_DY:
            dy_rows = tl.load(dy_rows_ptr + rows, mask=row_ok, other=0)
        # x's tile is loaded transposed, (BLOCK_K, BLOCK_R), so that the product needs no tl.trans.
        xt = tl.load(x_ptr + x_rows.to(tl.int64)[None, :] * K + ks[:, None], mask=k_ok[:, None] & row_ok[None, :],
                     other=0.0)
        dy = tl.load(dy_ptr + dy_rows.to(tl.int64)[:, None] * M + cols[None, :],
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            xt, dy = xt.to(tl.float32), dy.to(tl.float32)
        acc = tl.dot(xt, dy, acc, input_precision=PRECISION)
    dw_ptrs = dw_ptr + group.to(tl.int64) * K * M + ks[:, None] * M + cols[None, :]
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])


# Autotuning candidates on a GPU, the likeliest first (``autotune_candidates=n`` tries the first n):
# (first block, second block, third block, warps, stages), i.e. (BLOCK_M, BLOCK_N, BLOCK_K) for
# the forward kernel and (BLOCK_K, BLOCK_N, BLOCK_R) for dw. 128 × 128 tiles with 64-deep K steps
# are the usual Hopper choice for 16-bit matmuls of this size (two warp groups, three or four
# stages in flight); smaller tiles help when groups are small (fewer wasted rows in ragged tiles)
# or the output is narrow. float32 operands take twice the shared memory per element.
_FWD_CONFIGS = {
    "16-bit": [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
               (128, 64, 64, 4, 4), (64, 64, 64, 4, 4)],
    "fp32": [(64, 64, 32, 4, 3), (128, 64, 32, 8, 3), (64, 128, 32, 4, 3)],
}
_DW_CONFIGS = {
    "16-bit": [(128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
               (64, 64, 64, 4, 4)],
    "fp32": [(64, 64, 32, 4, 3), (128, 64, 32, 8, 3)],
}


def _config(row: tuple, names: tuple[str, str, str]) -> "triton.Config":
    return triton.Config(dict(zip(names, row[:3])), num_warps=row[3], num_stages=row[4])


def _autotuned(kernel_fn, table: dict, names: tuple[str, str, str], dtype_arg: str,
               reset_to_zero: list[str] | None = None):
    """``kernel_fn`` autotuned over the rows of ``table`` for the operands' dtype (the first
    ``N_CANDIDATES`` of them, or all for 0). ``reset_to_zero`` names outputs that must start at
    zero: the autotuner zeroes them before each candidate's runs and before the real launch."""
    configs = {row: _config(row, names) for group in table.values() for row in group}

    def prune(_, named_args, **kwargs):
        args = {**named_args, **kwargs}
        rows = table["fp32" if args[dtype_arg].dtype == torch.float32 else "16-bit"]
        return [configs[row] for row in rows[:args["N_CANDIDATES"] or None]]

    return triton.autotune(list(configs.values()), key=["K", "M", "ROWS_BUCKET", "N_CANDIDATES"],
                           prune_configs_by={"early_config_prune": prune}, reset_to_zero=reset_to_zero,
                           do_bench=autotune_bench)(kernel_fn)


_FWD_NAMES, _DW_NAMES = ("BLOCK_M", "BLOCK_N", "BLOCK_K"), ("BLOCK_K", "BLOCK_N", "BLOCK_R")
if INTERPRET:  # the interpreter cannot time anything: fixed, small blocks
    _fwd, _dw = grouped_matmul_kernel, grouped_matmul_dw_kernel
    _FWD_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}
    _DW_BLOCKS = {"BLOCK_K": 16, "BLOCK_N": 16, "BLOCK_R": 16}
else:
    _fwd = _autotuned(grouped_matmul_kernel, _FWD_CONFIGS, _FWD_NAMES, "x_ptr")
    _dw = _autotuned(grouped_matmul_dw_kernel, _DW_CONFIGS, _DW_NAMES, "x_ptr")
    _FWD_BLOCKS = _DW_BLOCKS = {}


def autotune_choices() -> dict[str, str]:
    """Blocks, warps and stages of the latest forward (also used for dx) and dw launches."""
    return {name: config_str(blocks if INTERPRET else getattr(kernel, "best_config", None))
            for name, kernel, blocks in (("fwd", _fwd, _FWD_BLOCKS), ("dw", _dw, _DW_BLOCKS))}


def _precision(dtype: torch.dtype) -> str:
    # fp32 operands: exact fp32 products ("ieee"), not Triton's default TF32 rounding.
    return "ieee" if dtype == torch.float32 else "tf32"


def _rows_bucket(n: int) -> int:
    """The autotuner's row-count key: N rounded up to a power of two (at least 1024), so a new
    number of routed rows costs no new round of timing unless it crosses a power of two."""
    return max(1024, triton.next_power_of_2(max(n, 1)))


def _group_offsets(group_sizes: torch.Tensor) -> torch.Tensor:
    """The E + 1 group boundaries ``(0, s_0, s_0 + s_1, ..., N)`` as int32, on the sizes' device."""
    offsets = torch.zeros(group_sizes.numel() + 1, dtype=torch.int32, device=group_sizes.device)
    offsets[1:] = torch.cumsum(group_sizes, 0)
    return offsets


def _tile_grid(N: int, E: int, M: int):
    """The launch grid of a kernel that walks row tiles of E groups (:func:`_tile_coords`): the most
    row tiles E groups of N rows can need (every group may end in a partial tile) times M's tiles,
    as one dimension."""
    return lambda meta: ((N + E * (meta["BLOCK_M"] - 1)) // meta["BLOCK_M"] * triton.cdiv(M, meta["BLOCK_N"]),)


def _matmul(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, candidates: int) -> torch.Tensor:
    """``y`` (N, M) with ``y[rows of e] = x[rows of e] · w[e]``; ``w`` (E, K, M) may be a strided view."""
    N, K = x.shape
    E, _, M = w.shape
    y = torch.empty(N, M, device=x.device, dtype=x.dtype)
    if N == 0:
        return y
    _fwd[_tile_grid(N, E, M)](x, w, y, offsets, N, K, M, E, *w.stride(), _rows_bucket(N), candidates,
                              UPCAST=INTERPRET, PRECISION=_precision(x.dtype), BLOCK_E=_block_e(E), **_FWD_BLOCKS)
    return y


def _block_e(E: int) -> int:
    """The vector width :func:`_find_tile` reads the E group offsets with."""
    return max(16, triton.next_power_of_2(E))


def _weight_grad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, E: int, candidates: int,
                 rows: torch.Tensor | None = None, dy_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``dw`` (E, K, M) with ``dw[e] = x[rows of e]ᵀ · dy[rows of e]`` (zeros for empty groups).
    With ``rows`` (one index per row of the product), row r of the product reads row ``rows[r]``
    of x; with ``dy_rows``, row ``dy_rows[r]`` of dy."""
    K, M = x.shape[1], dy.shape[1]
    N = dy.shape[0] if dy_rows is None else dy_rows.shape[0]  # rows of the product
    dw = torch.empty(E, K, M, device=x.device, dtype=x.dtype)
    grid = lambda meta: (triton.cdiv(K, meta["BLOCK_K"]), triton.cdiv(M, meta["BLOCK_N"]), E)  # noqa: E731
    _dw[grid](x, dy, dw, offsets, offsets if rows is None else rows, offsets if dy_rows is None else dy_rows, K, M,
              _rows_bucket(N), candidates, GATHER_X=rows is not None, GATHER_DY=dy_rows is not None,
              UPCAST=INTERPRET, PRECISION=_precision(x.dtype), **_DW_BLOCKS)
    return dw


class GroupedMatmul(torch.autograd.Function):
    """``GroupedMatmul.apply(x, w, group_sizes, autotune_candidates)``: :func:`grouped_matmul` as
    an autograd Function. Saves x and w; the backward runs the forward kernel on ``dy`` and
    ``w``'s transposed view for dx, and the dw kernel for dw."""

    @staticmethod
    def forward(ctx, x, w, group_sizes, autotune_candidates=None):
        candidates = n_candidates("grouped_matmul", autotune_candidates)
        x, w = x.contiguous(), w.contiguous()
        offsets = _group_offsets(group_sizes)
        ctx.save_for_backward(x, w, offsets)
        ctx.candidates = candidates
        return _matmul(x, w, offsets, candidates)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _matmul(dy, w.transpose(1, 2), offsets, ctx.candidates) if ctx.needs_input_grad[0] else None
        dw = _weight_grad(x, dy, offsets, w.shape[0], ctx.candidates) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def _check_groups(fn: str, x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Check the shapes; return the group sizes on x's device. The sizes' sum is checked when
    they are on the CPU; on a GPU that check would make the host wait for the GPU."""
    if x.dim() != 2 or w.dim() != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(f"{fn}: expected x (N, K) and w (E, K, M) with one K, got x {tuple(x.shape)} and "
                         f"w {tuple(w.shape)}; flatten the tokens first (x.reshape(-1, K))")
    if not isinstance(group_sizes, torch.Tensor) or group_sizes.dim() != 1 or group_sizes.shape[0] != w.shape[0]:
        shape = tuple(group_sizes.shape) if isinstance(group_sizes, torch.Tensor) else type(group_sizes).__name__
        raise ValueError(f"{fn}: group_sizes must be a 1-D tensor with one entry per group (w.shape[0] = "
                         f"{w.shape[0]}), got {shape}; e.g. torch.bincount(expert_ids, minlength=E)")
    if group_sizes.dtype.is_floating_point or group_sizes.dtype == torch.bool:
        raise TypeError(f"{fn}: group_sizes must hold integers, got {group_sizes.dtype}; use group_sizes.long()")
    if group_sizes.device.type == "cpu":
        if (group_sizes < 0).any() or int(group_sizes.sum()) != x.shape[0]:
            raise ValueError(f"{fn}: group_sizes must be ≥ 0 and sum to the {x.shape[0]} rows of x, got "
                             f"{group_sizes.tolist()} (sum {int(group_sizes.sum())})")
    return group_sizes.to(x.device)


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor,
                   autotune_candidates: int | None = None) -> torch.Tensor:
    """Rows of ``x`` grouped by expert, each group times its expert's matrix, in one Triton launch.

    ``x``: (N, K), rows sorted by group; ``w``: (E, K, M); ``group_sizes``: (E,) integers, rows
    per group, summing to N (zeros allowed). Returns (N, M) in x's dtype, with
    ``y[rows of e] = x[rows of e] · w[e]``; differentiable in x and w (dw by a second Triton
    kernel). Float32, float16 or bfloat16, accumulated in float32; on a CUDA GPU (or the CPU
    under Triton's interpreter). ``autotune_candidates``: on a GPU, how many block-size
    candidates per kernel the autotuner tries, the likeliest first (None: all).
    """
    check_tensors("grouped_matmul", x=x, w=w)
    sizes = _check_groups("grouped_matmul", x, w, group_sizes)
    return GroupedMatmul.apply(x, w, sizes, autotune_candidates)


def grouped_matmul_reference(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """The same product as :func:`grouped_matmul` by a loop of PyTorch matmuls, one per group
    (differentiable, any device): what the kernel is checked against."""
    _check_groups("grouped_matmul_reference", x, w, group_sizes)
    pieces = torch.split(x, [int(s) for s in group_sizes.tolist()])
    return torch.cat([piece @ w[e] for e, piece in enumerate(pieces)], dim=0)


def torch_grouped_mm() -> object | None:
    """PyTorch's grouped matmul (``F.grouped_mm``, or the older private ``torch._grouped_mm``), or
    None when the installed torch has neither."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def torch_grouped_matmul(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_matmul` by PyTorch's own grouped matmul (differentiable).

    Raises ``RuntimeError`` when the installed torch has none. PyTorch's kernel has its own
    limits (at the time of writing: row strides a multiple of 16 bytes, i.e. K and M multiples
    of 8 in 16 bits; bfloat16 on NVIDIA GPUs from sm80), and raises its own errors outside them.
    """
    fn = torch_grouped_mm()
    if fn is None:
        raise RuntimeError(f"torch_grouped_matmul: torch {torch.__version__} has no grouped matmul "
                           "(neither torch.nn.functional.grouped_mm nor torch._grouped_mm); use grouped_matmul")
    sizes = _check_groups("torch_grouped_matmul", x, w, group_sizes)
    return fn(x, w, offs=torch.cumsum(sizes, 0, dtype=torch.int32))


# ----------------------------------------------------------------------------------------------
# The opt-in for lmfs.nn.moe: its experts' grouped matmuls through this kernel


def experts_matmul(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """:func:`grouped_matmul` as :class:`lmfs.nn.moe.Experts` calls it: the weights cast to the
    activations' dtype first, as autocast would cast them for a plain matmul."""
    return grouped_matmul(x, w.to(x.dtype), group_sizes)


def use_triton_experts(model: torch.nn.Module, enabled: bool = True) -> torch.nn.Module:
    """Make every :class:`lmfs.nn.moe.Experts` inside ``model`` (an MoE layer or a whole
    ``TransformerLM``) run its grouped matmuls with this module's Triton kernel, in place; returns
    ``model``. Only the function changes, not the parameters, so the layer computes the same thing
    (checked in tests); ``enabled=False`` goes back to the PyTorch version of :mod:`lmfs.nn.moe`."""
    from lmfs.nn.moe import Experts

    found = 0
    for module in model.modules():
        if isinstance(module, Experts):
            if enabled:
                module.matmul = experts_matmul
            else:
                module.__dict__.pop("matmul", None)  # back to the class's own grouped_matmul
            found += 1
    if not found:
        raise ValueError(f"use_triton_experts: {type(model).__name__} holds no lmfs.nn.moe.Experts "
                         "(build the model with moe_experts > 0)")
    return model
