"""The engine: ``Engine(config)`` or ``Engine(**options)``, then ``.generate(...)`` and ``.chat(...)``, no HTTP.

Wires the layers: loader -> model + KV pool -> prefix cache over the slot
allocator -> scheduler, with the engine step (``step.py``) between its
``schedule()`` and ``process()``. Every request's cached prefix is matched,
locked and reused; finished requests insert prompt + output into the cache.
The loop that drives it all is ``driver.py``'s: ``generate`` turns it on the
caller's thread, the server's worker on its own.

    from radixserve import Engine
    engine = Engine()                     # the embedded SmolLM2-135M-Instruct
    engine = Engine(model_path="model.gguf", page_size=16)   # the options are EngineConfig's fields
    out = engine.chat([{"role": "user", "content": "Hi!"}], {"max_new_tokens": 32})
    print(out.text, out.cached_tokens)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any, overload

import numpy as np
import torch
from typing_extensions import TypeIs

from radixserve.cache import CacheListener, KVEventLog, cache_page_size, create_prefix_cache, pool_allocator
from radixserve.cache.summary import summarize
from radixserve.cache.tiers.build import build_tiers
from radixserve.cache.tiers.index import TierIndex
from radixserve.cache.tiers.options import ModelIdentity, TierConfig
from radixserve.core import GenerateResult, SamplingParams, is_token_ids
from radixserve.engine.config import EngineConfig, default_pool_tokens
from radixserve.engine.driver import Driver
from radixserve.engine.live import live_view
from radixserve.engine.output import OutputStage
from radixserve.engine.spec_costs import measure_verify_costs
from radixserve.engine.step import StepExecutor
from radixserve.memory.kv_pool import KVPool
from radixserve.model.attention import attention_split_invariance
from radixserve.model.grammar import GrammarCompiler
from radixserve.model.invariance import make_split_invariant
from radixserve.model.loader import LoadedModel, load_model
from radixserve.model.precision import resolve_kv_cache_dtype
from radixserve.model.runner import ModelRunner
from radixserve.model.summary import describe_model
from radixserve.scheduler.draft import Drafter, VerifyCosts
from radixserve.scheduler.loop import Scheduler
from radixserve.scheduler.ngram import NgramIndex
from radixserve.scheduler.policy import create_schedule_policy
from radixserve.scheduler.request import Request

logger = logging.getLogger(__name__)

Params = SamplingParams | dict[str, Any] | None


def _is_conversation(messages: object) -> TypeIs[list[dict[str, str]]]:
    """One conversation (message dicts), not a batch of them."""
    return isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict)


def _config(config: EngineConfig | None, options: dict[str, Any]) -> EngineConfig:
    """``config``, or one built from ``options`` (EngineConfig's fields): never both."""
    if config is None:
        return EngineConfig.from_options(**options)
    if not isinstance(config, EngineConfig):
        raise TypeError(f"Engine(config) takes an EngineConfig, not {type(config).__name__}: Engine(model_path=...)")
    if options:
        raise TypeError(f"give an EngineConfig or options, not both (got {', '.join(sorted(options))})")
    return config


def _drafter(config: EngineConfig) -> Drafter | None:
    """Speculative decoding's drafter (None: off), with the n-gram index over the cache where asked."""
    if config.speculative_algorithm is None:
        return None
    source, num = config.speculative_ngram_source, config.speculative_num_draft_tokens
    index = NgramIndex(max_continuation=num) if source in ("both", "tree") else None
    row_cost = config.speculative_row_cost
    costs = VerifyCosts.modelled(row_cost) if row_cost is not None else None  # None: measured once the model runs
    return Drafter(num, index, use_prompt=source in ("both", "prompt"), costs=costs)


class Engine(Driver):
    """The engine over one ``EngineConfig``: ``Engine(config)``, or ``Engine(**options)`` named as
    ``radixserve serve``'s flags (``EngineConfig.from_options``: the same path and checks as the flags)."""

    def __init__(self, config: EngineConfig | None = None, **options: Any) -> None:
        self.config = config = _config(config, options)
        torch.set_num_threads(config.num_threads)
        self.device = config.resolved_device()
        dtype, self.dtype_reason = config.resolved_dtype(self.device)
        logger.info("dtype %s: %s", str(dtype).removeprefix("torch."), self.dtype_reason)
        self.loaded: LoadedModel = load_model(
            config.model_path, self.device, dtype, config.attention_backend, config.quantization
        )
        logger.info("quantization %s: %s", self.loaded.model.quantization, self.loaded.quantization_reason)
        if self.loaded.model.quantization != "none":  # what was kept as the file's blocks, per GGUF type
            logger.info("quantization detail: %s", self.loaded.model.quantization_detail)
        self.split_invariant, self.split_invariant_reason = self._split_invariance(dtype)
        logger.info("split invariance: %s", self.split_invariant_reason)
        self.tokenizer = self.loaded.tokenizer.with_chat_template(config.chat_template)
        model = self.loaded.config
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype)
        pool_tokens = config.max_total_tokens or default_pool_tokens(
            KVPool.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, kv_dtype), self.device
        )
        # allocator -> pool -> tiers -> cache: the event log and the tiers are the cache's listeners from the start
        kind, page_size = config.prefix_cache, config.page_size
        self.allocator = pool_allocator(kind, pool_tokens, page_size)
        # size + one page of rows: the allocator's page 0 is reserved for padding writes
        self.kv_pool = KVPool(
            model.num_layers,
            self.allocator.size + self.allocator.page_size,
            model.num_kv_heads,
            model.head_dim,
            kv_dtype,
            self.device,
        )
        events = KVEventLog(cache_page_size(kind, page_size)) if config.enable_kv_events else None
        identity = ModelIdentity(self.loaded.path, self.loaded.model.quantization, self.tokenizer.encode)
        tiers = build_tiers(TierConfig.of(config), identity, self.kv_pool, events)
        listeners: list[CacheListener] = [events] if events is not None else []
        self.drafter = _drafter(config)
        if self.drafter is not None and self.drafter.index is not None:
            listeners.append(self.drafter.index)  # kept with the tree's inserts and evictions
        self.cache = create_prefix_cache(
            kind, self.allocator, page_size, config.radix_eviction_policy, listeners=listeners, tiers=tiers
        )
        eos = tuple(model.eos_token_ids) + tuple(self.tokenizer.eos_token_ids)
        self.eos_token_ids = eos
        self._grammars: GrammarCompiler | None = None
        runner = ModelRunner(self.loaded.model, model, self.kv_pool, self.device)
        if self.drafter is not None and config.speculative_row_cost is None:
            self._measure_verify_costs(self.drafter, runner)
        executor = StepExecutor(runner)
        self.output = OutputStage(self.tokenizer, eos)
        scheduler = Scheduler(
            self.cache,
            self.output,
            config.max_running_requests,
            config.chunked_prefill_size,
            create_schedule_policy(config.schedule_policy, config.in_batch_dedup, config.schedule_seed),
            enable_mixed_chunk=config.enable_mixed_chunk,
            drafter=self.drafter,
        )
        super().__init__(scheduler, executor)
        self._rids = itertools.count()
        logger.info("engine ready: %s, %d KV slots, %s on %s", config, self.allocator.size, dtype, self.device)

    @classmethod
    def create(cls, **options: Any) -> Engine:
        """``Engine(**options)``: an unknown option is a TypeError, a bad value a ValueError."""
        return cls(**options)

    # ---- public API -------------------------------------------------------------------------------

    @overload
    def generate(
        self, prompt: str, sampling_params: Params = None, input_ids: None = None, extra_key: str | None = None
    ) -> GenerateResult: ...
    @overload
    def generate(
        self,
        prompt: list[str],
        sampling_params: Params | list[Params] = None,
        input_ids: None = None,
        extra_key: str | None = None,
    ) -> list[GenerateResult]: ...
    @overload
    def generate(
        self, prompt: None = None, sampling_params: Params = None, *, input_ids: list[int], extra_key: str | None = None
    ) -> GenerateResult: ...
    @overload
    def generate(
        self,
        prompt: None = None,
        sampling_params: Params | list[Params] = None,
        *,
        input_ids: list[list[int]],
        extra_key: str | None = None,
    ) -> list[GenerateResult]: ...
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: Params | list[Params] = None,
        input_ids: list[int] | list[list[int]] | None = None,
        extra_key: str | None = None,
    ) -> GenerateResult | list[GenerateResult]:
        """Generate for one prompt (one result) or a list (a list, same order); give text or token ids.

        ``result.to_dict()`` is the shape SGLang's native API returns: ``{"text", "output_ids",
        "meta_info": {"prompt_tokens", "cached_tokens", "completion_tokens", "finish_reason", ...}}``.
        """
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if isinstance(prompt, str):
            return self._run([self.tokenizer.encode(prompt)], sampling_params, extra_key)[0]
        if prompt is not None:
            return self._run([self.tokenizer.encode(text) for text in prompt], sampling_params, extra_key)
        assert input_ids is not None
        if is_token_ids(input_ids):
            return self._run([input_ids], sampling_params, extra_key)[0]
        return self._run(input_ids, sampling_params, extra_key)

    @overload
    def chat(
        self, messages: list[dict[str, str]], sampling_params: Params = None, extra_key: str | None = None
    ) -> GenerateResult: ...
    @overload
    def chat(
        self,
        messages: list[list[dict[str, str]]],
        sampling_params: Params | list[Params] = None,
        extra_key: str | None = None,
    ) -> list[GenerateResult]: ...
    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: Params | list[Params] = None,
        extra_key: str | None = None,
    ) -> GenerateResult | list[GenerateResult]:
        """Apply the model's chat template, then ``generate``. A list of conversations gives a list."""
        if _is_conversation(messages):
            ids = self.tokenizer.apply_chat_template(messages)
            return self._run([ids], sampling_params, extra_key)[0]
        conversations = [self.tokenizer.apply_chat_template(conv) for conv in messages]
        return self._run(conversations, sampling_params, extra_key)

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler over this model's tokenizer (built at first use: most servers never need it)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.hf, self.loaded.config.vocab_size, self.eos_token_ids)
        return self._grammars

    # ---- what it holds (on the loop's thread: through ``call`` while a server runs it) --------------

    @property
    def tiers(self) -> TierIndex | None:
        """The cache tiers below the pool (None: the pool is the only tier); their counters are plain ints
        any thread may read (a value may lag one step behind, never tear)."""
        return self.cache.tiers

    def snapshot(self) -> dict[str, object]:
        """The scheduler's counters and the pool's figures (``/server_info``'s ``scheduler``)."""
        self._check_thread()
        return self.scheduler.snapshot()

    def tier_stats(self) -> dict[str, Any] | None:
        """The cache tiers below the pool, with their sizes and counters (None: the pool is the only tier)."""
        self._check_thread()
        tiers = self.cache.tiers
        if tiers is None:
            return None
        stats = tiers.stats
        return {
            **tiers.sizes(),
            "hit_tokens": dict(stats.hit_tokens),
            "load_failures": stats.load_failures,
            "prefetch": {"pages": stats.pages_prefetched, "hits": stats.prefetch_hits},
        }

    def cache_view(
        self, top: int = 10, check: bool = False, visible: Callable[[str | None], bool] | None = None
    ) -> dict[str, Any]:
        """What the prefix cache holds: sizes (tokens), shape, the ``top`` most shared prefixes.

        ``live_request_tokens`` are slots held privately by running requests: free + cached + live
        == pool, always. ``check`` also verifies every cache invariant (walks the whole tree).
        ``visible``: only the namespaces it accepts, and no pool-wide figures.
        """
        self._check_thread()
        out = summarize(self.cache, top, visible=visible)
        if visible is not None:
            return out
        out["live_request_tokens"] = out["pool_tokens"] - out["free_tokens"] - out["cached_tokens"]
        out["running_requests"] = len(self.scheduler.running)
        out["waiting_requests"] = len(self.scheduler.waiting)
        if self.cache.tiers is not None:
            out["tiers"] = self.cache.tiers.sizes()
        if check:
            try:
                self.cache.check_invariants()
                out["invariants"] = "ok"
            except AssertionError as exc:
                out["invariants"] = f"broken: {exc}"
        return out

    def live_view(self, tree_nodes: int = 0, visible: Callable[[str | None], bool] | None = None) -> dict[str, Any]:
        """What the dashboard polls: counters, load, pool, tiers, evictions, the last requests' timings and
        ``tree_nodes`` of the hottest subtrees (``engine/live.py`` says what each means)."""
        self._check_thread()
        return live_view(self.scheduler, tree_nodes, visible)

    def check_idle_invariants(self) -> None:
        """With nothing in flight: the cache is consistent and free + cached == pool."""
        assert not self.scheduler.has_work(), "requests still in flight"
        self.cache.check_invariants()
        assert self.cache.protected_size() == 0, "a prefix is still locked"
        assert self.allocator.free_size() + self.cache.total_size() == self.allocator.size, "KV slots leaked"

    # ---- internals --------------------------------------------------------------------------------

    def _run(
        self, prompts: Sequence[Sequence[int]], params: Params | list[Params], extra_key: str | None
    ) -> list[GenerateResult]:
        per_request = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_request) != len(prompts):
            raise ValueError(f"{len(per_request)} sampling_params for {len(prompts)} prompts")
        requests = [self.make_request(p, sp, extra_key) for p, sp in zip(prompts, per_request)]  # validate all first
        self.run_until_done(requests)
        return [req.result() for req in requests]

    @property
    def context_length(self) -> int:
        """The most tokens (prompt + output) one request may hold: the model's context."""
        return self.loaded.config.max_position_embeddings

    def make_request(
        self,
        prompt: Sequence[int],
        params: Params,
        extra_key: str | None = None,
        arrival_time: float | None = None,
        shared_len: int = 0,
        logprob_start_len: int = -1,
    ) -> Request:
        """A validated request (not yet queued); ValueError says what is wrong with the input.

        ``logprob_start_len >= 0``: also score the prompt from there (``result.input_logprobs``).
        ``max_new_tokens == 0`` still prefills the prompt into the cache. ``max_new_tokens`` is clipped to what
        the context leaves after the prompt. A
        ``json_schema`` / ``regex`` / ``ebnf`` that does not compile is a ValueError (GrammarError).
        ``shared_len``: leading prompt tokens cached in the shared namespace even
        though the request has its own ``extra_key`` (rounded down to a page).
        Thread-safe: the server calls it off the scheduler thread.
        """
        sp = params if isinstance(params, SamplingParams) else SamplingParams.from_dict(params)
        try:
            ids = np.asarray(prompt, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise ValueError("a prompt must be a sequence of integer token ids") from None
        vocab = self.loaded.config.vocab_size
        max_pos = self.context_length
        if ids.ndim != 1 or len(ids) == 0:
            raise ValueError("a prompt must be a non-empty sequence of token ids")
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"token ids must be in [0, {vocab}), got {ids.min()}..{ids.max()}")
        if len(ids) >= max_pos:
            raise ValueError(f"the prompt has {len(ids)} tokens but the model's context is {max_pos} tokens")
        if len(ids) + 1 > self.allocator.size:
            raise ValueError(f"the prompt has {len(ids)} tokens but the KV pool holds {self.allocator.size}")
        sp = dataclasses.replace(sp, max_new_tokens=min(sp.max_new_tokens, max_pos - len(ids)))
        grammar = sp.grammar
        # Compiling is memoised: the server compiles on a worker thread first, so this is a cache hit there.
        compiled = None if grammar is None else self.grammars.compile(*grammar)  # type: ignore[arg-type]
        matcher = None if compiled is None else self.grammars.matcher(compiled)
        req = Request(next(self._rids), ids, sp, extra_key, grammar=matcher)
        req.ask_prompt_logprobs(logprob_start_len)
        if extra_key is not None and shared_len > 0:
            req.shared_len = min(shared_len, len(ids)) - min(shared_len, len(ids)) % self.config.page_size
        if arrival_time is not None:
            req.arrival_time = arrival_time
        return req

    def _split_invariance(self, dtype: torch.dtype) -> tuple[bool, str]:
        """Make the model split-invariant where it can be (``--split-invariant``): (whether a token's logits are
        now independent of how its step is cut, why)."""
        if not self.config.split_invariant:
            return False, "off (--no-split-invariant)"
        if self.device.type != "cpu":
            return False, f"no split-invariant kernels on {self.device.type}"
        model = self.loaded.config
        kv_dtype = resolve_kv_cache_dtype(self.config.kv_cache_dtype, dtype)
        backend = self.loaded.model.attention_backend
        paged_extends, why_not = attention_split_invariance(dtype, kv_dtype, backend, model.head_dim)
        if why_not is not None:  # then the linears keep their faster GEMM path: invariance would not hold anyway
            return False, why_not
        holds, why = make_split_invariant(self.loaded.model, self.config.split_invariant_kernel)
        if holds:  # the shared-prefix pass merges a prefix's partial softmax with each row's own: other bits
            self.loaded.model.cascade_attention = False
            self.loaded.model.paged_extends = paged_extends
            why += "; decode rows read a shared prefix each on its own (no cascade pass)"
            why += "; extends read in place (paged kernel)" if paged_extends else ""
        return holds, why

    def _measure_verify_costs(self, drafter: Drafter, runner: ModelRunner) -> None:
        """Price the drafter's rows by what verify forwards cost here (``spec_costs.py``), before any request."""
        costs = measure_verify_costs(runner, self.allocator, drafter.max_draft_tokens)
        if costs is None:
            logger.info("speculative decoding: the pool has no room to time verify rows; modelled costs")
            return
        drafter.costs = costs
        figures = ", ".join(f"{n}: {cost:.2f}" for n, cost in costs.points)
        logger.info("speculative decoding: a forward of n rows costs (decode steps) %s", figures)

    def kv_bytes_per_token(self) -> int:
        """One token's K/V in the pool, all layers (an 8-bit pool's scales included)."""
        model = self.loaded.config
        return KVPool.bytes_per_token(model.num_layers, model.num_kv_heads, model.head_dim, self.kv_pool.dtype)

    def kv_tokens_per_gib(self) -> int:
        return (1 << 30) // self.kv_bytes_per_token()

    def describe(self) -> dict[str, Any]:
        """The resolved configuration: what was asked for, and what it became on this machine."""
        model = self.loaded.config
        kv_bytes = self.kv_bytes_per_token()
        return {
            **dataclasses.asdict(self.config),
            **describe_model(model, self.tokenizer, self.loaded.model, self.loaded.file_tensor_bytes),
            "resolved_model_path": str(self.loaded.path),
            "resolved_device": str(self.device),
            "resolved_dtype": str(self.loaded.model.dtype).removeprefix("torch."),
            "resolved_kv_cache_dtype": str(self.kv_pool.dtype).removeprefix("torch."),
            "dtype_reason": self.dtype_reason,
            "resolved_attention_backend": self.loaded.model.attention_backend,
            "resolved_quantization": self.loaded.model.quantization,
            "quantization_reason": self.loaded.quantization_reason,
            "quantization_detail": self.loaded.model.quantization_detail,
            "split_invariant": self.split_invariant,
            "split_invariant_reason": self.split_invariant_reason,
            "kv_pool_tokens": self.allocator.size,
            "context_length": self.context_length,
            "vocab_size": model.vocab_size,
            "kv_bytes_per_token": kv_bytes,
            "kv_tokens_per_gib": self.kv_tokens_per_gib(),
            **self._describe_speculative(),
        }

    def _describe_speculative(self) -> dict[str, Any]:
        """What the drafter prices a verify forward at (rows -> decode steps), and whether it was measured."""
        if self.drafter is None:
            return {}
        costs = self.drafter.costs
        steps = {str(n): round(cost, 3) for n, cost in costs.points if n <= self.drafter.max_draft_tokens + 1}
        return {"speculative_verify_costs": {"source": costs.source, "steps_by_rows": steps}}
