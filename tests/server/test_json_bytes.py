"""Non-streamed answers are encoded on a worker thread, a list's items one encoder call each (issue 37, item 5: a
100 MB answer encoded in one call held the GIL and stalled /health): the bytes are JSONResponse's exactly."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.responses import JSONResponse
from hypothesis import given
from hypothesis import strategies as st

from radixserve.server.app import json_bytes

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@given(body=st.dictionaries(st.text(max_size=8), JSON, max_size=4), choices=st.lists(JSON, max_size=5))
def test_the_bytes_are_json_responses(body: dict[str, Any], choices: list[Any]) -> None:
    answer = {**body, "choices": choices}
    assert json_bytes(answer) == JSONResponse(answer).body
    assert json_bytes([answer, body]) == JSONResponse([answer, body]).body


@pytest.mark.parametrize("text", ['"choices"', "choices-", "\u00e9\u6f22\U0001f600", '\\"x\\"', "</script>"])
def test_texts_that_look_like_the_splice_are_kept(text: str) -> None:
    answer = {"id": text, "choices": [{"text": text, "index": i} for i in range(3)], "usage": {text: 1}}
    assert json.loads(json_bytes(answer)) == answer
    assert json_bytes(answer) == JSONResponse(answer).body
