"""The exercise checkers of lectures 07 and 08 accept a right answer and reject a wrong one."""

import pytest
import torch

from lmfs.exercises.lecture07 import check_all_to_all, check_ring_reduce_scatter
from lmfs.exercises.lecture08 import check_bubble_fraction, check_zero_bytes_per_param, gpipe_timeline


def ring_reduce_scatter(xs, shift=1):
    n = len(xs)
    chunks = [list(x.clone().chunk(n)) for x in xs]
    for step in range(n - 1):
        msgs = [(r, (r - step - shift) % n, chunks[r][(r - step - shift) % n].clone()) for r in range(n)]
        for r, c, data in msgs:
            chunks[(r + 1) % n][c] += data
    return [chunks[r][r] for r in range(n)]


def test_lecture07_checkers():
    assert check_ring_reduce_scatter(ring_reduce_scatter) == 10
    # The lecture's ring as written (shift 0) leaves rank r with chunk r + 1, not chunk r.
    with pytest.raises(AssertionError, match="ring reduce-scatter: wrong result on input 2 ranks"):
        check_ring_reduce_scatter(lambda xs: ring_reduce_scatter(xs, shift=0))
    assert check_all_to_all(lambda xs: [torch.cat([x.chunk(len(xs))[r] for x in xs]) for r in range(len(xs))]) == 10
    with pytest.raises(AssertionError, match="all-to-all: wrong result"):  # rows instead of columns
        check_all_to_all(lambda xs: [x.clone() for x in xs])


def test_lecture08_checkers():
    # The ideal timeline itself: a step of (m + p - 1)(F + B) time units.
    timeline = gpipe_timeline(4, 8)
    assert max(e[3] for t in timeline for e in t) == (8 + 3) * 3
    assert check_bubble_fraction(lambda p, m: (p - 1) / (m + p - 1)) == 20
    with pytest.raises(AssertionError, match="bubble fraction: wrong result on input p=2"):
        check_bubble_fraction(lambda p, m: (p - 1) / m)  # the bubble-to-work ratio, not the fraction
    right = {0: lambda n: 16, 1: lambda n: 8 + 8 / n, 2: lambda n: 4 + 12 / n}
    assert check_zero_bytes_per_param(lambda stage, n: right[stage](n)) == 15
    with pytest.raises(AssertionError, match="stage=2"):
        check_zero_bytes_per_param(lambda stage, n: right[min(stage, 1)](n))  # forgets stage 2's gradients
