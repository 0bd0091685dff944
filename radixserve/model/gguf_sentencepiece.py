"""SentencePiece-style GGUF vocabularies (``tokenizer.ggml.model == "llama"``) as ``tokenizers`` BPE pipelines.

Llama 2, Mistral v0.1, Gemma and Phi-3 files store a SentencePiece BPE vocabulary: pieces spelled
with "▁" for a space, a score per piece, token types, and the 256 ``<0x..>`` byte tokens a piece
falls back to for a character the vocabulary lacks. There are no merges in the file: they are
recovered from the vocabulary, the best-scoring piece's merge first (what SentencePiece's BPE does
at encode time). The three layouts below are the ones transformers builds for these families (its
``LlamaTokenizer`` / ``GemmaTokenizer`` pipelines and its Phi-3 variant), chosen by architecture
because nothing in the file says which a model wants; tests compare every piece with its build.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

SPACE = "\u2581"  # SentencePiece's visible space
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def sentencepiece_layout(architecture: str) -> str:
    """Which of the three pipelines a file of this architecture gets: gemma, phi3 or llama."""
    return "gemma" if architecture in GEMMA_ARCHITECTURES else "phi3" if architecture == "phi3" else "llama"


def sentencepiece_backend(architecture: str, tokens: Sequence[str], scores: Sequence[float]) -> RustTokenizer:
    """The BPE pipeline of this family's SentencePiece vocabulary (tokens in file order)."""
    layout = sentencepiece_layout(architecture)
    if layout == "gemma":
        return _gemma(tokens)
    backend = _bpe(tokens, dict(zip(tokens, scores)))
    if layout == "phi3":
        # Phi-3 prepends "▁" to every text (not just the first piece) with a normalizer, no splitting.
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    else:  # Llama 2 / Mistral: "▁" before the first piece, spaces spelled "▁".
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return backend


def _gemma(tokens: Sequence[str]) -> RustTokenizer:
    """Gemma: no prefix space; a run of spaces stored as real spaces is the piece "▁▁..."; the file
    order (not the scores) ranks the merges."""
    spelled = [SPACE * len(token) if " " in token and not token.strip() else token for token in tokens]
    backend = _bpe(spelled, {token: -index for index, token in enumerate(spelled)}, unk_token="<unk>")
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend


def _bpe(tokens: Sequence[str], ranks: dict[str, float], unk_token: str | None = None) -> RustTokenizer:
    """Byte-fallback BPE whose merges are recovered from ``ranks`` (higher merges first).

    ``unk_token``: GemmaTokenizer names "<unk>" in its model (a piece no byte covers never occurs);
    LlamaTokenizer names none."""
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = recover_merges(vocab, ranks)
    model = BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True, dropout=None)
    return RustTokenizer(model)


def recover_merges(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """Every (left, right) split of a piece into two pieces, ordered by the merged piece's rank (best
    first), then longer left and right first; splits of one piece in vocabulary order.

    The order transformers uses (``generate_merges``), so both builds give the same merge table."""
    merges: list[tuple[float, int, int, str, str]] = []
    for piece, rank in ranks.items():
        splits = [(piece[:cut], piece[cut:]) for cut in range(1, len(piece))]
        known = [(left, right) for left, right in splits if left in vocab and right in vocab]
        local = sorted(known, key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((rank, len(left), len(right), left, right) for left, right in local)
    # Stable sort on (rank, len(left), len(right)), best rank first: Python's sort with reverse=True
    # keeps equal keys in order, as transformers' sorted(..., reverse=True) does.
    merges.sort(key=lambda merge: merge[:3], reverse=True)
    return [(left, right) for *_, left, right in merges]
