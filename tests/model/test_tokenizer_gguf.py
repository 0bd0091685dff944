"""Our GGUF tokenizer build (gguf_tokenizer.py) against transformers' own GGUF conversion, on tiny
GGUFs the test writes (one per pre-tokenizer we claim to build exactly) and on the embedded SmolLM2.

Every check compares the two builds on the same file: encodes, decodes, special tokens, eos ids
and the serialised ``tokenizers`` pipeline. Nothing is compared against hard-coded ids.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import gguf
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from radixserve.model.gguf_loader import GGUFReader, default_model_path
from radixserve.model.gguf_tokenizer import (
    PRE_TOKENIZER_SPLITS,
    UnsupportedGGUFTokenizer,
    build_gguf_tokenizer,
    byte_alphabet,
)
from radixserve.model.loader import read_checkpoint
from radixserve.model.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ids 0-2 as SmolLM2's; then the turn markers of the chat templates the families use (test_chat_template.py).
CONTROL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "[INST]",
    "[/INST]",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]
CORPUS = [
    "Hello, world! It's 2024; we're testing: they'll see, I'd say, you've got it, I'm done.",
    "  leading spaces and\ttabs\nnew lines\n\n\n   trailing   ",
    "numbers 1234567890 3.14159 -42 1e10 0x1F 007 12,345,678",
    "a  1  12   123    1234",
    "héllo wörld, naïve café, Ærøskøbing, ĞÜŞİÖÇ",
    "日本語のテキスト and 中文，标点。 한국어 텍스트",
    "emoji 😀🎉 family 👨‍👩‍👧 flag 🇫🇷 skin 👍🏽",
    "def f(x):\n    return x**2  # square\n\nfor i in range(10):\n\tprint(f'{i:>3}')\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <|im_end|>< |im_start|> <|im_ <think>why</think>",
    "URLs: https://example.org/a?b=c&d=e#f, mail: a.b@c.de, path C:\\Users\\x",
    "\r\n\r\nwindows\r\nlines\u00a0nbsp\u2009thin\u200bzero-width",
    "MiXeD CaSe WORDS AND ALLCAPS'S DON'T STOP camelCaseWords XMLHttpRequest iPhone",
    "العربية: مرحبا بالعالم، كيف حالك؟ ١٢٣٤٥",
    "हिन्दी: नमस्ते दुनिया, आप कैसे हैं? १२३४",
    "ภาษาไทย สวัสดีครับ Ελληνικά Привет, мир! Tiếng Việt có dấu",
    "emoji ZWJ 🧑‍💻 👩🏾‍🚀 🏳️‍🌈 ❤️‍🔥 keycap 1️⃣ #️⃣",
    "int main() {\r\n\tint x = 0;\r\n\t\treturn x;\r\n}\r\n",
    "digits 3141592653589793238462643383279 0.000001 1,000,000,000 -9999999999",
    "many    spaces     and\t\t\ttabs      then text",
    "x = {'a': [1, 2, 3], \"b\": None}  # dict/list; a->b => c != d && e || f",
    "ひらがなとカタカナと漢字が混ざった文章です。東京タワーは333メートル。",
    "עברית: שלום עולם 2024, தமிழ்: வணக்கம் உலகம், ქართული ენა",
    "combining: e\u0301 a\u0308 n\u0303, ligatures: ﬁ ﬂ, fullwidth: ＡＢＣ１２３, math: ∑ x² ≤ ∞ ½",
    '| col | value |\n|-----|------:|\n| a   |  1.50 |\n\n```json\n{"k": [true, null, -0.5e-3]}\n```',
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa !!!!!!!!!!!! ............ ------------ ____________",
    "I'M HERE, YOU'LL SEE, WE'VE SAID, SHE'D GO, IT'S 'QUOTED' ''twice'' and rock'n'roll",
    "mixed中文English混合text日本語123abc",
    "    def method(self) -> None:\r\n        pass\r\n\r\n\tif x:\n\t\ty = [i for i in range(100)]",
    "tel +1 (555) 010-9999 on 2024-12-05T10:08:36Z, v1.2.3-rc.4, $1,234.56, 99.9%",
    "🏴‍☠️ 👨‍👨‍👧‍👦 🫶🏻 🤌 🇯🇵🇺🇸 ✌️ ©®™ ←→↑↓",
    "",
    " ",
    "\n",
]
CONVERSATIONS = [
    [{"role": "user", "content": "Name three colors of the rainbow."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2=? 😀"}],
    [
        {"role": "user", "content": "Write code:\n```py\nprint('hi')\n```"},
        {"role": "assistant", "content": "  Sure!\n\nprint(1234)  "},
        {"role": "user", "content": "Thanks  <|im_end|> again"},
    ],
]


def _trained_vocab(size: int = 700) -> tuple[list[str], list[str]]:
    """A byte-level BPE trained on CORPUS with no pre-tokenizer split, so its merges cross every
    boundary (spaces, digits, punctuation): how the pre-tokenizer splits then shows in the ids."""
    backend = RustTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=CONTROL,
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    return tokens, [" ".join(pair) for pair in model["merges"]]


def write_tokenizer_gguf(
    path: Path,
    pre: str,
    model: str = "gpt2",
    add_bos: bool | None = None,
    arch: str = "llama",
    chat_template: str | None = CHATML,
    eot_token: str | None = None,
) -> Path:
    """A GGUF holding only a model header and a tokenizer, as llama.cpp's converter writes one.

    ``eot_token``: written as ``tokenizer.ggml.eot_token_id``."""
    tokens, merges = _trained_vocab()
    # A user-defined token, a token spelled with a real space (re-spelled byte by byte), and a
    # control token outside the byte alphabet (a mislabel: both builds skip it).
    extra = [("<think>", 4), ("</think>", 4), (" zq", 1), ("<|bad control|>", 3)]
    types = [3 if token in CONTROL else 1 for token in tokens] + [kind for _, kind in extra]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([*tokens, *(token for token, _ in extra)])
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if eot_token is not None:
        writer.add_eot_token_id(tokens.index(eot_token))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


def corpus_for(tok: Tokenizer) -> list[str]:
    """CORPUS, chat-template renderings of CONVERSATIONS, and seeded random mixes of their characters."""
    texts = [*CORPUS, *(tok.render_chat(conv) for conv in CONVERSATIONS if tok.chat_template)]
    chars = sorted(set("".join(texts)))
    rng = random.Random(0)
    texts += ["".join(rng.choice(chars) for _ in range(rng.randint(1, 40))) for _ in range(200)]
    return texts


def assert_same_tokenizer(ours: Tokenizer, theirs: Tokenizer) -> None:
    """Same pipeline, special tokens, eos ids, encodes and decodes."""
    assert json.loads(ours.hf.backend_tokenizer.to_str()) == json.loads(theirs.hf.backend_tokenizer.to_str())
    assert ours.vocab_size == theirs.vocab_size and ours.eos_token_ids == theirs.eos_token_ids
    assert ours.chat_template == theirs.chat_template
    for attr in ("special_tokens_map", "all_special_ids", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours.hf, attr) == getattr(theirs.hf, attr), attr
    assert ours.hf.added_tokens_decoder == theirs.hf.added_tokens_decoder
    for text in corpus_for(theirs):
        for special in (True, False):
            ids = theirs.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, (text, special)
            assert ours.decode(ids) == theirs.decode(ids)
            assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    rng = random.Random(1)
    for _ in range(100):  # arbitrary id sequences: partial UTF-8, specials anywhere
        ids = [rng.randrange(theirs.vocab_size) for _ in range(rng.randint(1, 12))]
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)


def test_byte_alphabet_is_gpt2s() -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert byte_alphabet() == bytes_to_unicode()
    assert sorted(byte_alphabet().values()) == sorted(pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZER_SPLITS))
@pytest.mark.parametrize("add_bos", [None, True])
def test_tiny_gguf_equals_transformers(tmp_path: Path, pre: str, add_bos: bool | None) -> None:
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", pre, add_bos=add_bos)
    ours = Tokenizer(build_gguf_tokenizer(GGUFReader(path)))
    theirs = Tokenizer(transformers_gguf_tokenizer(path))
    assert_same_tokenizer(ours, theirs)
    assert ours.encode("x")[0] == (1 if add_bos else ours.encode("x", add_special_tokens=False)[0])
    vocab = ours.hf.get_vocab()
    assert "Ġzq" in vocab and " zq" not in vocab  # spelled in bytes
    assert "<|badĠcontrol|>" in vocab and "<|badĠcontrol|>" not in ours.hf.all_special_tokens  # a mislabel
    assert ours.encode("a<think>b", add_special_tokens=False)[1] == vocab["<think>"]  # user-defined: whole


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Tokenizer]:
    path = write_tokenizer_gguf(tmp_path_factory.mktemp("tok") / "tok.gguf", "llama-bpe")
    return Tokenizer(build_gguf_tokenizer(GGUFReader(path))), Tokenizer(transformers_gguf_tokenizer(path))


@given(st.text(max_size=60))
def test_tiny_gguf_encodes_any_text_alike(tiny_pair: tuple[Tokenizer, Tokenizer], text: str) -> None:
    ours, theirs = tiny_pair
    assert ours.encode(text) == theirs.encode(text)
    assert ours.decode(theirs.encode(text)) == theirs.decode(theirs.encode(text))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3"])
def test_tiny_gguf_equals_transformers_for_each_architecture(tmp_path: Path, arch: str) -> None:
    """transformers picks a class per architecture (Qwen2Tokenizer, GemmaTokenizer, ...) with its own
    defaults; a byte-level vocabulary under each gives the same tokenizer."""
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", "qwen2", arch=arch, add_bos=True)
    assert_same_tokenizer(
        Tokenizer(build_gguf_tokenizer(GGUFReader(path))), Tokenizer(transformers_gguf_tokenizer(path))
    )


@pytest.mark.parametrize(
    ("pre", "model", "why"),
    [
        (
            "no-such-pre",
            "gpt2",
            "tokenizer.ggml.pre .no-such-pre. is not one we know .supported: .*default, .*llama-bpe.*qwen2.*smollm",
        ),
        ("gpt-2", "bert", r"tokenizer.ggml.model 'bert' .supported: gpt2, llama\)"),
        ("llama-bpe", "llama", "a SentencePiece vocabulary with tokenizer.ggml.pre 'llama-bpe'"),
        ("default", "llama", "a SentencePiece vocabulary with no tokenizer.ggml.scores"),
    ],
)
def test_unknown_tokenizers_are_refused_naming_the_supported_ones(
    tmp_path: Path, pre: str, model: str, why: str
) -> None:
    """Never a silent fallback (to GPT-2's rules, or to transformers' conversion, which applies them)."""
    path = write_tokenizer_gguf(tmp_path / "tok.gguf", pre, model=model)
    with pytest.raises(UnsupportedGGUFTokenizer, match=why):
        build_gguf_tokenizer(GGUFReader(path))
    with pytest.raises(ValueError, match=why):
        Tokenizer.from_gguf(path)


# ---- the embedded SmolLM2 (slow: transformers' conversion of its 49k-token vocabulary takes 6-12 s) ----


@pytest.fixture(scope="module")
def smollm2_pair() -> tuple[Tokenizer, Tokenizer]:
    path = Path(default_model_path())
    return Tokenizer.from_gguf(path), Tokenizer(transformers_gguf_tokenizer(path))


@pytest.mark.slow
def test_smollm2_equals_transformers(smollm2_pair: tuple[Tokenizer, Tokenizer]) -> None:
    ours, theirs = smollm2_pair
    assert_same_tokenizer(ours, theirs)
    assert ours.hf.get_vocab()["<|im_end|>"] in ours.eos_token_ids
    assert sum(token.special for token in ours.hf.added_tokens_decoder.values()) == 17  # the file's control tokens


@pytest.mark.slow
@given(st.text(max_size=80))
def test_smollm2_encodes_any_text_alike(smollm2_pair: tuple[Tokenizer, Tokenizer], text: str) -> None:
    ours, theirs = smollm2_pair
    ids = theirs.encode(text)
    assert ours.encode(text) == ids and ours.decode(ids) == theirs.decode(ids)


@pytest.mark.slow
def test_a_gguf_load_parses_the_file_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights and tokenizer from one parse of the file; transformers' GGUF conversion never runs."""
    opened: list[object] = []
    original_init = gguf.GGUFReader.__init__

    def counting_init(self: gguf.GGUFReader, *args: object, **kwargs: object) -> None:
        opened.append(args[0])
        original_init(self, *args, **kwargs)  # type: ignore[arg-type]

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("transformers' GGUF tokenizer conversion ran")

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting_init)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_conversion)
    checkpoint = read_checkpoint(default_model_path(), torch.device("cpu"), "none")
    assert len(opened) == 1
    assert checkpoint.tokenizer.encode("Hello world") == checkpoint.tokenizer.hf.encode("Hello world")
