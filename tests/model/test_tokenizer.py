"""Tokenizer from the embedded SmolLM2 GGUF: round trips, ChatML, eos ids, streaming, stop strings.

The tokenizer is loaded once per module (a few seconds) with sockets disabled, proving it
never needs the network. Compared only against itself: no hub access.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixserve.model.gguf_loader import default_model_path
from radixserve.model.tokenizer import IncrementalDecoder, StopMatch, Tokenizer, find_stop, partial_stop_len

SAMPLES = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines\n\n",
    "héllo wörld, naïve café",
    "日本語のテキスト and 中文",
    "emoji 😀🎉 family 👨‍👩‍👧 flag 🇫🇷",
    "numbers 1234567890 and code: def f(x): return x**2",
]
CHATML_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def _no_network(*args: object, **kwargs: object) -> None:
    raise AssertionError("the tokenizer tried to reach the network")


@pytest.fixture(scope="module")
def tok() -> Iterator[Tokenizer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", _no_network)
        patch.setattr(socket, "create_connection", _no_network)
        tokenizer = Tokenizer.from_model_path(None)
    yield tokenizer


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_vocab_and_special_tokens(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.encode("Hi") == tok.encode("Hi", add_special_tokens=False)  # SmolLM2 adds no BOS
    im_end = tok.hf.get_vocab()["<|im_end|>"]
    assert im_end in tok.eos_token_ids
    assert len(set(tok.eos_token_ids)) == len(tok.eos_token_ids)
    assert tok.decode([*tok.encode("a"), im_end]) == "a"
    assert tok.decode([*tok.encode("a"), im_end], skip_special_tokens=False) == "a<|im_end|>"


def test_chat_template_chatml(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    text = tok.render_chat(messages)
    assert text == CHATML_SYSTEM + "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert ids[0] == tok.hf.get_vocab()["<|im_start|>"]  # special tokens stay single ids
    assert tok.render_chat(messages, add_generation_prompt=False).endswith("Hi<|im_end|>\n")
    own_system = [{"role": "system", "content": "Be brief."}, *messages]
    assert tok.render_chat(own_system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


@pytest.mark.parametrize("text", SAMPLES)
def test_incremental_decode_token_by_token(tok: Tokenizer, text: str) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say something."}])
    ids = tok.encode(text)
    decoder = IncrementalDecoder(tok, prompt_ids=prompt)
    deltas = [decoder.push([i]) for i in ids]
    deltas.append(decoder.flush())
    assert "".join(deltas) == decoder.text == text
    assert not any("\ufffd" in d for d in deltas)


def test_incremental_decode_holds_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    assert len(ids) > 1  # byte-level: the emoji's 4 bytes span several tokens
    decoder = IncrementalDecoder(tok)
    assert [decoder.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert decoder.push(ids[-1:]) == "😀"


def test_incremental_decode_skips_special_tokens(tok: Tokenizer) -> None:
    im_end = tok.hf.get_vocab()["<|im_end|>"]
    decoder = IncrementalDecoder(tok)
    deltas = [decoder.push([i]) for i in [*tok.encode("ok"), im_end, *tok.encode(" then")]]
    assert "".join(deltas) + decoder.flush() == "ok then"


def test_find_stop() -> None:
    assert find_stop("Hello world. Bye", ["Bye", "."]) == StopMatch("Hello world", ".")
    assert find_stop("abc</s>def", ["</s>", "</"]) == StopMatch("abc", "</s>")  # tie: the longer
    assert find_stop("no stop here", ["STOP", ""]) is None
    assert find_stop("a.b.c", ["."], start=2) == StopMatch("a.b", ".")
    assert find_stop("😀 stop", ["stop"]) == StopMatch("😀 ", "stop")


def test_partial_stop_len() -> None:
    assert partial_stop_len("Hello <|im", ["<|im_end|>"]) == 4
    assert partial_stop_len("Hello <", ["<|im_end|>", "<<"]) == 1
    assert partial_stop_len("Hello", ["<|im_end|>"]) == 0
    assert partial_stop_len("ab", ["ab"]) == 0  # a whole stop is find_stop's job
    assert partial_stop_len("x", ["", "xyz"]) == 1


def test_streaming_stop_over_token_boundaries(tok: Tokenizer) -> None:
    stops = ["END"]
    decoder = IncrementalDecoder(tok)
    for token in tok.encode("first part E" + "ND second part"):
        decoder.push([token])
        match = find_stop(decoder.text, stops)
        if match is not None:
            break
    assert match == StopMatch("first part ", "END")


def test_from_hf_folder_matches_gguf(tok: Tokenizer, tmp_path: Path) -> None:
    tok.hf.save_pretrained(tmp_path)
    folder_tok = Tokenizer.from_model_path(tmp_path)
    assert folder_tok.chat_template == tok.chat_template
    assert folder_tok.eos_token_ids == tok.eos_token_ids and folder_tok.vocab_size == tok.vocab_size
    for text in SAMPLES:
        assert folder_tok.encode(text) == tok.encode(text)


def test_from_model_path_rejects_other_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_model_path(tmp_path)
    assert Path(default_model_path()).is_file()


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_continuation_is_what_the_incremental_decoder_streams(tok: Tokenizer, text: str) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say something."}])
    ids = tok.encode(text, add_special_tokens=False)
    decoder = IncrementalDecoder(tok, prompt_ids=prompt)
    streamed = "".join(decoder.push([i]) for i in ids) + decoder.flush()
    assert tok.decode_continuation(ids, prompt) == streamed == text
