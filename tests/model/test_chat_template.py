"""Chat templates: from a GGUF's ``tokenizer.chat_template``, an HF folder's chat_template.jinja or
tokenizer_config.json, or a ``--chat-template`` file; rendered as transformers' apply_chat_template
renders them; the model's own end-of-turn tokens stop generation.

The templates are small versions of the families' own (ChatML / Qwen, Llama 3, Gemma, Mistral
[INST], Phi-3), written here; the vocabulary is the test GGUF of test_tokenizer_gguf.py, which has
every family's turn markers as control tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers import AutoTokenizer

from radixserve.engine.config import EngineConfig
from radixserve.model.chat_template import NoChatTemplate
from radixserve.model.tokenizer import Tokenizer
from tests.model.test_tokenizer_gguf import transformers_gguf_tokenizer, write_tokenizer_gguf

ALTERNATE = (
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
)
TEMPLATES = {
    "chatml": (
        "{%- if tools %}{{- '<|im_start|>system\\n<tools>' + tools | tojson + '</tools><|im_end|>\\n' }}{%- endif %}"
        "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    "llama3": (
        "{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
    ),
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{% for message in messages %}" + ALTERNATE + "{% if message['role'] == 'assistant' %}"
        "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role "
        "+ '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for message in messages %}" + ALTERNATE + "{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
        "{{ message['content'] + eos_token }}{% else %}{{ raise_exception('Only user and assistant roles are "
        "supported!') }}{% endif %}{% endfor %}"
    ),
    "phi3": (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
    ),
}
CONVERSATION = [
    {"role": "user", "content": "Hi 😀"},
    {"role": "assistant", "content": " Hello!\n"},
    {"role": "user", "content": "日本語で 2+2?"},
]
# What each template renders for CONVERSATION with a generation prompt (bos <|im_start|>, eos <|im_end|>
# in the test vocabulary): written out by hand, a check independent of transformers.
EXPECTED = {
    "chatml": "<|im_start|>user\nHi 😀<|im_end|>\n<|im_start|>assistant\n Hello!\n<|im_end|>\n"
    "<|im_start|>user\n日本語で 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|im_start|><|start_header_id|>user<|end_header_id|>\n\nHi 😀<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>"
    "\n\n日本語で 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma": "<|im_start|><start_of_turn>user\nHi 😀<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
    "<start_of_turn>user\n日本語で 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "mistral": "<|im_start|>[INST] Hi 😀 [/INST] Hello!\n<|im_end|>[INST] 日本語で 2+2? [/INST]",
    "phi3": "<|user|>\nHi 😀<|end|>\n<|assistant|>\n Hello!\n<|end|>\n<|user|>\n日本語で 2+2?<|end|>\n<|assistant|>\n",
}
# The end-of-turn token each template writes: generation must stop on it.
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>", "phi3": "<|end|>"}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("chat")
    return {
        name: write_tokenizer_gguf(folder / f"{name}.gguf", "llama-bpe", chat_template=t)
        for name, t in TEMPLATES.items()
    }


def _theirs(tok: Any, messages: list[dict[str, str]], add_generation_prompt: bool, **kwargs: Any) -> str:
    return str(tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs))


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_gguf_template_renders_as_transformers(gguf_files: dict[str, Path], name: str) -> None:
    ours, theirs = Tokenizer.from_gguf(gguf_files[name]), transformers_gguf_tokenizer(gguf_files[name])
    assert ours.chat_template == TEMPLATES[name] and ours.chat_template_source == "GGUF tokenizer.chat_template"
    assert ours.render_chat(CONVERSATION) == EXPECTED[name] == _theirs(theirs, CONVERSATION, True)
    for messages in (CONVERSATION[:1], CONVERSATION[:2]):
        for prompt in (True, False):
            assert ours.render_chat(messages, prompt) == _theirs(theirs, messages, prompt)
    expected_ids = theirs.encode(EXPECTED[name], add_special_tokens=False)
    assert ours.apply_chat_template(CONVERSATION) == expected_ids  # the template writes its own BOS: no second one


def test_tools_are_passed_as_transformers_passes_them(gguf_files: dict[str, Path]) -> None:
    ours, theirs = Tokenizer.from_gguf(gguf_files["chatml"]), transformers_gguf_tokenizer(gguf_files["chatml"])
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    assert ours.render_chat(CONVERSATION, tools=tools) == _theirs(theirs, CONVERSATION, True, tools=tools)
    assert "<tools>" in ours.render_chat(CONVERSATION, tools=tools) and "<tools>" not in ours.render_chat(CONVERSATION)


@pytest.mark.parametrize("name", ["gemma", "mistral"])
def test_raise_exception_in_a_template_is_an_error(gguf_files: dict[str, Path], name: str) -> None:
    with pytest.raises(jinja2.TemplateError, match="alternate"):
        Tokenizer.from_gguf(gguf_files[name]).render_chat([CONVERSATION[0], CONVERSATION[0]])


def test_the_sandbox_refuses_unsafe_templates(tmp_path: Path) -> None:
    unsafe = "{{ messages.__class__.__mro__ }}"
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf", "llama-bpe", chat_template=unsafe))
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.render_chat(CONVERSATION)


@pytest.mark.parametrize("name", sorted(END_OF_TURN))
def test_the_templates_end_of_turn_token_stops_generation(gguf_files: dict[str, Path], name: str) -> None:
    tok = Tokenizer.from_gguf(gguf_files[name])
    vocab = tok.hf.get_vocab()
    assert vocab[END_OF_TURN[name]] in tok.eos_token_ids and tok.eos_token_ids[0] == tok.hf.eos_token_id


def test_the_files_eot_token_id_stops_generation(tmp_path: Path) -> None:
    """``tokenizer.ggml.eot_token_id`` counts even where the template does not write the token."""
    path = write_tokenizer_gguf(
        tmp_path / "t.gguf", "llama-bpe", chat_template=TEMPLATES["mistral"], eot_token="<|end|>"
    )
    tok = Tokenizer.from_gguf(path)
    assert tok.hf.get_vocab()["<|end|>"] in tok.eos_token_ids


def test_no_template_is_an_error_naming_the_flag(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(write_tokenizer_gguf(tmp_path / "t.gguf", "llama-bpe", chat_template=None))
    assert tok.chat_template is None and tok.chat_template_source == "none"
    with pytest.raises(NoChatTemplate, match="--chat-template PATH"):
        tok.apply_chat_template(CONVERSATION)


def test_chat_template_flag_overrides_the_models_template(tmp_path: Path, gguf_files: dict[str, Path]) -> None:
    template = tmp_path / "llama3.jinja"
    template.write_text(TEMPLATES["llama3"], encoding="utf-8")
    tok = Tokenizer.from_gguf(gguf_files["chatml"]).with_chat_template(template)
    assert tok.render_chat(CONVERSATION) == EXPECTED["llama3"]
    assert tok.chat_template_source == f"--chat-template {template}"
    assert tok.hf.get_vocab()["<|eot_id|>"] in tok.eos_token_ids  # the override's end-of-turn token stops too
    assert EngineConfig(chat_template=str(template)).chat_template == str(template)
    with pytest.raises(ValueError, match="chat_template .* is not a file"):
        EngineConfig(chat_template=str(tmp_path / "missing.jinja"))


def _hf_folder(folder: Path, gguf: Path, where: str) -> Path:
    """An HF tokenizer folder of the GGUF's vocabulary, its chat template in ``where``."""
    hf = Tokenizer.from_gguf(gguf).hf
    template = hf.chat_template
    hf.chat_template = None
    hf.save_pretrained(str(folder))
    for name in ("chat_template.jinja", "chat_template.json"):
        (folder / name).unlink(missing_ok=True)
    if where == "chat_template.jinja":
        (folder / where).write_text(template, encoding="utf-8")
    else:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        (folder / "tokenizer_config.json").write_text(
            json.dumps({**config, "chat_template": template}), encoding="utf-8"
        )
    return folder


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
def test_hf_folder_template_renders_as_transformers(tmp_path: Path, gguf_files: dict[str, Path], where: str) -> None:
    folder = _hf_folder(tmp_path / "model", gguf_files["llama3"], where)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}), encoding="utf-8")
    ours = Tokenizer.from_hf_folder(folder)
    theirs = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert ours.chat_template == TEMPLATES["llama3"] and ours.chat_template_source == f"model/{where}"
    for prompt in (True, False):
        assert ours.render_chat(CONVERSATION, prompt) == _theirs(theirs, CONVERSATION, prompt)
    assert set(ours.eos_token_ids) == {2, 5, ours.hf.get_vocab()["<|eot_id|>"]}  # generation_config.json's too


def test_start_up_report_names_the_tokenizer_and_template_source(gguf_files: dict[str, Path]) -> None:
    tok = Tokenizer.from_gguf(gguf_files["chatml"])
    assert tok.kind == "byte-level BPE, pre-tokenizer 'llama-bpe' (GGUF)"
    assert tok.chat_template_source == "GGUF tokenizer.chat_template"
