"""Building blocks of the decoder: RMSNorm, the gated MLP (SwiGLU / GeGLU), rotary embeddings.

Numerics follow HF transformers step for step (norm in float32, rotary tables
in float32 then cast), so our logits match theirs to float rounding.

On CPU, where our kernel library loads, RMSNorm, SwiGLU's silu(gate) * up and (attention.py) the
rotary with the K/V write each run as one fused op (csrc/fused_ops.cpp) that rounds where the torch
ops below round and gives their bits; the torch ops stay for CUDA, no compiler, and as the reference.
"""

from __future__ import annotations

import functools
import math
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model import paged_kernel
from radixserve.model.config import ModelConfig
from radixserve.model.gguf_rows import GGUFRowsLinear
from radixserve.model.quant import Int8Linear
from radixserve.model.quant_blocks import BlockLinear

M = TypeVar("M", bound=nn.Module)

# Tests and benchmarks switch this off to run the torch ops instead of the fused kernels.
USE_FUSED_OPS = True
FUSED_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def fused_ops_built() -> bool:
    """The kernel library (with csrc/fused_ops.cpp) loads; built once per machine (paged_kernel.load)."""
    return paged_kernel.load()


@functools.cache
def torch_float_lanes() -> int:
    """Floats in one of torch's CPU vectors (16 under its AVX512 kernels, else 8): where torch's silu
    switches from its vector exp to std::exp at the end of a row, which fused swiglu copies."""
    return 16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 8


def fused_ops_apply(x: torch.Tensor) -> bool:
    """The fused CPU kernels take ``x`` (float32 or bfloat16, on CPU, the library built)."""
    # is_cpu, not device.type: it builds no torch.device (0.05 us against 0.44 us; ~90 calls a decode step)
    return USE_FUSED_OPS and x.is_cpu and x.dtype in FUSED_DTYPES and fused_ops_built()


def uninitialised(cls: type[M], *args: Any, **kwargs: Any) -> M:
    """``cls(*args, **kwargs)`` with its parameters allocated but not initialised. ``load_weights`` /
    ``load_blocks`` write every one next: a random init only cost time, and under q4_1 it wrote
    (made resident) the float matrices the blocks replace, 540 MB for SmolLM2.

    Not torch's ``skip_init``: it initialises on the meta device and then moves, and the first
    ``normal_`` on meta (an embedding's init) imports torch._dynamo and the first move across
    devices sympy, 3-5 s of every start-up, for values thrown away."""
    without_reset = type(cls.__name__, (cls,), {"reset_parameters": lambda self: None})
    module: M = without_reset(*args, **kwargs)  # nn.Linear / nn.Embedding allocate (torch.empty), then reset
    module.__class__ = cls  # the plain class again: the subclass only lacked the reset
    return module


class RMSNorm(nn.Module):
    """``float32_scale`` (gemma's (1 + w) norms): the weight stays float32 and scales the float32 normed rows
    before they are rounded to x's dtype, as transformers' Gemma RMSNorm computes; otherwise (llama) the rows
    are rounded first and scaled by a weight in x's dtype."""

    def __init__(
        self, hidden_size: int, eps: float, device: torch.device, dtype: torch.dtype, float32_scale: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.ones(hidden_size, device=device, dtype=torch.float32 if float32_scale else dtype)
        )
        self.eps = eps
        self.float32_scale = float32_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [..., hidden]; the mean of squares is taken in float32."""
        weight = self.weight  # a Parameter: nn.Module.__getattr__ finds it, once
        if weight.dtype == x.dtype and fused_ops_apply(x):  # one pass, the bits of the ops below
            out: torch.Tensor = torch.ops.radixserve.rms_norm.default(x, weight, self.eps)
            return out
        if x.dtype == torch.float32:  # one fused op instead of seven; the same float32 arithmetic
            return F.rms_norm(x, weight.shape, weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.float32_scale:
            return (x32 * weight).to(x.dtype)
        return weight * x32.to(x.dtype)


def make_norm(config: ModelConfig, size: int, device: torch.device, dtype: torch.dtype) -> RMSNorm:
    """An RMSNorm over ``size`` as the architecture computes it (gemma: (1 + w) scaling in float32)."""
    return RMSNorm(size, config.rms_norm_eps, device, dtype, float32_scale=config.norm_unit_offset)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul: SwiGLU (silu) or GeGLU (gelu tanh)."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.intermediate_size = inter
        self.hidden_act = config.hidden_act
        self.gate_up_proj = uninitialised(nn.Linear, hidden, 2 * inter, bias=False, device=device, dtype=dtype)
        self.down_proj = uninitialised(nn.Linear, inter, hidden, bias=False, device=device, dtype=dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, overwrite_residual: bool = False
    ) -> torch.Tensor:
        """[T, hidden] -> residual + MLP(x), [T, hidden] (``overwrite_residual``: see linear_add); MLP(x) alone
        without a residual."""
        gate_up = self.gate_up_proj.forward(x)  # forward, not __call__: see DecoderLayer.forward
        act = swiglu(gate_up) if self.hidden_act == "silu" else geglu(gate_up)
        if residual is None:
            out: torch.Tensor = self.down_proj.forward(act)
            return out
        return linear_add(self.down_proj, act, residual, overwrite_residual)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * inter] (gate | up) -> silu(gate) * up, [T, inter]."""
    if gate_up.dim() == 2 and fused_ops_apply(gate_up):  # one pass, the bits of the two ops below
        out: torch.Tensor = torch.ops.radixserve.swiglu.default(gate_up, torch_float_lanes())
        return out
    gate, up = torch.split(gate_up, gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate).mul_(up)


def geglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * inter] (gate | up) -> gelu_tanh(gate) * up, [T, inter] (gemma's ``gelu_pytorch_tanh``)."""
    gate, up = torch.split(gate_up, gate_up.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): gemma2's soft-capping of attention scores and final logits."""
    return torch.tanh(x / cap) * cap


def linear_add(
    linear: nn.Module, x: torch.Tensor, residual: torch.Tensor, overwrite_residual: bool = False
) -> torch.Tensor:
    """residual + linear(x); a plain bias-free linear adds inside the GEMM (addmm), saving a pass over [T, N].
    ``overwrite_residual``: the caller no longer needs ``residual``; a block linear's tiled GEMMs may then add into
    it in place and return it (the same bits). Otherwise ``residual`` is never written."""
    if type(linear) is nn.Linear and linear.bias is None and x.dim() == 2:
        return torch.addmm(residual, x, linear.weight.t())
    if isinstance(linear, (BlockLinear, GGUFRowsLinear)):  # adds inside its kernel or GEMM
        return linear.forward_add(x, residual, overwrite_residual)
    if isinstance(linear, Int8Linear):
        return linear.forward_add(x, residual)
    out: torch.Tensor = residual + linear.forward(x)
    return out


def _base_inv_freq(theta: float, dim: int, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Llama 3.1 scaling: divide low frequencies by ``factor``, blend the middle band."""
    params = config.rope_scaling or {}
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = params.get("original_max_position_embeddings", config.max_position_embeddings)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _dynamic_inv_freq(config: ModelConfig, seq_len: int, device: torch.device) -> torch.Tensor:
    """Dynamic NTK: a larger base once the sequence outgrows max_position_embeddings.

    Computed with 0-d tensors, as transformers does in its forward pass, so the
    float32 rounding is the same as theirs.
    """
    dim, max_pos = config.head_dim, config.max_position_embeddings
    factor = float((config.rope_scaling or {})["factor"])
    length = torch.tensor(seq_len, dtype=torch.int64, device=device)
    base = config.rope_theta * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def compute_inv_freq(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32) for sequences within max_position_embeddings."""
    inv_freq = _base_inv_freq(config.rope_theta, config.head_dim, device)
    if config.rope_freq_factors is not None:  # a GGUF's rope_freqs.weight, llama.cpp's form of llama3 scaling
        return inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32, device=device)
    if config.rope_type == "linear":
        return inv_freq / float((config.rope_scaling or {})["factor"])
    if config.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, config)
    return inv_freq  # "default", and "dynamic" below max_position_embeddings


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the new tokens of one step; applied to q and k by ``apply_rotary``.

    "dynamic" rope follows transformers' single-sequence behaviour per request:
    a request's new tokens use the base scaled for its current context length
    (the keys already in the pool keep the rotation they were written with,
    exactly as in transformers' own KV cache).
    """

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", compute_inv_freq(config, device), persistent=False)

    def forward(self, positions: torch.Tensor, seq_lens: list[int], extend_lens: list[int]) -> torch.Tensor:
        """positions [T] -> angles [T, head_dim] (float32, the two halves equal).

        ``seq_lens[i]`` is request i's context length including its new tokens.
        """
        inv_freq = self.inv_freq[None, :]
        max_pos = self.config.max_position_embeddings
        if self.config.rope_type == "dynamic" and max(seq_lens) > max_pos:
            rows = [
                self.inv_freq if n <= max_pos else _dynamic_inv_freq(self.config, n, self.inv_freq.device)
                for n in seq_lens
            ]
            repeats = torch.tensor(extend_lens, device=positions.device)
            inv_freq = torch.stack(rows).repeat_interleave(repeats, dim=0)
        freqs = positions[:, None].float() * inv_freq
        return torch.cat((freqs, freqs), dim=-1)


def rotary_cos_sin(angles: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Angles [T, head_dim] -> cos, sin [T, 1, head_dim] in ``dtype`` (broadcast over heads)."""
    return angles.cos().to(dtype)[:, None, :], angles.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] by position (the "rotate half" layout of HF checkpoints)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
