"""llama.cpp's reference K-quant quantizers in numpy, byte for byte: Q4_K, Q5_K and Q6_K files without llama.cpp.

A port of ggml-quants.c's ``quantize_row_q4_K_ref``, ``quantize_row_q5_K_ref`` and ``quantize_row_q6_K_ref``
with their helpers ``make_qkx2_quants``, ``make_qx_quants`` and ``nearest_int``: what ``llama-quantize`` runs
for these types without an imatrix. gguf-py dequantizes these types but has no quantizer for them.

Bit-exactness rests on doing every float32 operation the C does, in its order: each product and sum is
rounded to float32 as it is made, and the C's running sums over a sub-block's 16 or 32 values are summed
in that order (``_running_sum``; numpy's own ``sum`` is pairwise, a different rounding). ggml-quants.c
is built without ``-march`` flags (ggml-base, not the CPU backend), so no multiply-add is fused.
Vectorized over sub-blocks (values along axis 0, sub-blocks along axis 1), a few thousand at a time
so that the working set stays in cache.
"""

from __future__ import annotations

import gguf
import numpy as np

QK_K = 256
F32 = np.float32
CHUNK_BLOCKS = 512  # super-blocks a pass: [32, 4096] float32 arrays of 512 KiB
Q4_K, Q5_K, Q6_K = (gguf.GGMLQuantizationType[name] for name in ("Q4_K", "Q5_K", "Q6_K"))


def nearest_int(value: np.ndarray) -> np.ndarray:
    """ggml's round-to-nearest-even by the float trick (int32), defined where |value| < 2^22 as in C."""
    shifted = (value.astype(F32) + F32(12582912.0)).view(np.int32)
    return (shifted & 0x7FFFFF) - 0x400000


def _rint_clip(value: np.ndarray, low: int, high: int) -> np.ndarray:
    """``MAX(low, MIN(high, nearest_int(value)))`` as float32, in place: rounding commutes with clipping to integers."""
    np.maximum(value, F32(low), out=value)
    np.minimum(value, F32(high), out=value)
    return np.rint(value, out=value)


def _running_sum(values: np.ndarray) -> np.ndarray:
    """Sum over axis 0 in order, rounding after each add, as a C loop ``s += v[i]`` does.

    numpy sums pairwise only along the contiguous axis; over axis 0 of a C-contiguous array it adds row
    after row (tests/test_kquants_port.py checks this against an explicit loop)."""
    total: np.ndarray = np.add.reduce(values, axis=0)
    return total


def _levels(x: np.ndarray, low: np.ndarray, iscale: np.ndarray, nmax: int, out: np.ndarray) -> np.ndarray:
    """``MAX(0, MIN(nmax, nearest_int(iscale * (x - min))))`` into ``out``."""
    np.subtract(x, low, out=out)
    out *= iscale
    return _rint_clip(out, 0, nmax)


def _weighted_error(
    weights: np.ndarray, x: np.ndarray, scale: np.ndarray, low: np.ndarray, levels: np.ndarray, work: np.ndarray
) -> np.ndarray:
    """The C's ``sum of w * (scale * L + min - x)^2`` in its order, ``work`` a scratch array like ``x``."""
    np.multiply(levels, scale, out=work)
    work += low
    work -= x
    work *= work
    work *= weights
    return _running_sum(work)


def make_qkx2_quants(
    x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scale, the_min, L) per column of ``x`` [n, S]: ggml's weighted search for a scale and a min (min <= 0).

    Each trial scale that lowers the weighted error replaces the scale, the min and the levels; the next
    trials start from the new min, as in C."""
    low = np.minimum(x.min(axis=0), F32(0))
    high = x.max(axis=0)
    flat = high == low
    sum_w, sum_x = _running_sum(weights), _running_sum(weights * x)
    levels, trial, work = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / (high - low)
        scale = F32(1) / iscale
        best_error = _weighted_error(weights, x, scale, low, _levels(x, low, iscale, nmax, levels), work)
        for step in range(nstep + 1):
            _levels(x, low, (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (high - low), nmax, trial)
            weighted = np.multiply(weights, trial, out=work)
            sum_l, sum_l2 = _running_sum(weighted), _running_sum(np.multiply(weighted, trial, out=work))
            sum_xl = _running_sum(np.multiply(np.multiply(weights, trial, out=work), x, out=work))
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            clamped = this_min > 0
            this_min = np.where(clamped, F32(0), this_min)
            this_scale = np.where(clamped, sum_xl / sum_l2, this_scale)
            error = _weighted_error(weights, x, this_scale, this_min, trial, work)
            better = (det > 0) & (error < best_error)
            np.copyto(levels, trial, where=better)
            best_error = np.where(better, error, best_error)
            scale, low = np.where(better, this_scale, scale), np.where(better, this_min, low)
    scale = np.where(flat, F32(0), scale)
    return scale, -low, np.where(flat, F32(0), levels)


def make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale, L + nmax) per column of ``x`` [n, S]: ggml's ``make_qx_quants(n, nmax, x, L, 1, NULL)``."""
    columns = np.arange(x.shape[1])
    peak = x[np.argmax(np.abs(x), axis=0), columns]  # the first value of largest magnitude, signed
    zero = np.abs(peak) < F32(1e-15)
    weights = x * x
    weighted_x = weights * x

    def trial(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        levels = _rint_clip(iscale * x, -nmax, nmax - 1)
        return levels, _running_sum(weighted_x * levels), _running_sum(weights * levels * levels)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        levels, sum_lx, sum_l2 = trial(F32(-nmax) / peak)
        scale = np.where(sum_l2 != 0, sum_lx / sum_l2, F32(0))
        best = scale * sum_lx
        for step in (*range(-9, 0), *range(1, 10)):
            candidate, sum_lx, sum_l2 = trial(-(F32(nmax) + F32(0.1) * F32(step)) / peak)
            better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
            levels = np.where(better, candidate, levels)
            scale = np.where(better, sum_lx / sum_l2, scale)
            best = np.where(better, scale * sum_lx, best)
    return np.where(zero, F32(0), scale), np.where(zero, F32(0), levels + F32(nmax))


def _columns(blocks: np.ndarray, width: int) -> np.ndarray:
    """Super-blocks [nb, 256] as sub-block columns [width, nb * 256 / width] (values along axis 0)."""
    return np.ascontiguousarray(blocks.reshape(-1, width).T)


def _blocks(columns: np.ndarray, nb: int) -> np.ndarray:
    return columns.T.reshape(nb, QK_K)


def _fp16(value: np.ndarray) -> np.ndarray:
    return value.astype(np.float16)


def _pack_scales_mins(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """The 12 bytes of 8 six-bit scales and mins (ggml's K_SCALE_SIZE layout; get_scale_min_k4 reads it)."""
    packed = np.empty((ls.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return packed


def _six_bit(values: np.ndarray, peak: np.ndarray) -> np.ndarray:
    """``MIN(63, (uint8_t)nearest_int(inv * v))`` with ``inv = 63 / peak`` (0 where peak is not positive)."""
    with np.errstate(divide="ignore"):
        inverse = np.where(peak > 0, F32(63) / peak, F32(0))
    return np.minimum(nearest_int(inverse[:, None] * values) & 0xFF, 63).astype(np.uint8)


def _quantize_k_levels(blocks: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple[np.ndarray, ...]:
    """Q4_K / Q5_K's shared part: (d, dmin as float16 [nb], 12 scale bytes [nb, 12], levels uint8 [nb, 256])."""
    nb = blocks.shape[0]
    x = _columns(blocks, 32)
    av_x = np.sqrt(_running_sum(x * x) / F32(32))
    scales, mins, levels = make_qkx2_quants(x, av_x + np.abs(x), nmax, rmin, rdelta, nstep)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale, max_min = np.maximum(scales.max(axis=1), F32(0)), np.maximum(mins.max(axis=1), F32(0))
    ls, lm = _six_bit(scales, max_scale), _six_bit(mins, max_min)
    d, dmin = _fp16(max_scale / F32(63)), _fp16(max_min / F32(63))
    # Requantized against the scales as stored; a sub-block whose stored scale is 0 keeps its first levels.
    sub_d = (d.astype(F32)[:, None] * ls.astype(F32)).reshape(-1)
    sub_m = (dmin.astype(F32)[:, None] * lm.astype(F32)).reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        requantized = np.clip(nearest_int((x + sub_m) / sub_d), 0, nmax).astype(F32)
    levels = np.where(sub_d != 0, requantized, levels)
    return d, dmin, _pack_scales_mins(ls, lm), _blocks(levels, nb).astype(np.uint8)


def _pairs(levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Levels [nb, 256] as the (low, high) halves of each 64: value j and j + 32 share a byte."""
    quads = levels.reshape(-1, 4, 2, 32)
    return quads[:, :, 0, :], quads[:, :, 1, :]


def quantize_q4_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """``quantize_row_q4_K_ref``: float32 [nb, 256] -> block_q4_K bytes [nb, 144] (d, dmin, scales, qs)."""
    d, dmin, scales, levels = _quantize_k_levels(blocks, 15, -1.0, 0.1, 20)
    low, high = _pairs(levels)
    qs = (low | (high << 4)).reshape(-1, 128)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1)


def quantize_q5_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """``quantize_row_q5_K_ref``: float32 [nb, 256] -> block_q5_K bytes [nb, 176] (d, dmin, scales, qh, qs)."""
    d, dmin, scales, levels = _quantize_k_levels(blocks, 31, -0.5, 0.1, 15)
    low, high = _pairs(levels)
    qs = ((low & 0xF) | ((high & 0xF) << 4)).reshape(-1, 128)
    shifts = 2 * np.arange(4, dtype=np.uint8)[None, :, None]
    qh = np.bitwise_or.reduce(((low >> 4) << shifts) | ((high >> 4) << (shifts + 1)), axis=1).astype(np.uint8)
    head = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales]
    return np.concatenate([*head, qh, qs], axis=1)


def quantize_q6_k_blocks(blocks: np.ndarray) -> np.ndarray:
    """``quantize_row_q6_K_ref``: float32 [nb, 256] -> block_q6_K bytes [nb, 210] (ql, qh, scales, d)."""
    nb = blocks.shape[0]
    x = _columns(blocks, 16)
    scales, levels = make_qx_quants_rmse1(x, 32)
    scales = scales.reshape(nb, 16)
    first_peak = np.argmax(np.abs(scales), axis=1)
    max_scale = scales[np.arange(nb), first_peak]
    zero = np.abs(max_scale) < F32(1e-15)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(-128) / max_scale
        d = _fp16(F32(1) / iscale)
        q_scales = np.minimum(nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
        sub_d = (d.astype(F32)[:, None] * q_scales.astype(F32)).reshape(-1)
        requantized = (np.clip(nearest_int(x / sub_d), -32, 31) + 32).astype(F32)
    levels = _blocks(np.where(sub_d != 0, requantized, levels), nb).astype(np.uint8).reshape(nb, 2, 4, 32)
    ql = np.concatenate(
        [levels[:, :, 0] & 0xF | (levels[:, :, 2] & 0xF) << 4, levels[:, :, 1] & 0xF | (levels[:, :, 3] & 0xF) << 4],
        axis=2,
    ).reshape(nb, 128)
    shifts = 2 * np.arange(4, dtype=np.uint8)[None, None, :, None]
    qh = np.bitwise_or.reduce((levels >> 4) << shifts, axis=2).astype(np.uint8).reshape(nb, 64)
    out = np.concatenate([ql, qh, q_scales.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    out[zero] = 0
    return out


BLOCK_QUANTIZERS = {Q4_K: quantize_q4_k_blocks, Q5_K: quantize_q5_k_blocks, Q6_K: quantize_q6_k_blocks}


def quantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """float rows [..., K] as ``qtype`` bytes [..., K / 256 * block bytes]; gguf-py's quantize for other types."""
    if qtype not in BLOCK_QUANTIZERS:
        return gguf.quants.quantize(data, qtype)
    rows = np.asarray(data, dtype=F32)
    if rows.shape[-1] % QK_K:
        raise ValueError(f"{qtype.name} rows need a multiple of {QK_K} values, not {rows.shape[-1]}")
    blocks = rows.reshape(-1, QK_K)
    parts = [BLOCK_QUANTIZERS[qtype](blocks[i : i + CHUNK_BLOCKS]) for i in range(0, len(blocks), CHUNK_BLOCKS)]
    return np.concatenate(parts).reshape(gguf.quants.quant_shape_to_byte_shape(rows.shape, qtype))
