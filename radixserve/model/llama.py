"""The decoder of every architecture (config.py: llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3) over the KV pool.

One forward runs one scheduler step on the flattened batch: every matmul sees all
T new tokens at once, and only attention knows where one request ends::

    input_ids [T] -> embed -> N x (norm -> attention(pool) -> +res -> norm -> gated MLP -> +res)
                  -> last row of each request (or all rows) -> norm -> lm_head -> logits float32

    gemma (sandwich_norms):  h + post_attention_norm(attention(norm(h))), then
                             h + post_feedforward_norm(MLP(pre_feedforward_norm(h)));
                             the embedding times sqrt(hidden), the logits soft-capped

Where only each request's last row is wanted, the last layer writes every row's K/V, then goes on
with a tail of rows (attention.tail_lens): the same logits for less work.

Weights are stored fused (q|k|v, gate|up) for fewer, larger matmuls;
``load_weights`` takes HF names and copies each tensor into its slice (phi3's checkpoints are fused
already). Gemma's norms hold 1 + w: its checkpoints store w, and ``load_weights`` adds the 1 in float32,
as transformers does at each forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.memory.kv_pool import KVPool
from radixserve.model.attention import Attention, AttentionPlan, tail_lens
from radixserve.model.config import ModelConfig
from radixserve.model.forward import ForwardBatch
from radixserve.model.gather import GatherWorkspace
from radixserve.model.gguf_loader import Kept
from radixserve.model.gguf_rows import INT8_ROW_TYPES, GGUFRowsEmbedding, GGUFRowsLinear
from radixserve.model.kept_weights import (
    Outcome,
    TypeReport,
    converted,
    describe_by_type,
    embedding_of,
    kept_linear,
    layer_parts,
    linear_of,
    usable_blocks,
    weights_by_type,
)
from radixserve.model.layers import GatedMLP, RotaryEmbedding, make_norm, rotary_cos_sin, softcap, uninitialised
from radixserve.model.paged_kernel import resolve_backend
from radixserve.model.precision import KEPT_TYPES
from radixserve.model.quant import BLOCK_QUANTIZATIONS, QUANTIZATIONS, Int8Linear, quantize_linears
from radixserve.model.quant_blocks import BlockEmbedding, BlockLinear, QuantBlocks


class DecoderLayer(nn.Module):
    """Norms named as HF names them: ``post_attention_layernorm`` is the MLP's input norm, except under
    ``sandwich_norms`` (gemma), where it norms the attention's output and ``pre_feedforward_layernorm`` the
    MLP's input."""

    def __init__(self, config: ModelConfig, layer_id: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = make_norm(config, config.hidden_size, device, dtype)
        self.self_attn = Attention(config, layer_id, device, dtype)
        self.post_attention_layernorm = make_norm(config, config.hidden_size, device, dtype)
        self.mlp = GatedMLP(config, device, dtype)
        self.sandwich = config.sandwich_norms
        self.pre_feedforward_layernorm = make_norm(config, config.hidden_size, device, dtype) if self.sandwich else None
        self.post_feedforward_layernorm = (
            make_norm(config, config.hidden_size, device, dtype) if self.sandwich else None
        )
        self.fused_checkpoint = config.architecture == "phi3"
        self.local_rope = config.rope_local_base_freq is not None and config.is_sliding(layer_id)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        plan: AttentionPlan,
        kv_pool: KVPool,
        tail: tuple[torch.Tensor, AttentionPlan] | None = None,
    ) -> torch.Tensor:
        """h [T, hidden] -> [T, hidden], or [len(rows), hidden] with ``tail`` (rows and their plan: every row
        writes its K/V, only those rows go on). h is consumed: each residual add may write into it.

        The step calls its modules' ``forward``, not the modules: nn.Module.__call__'s hook machinery (no hook
        is ever registered on the model) was ~215 calls a decode step, a few microseconds each."""
        x = self.input_layernorm.forward(h)
        if self.sandwich:
            return self._sandwich(h, x, cos, sin, out_slots, plan, kv_pool, tail)
        h = self.self_attn.forward(
            x, cos, sin, out_slots, plan, kv_pool, residual=h, overwrite_residual=True, tail=tail
        )
        mlp_in = self.post_attention_layernorm.forward(h)
        out: torch.Tensor = self.mlp.forward(mlp_in, residual=h, overwrite_residual=True)
        return out

    def _sandwich(
        self,
        h: torch.Tensor,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        out_slots: torch.Tensor,
        plan: AttentionPlan,
        kv_pool: KVPool,
        tail: tuple[torch.Tensor, AttentionPlan] | None,
    ) -> torch.Tensor:
        """gemma: each block's output is normed before its residual add."""
        assert self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None
        attended = self.self_attn.forward(x, cos, sin, out_slots, plan, kv_pool, residual=None, tail=tail)
        h = (h if tail is None else h[tail[0]]) + self.post_attention_layernorm.forward(attended)
        mlp_out = self.mlp.forward(self.pre_feedforward_layernorm.forward(h))
        out: torch.Tensor = h + self.post_feedforward_layernorm.forward(mlp_out)
        return out

    def weight_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """HF parameter name -> the (view of the) tensor it is copied into."""
        attn = self.self_attn
        targets = {f"{prefix}self_attn.o_proj.weight": attn.o_proj.weight}
        if self.fused_checkpoint:  # phi3 stores q|k|v and gate|up fused, as we do
            targets[f"{prefix}self_attn.qkv_proj.weight"] = attn.qkv_proj.weight
            targets[f"{prefix}mlp.gate_up_proj.weight"] = self.mlp.gate_up_proj.weight
        else:
            fused = zip(("q_proj", "k_proj", "v_proj"), torch.split(attn.qkv_proj.weight, attn.split_sizes))
            targets.update({f"{prefix}self_attn.{name}.weight": view for name, view in fused})
            gate, up = torch.split(self.mlp.gate_up_proj.weight, self.mlp.intermediate_size)
            targets[f"{prefix}mlp.gate_proj.weight"] = gate
            targets[f"{prefix}mlp.up_proj.weight"] = up
        if attn.qkv_proj.bias is not None:
            fused = zip(("q_proj", "k_proj", "v_proj"), torch.split(attn.qkv_proj.bias, attn.split_sizes))
            targets.update({f"{prefix}self_attn.{name}.bias": view for name, view in fused})
        if attn.o_proj.bias is not None:
            targets[f"{prefix}self_attn.o_proj.bias"] = attn.o_proj.bias
        targets[f"{prefix}mlp.down_proj.weight"] = self.mlp.down_proj.weight
        norms = {
            "input_layernorm": self.input_layernorm,
            "post_attention_layernorm": self.post_attention_layernorm,
            "pre_feedforward_layernorm": self.pre_feedforward_layernorm,
            "post_feedforward_layernorm": self.post_feedforward_layernorm,
            "self_attn.q_norm": attn.q_norm,
            "self_attn.k_norm": attn.k_norm,
        }
        targets.update({f"{prefix}{name}.weight": norm.weight for name, norm in norms.items() if norm is not None})
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
        self.paged_extends = False  # paged backend: every extend the bf16 extend kernel does not take reads in place
        self.embed_tokens: nn.Module = uninitialised(
            nn.Embedding, config.vocab_size, config.hidden_size, device=device, dtype=dtype
        )
        self.rotary = RotaryEmbedding(config, device)
        self.local_rotary = None  # gemma3's sliding layers: their own theta, no scaling
        if config.rope_local_base_freq is not None:
            local = replace(config, rope_theta=config.rope_local_base_freq, rope_scaling=None, rope_freq_factors=None)
            self.local_rotary = RotaryEmbedding(local, device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, device, dtype) for i in range(config.num_layers))
        self.norm = make_norm(config, config.hidden_size, device, dtype)
        self.lm_head: nn.Module | None = None  # None: tied to the embedding
        if not config.tie_word_embeddings:
            self.lm_head = uninitialised(
                nn.Linear, config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype
            )
        self.workspace = GatherWorkspace()
        self.quantization = "none"
        self.quantization_detail = "none"  # what quantize() did, for /server_info
        self.weights_by_type: dict[str, TypeReport] = {}  # a GGUF's matrices per type: kept, converted, why
        self.requires_grad_(False)  # inference only: no autograd graph even outside inference_mode

    def forward(
        self, batch: ForwardBatch, kv_pool: KVPool, return_all_logits: bool = False, return_hidden: bool = False
    ) -> torch.Tensor:
        """One step. Logits float32 [B, vocab] of each request's last new token, or [T, vocab] of all;
        ``return_hidden``: those rows' final (normed) hidden states instead, [B or T, hidden] (``logits(h)``
        turns them into the logits).

        Writes every new token's K/V to ``kv_pool`` at ``batch.out_slots`` in every layer.
        """
        if batch.input_ids.shape[0] != sum(batch.extend_lens) or len(batch.context_slots) != batch.batch_size:
            raise ValueError("ForwardBatch: input_ids, extend_lens and context_slots disagree")
        plan = AttentionPlan.build(
            batch, self.workspace, self.attention_backend, self.cascade_attention, self.paged_extends
        )
        seq_lens = [slots.shape[0] for slots in batch.context_slots]
        cos, sin = rotary_cos_sin(self.rotary.forward(batch.positions, seq_lens, batch.extend_lens), self.dtype)
        local = cos, sin
        if self.local_rotary is not None:
            local = rotary_cos_sin(self.local_rotary.forward(batch.positions, seq_lens, batch.extend_lens), self.dtype)
        h = self.embed_tokens.forward(batch.input_ids)  # modules' forward, not __call__: see DecoderLayer.forward
        if self.config.scale_embeddings:  # gemma: the factor rounded to the hidden dtype first, as transformers
            h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype)
        # Only each request's last row reaches the logits: the last layer goes on with a tail of rows past its
        # K/V write (its attention, o_proj and MLP for 2,048 rows were ~3% of a 2k prefill).
        lens, tail = batch.extend_lens, None
        if not return_all_logits and batch.mode != "decode" and (kept := tail_lens(batch.extend_lens)) is not None:
            tail_batch, rows = batch.tail(kept)
            lens = kept
            tail = (
                rows,
                AttentionPlan.build(
                    tail_batch, self.workspace, self.attention_backend, self.cascade_attention, self.paged_extends
                ),
            )
        layers, out_slots = self.layers, batch.out_slots
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            layer_cos, layer_sin = local if layer.local_rope else (cos, sin)
            h = layer.forward(h, layer_cos, layer_sin, out_slots, plan, kv_pool, tail if i == last else None)
        if not return_all_logits and batch.mode != "decode":
            last_rows = torch.tensor(list(accumulate(lens)), device=h.device) - 1
            h = h[last_rows]  # the final norm is per row: select first, skip the rest of lm_head
        h = self.norm.forward(h)
        return h if return_hidden else self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits float32 [rows, vocab] of final hidden states [rows, hidden]."""
        head = self.lm_head
        logits = F.linear(h, self._embedding_weight()) if head is None else head.forward(h)
        if self.config.final_logit_softcapping:  # gemma2, in the model's dtype as transformers does
            logits = softcap(logits, self.config.final_logit_softcapping)
        return logits.float()

    def quantize(
        self,
        method: str,
        kept: Mapping[str, Kept] | None = None,
        file_types: Mapping[str, str] | None = None,
        float_rest: bool = False,
    ) -> None:
        """Weight-only quantization of every linear and the lm_head, in place, after ``load_weights``.

        int8: a tied lm_head gets its own quantized copy of the embedding (the lookup keeps the
        float one). q4_1 / q4_1-exact: ``kept`` (HF name -> a GGUF file's own weights) are used as they are,
        other weights quantized, or with ``float_rest`` (auto) left float (see ``_quantize_blocks``); q4_1 quantizes
        activations to int8 blocks (quant_blocks.py). ``file_types`` (HF name -> GGUF type of every matrix)
        names the types of what was converted in ``weights_by_type``. A quantized model loads no more weights.
        """
        if method not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
        if self.quantization != "none":
            if method == "none":
                return
            raise ValueError(f"the model is already quantized ({self.quantization})")
        if method in BLOCK_QUANTIZATIONS:
            self._quantize_blocks(kept or {}, method, file_types or {}, float_rest)
            self.quantization = method
            return
        to = "int8" if method == "int8" else str(self.dtype).removeprefix("torch.")
        if file_types:
            outcomes = {
                name: Outcome(to, f"quantization {method}" if qtype in KEPT_TYPES else f"no kernel for {qtype}")
                for name, qtype in file_types.items()
            }
            self.weights_by_type = weights_by_type(outcomes, file_types)
        if method == "int8":
            quantize_linears(self.layers, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), self.dtype)
            head = self._embedding_weight() if self.lm_head is None else self.lm_head.weight
            assert isinstance(head, torch.Tensor)
            self.lm_head = Int8Linear(head.detach(), None, self.dtype)
            self.quantization_detail = "int8: every linear and the lm_head, per-channel scales"
            self.quantization = method

    def _quantize_blocks(
        self, kept: Mapping[str, Kept], method: str, file_types: Mapping[str, str], float_rest: bool
    ) -> None:
        """Linears as Q4_1, the lm_head as Q8_0 (``float_rest``: both left float); a weight the file stores as a
        KEPT_TYPES type keeps the file's data (a fused linear only when all its parts do: ``kept_linear``).

        The embedding lookup keeps its float values, unless the file's embedding was kept:
        then it reads it (exactly its values), and a tied lm_head shares it (one buffer)."""
        int8_activations, outcomes = method == "q4_1", dict[str, Outcome]()
        to = str(self.dtype).removeprefix("torch.") if float_rest else "q4_1"
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            for (owner_name, attr), names in layer_parts(f"model.layers.{i}.", layer.fused_checkpoint).items():
                owner = getattr(layer, owner_name)
                linear = getattr(owner, attr)
                found = [kept.get(name) for name in names]
                new = kept_linear(linear.weight, linear.bias, found, self.dtype, int8_activations)
                outcomes.update(
                    {n: Outcome() if new is not None else converted(file_types.get(n), to, float_rest) for n in names}
                )
                if new is None and not float_rest:
                    new = linear_of(
                        QuantBlocks.quantize(linear.weight, "q4_1"), linear.bias, self.dtype, int8_activations
                    )
                setattr(owner, attr, linear if new is None else new)
        linears = list(outcomes.values())
        head, embed = self._keep_head(kept, int8_activations, float_rest, file_types, outcomes)
        types = {name: data.source for name, data in kept.items() if data.source} | dict(file_types)
        self.weights_by_type = weights_by_type(outcomes, types, int8_activations)
        float_rows = sorted(
            {m.qtype for m in self.modules() if isinstance(m, GGUFRowsLinear) and not m.int8_activations}
        )
        why = "; this CPU's int8 rows kernel is a portable loop" if set(float_rows) & set(INT8_ROW_TYPES) else ""
        rows_note = f" ({', '.join(float_rows)} rows: float{why})" if int8_activations and float_rows else ""
        used = sum(not o.to for o in linears)
        rest = "" if used == len(linears) else f", the rest {'dequantized to ' + to if float_rest else 'quantized'}"
        self.quantization_detail = (
            f"{method}: {used} of {len(linears)} linear weights kept as the file's blocks{rest}; "
            f"lm_head {head}; embedding {embed}; "
            f"activations {'int8 blocks of 32 (CPU)' + rows_note if int8_activations else 'float'}"
            f"{describe_by_type(self.weights_by_type)}"
        )

    def _keep_head(
        self,
        kept: Mapping[str, Kept],
        int8_activations: bool,
        float_rest: bool,
        file_types: Mapping[str, str],
        outcomes: dict[str, Outcome],
    ) -> tuple[str, str]:
        """The embedding and lm_head of ``_quantize_blocks``, their outcomes added to ``outcomes``; returns how
        each one runs, for quantization_detail."""
        embed_name, head_name, tied = "model.embed_tokens.weight", "lm_head.weight", self.lm_head is None
        head_weight = self._embedding_weight() if self.lm_head is None else self.lm_head.weight
        assert isinstance(head_weight, torch.Tensor)
        dtype = str(self.dtype).removeprefix("torch.")
        embed = kept.get(embed_name)
        embed = None if embed is None else embed.to(head_weight.device)  # moved once: a tied lm_head shares it
        head = embed if tied else kept.get(head_name)
        to = dtype if float_rest else "q8_0"
        if head is not None:
            self.lm_head = kept_linear(head_weight, None, [head], self.dtype, int8_activations)
        elif not float_rest:
            self.lm_head = BlockLinear(QuantBlocks.quantize(head_weight, "q8_0"), None, self.dtype, int8_activations)
        if embed is not None:
            self.embed_tokens = embedding_of(embed, self.dtype)
        if not tied:
            outcomes[head_name] = (
                Outcome() if head is not None else converted(file_types.get(head_name), to, float_rest)
            )
        # A tied embedding is the lm_head's weight; an untied one is only looked up, in floats when not kept.
        embed_to, lossless = (to, float_rest) if tied else (dtype, True)
        outcomes[embed_name] = (
            Outcome() if embed is not None else converted(file_types.get(embed_name), embed_to, lossless)
        )
        how_head = f"kept as {head.fmt}" if head is not None else ("float" if float_rest else "quantized to q8_0")
        return how_head, f"kept as {embed.fmt}" if embed is not None else "float"

    def _embedding_weight(self) -> torch.Tensor:
        embed = self.embed_tokens
        if isinstance(embed, BlockEmbedding):
            return embed.blocks.dequantize_fast().to(self.dtype)
        if isinstance(embed, GGUFRowsEmbedding):
            return embed.rows.dequantize().to(self.dtype)
        assert isinstance(embed, nn.Embedding)
        return embed.weight

    def load_blocks(
        self,
        state_dict: dict[str, torch.Tensor],
        blocks: Mapping[str, Kept],
        method: str = "q4_1-exact",
        file_types: Mapping[str, str] | None = None,
        float_rest: bool = False,
    ) -> None:
        """``load_weights`` then ``quantize(method, blocks, file_types, float_rest)``, with no float copy of what
        ``blocks`` replace: ``state_dict`` holds every other tensor, ``blocks`` only what ``usable_blocks`` keeps.

        Loading a GGUF this way never dequantizes the matrices that stay as stored (nor casts them)."""
        unusable = sorted(blocks.keys() - usable_blocks(blocks, len(self.layers)).keys())
        if unusable:
            raise ValueError(f"blocks quantize() would not keep as they are: {unusable[:5]}")
        if method not in BLOCK_QUANTIZATIONS:
            raise ValueError(f"load_blocks needs a block quantization {BLOCK_QUANTIZATIONS}, not {method!r}")
        self.load_weights(state_dict, replaced=blocks)
        self.quantize(method, blocks, file_types, float_rest)

    def load_weights(self, state_dict: dict[str, torch.Tensor], replaced: Mapping[str, Kept] | None = None) -> None:
        """Copy HF-named tensors into this model (cast to its dtype); all or nothing.

        Raises ValueError naming every missing or unknown tensor and every shape
        mismatch. Rotary ``inv_freq`` buffers are ignored (we compute our own);
        a tied model accepts an ``lm_head.weight`` only if it equals the embedding.
        ``replaced``: blocks that replace their weights next (``load_blocks`` only): not loaded, shapes checked.
        """
        replaced = replaced or {}
        if self.quantization != "none":
            raise ValueError("load_weights on a quantized model: load first, then quantize")
        targets = self._weight_targets()
        names = {n for n in state_dict if not n.endswith("rotary_emb.inv_freq")} | set(replaced)
        if self.lm_head is None and "lm_head.weight" in state_dict:
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
            if name in state_dict and state_dict[name].shape != dst.shape
        ]
        problems += [
            f"{name}: {blocks.fmt} blocks of shape {blocks.shape}, model expects {tuple(dst.shape)}"
            for name, dst in targets.items()
            if (blocks := replaced.get(name)) is not None and blocks.shape != tuple(dst.shape)
        ]
        if problems:
            raise ValueError("cannot load weights: " + "; ".join(problems))
        unit_offset = self.config.norm_unit_offset
        with torch.no_grad():
            for name, dst in targets.items():
                if name not in replaced:
                    src = state_dict[name]
                    # gemma's norms scale by 1 + w, computed in float32 as transformers does at each forward
                    dst.copy_(src.float() + 1.0 if unit_offset and name.endswith("norm.weight") else src)

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        targets = {"model.embed_tokens.weight": self._embedding_weight(), "model.norm.weight": self.norm.weight}
        if isinstance(self.lm_head, nn.Linear):
            targets["lm_head.weight"] = self.lm_head.weight
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            targets.update(layer.weight_targets(f"model.layers.{i}."))
        return targets
