"""Chat workloads that copy from their context (and one that does not), for speculative decoding's benchmarks.

``radixserve bench speculative`` (engine-level) and ``radixserve bench serve --servers`` (through HTTP servers,
side by side) replay the same prompts from here:

- code-edit: a Python file in the prompt, the answer rewrites it with one rename (copies most of it);
- code-edit-class: the same task on a second file (a class), three renames: how much a copy pays depends on the
  file (the embedded model rewrites a function of the first file in its own words, the class it copies);
- rag-quote: a document in the prompt, the answer quotes from it;
- agent: turns of one tool-calling agent, one request each (no history in the prompt), the same JSON shape
  every turn (``AGENT_SCHEMA``, structured output): earlier answers are in the prefix cache (tree drafts) but
  not in the prompt (prompt lookup);
- prose: free stories (nothing to copy: drafting must not cost).
"""

from __future__ import annotations

import json

CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals; return them sorted."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


def total_covered(intervals):
    """The total length the intervals cover, counting overlaps once."""
    return sum(end - start for start, end in merge_intervals(intervals))
'''
CLASS_CODE = '''class LRUCache:
    """A fixed-size mapping that forgets the least recently used key first."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}
        self.order = []

    def get(self, key, default=None):
        if key not in self.items:
            return default
        self.order.remove(key)
        self.order.append(key)
        return self.items[key]

    def put(self, key, value):
        if key in self.items:
            self.order.remove(key)
        elif len(self.items) >= self.capacity:
            oldest = self.order.pop(0)
            del self.items[oldest]
        self.items[key] = value
        self.order.append(key)
'''
CLASS_RENAMES = [("items", "entries"), ("order", "recency"), ("capacity", "size")]
DOC = (
    "The Harbor Bridge opened in 1932 after eight years of construction. It carries eight lanes of traffic, "
    "two railway lines and a footway. The arch spans 503 metres and its top stands 134 metres above the water. "
    "About 160,000 vehicles cross it every day. Workers repaint it continuously; a full coat takes ten years. "
    "In 1998 a climbing tour opened, and more than four million people have climbed the arch since then. "
    "The bridge was designed by John Bradfield, who oversaw the project from its first survey to its opening."
)
# The file first, in a fence, then the edit: the embedded model's greedy answers reproduce more of the file
# (difflib ratio against it, names spans / ranges / segments / periods: 0.63 / 0.57 / 0.82 / 0.87) than asked
# "Rewrite this code, renaming `intervals` to ... Output only the code." with the file after the request (0.38 /
# 0.48 / 0.76 / 0.38: since the split-invariance changes it rewrites one function for spans and ranges).
CODE_EDIT = (
    "Rewrite the whole file above with every `intervals` renamed to `{name}`. "
    "Reply with the full file in one code block."
)
CLASS_EDIT = (
    "Rewrite the whole file above with every `{old}` renamed to `{new}`. Reply with the full file in one code block."
)
QUESTIONS = ["How long is the arch?", "Who designed the bridge?", "How many vehicles cross it?", "When did it open?"]
AGENT_SYSTEM = "You are a weather assistant. Call the get_weather tool for the city the user asks about."
# The call's JSON is held to this schema (structured output) and is nowhere in the prompt: drafts of its shape
# come from earlier turns' answers in the prefix cache (tree), not from the request's own text (prompt).
AGENT_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {
            "tool": {"type": "string", "enum": ["get_weather"]},
            "arguments": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "days": {"type": "integer"},
                    "include_hourly_forecast": {"type": "boolean"},
                },
                "required": ["city", "unit", "days", "include_hourly_forecast"],
            },
        },
        "required": ["tool", "arguments"],
    }
)
SCHEMAS = {"agent": AGENT_SCHEMA}  # the workloads answered under a JSON schema (structured output)
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Rome"]
TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow", "a market at dawn", "an old violin", "a comet"]

Workload = list[list[dict[str, str]]]


def workloads() -> dict[str, Workload]:
    def user(text: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": text}]

    return {
        "code-edit": [user(f"```python\n{CODE}```\n\n{CODE_EDIT.format(name=name)}") for name in ("spans", "ranges")],
        "code-edit-class": [
            user(f"```python\n{CLASS_CODE}```\n\n{CLASS_EDIT.format(old=old, new=new)}") for old, new in CLASS_RENAMES
        ],
        "rag-quote": [user(f"{DOC}\n\nQuote the sentence that answers: {q}") for q in QUESTIONS[:2]],
        "agent": [
            [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": f"Weather in {city}?"}]
            for city in CITIES[:6]
        ],
        "prose": [user(f"Write a short story about {topic}.") for topic in TOPICS[:2]],
    }


def repeated(prompts: Workload, num: int) -> Workload:
    """``num`` requests cycling through ``prompts`` (a batch of the workload: 16 at once for concurrency 16)."""
    return [prompts[i % len(prompts)] for i in range(num)]
