"""The cache tiers below the KV pool: host memory (L2) and a disk directory (L3), and how pages move between them.

    index.py        ``TierIndex``: where a page lives below the pool, loading continuations back (the cache's handle)
    store.py        storing: pages leaving the pool go to L2, L2's victims to L3; write policies
    pages.py        what a tier page is and how it is named; the state the store and the load-back share
    events.py       KV events for L2 / L3 (medium ``cpu`` / ``disk``), reconciled at each drain
    labels.py       a tier page's label as bytes (kept in each page file's header)
    prefetch.py     the thread that brings a queued request's disk continuation into L2
    host_arena.py   ``HostArena``: L2, pages in host RAM (optionally int8)
    disk_store.py   ``DiskPageStore``: L3, one checksummed file per page, written by a thread
    disk_dir.py     opening a cache directory: lock, fingerprint, warm-restart scan
    disk_format.py  the page file format and its checks
    kv_pages.py     ``PoolPageMover``: whole pages copied between the KV pool and the tiers (torch)
    build.py        ``build_tiers``: the tiers an engine's options ask for, and the directory's fingerprint
    options.py      ``TierConfig`` and ``ModelIdentity``: what the engine hands in, as plain data
    metrics.py      the tiers' figures as plain data (server/tier_metrics.py renders them for Prometheus)

Import the modules themselves: this package's ``__init__`` imports nothing, so ``import radixserve.cache``
never pulls in torch (host_arena.py and kv_pages.py need it).
"""
