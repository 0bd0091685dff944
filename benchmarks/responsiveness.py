"""``radixserve bench responsiveness``: do /health and /metrics answer while a long prefill runs?

Starts a server (the embedded SmolLM2 unless ``--model-path``; or uses ``--base-url``),
sends one long prompt (``--prompt-tokens``, default 2,000, one prefill step), and,
while it runs, requests /health and /metrics back to back. Prints how long the
prefill took and the latency of those probes (the target: under 100 ms, because
the model step never runs on the HTTP event loop).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import httpx

from tests.support.server_process import ServerProcess


def probe(base_url: str, prompt_tokens: int, rounds: int) -> None:
    with httpx.Client(timeout=600) as client:
        info = client.get(base_url + "/server_info").json()
        vocab = int(info["engine"]["vocab_size"])
        for round_ in range(rounds):
            # a prompt no earlier round cached: every round prefills in full
            prompt = [100 + (i * 7919 + round_ * 104729) % (vocab - 200) for i in range(prompt_tokens)]
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}
            done = threading.Event()
            timing: dict[str, float] = {}

            def long_request(body: dict[str, object], timing: dict[str, float], done: threading.Event) -> None:
                start = time.perf_counter()
                client.post(base_url + "/generate", json=body).raise_for_status()
                timing["prefill"] = time.perf_counter() - start
                done.set()

            worker = threading.Thread(target=long_request, args=(body, timing, done))
            worker.start()
            health: list[float] = []
            metrics: list[float] = []
            with httpx.Client(timeout=60) as probes:
                while not done.is_set():
                    for path, into in (("/health", health), ("/metrics", metrics)):
                        start = time.perf_counter()
                        probes.get(base_url + path)
                        if not done.is_set():
                            into.append(time.perf_counter() - start)
            worker.join()
            print(f"round {round_ + 1}: {prompt_tokens}-token prefill took {timing['prefill'] * 1000:.0f} ms")
            for name, values in (("/health", health), ("/metrics", metrics)):
                if values:
                    ms = sorted(v * 1000 for v in values)
                    print(
                        f"  {name:9s} {len(ms):4d} answers during it: median {statistics.median(ms):6.1f} ms, "
                        f"p99 {ms[int(0.99 * (len(ms) - 1))]:6.1f} ms, max {ms[-1]:6.1f} ms"
                    )
                else:
                    print(f"  {name:9s} no answer while the prefill ran")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="radixserve bench responsiveness",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base-url", default=None, help="a running radixserve (with --enable-metrics); else start one")
    parser.add_argument("--model-path", default=None, help="model for the server this command starts")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.base_url:
        probe(args.base_url.rstrip("/"), args.prompt_tokens, args.rounds)
        return
    server = ServerProcess("--enable-metrics", "--log-level", "warning", model_path=args.model_path).start(timeout=600)
    try:
        probe(server.url, args.prompt_tokens, args.rounds)
    finally:
        server.stop()
