"""SGLang's ``/generate`` request fields (``GenerateReqInput``) and what ``/generate`` does with each.

SGLang's own clients (``bench_serving --backend sglang``, its Python frontend) send many
of these fields, mostly at their defaults. ``GenerateRequest`` declares the fields we
honour; every other SGLang field is accepted here and:

- at its default (or any "off" value: None, False, 0, -1, empty) or in ``HARMLESS``
  (logging, tracing, disaggregation routing: nothing the answer depends on): ignored,
  with one warning per field name for the server's lifetime;
- otherwise (``lora_path: "x"``, ``return_hidden_states: true``, ``image_data``, ...)
  a 400: the answer would silently lack what was asked for.

A name that is not an SGLang field at all stays a 400 (a typo must not pass).
The test suite checks ``SGLANG_FIELDS`` against the installed sglang package.
"""

from __future__ import annotations

from typing import Any

HONOURED = {
    "rid",
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "stream",
    "routing_key",
    "priority",
    "extra_key",
    "cache_salt",
}
HARMLESS = {
    "session_id",
    "log_metrics",
    "no_logs",
    "custom_labels",
    "external_trace_header",
    "received_time",
    "http_worker_ipc",
    "conversation_id",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "routed_dp_rank",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "modalities",
    "need_wait_for_mm_inputs",
    "num_items_assigned",
    "encoder_urls",
    "max_dynamic_patch",
    "min_dynamic_patch",
    "image_max_dynamic_patch",
    "video_max_dynamic_patch",
    "images_config",
    "mm_processor_kwargs",
    "use_audio_in_video",
    "video_config",
    "kv_hints",
}
IGNORED_WHEN_OFF = {
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "mm_hashes",
    "mm_content_hashes",
    "watermark",
    "token_ids_logprob",
    "return_sampling_mask",
    "sampling_logprobs_mode",
    "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64",
    "return_hidden_states",
    "return_routed_experts",
    "routed_experts_start_len",
    "return_indexer_topk",
    "session_params",
    "lora_path",
    "lora_id",
    "custom_logit_processor",
    "positional_embed_overrides",
    "background",
    "require_reasoning",
    "max_thinking_tokens",
    "return_bytes",
    "return_entropy",
    "return_prompt_token_ids",
    "multi_item_delimiter_indices",
    "token_indices_to_pool",
}
SGLANG_FIELDS = HONOURED | HARMLESS | IGNORED_WHEN_OFF

# SGLang's sampling parameters that ours lack, and the values that ask for nothing (the frontend
# sends most of them on every call). Any other value is a 400; ``sampling_seed`` is our ``seed``.
SAMPLING_AT_DEFAULT: dict[str, tuple[Any, ...]] = {
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "min_new_tokens": (0, None),
    "n": (1, None),
    "stop_regex": (None, (), []),
    "beam_width": (None,),
    "structural_tag": (None,),
    "no_stop_trim": (False,),
    "stream_interval": (None,),
    "logit_bias": (None, {}),
    "custom_params": (None, {}),
    "watermark": (None,),
    "ebnf_full_assistant": (False,),
}
# Ours, where SGLang's None means "unset".
NONE_IS_UNSET = ("stop", "stop_token_ids", "json_schema", "regex", "ebnf", "max_new_tokens", "sampling_seed")


def is_off(value: Any) -> bool:
    """A value that asks for nothing: None, False, 0, -1, or empty (also a batch's list of those)."""
    if isinstance(value, list) and value:
        return all(is_off(v) for v in value)
    return value is None or value is False or (type(value) is int and value in (0, -1)) or value in ("", [], {})


def triage(extra: dict[str, Any]) -> tuple[list[str], str | None]:
    """(fields to ignore with a warning, why the request must be refused or None)."""
    ignored = []
    for name, value in extra.items():
        if name not in SGLANG_FIELDS:
            return [], f"{name}: Extra inputs are not permitted (not an SGLang /generate field)"
        if name in HARMLESS or is_off(value):
            ignored.append(name)
        else:
            return [], f"{name} is not supported by this server (send it off or leave it out)"
    return ignored, None


def native_sampling(params: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """SGLang ``sampling_params`` as ours: (params, why the request must be refused or None)."""
    out = dict(params)
    for name in NONE_IS_UNSET:
        if name in out and out[name] is None:
            del out[name]
    if "sampling_seed" in out:
        out["seed"] = out.pop("sampling_seed")
    for name, defaults in SAMPLING_AT_DEFAULT.items():
        if name not in out:
            continue
        value = out.pop(name)
        if not any(value == d and type(value) is type(d) for d in defaults):
            return out, f"sampling_params.{name}={value!r} is not supported by this server"
    if isinstance(out.get("stop"), list):
        out["stop"] = tuple(out["stop"])
    return out, None
