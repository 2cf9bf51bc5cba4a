"""Checkers for the exercises of lecture 05 (GPUs).

Each ``check_*`` takes the learner's function, calls it on several cases and compares the result
with :mod:`lmfs.bench.roofline`.
"""

from __future__ import annotations

from collections.abc import Callable

from lmfs.bench.roofline import attainable_flops, tile_waves
from lmfs.exercises import check


def _roofline_seconds(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> float:
    return flops / float(attainable_flops(flops / nbytes, peak_flops, bandwidth))


def check_roofline_time(answer: Callable[[float, float, float, float], float]) -> int:
    """``answer(flops, bytes_moved, peak_flops, bandwidth)``: the least time a kernel can take by the
    roofline, compared with ``flops / attainable_flops(flops / bytes, peak, bandwidth)``
    (:mod:`lmfs.bench.roofline`)."""
    cases = [(2 * 8192**3, 3 * 8192**2 * 2, 989.5e12, 4.8e12),   # a large bf16 matmul: compute-bound
             (2**27, 3 * 2**27 * 2, 989.5e12, 4.8e12),          # x + y in bf16: memory-bound
             (2 * 512**3, 3 * 512**2 * 2, 312e12, 2.039e12),    # a small matmul: memory-bound still
             (1e12, 5e9, 1e14, 5e11)]                           # exactly on the ridge
    return check("roofline_time", answer, _roofline_seconds, cases, rtol=1e-9, atol=0.0)


def check_waves(answer: Callable[[int, int, tuple[int, int], int], tuple[int, float]]) -> int:
    """``answer(M, N, tile, n_sm)``: ``(waves, efficiency)`` of an ``M × N`` matmul output in
    ``tile = (BM, BN)`` tiles on ``n_sm`` SMs (tile and wave quantisation together), compared with
    :func:`lmfs.bench.roofline.tile_waves`."""
    cases = [(1792, 1792, (256, 128), 108), (1793, 1793, (256, 128), 108), (2048, 2048, (256, 128), 132),
             (2112, 2112, (256, 128), 132), (100, 5000, (128, 128), 148), (4096, 4096, (128, 256), 132)]

    def reference(M, N, tile, n_sm):
        tw = tile_waves(M, N, tile, n_sm)
        return tw.waves, tw.efficiency

    return check("waves", answer, reference, cases, rtol=1e-9, atol=0.0)
