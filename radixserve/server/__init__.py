"""The HTTP server: OpenAI-compatible and native endpoints, Prometheus metrics, ``radixserve serve``.

    radixserve serve --model-path PATH --port 30000 --enable-metrics

Layout: ``args`` (flags -> ServerArgs), ``app`` (routes), ``openai_api`` / ``native_api``
(request -> engine requests -> response or SSE), ``generation`` (tokenize, validate,
submit, collect), ``worker`` (the scheduler thread), ``metrics``, ``protocol``
(request schemas), ``errors``, ``launch`` (uvicorn, signals).
"""
