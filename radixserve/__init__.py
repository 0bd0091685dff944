"""radixserve: an LLM serving engine built around a radix-tree prefix cache."""

__version__ = "0.1.0"
