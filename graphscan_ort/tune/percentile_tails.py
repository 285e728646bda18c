"""A symmetric Percentile read off each tensor's greatest magnitudes, not a whole histogram.

onnxruntime's symmetric Percentile (its default) bins every magnitude of a tensor over all
samples and takes the edge of the first bin whose cumulative share reaches p (its
``compute_percentile``, a float64 cumsum), clipped to the tensor's extremes, and keeps the
first two bins' counts beside the range. That edge is the one of the bin holding the
magnitude of rank ceil(p N), and the bins above it hold fewer than N (1 - p) + 1 magnitudes,
all among the greatest. So for p at or above TAIL_PERCENTILE one pass over the samples keeps
each tensor's Tail: its greatest magnitudes (a sample's below the least kept so far are
dropped by one comparison, the rest by a partition) and its counts in the first two bins.
From a Tail, for each percentile, tail_histogram makes a histogram whose bins above the
crossing one are counted off the tail and whose rest lies in the crossing bin: onnxruntime's
own ``compute_percentile`` reads the same range and first bins off it as off the whole one.
Where a cumulative count lies within TAIL_MARGIN of p N, too near for that float64 cumsum to
be sure of (a round N, such as 20,000 elements at 99.99), the tensor is counted whole
(calibration.histograms). The tails are kept for the next percentile of the same prepared
model (tune asks for 99.999, then 99.99 and 99.9). At page size (PP-OCRv4 det, 6 pages at
1x3x768x896) this takes the first Percentile calibration from 6.4 s to 3.7 s, the ranges
the same.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import numpy as np

TAIL_PERCENTILE = 99.9  # the lowest percentile read off the tails: tune's least
# How far (a share of the elements) a cumulative count must lie from p N for the crossing bin
# to be the one onnxruntime's float64 cumsum of the histogram finds: its rounding is at most
# about bins * 2**-53 (2.3e-13 for 2,048 bins); nearer, the whole histogram is counted.
TAIL_MARGIN = 1e-9
TAIL_SLACK = 16  # magnitudes a Tail keeps beyond the lowest percentile's need
# A Tail's first sample is cut at a floor read off every GUESS_STRIDE-th magnitude before its
# partition (a partition of the whole sample took 4-5 times the rest of its share at page size).
GUESS_STRIDE = 16


class Tail:
    """One tensor's magnitudes over every sample, as a symmetric Percentile needs them: the
    ``keep`` greatest (descending), and how many lie below the first and the second inner
    edge of its bins (``below``: hist[0] and hist[0] + hist[1])."""

    def __init__(self, keep: int, dtype: np.dtype) -> None:
        self.keep = keep
        self.top = np.empty(0, dtype)
        self.below = [0, 0]

    def floor(self) -> Any:
        """A magnitude no greater one can be below and still be kept (None: not full yet)."""
        return self.top[-1] if len(self.top) >= self.keep else None

    def add(self, part: tuple[np.ndarray, int, int]) -> None:
        """One sample's share (tail_part): its candidates, and its counts below the edges."""
        candidates, first, second = part
        merged = np.concatenate([self.top, candidates])
        if len(merged) > self.keep:
            merged = np.partition(merged, len(merged) - self.keep)[len(merged) - self.keep :]
        self.top = np.sort(merged)[::-1]
        self.below = [self.below[0] + first, self.below[1] + second]


def tail_part(array: np.ndarray, keep: int, floor: Any, edges: np.ndarray) -> tuple[np.ndarray, int, int]:
    """One sample of one tensor for its Tail: the magnitudes that may be among the ``keep``
    greatest (at least ``floor``, the greatest kept so far, when the Tail is full), and how
    many lie below the first and the second inner edge of ``edges``."""
    magnitudes = np.absolute(array.ravel())
    first = int(np.count_nonzero(magnitudes < edges[1]))
    second = int(np.count_nonzero(magnitudes < edges[2]))
    if floor is not None:
        magnitudes = magnitudes[magnitudes >= floor]
    elif len(magnitudes) > keep:  # the Tail's first sample: no floor yet, so one guessed and checked
        magnitudes = at_least_keep_above(magnitudes, keep, guessed_floor(magnitudes, keep))
    if len(magnitudes) > keep:
        magnitudes = np.partition(magnitudes, len(magnitudes) - keep)[len(magnitudes) - keep :]
    return magnitudes.copy(), first, second


def guessed_floor(magnitudes: np.ndarray, keep: int) -> Any:
    """A magnitude about 2 ``keep`` of ``magnitudes`` reach, read off every GUESS_STRIDE-th
    (None where so few are read that a whole partition costs about as much)."""
    sampled = magnitudes[::GUESS_STRIDE]
    rank = 2 * keep // GUESS_STRIDE + 1  # its place among the sampled, from the top
    if 2 * rank > len(sampled):
        return None
    return np.partition(sampled, len(sampled) - rank)[len(sampled) - rank]


def at_least_keep_above(magnitudes: np.ndarray, keep: int, floor: Any) -> np.ndarray:
    """``magnitudes`` at or above ``floor`` where at least ``keep`` are (the ``keep`` greatest
    are then all among them, so a partition of these finds the same), else all of them."""
    if floor is None:
        return magnitudes
    above = magnitudes[magnitudes >= floor]
    return above if len(above) >= keep else magnitudes


def tail_keep(size: int) -> int:
    """How many of a tensor's ``size`` magnitudes a Tail keeps: those from rank ceil(p size)
    up at p = TAIL_PERCENTILE (every higher percentile needs fewer), and TAIL_SLACK more, so
    that the count below the crossing bin is known or far from p size (tail_histogram)."""
    rank = math.ceil(Fraction(TAIL_PERCENTILE / 100.0) * size)
    return min(size, size - rank + 1 + TAIL_SLACK)


def tail_histogram(tail: Tail, index: np.ndarray, size: int, bins: int, percentile: float) -> np.ndarray | None:
    """A histogram over ``bins`` bins of ``size`` magnitudes (``index``: the bin of each of the
    tail's, as np.histogram counts it: calibration.bin_indices) whose Percentile range (onnxruntime's
    ``compute_percentile``: the first bin whose cdf, a float64 cumsum, reaches p) and first
    two bins are the whole one's: hist[0] and hist[1] as counted (Tail.below), every bin above
    the crossing one counted off the tail (its magnitudes are all there), and the rest of the
    elements in the crossing bin. None where the crossing is too near p for the cdf's rounding
    to be sure of (TAIL_MARGIN), or the tail cannot show it: the whole histogram then."""
    p = Fraction(percentile / 100.0)  # onnxruntime's float64 p, exactly
    rank = math.ceil(p * size)  # the first count at or past p N
    wanted = size - rank + 1  # the magnitude of rank ``rank`` is the wanted-th greatest
    if rank < 1 or wanted > len(tail.top):
        return None
    crossing = int(index[wanted - 1])
    histogram = np.zeros(bins, np.intp)
    above = index > crossing  # all of them in the tail: fewer than ``wanted``, each above it
    np.add.at(histogram, index[above], 1)
    first, second = tail.below[0], tail.below[1] - tail.below[0]
    if crossing >= 2:
        histogram[0], histogram[1] = first, second
    elif crossing == 1:
        histogram[0] = first
    counted = int(histogram.sum())
    histogram[crossing] = size - counted
    if histogram[crossing] < 0 or (crossing <= 1 and histogram[:2].tolist() != [first, second]):
        return None
    reached = size - int(above.sum())  # the cumulative count at the crossing bin
    below_bound = size - int(np.count_nonzero(index >= crossing))  # at least the count before it
    if reached - p * size <= TAIL_MARGIN * size or p * size - below_bound <= TAIL_MARGIN * size:
        return None
    return histogram
