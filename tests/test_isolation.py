"""The scheduler side channel: under tenant namespaces, what tenant B sees does not depend on A's cache.

Published attacks read other users' prompts from a shared prefix cache's TTFT
(here: ``cached_tokens``) and from the order an LPM scheduler serves requests.
B submits guesses, some of which are A's cached prompts; we record B's cached
tokens and admission order with and without A's prompts in the cache. Paired:
without isolation (one shared namespace) the same experiment must leak, or the
test proves nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from radixserve import Engine
from radixserve.scheduler.request import Status
from radixserve.server.tenancy import tenant_namespace

SECRETS = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]]
GUESSES = [[60, 61, 62, 63], SECRETS[1] + [13], [70, 71, 72], SECRETS[0] + [14], [80, 81, 82, 83, 84]]
PARAMS = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


def tenant_b_view(tiny_model_dir: Path, a_cached: bool, isolated: bool, policy: str) -> tuple[list[int], list[int]]:
    engine = Engine.create(
        model_path=str(tiny_model_dir), schedule_policy=policy, max_running_requests=1, max_total_tokens=2048
    )
    ns_a, ns_b = (tenant_namespace("A"), tenant_namespace("B")) if isolated else (None, None)
    if a_cached:
        engine.generate(input_ids=SECRETS, sampling_params=PARAMS, extra_key=ns_a)
    guesses = [engine.make_request(g, PARAMS, ns_b) for g in GUESSES]
    for req in guesses:
        engine.scheduler.add(req)
    admitted: list[int] = []
    while engine.scheduler.has_work():
        engine.step()
        admitted += [i for i, r in enumerate(guesses) if r.status is not Status.WAITING and i not in admitted]
    return [r.cached_tokens for r in guesses], admitted


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_tenant_b_learns_nothing_from_tenant_a_cache(tiny_model_dir: Path, policy: str) -> None:
    assert tenant_b_view(tiny_model_dir, True, isolated=True, policy=policy) == tenant_b_view(
        tiny_model_dir, False, isolated=True, policy=policy
    )


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_the_same_experiment_leaks_without_isolation(tiny_model_dir: Path, policy: str) -> None:
    with_a, without_a = (tenant_b_view(tiny_model_dir, a, isolated=False, policy=policy) for a in (True, False))
    assert with_a[0] != without_a[0]  # cached_tokens reveal A's prompts
    assert with_a[1] != without_a[1]  # and so does the service order
