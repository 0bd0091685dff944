"""Workload generators keep their documented shapes; traces, arrivals, text and working sets are exact."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.traces import load_trace, save_trace, text_of, with_poisson_arrivals, working_set_tokens
from benchmarks.workloads import (
    WORKLOADS,
    TraceRequest,
    agent_loop,
    branching,
    fewshot_burst,
    generated_shared_prefix,
    make_workload,
    no_sharing,
    rag,
    rag_shift,
    support_agent,
)
from radixserve.cache.core.key import common_prefix_len


def same(a: list[TraceRequest], b: list[TraceRequest]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x.prompt, y.prompt)
        and np.array_equal(x.output, y.output)
        and (x.extra_key, x.timestamp) == (y.extra_key, y.timestamp)
        for x, y in zip(a, b)
    )


def is_prefix(prefix: np.ndarray, seq: np.ndarray) -> bool:
    return len(prefix) <= len(seq) and np.array_equal(seq[: len(prefix)], prefix)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_every_workload_is_seeded(name: str) -> None:
    a, b = make_workload(name, 40, seed=1), make_workload(name, 40, seed=1)
    assert same(a, b) and not same(a, make_workload(name, 40, seed=2))
    assert all(r.prompt.dtype == np.int64 and r.output.dtype == np.int64 for r in a)
    assert all(3 <= r.prompt.min() and r.prompt.max() < 49_152 for r in a)


def test_support_agent_shares_the_preamble_and_embeds_earlier_turns() -> None:
    trace = support_agent(num_users=4, turns_per_user=3, seed=5)
    preamble = trace[0].prompt[: 512 + 1543]
    assert all(is_prefix(preamble, r.prompt) for r in trace)
    # Each user's later turn starts with that user's previous prompt + reply: 4 first turns, 8 that extend.
    extends = [
        any(is_prefix(np.concatenate([e.prompt, e.output]), r.prompt) for e in trace[:i]) for i, r in enumerate(trace)
    ]
    assert extends.count(True) == 8 and all(r.timestamp is None for r in trace)


def test_agent_loop_turns_extend_the_previous_prompt_by_a_call_and_a_result() -> None:
    trace = agent_loop(num_agents=3, turns=4, system_len=16, tools_len=32, result_len=(5, 9), seed=4)
    assert [(r.session, r.turn) for r in trace] == [(a, t) for a in range(3) for t in range(4)]
    assert all(is_prefix(trace[0].prompt[:48], r.prompt) for r in trace)
    for before, after in zip(trace, trace[1:]):
        if before.session == after.session:
            grown = len(after.prompt) - len(before.prompt) - len(before.output)
            assert is_prefix(np.concatenate([before.prompt, before.output]), after.prompt) and 5 <= grown <= 9
        else:  # another agent: only the preamble in common
            assert common_prefix_len(before.prompt, after.prompt) == 48


def test_agent_loop_sessions_round_trip_through_a_trace_file(tmp_path: Path) -> None:
    trace = agent_loop(num_agents=2, turns=3, system_len=8, tools_len=8, result_len=(5, 9), seed=1)
    save_trace(trace, tmp_path / "agents.jsonl")
    back = load_trace(tmp_path / "agents.jsonl")
    assert [(r.session, r.turn) for r in back] == [(r.session, r.turn) for r in trace]
    assert all(np.array_equal(a.prompt, b.prompt) for a, b in zip(trace, back))


def test_generated_shared_prefix_groups_share_exactly_the_system_prompt() -> None:
    trace = generated_shared_prefix(
        num_groups=5, prompts_per_group=4, system_prompt_len=64, question_len=16, output_len=8
    )
    assert len(trace) == 20
    assert all(len(r.prompt) == 80 and len(r.output) == 8 for r in trace)
    group = [int(r.prompt[0]) for r in trace]  # system prompts start with distinct tokens
    assert sorted(Counter(group).values()) == [4] * 5
    for i, a in enumerate(trace):
        for j, b in enumerate(trace[i + 1 :], i + 1):
            assert common_prefix_len(a.prompt, b.prompt) == (64 if group[i] == group[j] else 0)
    # Shuffled: the groups interleave. Grouped: each group's requests are adjacent.
    assert sum(x != y for x, y in zip(group, group[1:])) > 4
    grouped = [int(r.prompt[0]) for r in generated_shared_prefix(5, 4, 64, 16, 8, grouped=True)]
    assert sum(x != y for x, y in zip(grouped, grouped[1:])) == 4


def test_rag_follows_zipf_popularity_behind_one_system_prompt() -> None:
    trace = rag(num_requests=400, num_docs=50, system_len=32, doc_len=(40, 60), seed=3)
    system = trace[0].prompt[:32]
    assert all(is_prefix(system, r.prompt) for r in trace)
    hits = Counter(int(r.prompt[32]) for r in trace)  # a document's first token names it
    assert max(hits.values()) > 5 * 400 / 50  # the most popular doc: far above uniform
    assert min(hits.values()) < 400 / 50 and len(hits) < 50  # the tail: below uniform, some never asked
    # Same document, same tokens: two requests on one doc share system + the whole doc.
    first, second = [r for r in trace if int(r.prompt[32]) == hits.most_common(1)[0][0]][:2]
    assert common_prefix_len(first.prompt, second.prompt) >= 32 + 40


def test_rag_shift_flips_popularity_halfway_and_keeps_the_first_half() -> None:
    params = dict(num_docs=50, system_len=32, doc_len=(40, 60), seed=3)
    plain, shifted = rag(num_requests=400, **params), rag_shift(num_requests=400, **params)  # type: ignore[arg-type]
    assert same(plain[:200], shifted[:200])  # the same trace until the flip
    hot_before = Counter(int(r.prompt[32]) for r in shifted[:200]).most_common(5)
    hot_after = Counter(int(r.prompt[32]) for r in shifted[200:]).most_common(5)
    assert not {doc for doc, _ in hot_before} & {doc for doc, _ in hot_after}  # the hot set changed
    assert hot_after[0][1] > 5 * 200 / 50  # and it is as skewed as before


def test_branching_children_extend_parent_prompt_and_output() -> None:
    trace = branching(num_trees=3, fanout=2, depth=3, root_len=50, step_len=(5, 9), output_len=(3, 6), seed=4)
    assert len(trace) == 3 * (1 + 2 + 4)
    roots = [r for r in trace if len(r.prompt) == 50]
    assert len(roots) == 3 and len({int(r.prompt[0]) for r in roots}) == 3
    for i, child in enumerate(trace):
        if len(child.prompt) == 50:
            continue
        parents = [p for p in trace[:i] if is_prefix(np.concatenate([p.prompt, p.output]), child.prompt)]
        steps = [len(child.prompt) - len(p.prompt) - len(p.output) for p in parents]
        assert any(5 <= s <= 9 for s in steps)  # the parent came earlier; the child adds one step
    first_roots = [i for i, r in enumerate(trace) if len(r.prompt) == 50]
    assert first_roots != [0, 7, 14]  # trees interleave rather than run one after another


@pytest.mark.parametrize("vocab_size", [49_152, 20])
def test_no_sharing_prompts_share_no_first_block(vocab_size: int) -> None:
    trace = no_sharing(num_requests=60, prompt_len=(20, 40), output_len=(1, 5), vocab_size=vocab_size)
    assert len({tuple(r.prompt[:16].tolist()) for r in trace}) == 60
    head_len = 1 if vocab_size > 60 else 2  # a small vocabulary: distinct first token pairs
    assert len({tuple(r.prompt[:head_len].tolist()) for r in trace}) == 60


def test_fewshot_burst_bursts_are_timed_and_cold() -> None:
    one, three = fewshot_burst(4, 100, 10, seed=2), fewshot_burst(4, 100, 10, seed=2, num_bursts=3, burst_interval=2.5)
    assert same(one, three[:4])  # num_bursts=1 is the old workload; later bursts follow
    assert [r.timestamp for r in three] == [0.0] * 4 + [2.5] * 4 + [5.0] * 4
    assert common_prefix_len(three[0].prompt, three[1].prompt) >= 100
    assert common_prefix_len(three[0].prompt, three[4].prompt) < 100


def test_make_workload_scales_and_rejects_unknown_names() -> None:
    assert len(make_workload("rag", 37)) == 37
    assert len(make_workload("support-agent", 10, turns_per_user=3)) == 12  # 4 users x 3 turns
    assert len(make_workload("generated-shared-prefix", 20, prompts_per_group=8, system_prompt_len=16)) == 24
    assert len(make_workload("branching", 30, fanout=2, depth=2, root_len=10)) == 30  # 10 trees x 3 nodes
    assert len(make_workload("fewshot-burst", 10, num_bursts=2, shared_len=10)) == 10
    assert len(make_workload("no-sharing")) == 1000  # None: the generator's defaults
    with pytest.raises(ValueError, match="no-sharing"):
        make_workload("nope", 10)
    with pytest.raises(TypeError):
        make_workload("rag", 10, not_an_option=1)


def test_trace_round_trip(tmp_path: Path) -> None:
    trace = with_poisson_arrivals(fewshot_burst(3, 20, 5, seed=1), rate=7.0)
    trace[1] = TraceRequest(trace[1].prompt, trace[1].output, extra_key="tenant-a", timestamp=None)
    save_trace(trace, tmp_path / "t.jsonl")
    back = load_trace(tmp_path / "t.jsonl")
    assert [len(r.output) for r in back] == [len(r.output) for r in trace]
    assert all(np.array_equal(a.prompt, b.prompt) and a.extra_key == b.extra_key for a, b in zip(trace, back))
    assert [r.timestamp for r in back] == pytest.approx([r.timestamp for r in trace])
    assert len(load_trace(tmp_path / "t.jsonl", limit=2)) == 2


def test_mooncake_lines_map_hash_ids_to_shared_blocks(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [7, 8, 9]},
        {"timestamp": 1500, "input_length": 7, "output_length": 2, "hash_ids": [7, 5]},
    ]
    (tmp_path / "m.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    a, b = load_trace(tmp_path / "m.jsonl", block_size=4)
    assert len(a.prompt) == 10 and len(b.prompt) == 7  # the partial last block is cut to input_length
    assert np.array_equal(a.prompt[:4], b.prompt[:4]) and not np.array_equal(a.prompt[4:7], b.prompt[4:7])
    assert (a.timestamp, b.timestamp) == (0.0, 1.5) and (len(a.output), len(b.output)) == (3, 2)


@pytest.mark.parametrize(
    "bad",
    [
        "{not json",
        '{"input_length": 10, "output_length": 1, "hash_ids": [1]}',  # too few blocks for 10 tokens
        '{"input_ids": [1, "x"], "output_length": 1}',
        '{"input_ids": [1, 2], "output_length": -1}',
        '{"input_length": 2, "hash_ids": [1]}',
    ],
)
def test_malformed_line_names_its_number(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"input_ids": [5, 6], "output_length": 1}\n\n' + bad + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3"):
        load_trace(path, block_size=4)


def test_poisson_arrivals() -> None:
    trace = no_sharing(num_requests=2000, prompt_len=(1, 1), output_len=(1, 1))
    times = [r.timestamp or 0.0 for r in with_poisson_arrivals(trace, rate=50.0, seed=3)]
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] == pytest.approx(2000 / 50, rel=0.1)  # mean gap 1 / rate
    assert all(r.timestamp == 0.0 for r in with_poisson_arrivals(trace[:5], rate=float("inf")))
    with pytest.raises(ValueError):
        with_poisson_arrivals(trace, rate=0.0)


tokens = st.lists(st.integers(0, 200_000), max_size=20)


@given(tokens, tokens)
def test_text_of_keeps_prefixes_and_tells_tokens_apart(a: list[int], b: list[int]) -> None:
    text_a, text_ab = text_of(a), text_of(a + b)
    assert text_ab.startswith(text_a) and text_a.count(" ") == max(len(a) - 1, 0)
    assert (text_of(a) == text_of(b)) == (a == b)
    words_a, words_b = text_a.split(" "), text_of(b).split(" ")
    if a and b:
        assert (words_a[0] == words_b[0]) == (a[0] == b[0])


def test_working_set_counts_shared_prefixes_once_per_namespace() -> None:
    def req(prompt: list[int], output: list[int], extra_key: str | None = None) -> TraceRequest:
        return TraceRequest(np.array(prompt, dtype=np.int64), np.array(output, dtype=np.int64), extra_key)

    trace = [
        req([1, 2, 3, 4], [5, 6]),  # 6 new
        req([1, 2, 3, 9], [7]),  # shares 1 2 3: 2 new
        req([1, 2, 3, 4, 5, 6, 8], []),  # extends the first turn: 1 new
        req([1, 2, 3, 4], [5, 6], extra_key="b"),  # same tokens, other namespace: 6 new
        req([1, 2], []),  # already held
    ]
    assert working_set_tokens(trace) == 6 + 2 + 1 + 6
    assert working_set_tokens([]) == 0
    gsp = generated_shared_prefix(num_groups=3, prompts_per_group=5, system_prompt_len=30, question_len=7, output_len=4)
    assert working_set_tokens(gsp) == 3 * 30 + 15 * (7 + 4)


def test_chat_and_one_offs_alternates_conversation_turns_with_unrelated_prompts() -> None:
    trace = make_workload("chat-and-one-offs", 48, seed=2)
    assert len(trace) == 48
    chats, one_offs = trace[0::2], trace[1::2]
    preamble = chats[0].prompt[: 512 + 1543]
    assert all(is_prefix(preamble, r.prompt) for r in chats)
    assert len({int(r.prompt[0]) for r in one_offs}) == len(one_offs)  # no two one-offs share a first token
