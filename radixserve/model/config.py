"""ModelConfig: the numbers and the named differences of one decoder family, validated at construction.

One decoder (llama.py) serves every architecture here; what differs between them is a field, named as
transformers names it where it has a name:

    llama    the base: RMSNorm, SwiGLU, rotary (default / linear / llama3 / dynamic), tied or untied lm_head
    mistral  llama + ``sliding_window`` on every layer
    qwen2    llama + bias on q, k, v (``attention_bias``, not on o_proj)
    qwen3    llama + ``qk_norm`` (per-head RMSNorm on q and k before rotary)
    phi3     llama with fused qkv_proj / gate_up_proj in the checkpoint (the decoder fuses them anyway)
    gemma2   ``scale_embeddings``, ``norm_unit_offset`` ((1 + w) RMSNorm), GeGLU (``hidden_act``),
             ``sandwich_norms``, soft-capped attention and logits, ``query_pre_attn_scalar``, alternating
             sliding-window and global ``layer_types``
    gemma3   gemma2 without attention soft-capping, + ``qk_norm``, 5 sliding layers per global one, and
             ``rope_local_base_freq`` for the sliding layers

Built from an HF ``config.json`` (``from_hf``, hf_config.py) or from GGUF metadata (gguf_loader). Options we
do not implement are an error, never silently dropped: an unknown rope type or architecture fails at load,
not with wrong logits later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.model.hf_config import ARCHITECTURES, config_fields

__all__ = ["ARCHITECTURES", "ModelConfig"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # one of ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    # llama.cpp's rope_freqs.weight (a GGUF's form of llama3 scaling): each frequency divided by its factor.
    rope_freq_factors: tuple[float, ...] | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v (qwen2: only there; llama, qwen3, gemma: on o_proj too)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = False  # qwen3, gemma3: RMSNorm over each head of q and k (weights [head_dim]) before rotary
    hidden_act: str = "silu"  # the gate's activation: SwiGLU, or GeGLU with "gelu_pytorch_tanh" (gemma)
    sliding_window: int | None = None  # a sliding layer's query at p sees keys p - W + 1 .. p (transformers')
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; () = all full
    attn_logit_softcapping: float | None = None  # gemma2: scores = c * tanh(scores / c), after the scale
    final_logit_softcapping: float | None = None  # gemma2: logits = c * tanh(logits / c)
    query_pre_attn_scalar: float | None = None  # gemma: attention scale = query_pre_attn_scalar ** -0.5
    rope_local_base_freq: float | None = None  # gemma3: the sliding layers' rope theta (no scaling)
    scale_embeddings: bool = False  # gemma: embedding * sqrt(hidden_size), the factor rounded to the dtype
    norm_unit_offset: bool = False  # gemma: RMSNorm scales by (1 + w) in float32 (checkpoints store w)
    sandwich_norms: bool = False  # gemma: norms on the attention and MLP outputs too, before each residual add

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not supported (supported: {ARCHITECTURES})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (supported: {HIDDEN_ACTS})")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer_types for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported (supported: {LAYER_TYPES})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"{len(self.rope_freq_factors)} rope frequency factors for head_dim {self.head_dim}")

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def o_proj_bias(self) -> bool:
        """attention_bias covers o_proj too, except in qwen2 (q, k, v only)."""
        return self.attention_bias and self.architecture != "qwen2"

    def is_sliding(self, layer: int) -> bool:
        """Layer ``layer`` attends through a sliding window."""
        return bool(self.sliding_window) and bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int:
        """Keys a query of layer ``layer`` sees (itself included); 0: every earlier key."""
        return int(self.sliding_window or 0) if self.is_sliding(layer) else 0

    def attention_scale(self) -> float:
        """The factor on q . k: head_dim ** -0.5, or gemma's query_pre_attn_scalar ** -0.5."""
        scale: float = float(self.query_pre_attn_scalar or self.head_dim) ** -0.5  # transformers' arithmetic
        return scale

    def rope_summary(self) -> str:
        """Rope in words, for the start-up log: theta, scaling, the sliding layers' theta."""
        kind = "llama3 as the GGUF's rope_freqs factors" if self.rope_freq_factors is not None else self.rope_type
        text = f"theta {self.rope_theta:g}, {kind}"
        if self.rope_scaling:
            params = {k: v for k, v in self.rope_scaling.items() if k not in ("rope_type", "type", "rope_theta")}
            text += f" {params}"
        if self.rope_local_base_freq is not None:
            text += f"; sliding layers theta {self.rope_local_base_freq:g}, default"
        return text

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From a parsed HF ``config.json`` (see hf_config.py)."""
        return cls(**config_fields(hf))
