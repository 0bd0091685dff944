"""``radixserve serve`` as a child process on a free loopback port: start, wait for /health, stop.

The benchmarks drive servers this way (as users run them), and so do the server tests. ``program`` runs
another OpenAI-compatible server the same way (a peer such as llama.cpp's ``llama-server``, which also
takes ``--port`` and answers /health with 200 once its model is loaded).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    # Flags every radixserve server of this process starts with, before its own (which win: argparse keeps the last).
    base_flags: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *flags: str, model_path: str | Path | None = None, program: Sequence[str] | None = None) -> None:
        self.program = list(program) if program is not None else [sys.executable, "-m", "radixserve", "serve"]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags = [
            *(["--model-path", str(model_path)] if model_path is not None else []),
            *(self.base_flags if program is None else ()),  # radixserve's flags: not a peer's
            *flags,
            "--port",
            str(self.port),
        ]
        self._log = tempfile.NamedTemporaryFile("w+", prefix="radixserve-", suffix=".log", delete=False)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 180.0) -> ServerProcess:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            [*self.program, *self.flags],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server did not become healthy in {timeout} s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")
