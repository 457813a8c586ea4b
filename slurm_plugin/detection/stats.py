"""Vectorised building blocks of the detector: robust row statistics, EWMA, CUSUM (pure)."""

from __future__ import annotations

import warnings

import numpy as np

from slurm_plugin.detection.params import F64

MAD_TO_SIGMA = 1.4826


def row_median(values: F64) -> F64:
    """Median of each row ignoring NaN; NaN for rows without data (no warning).

    One sort per row (NaN sorts last) and the middle of each row's finite part: several times
    faster than ``np.nanmedian``, which goes through masked arrays for short rows."""
    if values.ndim != 2 or not values.shape[1]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return np.nanmedian(values, axis=1)
    ordered = np.sort(values, axis=1)
    count = values.shape[1] - np.isnan(values).sum(axis=1)
    rows = np.arange(len(values))
    low = np.maximum((count - 1) // 2, 0)
    with np.errstate(invalid="ignore"):  # -inf and +inf in the middle: NaN, as numpy's
        out: F64 = (ordered[rows, low] + ordered[rows, np.maximum(count // 2, 0)]) / 2
    out[count == 0] = np.nan
    return out


def median_last(values: F64) -> F64:
    """The median along the last axis, NaN where that axis holds a NaN (as ``np.median``):
    one sort, several times faster than ``np.median`` on the small groups the detector has."""
    n = values.shape[-1]
    ordered = np.sort(values, axis=-1)  # NaN sorts last
    out: F64 = (ordered[..., (n - 1) // 2] + ordered[..., n // 2]) / 2
    out[np.isnan(ordered[..., -1])] = np.nan
    return out


def row_mad(values: F64) -> F64:
    """Per row, 1.4826 x the median absolute deviation from the row's median (a robust
    standard deviation; NaN ignored, NaN for rows without data)."""
    med = row_median(values)
    return row_median(np.abs(values - med[:, None])) * MAD_TO_SIGMA


def ewma(values: F64, alpha: float, start: float) -> F64:
    """Exponentially weighted mean of a series, row by row, from ``start`` (NaN: take the
    first finite value). NaN inputs keep the previous value. Vectorised, exact."""
    out = np.empty_like(values)
    state = start
    # Blocks are at most a few thousand rows; a closed form with growing weights would
    # overflow for long blocks, so walk in chunks where (1 - alpha)^-n stays finite.
    chunk = 256
    decay = 1.0 - alpha
    for begin in range(0, len(values), chunk):
        part = values[begin : begin + chunk]
        finite = np.isfinite(part)
        if not np.isfinite(state):
            if not finite.any():
                out[begin : begin + chunk] = np.nan
                continue
            first = int(np.argmax(finite))
            state = float(part[first])
        filled = np.where(finite, part, np.nan)
        n = len(part)
        idx = np.arange(1, n + 1, dtype=np.float64)
        weights = decay ** (-idx)
        # x_t = d^t s0 + a * sum_{j<=t} d^(t-j) v_j ; NaN steps: v_j := x_{j-1} (no change).
        # Handle NaN by a forward pass only where needed (rare): fall back to a loop.
        if not finite.all():
            res = np.empty(n)
            s = state
            for i in range(n):
                if finite[i]:
                    s = s + alpha * (filled[i] - s)
                res[i] = s
        else:
            cum = np.cumsum(weights * part)
            res = decay**idx * (state + alpha * cum)
        out[begin : begin + chunk] = res
        state = float(res[-1])
    return out


def envelope(values: F64, decay: float, start: float) -> F64:
    """The running upper envelope of a series: each value or the previous envelope times
    ``decay``, whichever is larger, from ``start`` (NaN: none yet). NaN inputs only decay."""
    out = np.empty_like(values)
    state = start if np.isfinite(start) else 0.0
    for i, value in enumerate(values.tolist()):
        state *= decay
        state = max(state, value)
        out[i] = state
    return out


def ewma_columns(values: F64, alpha: float, start: F64) -> F64:
    """:func:`ewma` of every column (rows x columns) from ``start`` (per column; NaN: take
    the column's first finite value). NaN inputs keep the previous value."""
    out = np.empty_like(values)
    state = np.array(start, dtype=np.float64, copy=True)
    for row in range(len(values)):
        value = values[row]
        finite = np.isfinite(value)
        fresh = finite & ~np.isfinite(state)
        state[fresh] = value[fresh]
        state = np.where(finite, state + alpha * (value - state), state)
        out[row] = state
    return out


def cusum(increments: F64, start: F64, cap: F64 | None = None) -> F64:
    """One-sided CUSUM S_t = max(0, S_{t-1} + Y_t) of every column, vectorised over time.

    With W_t = S_0 + Y_1 + ... + Y_t: S_t = W_t - min(0, min_{j<=t} W_j). With ``cap``
    (broadcast to the rows x columns of ``increments``) S_t = min(cap_t, ...): a chart that
    stayed over its threshold for a long time falls back under it within a few steps of the
    end of the shift, instead of carrying the whole past. Only the columns that reach their
    cap are run step by step.
    """
    walk = np.cumsum(increments, axis=0)
    walk += start[None, :]
    lowest = np.minimum.accumulate(walk, axis=0)
    np.minimum(lowest, 0.0, out=lowest)
    s = np.subtract(walk, lowest, out=walk)
    if cap is None or not len(s):
        return s
    top = np.broadcast_to(cap, s.shape)
    over = np.flatnonzero((s > top).any(axis=0))
    if len(over):
        inc, top = increments[:, over], top[:, over]
        value = start[over]
        for row in range(len(s)):
            value = np.clip(value + inc[row], 0.0, top[row])
            s[row, over] = value
    return s
