"""Llama-family decoder (Llama, Qwen2, Mistral without sliding window) over the KV pool.

One forward runs one scheduler step on the flattened batch: every matmul sees all
T new tokens at once, and only attention knows where one request ends::

    input_ids [T] -> embed -> N x (norm -> attention(pool) -> +res -> norm -> SwiGLU -> +res)
                  -> last row of each request (or all rows) -> norm -> lm_head -> logits float32

Weights are stored fused (q|k|v, gate|up) for fewer, larger matmuls;
``load_weights`` takes HF names and copies each tensor into its slice.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.memory.kv_pool import KVPool
from radixserve.model.attention import Attention, AttentionPlan
from radixserve.model.config import ModelConfig
from radixserve.model.forward import ForwardBatch
from radixserve.model.gather import GatherWorkspace
from radixserve.model.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, rotary_cos_sin
from radixserve.model.paged_kernel import resolve_backend
from radixserve.model.quant import QUANTIZATIONS, Int8Linear, quantize_linears


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = Attention(config, layer_id, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.mlp = SwiGLUMLP(config, device, dtype)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        plan: AttentionPlan,
        kv_pool: KVPool,
    ) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden]."""
        h = self.self_attn(self.input_layernorm(h), cos, sin, out_slots, plan, kv_pool, residual=h)
        out: torch.Tensor = self.mlp(self.post_attention_layernorm(h), residual=h)
        return out

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """HF parameter name -> the (view of the) tensor it is copied into."""
        attn = self.self_attn
        targets = {f"{prefix}self_attn.o_proj.weight": attn.o_proj.weight}
        fused = zip(("q_proj", "k_proj", "v_proj"), torch.split(attn.qkv_proj.weight, attn.split_sizes))
        targets.update({f"{prefix}self_attn.{name}.weight": view for name, view in fused})
        if attn.qkv_proj.bias is not None:
            fused = zip(("q_proj", "k_proj", "v_proj"), torch.split(attn.qkv_proj.bias, attn.split_sizes))
            targets.update({f"{prefix}self_attn.{name}.bias": view for name, view in fused})
        if attn.o_proj.bias is not None:
            targets[f"{prefix}self_attn.o_proj.bias"] = attn.o_proj.bias
        gate, up = torch.split(self.mlp.gate_up_proj.weight, self.mlp.intermediate_size)
        targets[f"{prefix}mlp.gate_proj.weight"] = gate
        targets[f"{prefix}mlp.up_proj.weight"] = up
        targets[f"{prefix}mlp.down_proj.weight"] = self.mlp.down_proj.weight
        targets[f"{prefix}input_layernorm.weight"] = self.input_layernorm.weight
        targets[f"{prefix}post_attention_layernorm.weight"] = self.post_attention_layernorm.weight
        return targets


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        attention_backend: str = "auto",
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        device = torch.device(device)
        self.attention_backend = resolve_backend(attention_backend, device)
        self.cascade_attention = True  # paged backend: read a prefix shared by several requests once (bench: off)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.rotary = RotaryEmbedding(config, device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, device, dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.lm_head: nn.Module | None = None  # None: tied to the embedding
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
        self.workspace = GatherWorkspace()
        self.quantization = "none"
        self.requires_grad_(False)  # inference only: no autograd graph even outside inference_mode

    def forward(self, batch: ForwardBatch, kv_pool: KVPool, return_all_logits: bool = False) -> torch.Tensor:
        """One step. Logits float32 [B, vocab] of each request's last new token, or [T, vocab] of all.

        Writes every new token's K/V to ``kv_pool`` at ``batch.out_slots`` in every layer.
        """
        if batch.input_ids.shape[0] != sum(batch.extend_lens) or len(batch.context_slots) != batch.batch_size:
            raise ValueError("ForwardBatch: input_ids, extend_lens and context_slots disagree")
        plan = AttentionPlan.build(batch, self.workspace, self.attention_backend, self.cascade_attention)
        seq_lens = [slots.shape[0] for slots in batch.context_slots]
        angles = self.rotary(batch.positions, seq_lens, batch.extend_lens)
        cos, sin = rotary_cos_sin(angles, self.dtype)
        h = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin, batch.out_slots, plan, kv_pool)
        if not return_all_logits and batch.mode != "decode":
            last_rows = torch.tensor(list(accumulate(batch.extend_lens)), device=h.device) - 1
            h = h[last_rows]  # the final norm is per row: select first, skip the rest of lm_head
        h = self.norm(h)
        if self.lm_head is None:
            return F.linear(h, self.embed_tokens.weight).float()
        logits: torch.Tensor = self.lm_head(h)
        return logits.float()

    def quantize(self, method: str) -> None:
        """Weight-only quantization of every linear and the lm_head, in place, after ``load_weights``.

        A tied lm_head gets its own quantized copy of the embedding (the lookup keeps the
        float one). A quantized model loads no more weights.
        """
        if method not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
        if method == "none":
            return
        quantize_linears(self.layers, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), self.dtype)
        head_weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        assert isinstance(head_weight, torch.Tensor)
        self.lm_head = Int8Linear(head_weight.detach(), None, self.dtype)
        self.quantization = method

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors into this model (cast to its dtype); all or nothing.

        Raises ValueError naming every missing or unknown tensor and every shape
        mismatch. Rotary ``inv_freq`` buffers are ignored (we compute our own);
        a tied model accepts an ``lm_head.weight`` only if it equals the embedding.
        """
        if self.quantization != "none":
            raise ValueError("load_weights on a quantized model: load first, then quantize")
        targets = self._weight_targets()
        names = {n for n in state_dict if not n.endswith("rotary_emb.inv_freq")}
        if self.lm_head is None and "lm_head.weight" in names:
            embed = state_dict.get("model.embed_tokens.weight")
            if embed is None or not torch.equal(state_dict["lm_head.weight"], embed):
                raise ValueError("tie_word_embeddings is set but lm_head.weight differs from the embedding")
            names.discard("lm_head.weight")
        missing, unknown = sorted(targets.keys() - names), sorted(names - targets.keys())
        problems = [f"missing tensors: {missing}"] if missing else []
        problems += [f"unknown tensors: {unknown}"] if unknown else []
        problems += [
            f"{name}: checkpoint shape {tuple(state_dict[name].shape)}, model expects {tuple(dst.shape)}"
            for name, dst in targets.items()
            if name in names and state_dict[name].shape != dst.shape
        ]
        if problems:
            raise ValueError("cannot load weights: " + "; ".join(problems))
        with torch.no_grad():
            for name, dst in targets.items():
                dst.copy_(state_dict[name])

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        targets = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm.weight}
        if isinstance(self.lm_head, nn.Linear):
            targets["lm_head.weight"] = self.lm_head.weight
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            targets.update(layer.weight_targets(f"model.layers.{i}."))
        return targets
