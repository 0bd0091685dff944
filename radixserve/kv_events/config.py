"""``--kv-events-config``: the JSON object vLLM and SGLang take, checked at start.

Their keys mean what they mean there. ``publisher`` is ``"zmq"`` (absent: zmq
if ``enable_kv_cache_events``, else null, vLLM's rule); a config that would
publish nothing is an error rather than a server silently without events.
``max_queue_size`` is accepted and has no effect (we publish on the scheduler
thread, with no queue); ``bind`` may only be true (we always bind);
``format`` only ``"default"``. Any other key is an error.

Checked here, before any socket exists: a TCP endpoint's port (1..65535 or ``*``), the
replay endpoint differing from the publisher's (the default one too: the next port, so
port 65535 has none), ``buffer_steps`` and ``hwm`` within what a ZMQ high-water mark
holds. What only binding can tell (a port in use, a missing ipc directory) the
publisher reports as ``KVEventsBindError`` (publisher.py); the server opens it before
the model loads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SCHEMES = ("tcp://", "ipc://", "inproc://")
MAX_BUFFER_STEPS = 1_000_000  # batches kept for replay: the replay socket's high-water mark is twice this
MAX_HWM = (1 << 31) - 1  # ZMQ's SNDHWM is a C int
_TYPES: dict[str, tuple[type, ...]] = {
    "publisher": (str,),
    "enable_kv_cache_events": (bool,),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "topic": (str,),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "bind": (bool, type(None)),
    "format": (str,),
}


@dataclass(frozen=True)
class KVEventsConfig:
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # None: the next port (tcp) or <path>.replay (ipc)
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None:
                check_endpoint(name, value)
        replay = self.replay_endpoint or replay_endpoint_for(self.endpoint)
        if self.replay_endpoint is None:
            check_endpoint("replay_endpoint (by default the next port)", replay)
        if replay == self.endpoint and not replay.endswith(":*"):
            raise ValueError(f"kv events replay_endpoint {replay!r} is the publisher's endpoint: give each its own")
        if not 1 <= self.buffer_steps <= MAX_BUFFER_STEPS:
            raise ValueError(f"kv events buffer_steps must be in 1..{MAX_BUFFER_STEPS:_}, got {self.buffer_steps}")
        if not 1 <= self.hwm <= MAX_HWM:
            raise ValueError(f"kv events hwm must be in 1..{MAX_HWM:_}, got {self.hwm}")


def check_endpoint(name: str, endpoint: str) -> None:
    """ValueError naming ``name`` unless ``endpoint`` is a ZMQ address we can bind: a known scheme, and for TCP a
    ``host:port`` with a port in 1..65535 (or ``*``: any free one)."""
    if not endpoint.startswith(SCHEMES):
        raise ValueError(f"kv events {name} {endpoint!r} must start with one of {', '.join(SCHEMES)}")
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if not host or not (port == "*" or (port.isdigit() and 1 <= int(port) <= 65535)):
            raise ValueError(f"kv events {name} {endpoint!r}: a TCP endpoint is host:port with a port in 1..65535 or *")
    elif endpoint.partition("://")[2] == "":
        raise ValueError(f"kv events {name} {endpoint!r} names no address")


def replay_endpoint_for(endpoint: str) -> str:
    """The default replay endpoint: the next TCP port (any free one for ``tcp://host:*``), or ``<path>.replay``."""
    if endpoint.startswith("tcp://"):
        host, port = endpoint.rsplit(":", 1)
        if port == "*":
            return endpoint
        if port.isdigit():
            return f"{host}:{int(port) + 1}"
    return endpoint + ".replay"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The config ``text`` describes (``ValueError`` naming the problem if it is not a valid one)."""
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    for key, value in raw.items():
        if key not in _TYPES:
            raise ValueError(f"--kv-events-config: unknown key {key!r} (known: {', '.join(_TYPES)})")
        # bool is an int in Python: refuse true where a count is meant
        if not isinstance(value, _TYPES[key]) or (isinstance(value, bool) and bool not in _TYPES[key]):
            raise ValueError(f"--kv-events-config: {key} has the wrong type ({type(value).__name__})")
    publisher = raw.get("publisher", "zmq" if raw.get("enable_kv_cache_events") else "null")
    if publisher == "null":
        raise ValueError('--kv-events-config publishes nothing (publisher "null"): add "publisher": "zmq"')
    if publisher != "zmq":
        raise ValueError(f'--kv-events-config: unknown publisher {publisher!r} (radixserve has "zmq")')
    if raw.get("bind") is False:
        raise ValueError("--kv-events-config: bind must be true (radixserve binds its sockets)")
    if raw.get("format", "default") != "default":
        raise ValueError(f'--kv-events-config: format {raw["format"]!r} is not supported (only "default")')
    if raw.get("max_queue_size", 1) < 1:
        raise ValueError("--kv-events-config: max_queue_size must be >= 1")
    fields = ("endpoint", "replay_endpoint", "topic", "buffer_steps", "hwm")
    return KVEventsConfig(**{k: raw[k] for k in fields if k in raw})
