"""``--kv-events-config`` / ``--kv-events-endpoint`` problems are a usage error before the model loads.

What the config alone tells (a port out of range, the replay endpoint equal to the
publisher's, a buffer no high-water mark holds) is checked when the flags are parsed;
what only binding tells (a port in use, a missing ipc directory) when the server opens
its sockets, before it reads any weights. Either way: the flag and the problem on
stderr, exit code 2 as for any bad flag, no traceback.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from radixserve.kv_events.config import MAX_BUFFER_STEPS, KVEventsConfig, check_endpoint, parse_kv_events_config
from radixserve.kv_events.publisher import KVEventPublisher, KVEventsBindError
from radixserve.server.args import parse_args
from tests.support.server_process import free_port


@pytest.mark.parametrize(
    "endpoint,message",
    [
        ("tcp://127.0.0.1:99999", "port in 1..65535"),
        ("tcp://127.0.0.1:0", "port in 1..65535"),
        ("tcp://127.0.0.1", "port in 1..65535"),
        ("tcp://:5557", "port in 1..65535"),
        ("tcp://127.0.0.1:55x", "port in 1..65535"),
        ("ipc://", "names no address"),
        ("udp://127.0.0.1:5557", "must start with"),
    ],
)
def test_an_endpoint_that_no_socket_can_bind_is_refused(endpoint: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_endpoint("endpoint", endpoint)
    with pytest.raises(ValueError, match=message):
        KVEventsConfig(endpoint)


def test_good_endpoints_pass() -> None:
    for endpoint in (
        "tcp://*:5557",
        "tcp://127.0.0.1:1",
        "tcp://[::1]:65535",
        "tcp://*:*",
        "ipc:///tmp/x",
        "inproc://a",
    ):
        check_endpoint("endpoint", endpoint)
    assert KVEventsConfig("tcp://*:*").replay_endpoint is None  # two wildcards: two free ports


def test_the_replay_endpoint_must_differ_and_exist() -> None:
    with pytest.raises(ValueError, match="is the publisher's endpoint"):
        KVEventsConfig("tcp://127.0.0.1:6000", "tcp://127.0.0.1:6000")
    with pytest.raises(ValueError, match="is the publisher's endpoint"):
        parse_kv_events_config('{"publisher": "zmq", "endpoint": "ipc:///tmp/a", "replay_endpoint": "ipc:///tmp/a"}')
    with pytest.raises(ValueError, match="replay_endpoint .by default the next port"):
        KVEventsConfig("tcp://127.0.0.1:65535")  # its default replay port would be 65536
    assert KVEventsConfig("tcp://127.0.0.1:65535", "tcp://127.0.0.1:65534").replay_endpoint == "tcp://127.0.0.1:65534"


@pytest.mark.parametrize("steps", [0, MAX_BUFFER_STEPS + 1, 10**30])
def test_buffer_steps_stay_within_what_a_high_water_mark_holds(steps: int) -> None:
    with pytest.raises(ValueError, match="buffer_steps must be in 1..1_000_000"):
        KVEventsConfig(buffer_steps=steps)
    with pytest.raises(ValueError, match="hwm must be in"):
        KVEventsConfig(hwm=1 << 31)
    assert KVEventsConfig(buffer_steps=MAX_BUFFER_STEPS).buffer_steps == MAX_BUFFER_STEPS


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--kv-events-endpoint", "tcp://127.0.0.1:99999"], "--kv-events-endpoint: kv events endpoint"),
        (
            ["--kv-events-endpoint", "tcp://127.0.0.1:7000", "--kv-events-replay-endpoint", "tcp://127.0.0.1:7000"],
            "--kv-events-endpoint: kv events replay_endpoint 'tcp://127.0.0.1:7000' is the publisher's endpoint",
        ),
        (
            ["--kv-events-config", json.dumps({"publisher": "zmq", "buffer_steps": 10**20})],
            "--kv-events-config: kv events buffer_steps must be in 1..",
        ),
    ],
)
def test_the_flags_name_themselves_in_the_error(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(flags)
    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture
def busy_port() -> Iterator[int]:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield port


def test_the_publisher_names_an_endpoint_it_cannot_bind(busy_port: int, tmp_path: Path) -> None:
    with pytest.raises(KVEventsBindError, match=f"endpoint 'tcp://127.0.0.1:{busy_port}' cannot be bound"):
        KVEventPublisher(f"tcp://127.0.0.1:{busy_port}", "tcp://127.0.0.1:*")
    with pytest.raises(KVEventsBindError, match="replay endpoint .* cannot be bound"):
        KVEventPublisher("tcp://127.0.0.1:*", f"tcp://127.0.0.1:{busy_port}")
    with pytest.raises(KVEventsBindError, match="cannot be bound"):
        KVEventPublisher(f"ipc://{tmp_path}/missing/events")
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")  # the failures left nothing bound
    publisher.close()


def serve_fails(tiny_model_dir: Path, *flags: str) -> tuple[str, float]:
    """``python -m radixserve serve`` with ``flags``: its stderr and how long it ran; it must exit with 2."""
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "radixserve", "serve", "--model-path", str(tiny_model_dir), "--port", str(free_port())]
        + list(flags),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "usage: radixserve serve" in done.stderr
    return done.stderr, time.monotonic() - began


def test_the_cli_refuses_endpoints_it_cannot_bind_before_loading_the_model(
    tiny_model_dir: Path, busy_port: int, tmp_path: Path
) -> None:
    err, _ = serve_fails(tiny_model_dir, "--kv-events-endpoint", f"tcp://127.0.0.1:{busy_port}")
    assert f"'tcp://127.0.0.1:{busy_port}' cannot be bound: Address already in use" in err
    assert "--kv-events-endpoint" in err and "engine:" not in err  # the model never loaded
    config = {"publisher": "zmq", "endpoint": f"ipc://{tmp_path}/no/such/dir/ev"}
    err, _ = serve_fails(tiny_model_dir, "--kv-events-config", json.dumps(config))
    assert "--kv-events-config" in err and "cannot be bound" in err and "engine:" not in err


def test_the_cli_refuses_bad_configs_at_once(tiny_model_dir: Path) -> None:
    for flags, message in (
        (("--kv-events-endpoint", "tcp://127.0.0.1:99999"), "port in 1..65535"),
        (("--kv-events-config", '{"publisher": "zmq", "buffer_steps": 100000000000000000000}'), "buffer_steps"),
        (
            ("--kv-events-endpoint", "tcp://127.0.0.1:7001", "--kv-events-replay-endpoint", "tcp://127.0.0.1:7001"),
            "is the publisher's endpoint",
        ),
    ):
        err, seconds = serve_fails(tiny_model_dir, *flags)
        assert message in err and seconds < 120
