"""core's prompt-shape guards: one prompt or a batch, as the engine and both APIs tell them apart."""

from __future__ import annotations

from radixserve.core import is_texts, is_token_ids


def test_one_prompt_of_token_ids_is_not_a_batch() -> None:
    assert is_token_ids([5, 6]) and is_token_ids((5, 6)) and is_token_ids([])  # empty: one (empty) prompt
    assert not is_token_ids([[5, 6], [7]]) and not is_token_ids("w5 w6") and not is_token_ids(["w5"])


def test_a_batch_of_texts() -> None:
    assert is_texts(["a", "b"]) and is_texts(("a",))
    assert not is_texts([]) and not is_texts("ab") and not is_texts([1, 2]) and not is_texts(["a", 1])
