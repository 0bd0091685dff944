"""The embedded default model, end to end (slow: loads the real 98 MB GGUF twice).

The reference is transformers reading the same GGUF with its own code
(``load_gguf_checkpoint``: its own dequantisation and Q/K un-permutation),
independent of our loader.
"""

from __future__ import annotations

import pytest
import torch

from radixserve import Engine
from radixserve.model.gguf_loader import default_model_path

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colors of the rainbow."}]


@pytest.fixture(scope="module")
def engine() -> Engine:
    # Equal to transformers: float32 weights only (the default, auto, keeps the GGUF's 4-bit blocks).
    return Engine.create(max_total_tokens=4096, dtype="float32", quantization="none")


def transformers_greedy(prompt_ids: list[int], num_tokens: int) -> list[int]:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    parsed = load_gguf_checkpoint(path)
    config = {k: v for k, v in parsed["config"].items() if k not in ("model_type", "_model_name_or_path")}
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and all("lm_head" in name for name in missing), (missing, unexpected)
    model.tie_weights()
    # An explicit mask: pad_token_id is <|im_end|> here, which the ChatML prompt contains, and
    # generate would otherwise mask those tokens out as padding.
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens, do_sample=False, eos_token_id=None
    )
    return out[0, len(prompt_ids) :].tolist()


def test_chat_template_is_chatml_with_the_default_system_message(engine: Engine) -> None:
    text = engine.tokenizer.hf.decode(engine.tokenizer.apply_chat_template(QUESTION))
    assert text.startswith("<|im_start|>system\n") and "You are a helpful AI assistant" in text
    assert text.endswith("<|im_start|>user\nName three colors of the rainbow.<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_chat_equals_transformers_on_the_same_gguf(engine: Engine) -> None:
    prompt = engine.tokenizer.apply_chat_template(QUESTION)
    ours = engine.generate(
        input_ids=prompt, sampling_params={"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    )
    assert ours.output_ids == transformers_greedy(prompt, 16)
    assert ours.text.strip()


def test_a_second_question_reuses_the_system_prompt(engine: Engine) -> None:
    first = engine.chat(QUESTION, {"max_new_tokens": 8, "temperature": 0})
    second = engine.chat([{"role": "user", "content": "Name three animals."}], {"max_new_tokens": 8, "temperature": 0})
    assert second.cached_tokens >= 20  # the default system message and the user header
    assert first.prompt_tokens > 20
    engine.check_idle_invariants()


CHATS = [
    "Name three colors of the rainbow.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Give me a tip for learning to code.",
]


def test_the_default_keeps_the_files_blocks_and_answers_as_float32(engine: Engine) -> None:
    """The GGUF's linears are Q4_1 and its embedding Q8_0: the default (auto = q4_1-exact) keeps those blocks with float
    activations, so only the summation order differs from float32 (measured: all 5 greedy answers identical). The
    dtype is pinned: on a CPU with AVX512-BF16 or AMX, auto means bfloat16, whose rounding is another matter
    (tests/model/test_precision.py)."""
    q4 = Engine.create(max_total_tokens=4096, dtype="float32")
    info = q4.describe()
    assert (info["quantization"], info["resolved_quantization"]) == ("auto", "q4_1-exact")
    assert info["quantization_reason"].startswith("auto: q4_1-exact, the GGUF stores its matrices as 210 Q4_1, 1 Q8_0")
    assert info["quantization_detail"].startswith("q4_1-exact: 210 of 210 linear weights kept")
    assert info["weight_bytes"] < 0.2 * engine.describe()["weight_bytes"]
    greedy = {"max_new_tokens": 32, "temperature": 0, "ignore_eos": True}
    same = 0
    for question in CHATS:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
        same += q4.generate(input_ids=prompt, sampling_params=greedy).output_ids == (
            engine.generate(input_ids=prompt, sampling_params=greedy).output_ids
        )
    print(f"default (q4_1-exact) vs float32: {same} of {len(CHATS)} greedy answers identical")
    assert same >= 4
