"""The SGLang paper's kinds of workload as SGLang frontend programs, with the data they run on.

Every question and document is generated here from a seed (no downloads): arithmetic and
lookup questions whose answers are known, so a 5-shot prompt makes sense to a small model.

- ``mmlu``: 5-shot multiple choice. One shared few-shot block, then a question; ``select``
  ranks the four choices by prompt logprobs (the paper's MMLU workload).
- ``tree``: tree-of-thought search: a question, ``fork`` into branches that each think and
  then ``fork`` again, every branch reading the question and its parent's thoughts.
- ``chat``: multi-turn chat: a long system prompt shared by every user, then several turns per
  user, each turn's prompt the whole conversation so far.
- ``json``: JSON decoding with a schema: a shared instruction, a short document per request,
  and a ``gen`` constrained to a schema (xgrammar).
"""

from __future__ import annotations

import json
import random
from typing import Any

import sglang as sgl

SUBJECTS = ["arithmetic", "geography of made-up islands", "units", "calendars", "sequences"]
ISLANDS = ["Avel", "Borin", "Cassa", "Dorn", "Elra", "Fenn", "Gosk", "Hale", "Ivor", "Jast", "Kell", "Lune"]
CAPITALS = ["Port Mira", "Oldwick", "Sandhold", "Veyra", "Brightwater", "Coldharbor", "Redfern", "Tallis"]
LETTERS = "ABCD"


def mc_question(rng: random.Random) -> tuple[str, list[str], int]:
    """(question, four choices, index of the right one)."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    right = a + b
    wrong = rng.sample([right + d for d in (-11, -10, -2, -1, 1, 2, 9, 10)], 3)
    choices = [right, *wrong]
    rng.shuffle(choices)
    return f"What is {a} + {b}?", [str(c) for c in choices], choices.index(right)


def mc_prompt(question: str, choices: list[str]) -> str:
    lines = [f"Question: {question}"] + [f"{letter}. {c}" for letter, c in zip(LETTERS, choices)]
    return "\n".join(lines) + "\nAnswer:"


def few_shot_block(rng: random.Random, shots: int = 5) -> str:
    header = "The following are multiple choice questions (with answers) about arithmetic.\n\n"
    examples = []
    for _ in range(shots):
        question, choices, right = mc_question(rng)
        examples.append(f"{mc_prompt(question, choices)} {LETTERS[right]}\n\n")
    return header + "".join(examples)


def _mmlu(s: Any, few_shot: str, question: str) -> None:
    s += few_shot + question
    s += sgl.select("answer", choices=[f" {letter}" for letter in LETTERS])


def _tree_of_thought(s: Any, question: str, width: int, max_tokens: int) -> None:
    s += "You solve problems by trying several ideas and keeping the best.\n"
    s += f"Problem: {question}\n"
    plans = s.fork(width)
    for i, plan in enumerate(plans):
        plan += f"Idea {i + 1}:" + sgl.gen("idea", max_tokens=max_tokens, stop="\n", temperature=0.8)
        checks = plan.fork(width)
        for j, check in enumerate(checks):
            check += f"\nCheck {j + 1}:" + sgl.gen("check", max_tokens=max_tokens, stop="\n", temperature=0.8)
        checks.join()
    plans.join()
    s += "\nBest idea:" + sgl.gen("best", max_tokens=max_tokens, stop="\n", temperature=0)


def system_prompt(rng: random.Random, words: int = 300) -> str:
    facts = [f"The capital of {i} is {rng.choice(CAPITALS)}." for i in ISLANDS]
    filler = " ".join(rng.choice(facts) for _ in range(words // 7))
    return "You are the help desk of the Island Ferry Company. Facts you know: " + filler


def _chat(s: Any, system: str, questions: list[str], max_tokens: int) -> None:
    s += sgl.system(system)
    for i, question in enumerate(questions):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"reply{i}", max_tokens=max_tokens, temperature=0))


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "island": {"enum": ISLANDS},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ferry_pass": {"type": "boolean"},
    },
    "required": ["name", "island", "age", "ferry_pass"],
}
JSON_INSTRUCTION = (
    "Read the record and answer with a JSON object holding the person's name, home island, age and whether "
    "they hold a ferry pass. Records are written by different clerks in different styles.\n"
)


def person_record(rng: random.Random) -> str:
    name = rng.choice(["Ada", "Bo", "Cyr", "Dee", "Eli", "Fay"]) + " " + rng.choice(["Marsh", "Quill", "Stone"])
    return (
        f"Record: {name}, aged {rng.randint(18, 90)}, lives on {rng.choice(ISLANDS)} and "
        f"{'holds' if rng.random() < 0.5 else 'does not hold'} a ferry pass.\nJSON:"
    )


def _json_decode(s: Any, record: str, max_tokens: int) -> None:
    s += JSON_INSTRUCTION + record
    s += sgl.gen("person", max_tokens=max_tokens, json_schema=json.dumps(PERSON_SCHEMA), temperature=0)


def workload(
    name: str, count: int, seed: int, max_tokens: int, json_max_tokens: int | None = None
) -> tuple[Any, list[dict[str, Any]]]:
    """(the program, its arguments for ``run_batch``): ``count`` programs, the same for a given seed.

    ``max_tokens`` per ``gen``; the JSON object gets ``json_max_tokens`` (default 4x: it is longer).
    """
    rng = random.Random(seed)
    if name == "mmlu":
        shots = few_shot_block(rng)
        args = [{"few_shot": shots, "question": mc_prompt(*mc_question(rng)[:2])} for _ in range(count)]
        return mmlu, args
    if name == "tree":
        return tree_of_thought, [
            {"question": mc_question(rng)[0], "width": 2, "max_tokens": max_tokens} for _ in range(count)
        ]
    if name == "chat":
        system = system_prompt(rng)
        return chat, [
            {
                "system": system,
                "questions": [f"What is the capital of {i}?" for i in rng.sample(ISLANDS, 3)],
                "max_tokens": max_tokens,
            }
            for _ in range(count)
        ]
    if name == "json":
        budget = 4 * max_tokens if json_max_tokens is None else json_max_tokens
        return json_decode, [{"record": person_record(rng), "max_tokens": budget} for _ in range(count)]
    raise ValueError(f"unknown workload {name!r}")


# SGLang programs (sgl.function is untyped: wrapped here rather than used as a decorator)
mmlu, tree_of_thought, chat, json_decode = map(sgl.function, (_mmlu, _tree_of_thought, _chat, _json_decode))
WORKLOADS = ("mmlu", "tree", "chat", "json")


def valid(name: str, state: Any) -> bool:
    """The program's answer has the right shape (JSON validates; select picked a letter)."""
    if name == "mmlu":
        return state["answer"] in [f" {letter}" for letter in LETTERS]
    if name == "json":
        try:
            data = json.loads(state["person"], strict=False)
        except ValueError:
            return False
        return isinstance(data, dict) and set(data) == set(PERSON_SCHEMA["required"])
    return True


def stopped_by_length(name: str, state: Any) -> bool:
    """The program's constrained ``gen`` ran out of ``max_tokens`` before its JSON object closed.

    Such an output is a valid prefix of the grammar, never a whole object: it cannot parse, and
    the grammar mask is not at fault. Other workloads' ``gen`` stop at their limit by design.
    """
    if name != "json":
        return False
    reason = (state.get_meta_info("person") or {}).get("finish_reason")
    return (reason.get("type") if isinstance(reason, dict) else reason) == "length"  # SGLang sends a dict
