"""The front's relay of a replica's streamed body when the replica dies mid-stream (issue 37, item 7): an event
stream ends with an error event and [DONE] (it was a cut chunked body, with neither); a client that leaves
cancels the replica's side."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("ray")
from radixserve.router.deployments import _body  # noqa: E402


class FakeStream:
    """A Ray streaming response: some chunks, then (``dies``) the replica's death."""

    def __init__(self, chunks: list[bytes], dies: bool) -> None:
        self.chunks, self.dies, self.cancelled = chunks, dies, False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._parts()

    async def _parts(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.dies:
            raise RuntimeError("ActorDiedError: the replica's process exited")

    def cancel(self) -> None:
        self.cancelled = True


async def relayed(stream: FakeStream, events: bool) -> bytes:
    return b"".join([part async for part in _body(stream, events)])


def test_a_stream_whose_replica_dies_ends_with_an_error_event_and_done() -> None:
    stream = FakeStream([b'data: {"choices": []}\n\n'], dies=True)
    body = asyncio.run(relayed(stream, events=True)).decode()
    events = [line.removeprefix("data: ") for line in body.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "replica_unavailable" and "failed" in error["message"]
    assert not stream.cancelled


def test_other_bodies_just_end_and_whole_streams_are_unchanged() -> None:
    assert asyncio.run(relayed(FakeStream([b'{"a": 1'], dies=True), events=False)) == b'{"a": 1'
    whole = [b"data: 1\n\n", b"data: [DONE]\n\n"]
    assert asyncio.run(relayed(FakeStream(whole, dies=False), events=True)) == b"".join(whole)


def test_a_client_that_leaves_cancels_the_replica_side() -> None:
    stream = FakeStream([b"data: 1\n\n", b"data: 2\n\n"], dies=False)

    async def leave_after_one() -> None:
        parts = _body(stream, True)
        await parts.__anext__()
        await parts.aclose()

    asyncio.run(leave_after_one())
    assert stream.cancelled
