"""The roofline model, and the tile/wave-quantisation model behind the "matmul mystery".

**Roofline.** A kernel that does ``F`` FLOPs while moving ``B`` bytes to and from memory has
arithmetic intensity ``I = F / B``. It can go no faster than the compute peak, nor faster than
memory can feed it: attainable FLOP/s = min(peak, I · bandwidth). Below the *ridge point*
``peak / bandwidth`` a kernel is memory-bound (elementwise ops, softmax, norms: I < 1), above it
compute-bound (large matmuls). The datasheet figures are in :mod:`lmfs.hardware`; an H100
SXM's ridge in bf16:

>>> from lmfs.hardware import gpu
>>> h100 = gpu("H100")
>>> round(ridge_point(h100.peak("bf16"), h100.hbm_bandwidth))   # FLOPs per byte
295

**The matmul mystery.** Matmul throughput against size is not smooth: it dips when a size passes
a multiple of the tile. A GPU matmul cuts the (M, N) output into tiles of (BM, BN); each tile is
one thread block on one SM. Two losses:

* *tile quantisation*: the last row and column of tiles hang over the matrix, and their padding is
  computed and thrown away: useful fraction (M·N) / (⌈M/BM⌉·BM · ⌈N/BN⌉·BN);
* *wave quantisation*: the tiles run in waves of ``n_sm`` at a time; a last wave that fills only
  a few SMs leaves the rest idle: useful fraction tiles / (waves · n_sm).

With 256×128 tiles on an A100 (108 SMs), a 1792² output is 7·14 = 98 tiles, one wave at
98/108 = 91 %; at 1793² it is 8·15 = 120 tiles, two waves, 120/216 = 56 % busy, and the extra
tile row and column are mostly padding.

>>> tw = tile_waves(1792, 1792, tile=(256, 128), n_sm=108)
>>> tw.tiles, tw.waves, round(tw.efficiency, 3)
(98, 1, 0.907)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs per byte moved to or from memory."""
    return flops / bytes_moved


def attainable_flops(intensity, peak_flops: float, bandwidth: float):
    """The roofline: min(peak, intensity · bandwidth); ``intensity`` may be an array."""
    return np.minimum(peak_flops, np.asarray(intensity, dtype=float) * bandwidth)


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The intensity where memory stops being the limit: peak / bandwidth (FLOPs per byte)."""
    return peak_flops / bandwidth


def matmul_intensity(m: int, n: int, k: int, bytes_per_element: int = 2) -> float:
    """Intensity of ``(m, k) @ (k, n)`` if each operand is read once and the result written once."""
    return 2 * m * n * k / (bytes_per_element * (m * k + k * n + m * n))


def plot_roofline(peak_flops: float, bandwidth: float, points=(), ax=None, title: str | None = None):
    """Log-log roofline with measured kernels on it; returns the matplotlib Axes.

    ``points``: ``(label, intensity, achieved FLOP/s)`` triples. A point's distance below the roof
    is what that kernel leaves on the table.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        ax = plt.subplots(figsize=(7, 4.5))[1]
    ridge = ridge_point(peak_flops, bandwidth)
    intensities = [p[1] for p in points] + [ridge]
    x = np.logspace(math.log10(min(intensities) / 4), math.log10(max(intensities) * 4), 200)
    ax.loglog(x, attainable_flops(x, peak_flops, bandwidth) / 1e12, "k-", lw=2, label="roofline")
    ax.axvline(ridge, color="gray", ls=":", lw=1)
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak_flops / 1e12), textcoords="offset points",
                xytext=(5, -15), fontsize=8, color="gray")
    for label, intensity, achieved in points:
        ax.loglog(intensity, achieved / 1e12, "o")
        ax.annotate(label, (intensity, achieved / 1e12), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlabel("arithmetic intensity (FLOPs / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title or f"roofline: {peak_flops / 1e12:.0f} TFLOP/s, {bandwidth / 1e12:.2f} TB/s")
    ax.grid(True, which="both", alpha=0.3)
    return ax


@dataclass(frozen=True)
class TileWaves:
    """How an (M, N) matmul output maps onto tiles and waves; see the module doc."""

    tiles: int
    waves: int
    tile_efficiency: float  # useful output / computed output (padding of the edge tiles)
    wave_efficiency: float  # tiles / (waves · n_sm): busy SM-slots over all SM-slots

    @property
    def efficiency(self) -> float:
        """The predicted fraction of peak: both losses together."""
        return self.tile_efficiency * self.wave_efficiency


def tile_waves(M: int, N: int, tile: tuple[int, int] = (256, 128), n_sm: int = 108) -> TileWaves:
    """Tiles, waves and predicted efficiency of an ``M × N`` output in ``tile = (BM, BN)`` tiles.

    >>> tile_waves(1793, 1793, (256, 128), 108).waves      # 8·15 = 120 tiles > 108 SMs
    2
    """
    BM, BN = tile
    if min(M, N, BM, BN, n_sm) < 1:
        raise ValueError(f"tile_waves: sizes, tile and n_sm must be positive, got M={M}, N={N}, "
                         f"tile={tile}, n_sm={n_sm}")
    rows, cols = math.ceil(M / BM), math.ceil(N / BN)
    tiles = rows * cols
    waves = math.ceil(tiles / n_sm)
    return TileWaves(tiles, waves, (M * N) / (rows * BM * cols * BN), tiles / (waves * n_sm))


def predicted_matmul_rate(sizes, peak_flops: float, tile: tuple[int, int] = (256, 128), n_sm: int = 108,
                          bandwidth: float | None = None, bytes_per_element: int = 2) -> np.ndarray:
    """Predicted FLOP/s of square ``n × n × n`` matmuls for each ``n`` in ``sizes``.

    ``peak · efficiency(n)`` from :func:`tile_waves`; with ``bandwidth`` also capped by the
    roofline, which matters for small ``n``. Overlay it on a measured sweep to see the dips line up
    (the real library picks its tile per shape, so expect the pattern rather than exact heights).
    """
    rates = []
    for n in sizes:
        rate = peak_flops * tile_waves(int(n), int(n), tile, n_sm).efficiency
        if bandwidth is not None:
            rate = min(rate, float(attainable_flops(matmul_intensity(n, n, n, bytes_per_element),
                                                    peak_flops, bandwidth)))
        rates.append(rate)
    return np.array(rates)
