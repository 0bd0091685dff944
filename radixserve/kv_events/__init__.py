"""KV events for routers outside the process, in the wire format vLLM and SGLang share.

``wire`` (the format and a block mirror), ``publisher`` (the server's side),
``subscriber`` (a router's side), ``config`` (``--kv-events-config``). The
cache layer only records events in process (``cache/events.py``); this package
sits at the server and router floor and imports only the cache below it.
"""
