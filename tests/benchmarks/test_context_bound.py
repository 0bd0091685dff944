"""``bench speculative``'s bound for drafts from context: the fewest forwards a copying drafter could take."""

from benchmarks.speculative import context_bound


def test_a_copied_span_takes_one_forward_per_draft_run():
    prompt = list(range(1, 21))
    answer = list(range(5, 21))  # 16 tokens: the first from the prefill, then 15 decoded
    # [20, 5] occurs nowhere, so the first decoded token (6) takes a forward of its own; from then on each
    # forward takes 4 drafts and its own token: 5, 5, then the last 4.
    assert context_bound([(prompt, answer)], max_draft=4) == 4 / 15
    assert context_bound([(prompt, answer)], max_draft=16) == 2 / 15


def test_nothing_to_copy_is_one_forward_a_token():
    assert context_bound([([1, 2, 3], [10, 11, 12, 13, 14])], max_draft=8) == 1.0
    assert context_bound([([1, 2, 3], [10, 11, 10, 11, 10, 11])], max_draft=8) < 1.0  # its own output repeats


def test_earlier_requests_answers_are_drafts_the_prompt_does_not_hold():
    shape = [50, 51, 52, 53, 54, 55, 56, 57]
    first, second = ([1, 2], [9, *shape]), ([3, 4], [9, *shape])
    alone = context_bound([second], max_draft=8)
    after = context_bound([first, second], max_draft=8)
    # The first answer: a forward a token (8); the second: [4, 9] occurs nowhere, so 50 takes a forward, then
    # [9, 50] is in the first answer and the last 7 tokens come in one.
    assert alone == 1.0 and after == (8 + 2) / 16
