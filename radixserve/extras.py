"""Optional dependencies: the core (engine, server) needs none of them.

``[router]`` (Ray Serve) for ``serve --replicas``; ``[bench]`` (tqdm, matplotlib)
for progress bars and plots; ``[all]`` is both.
"""

from __future__ import annotations


def missing_extra(extra: str, what: str) -> SystemExit:
    """The error to raise when ``what`` needs the ``extra`` that is not installed."""
    return SystemExit(f"{what} needs the [{extra}] extra: pip install 'radixserve[{extra}]' (or [all])")
