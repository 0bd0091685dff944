"""``bench kv-fidelity``'s teacher-forced steps: prefill chunks, then the last positions as decode steps."""

from __future__ import annotations

from benchmarks.kv_fidelity import forced_steps


def test_the_decode_tail_forces_the_last_positions_one_decode_step_each() -> None:
    assert forced_steps(10, 4, 0) == [(0, 4, "extend"), (4, 8, "extend"), (8, 10, "extend")]
    assert forced_steps(10, 4, 3) == [(0, 4, "extend"), (4, 7, "extend"), *((p, p + 1, "decode") for p in (7, 8, 9))]
    assert forced_steps(3, 4, 5) == [(0, 1, "decode"), (1, 2, "decode"), (2, 3, "decode")]  # all of a short prompt
