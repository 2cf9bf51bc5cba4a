"""Explorers of lectures 05-08: the roofline, a kernel's grid against the SMs, and the cost of
each parallelism strategy."""

from __future__ import annotations

import numpy as np
import ipywidgets as widgets

from lmfs.explore._core import Explorer, View, new_figure, slider, table

GPU_NAMES = ("A100", "H100", "H200", "B200")


# --- 05: the roofline ---------------------------------------------------------------------------

OPERATIONS = ("matmul n×n×n", "matmul batch×n×n (decode)", "elementwise add of n×n")


def roofline_view(operation: str, n: int, batch: int = 1, gpu: str = "H100", dtype: str = "bf16",
                  tile: tuple[int, int] = (256, 128)) -> View:
    """Where ``operation`` at size ``n`` lands on ``gpu``'s roofline (:mod:`lmfs.bench.roofline`).

    A matmul's attainable rate is the roofline's ``min(peak · e, I·bandwidth)`` with ``e`` the tile and wave
    efficiency of its output (:func:`lmfs.bench.roofline.tile_waves` on the GPU's SMs); the
    elementwise add does one FLOP per three elements moved, far left of the ridge.
    """
    from lmfs.bench.roofline import (arithmetic_intensity, attainable_flops, matmul_intensity,
                                     plot_roofline, predicted_matmul_rate, ridge_point, tile_waves)
    from lmfs.hardware import gpu as find_gpu

    if operation not in OPERATIONS:
        raise ValueError(f"operation {operation!r}: use one of {OPERATIONS}")
    if n < 1 or batch < 1:
        raise ValueError(f"n={n} and batch={batch} must be positive")
    device = find_gpu(gpu)
    peak, bw = device.peak(dtype), device.hbm_bandwidth
    size = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}[dtype]
    if operation == "elementwise add of n×n":
        intensity = arithmetic_intensity(n * n, 3 * n * n * size)
        efficiency, waves = 1.0, None
    else:
        m = n if operation == "matmul n×n×n" else batch
        intensity = matmul_intensity(m, n, n, size)
        waves = tile_waves(m, n, tile, device.sm_count)
        efficiency = waves.efficiency
    rate = min(peak * efficiency, float(attainable_flops(intensity, peak, bw)))  # padding costs FLOPs, not bytes
    bound = "memory-bound" if intensity < ridge_point(peak, bw) else "compute-bound"
    fig, (ax, ax2) = new_figure(2, size=(8.5, 3.2))
    plot_roofline(peak, bw, [(f"n={n}", intensity, rate)], ax=ax, title=f"{gpu} {dtype}")
    sizes = np.arange(max(64, n - 512), n + 513, 16)
    ax2.plot(sizes, predicted_matmul_rate(sizes, peak, tile, device.sm_count, bw, size) / 1e12, lw=1)
    ax2.axvline(n, color="C3", lw=1)
    ax2.set(xlabel="n (square matmul)", ylabel="predicted TFLOP/s", title="tile and wave quantisation")
    ax2.grid(alpha=0.3)
    rows = {"arithmetic intensity (FLOP/byte)": intensity, "ridge point": ridge_point(peak, bw),
            "regime": bound, "predicted TFLOP/s": rate / 1e12, "fraction of peak": rate / peak}
    if waves is not None:
        rows.update({f"tiles of {tile[0]}×{tile[1]}": waves.tiles, f"waves on {device.sm_count} SMs": waves.waves,
                     "tile efficiency": waves.tile_efficiency, "wave efficiency": waves.wave_efficiency})
    return View(table(rows), fig, dict(intensity=intensity, rate=rate, bound=bound, efficiency=efficiency))


def explore_roofline(gpu: str = "H100") -> Explorer:
    """Pick an operation and its size: its intensity, its place on the roofline, its waves."""
    controls = {
        "n": slider(1792, 64, 8192, description="n"),
        "operation": widgets.Dropdown(options=OPERATIONS, value=OPERATIONS[0], description="operation"),
        "batch": slider(8, 1, 512, description="batch (decode)"),
        "gpu": widgets.Dropdown(options=GPU_NAMES, value=gpu, description="GPU"),
        "dtype": widgets.Dropdown(options=("bf16", "fp8", "tf32", "fp32"), value="bf16", description="dtype"),
    }
    return Explorer("The roofline", roofline_view, controls)


# --- 06: a kernel's grid against the SMs --------------------------------------------------------

BLOCK_SIZES = (16, 32, 64, 128, 256)


def kernel_grid_view(block_m: int, seq_len: int, batch_heads: int, blocks_per_sm: int = 1, gpu: str = "H100") -> View:
    """A FlashAttention forward's grid, ``cdiv(seq_len, block_m) × batch_heads`` programs, on ``gpu``'s
    SMs: :func:`lmfs.bench.roofline.tile_waves` with 1-wide tiles of ``block_m`` query rows and
    ``sm_count · blocks_per_sm`` program slots. Small blocks fill the SMs but reread K and V once per
    block (``seq_len / block_m`` times); large blocks leave a ragged last wave."""
    from lmfs.bench.roofline import tile_waves
    from lmfs.hardware import gpu as find_gpu

    if min(block_m, seq_len, batch_heads, blocks_per_sm) < 1:
        raise ValueError("block_m, seq_len, batch_heads and blocks_per_sm must be positive")
    slots = find_gpu(gpu).sm_count * blocks_per_sm
    tw = tile_waves(seq_len, batch_heads, (block_m, 1), slots)
    fig, ax = new_figure(size=(6.4, 2.9))
    lengths = np.unique(np.geomspace(256, 32768, 120).astype(int))
    for i, bm in enumerate(BLOCK_SIZES):
        eff = [tile_waves(int(t), batch_heads, (bm, 1), slots).efficiency for t in lengths]
        ax.semilogx(lengths, eff, color=f"C{i}", lw=2.5 if bm == block_m else 0.8, label=f"BLOCK_M={bm}")
    ax.axvline(seq_len, color="k", ls=":", lw=1)
    ax.set(xlabel="sequence length", ylabel="busy fraction of SM slots", ylim=(0, 1.05),
           title=f"{batch_heads} (batch·heads) × cdiv(T, BLOCK_M) programs on {slots} slots")
    ax.legend(fontsize=7, ncol=3)
    rows = {"programs": tw.tiles, "waves": tw.waves, "rows padded (tile efficiency)": tw.tile_efficiency,
            "last wave fill (wave efficiency)": tw.wave_efficiency, "predicted fraction of peak": tw.efficiency,
            "K/V reads per head (T / BLOCK_M)": -(-seq_len // block_m)}
    return View(table(rows), fig, dict(programs=tw.tiles, waves=tw.waves, efficiency=tw.efficiency))


def explore_kernel_grid(gpu: str = "H100") -> Explorer:
    """BLOCK_M of a FlashAttention kernel against its grid's fill of the GPU."""
    controls = {
        "block_m": widgets.SelectionSlider(options=BLOCK_SIZES, value=128, description="BLOCK_M",
                                           continuous_update=False),
        "seq_len": slider(4096, 256, 32768, step=256, description="sequence length"),
        "batch_heads": slider(16, 1, 256, description="batch · heads"),
        "blocks_per_sm": slider(1, 1, 4, description="blocks per SM"),
        "gpu": widgets.Dropdown(options=GPU_NAMES, value=gpu, description="GPU"),
    }
    return Explorer("A kernel's grid on the SMs", kernel_grid_view, controls)


# --- 07-08: the parallelism cost calculator -------------------------------------------------------

def model_presets() -> dict:
    """Named model shapes for the calculator: ``name -> TransformerConfig``."""
    from lmfs.nn import TransformerConfig
    from lmfs.parallel.costs import llama_70b

    return {
        "Llama-3-70B": llama_70b(),
        "Llama-3-8B": TransformerConfig(vocab_size=128256, context_length=8192, d_model=4096, n_layers=32,
                                        n_heads=32, n_kv_heads=8, d_ff=14336, tie_embeddings=False),
        "1B (2048 × 16 layers)": TransformerConfig(vocab_size=32000, context_length=4096, d_model=2048, n_layers=16,
                                                   n_heads=16, tie_embeddings=False),
    }


def parallelism_view(strategy: str, n: int, model: str = "Llama-3-70B", batch_size: int = 16, seq_len: int = 4096,
                     micro_batches: int = 8, n_experts: int | None = None,
                     strategies=("ddp", "zero1", "zero2", "zero3", "tp", "tp+sp", "pp", "cp"),
                     gpu_memory_GB: float = 80.0) -> View:
    """Memory per GPU and bytes sent per GPU per step of every strategy in ``strategies`` at
    degree ``n``, by :func:`lmfs.parallel.costs.strategy_costs`; ``strategy`` is highlighted."""
    from lmfs.parallel.costs import strategy_costs

    presets = model_presets()
    if model not in presets:
        raise ValueError(f"model {model!r}: use one of {list(presets)}")
    if strategy not in strategies:
        raise ValueError(f"strategy {strategy!r} is not among {strategies}")
    config = presets[model]
    costs = {s: strategy_costs(config, s, n, batch_size, seq_len, micro_batches, n_experts) for s in strategies}
    fig, (ax, ax2) = new_figure(2, size=(9, 3.2))
    x = np.arange(len(strategies))
    bottom = np.zeros(len(strategies))
    for i, part in enumerate(("params", "grads", "optimizer", "activations")):
        h = np.array([costs[s][f"{part}_GB"] for s in strategies])
        ax.bar(x, h, bottom=bottom, color=f"C{i}", label=part)
        bottom += h
    ax.axhline(gpu_memory_GB, color="k", ls="--", lw=1, label=f"{gpu_memory_GB:g} GB GPU")
    ax.set(xticks=x, ylabel="GB per GPU", title=f"{model}, n = {n}, batch {batch_size}×{seq_len}")
    ax.set_xticklabels(strategies, fontsize=8)
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    sent = [costs[s]["sent_GB_per_step"] for s in strategies]
    ax2.bar(x, sent, color=["C3" if s == strategy else "0.6" for s in strategies])
    ax2.set(xticks=x, ylabel="GB sent per GPU per step", title="communication", yscale="log")
    ax2.set_xticklabels(strategies, fontsize=8)
    for a in (ax, ax2):
        a.get_xticklabels()[list(strategies).index(strategy)].set_fontweight("bold")
    c = costs[strategy]
    rows = {"strategy": strategy, "memory per GPU": f"{c['total_GB']:.1f} GB"
            + (" (does not fit)" if c["total_GB"] > gpu_memory_GB else ""),
            **{f"  {k}": f"{c[f'{k}_GB']:.2f} GB" for k in ("params", "grads", "optimizer", "activations")},
            "sent per GPU per step": f"{c['sent_GB_per_step']:.2f} GB", "pattern": c["communication"]}
    return View(table(rows), fig, dict(costs=costs))


def explore_parallelism(strategies=("ddp", "zero1", "zero2", "zero3", "tp", "tp+sp", "pp", "cp"),
                        strategy: str = "zero3", model: str = "Llama-3-70B") -> Explorer:
    """Model, GPUs and strategy -> memory per GPU and communication per step (lectures 07-08)."""
    controls = {
        "strategy": widgets.Dropdown(options=strategies, value=strategy, description="strategy"),
        "n": widgets.SelectionSlider(options=[2, 4, 8, 16, 32, 64], value=8, description="GPUs",
                                     continuous_update=False),
        "model": widgets.Dropdown(options=list(model_presets()), value=model, description="model"),
        "batch_size": widgets.SelectionSlider(options=[64, 128, 256, 512], value=128, description="batch",
                                              continuous_update=False),
        "seq_len": widgets.SelectionSlider(options=[1024, 2048, 4096, 8192], value=4096, description="seq_len",
                                           continuous_update=False),
        "micro_batches": widgets.SelectionSlider(options=[1, 2, 4, 8, 16, 32], value=8,
                                                 description="micro-batches (pp)", continuous_update=False),
    }
    return Explorer("Parallelism: memory and communication per GPU", parallelism_view, controls,
                    dict(strategies=tuple(strategies)))
