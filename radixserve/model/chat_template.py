"""Where a model's chat template and its end-of-turn tokens come from; the error when it has none.

A GGUF carries its template as ``tokenizer.chat_template``; an HF folder as chat_template.jinja or in
tokenizer_config.json (transformers reads both, the .jinja first); ``--chat-template PATH`` replaces
either. ``Tokenizer.render_chat`` renders it with transformers' ``apply_chat_template`` (a jinja2
sandbox with ``bos_token`` / ``eos_token``, ``raise_exception``, ``add_generation_prompt``,
``tools``). Generation stops on eos, on the ids the files name (a GGUF's ``eot_token_id`` /
``eom_token_id``, generation_config.json's ``eos_token_id`` list) and on the end-of-turn tokens
the template writes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

# Chat templates end a turn with one of these; generation must stop on it as well as on eos.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")  # where an HF folder keeps its template


class NoChatTemplate(ValueError):
    """The model has no chat template and none was given: the message names the flag."""

    def __init__(self) -> None:
        super().__init__(
            "this model has no chat template (none in its GGUF or tokenizer_config.json): start the server "
            "with --chat-template PATH (a Jinja file; Engine(chat_template=PATH)), or send the prompt as text "
            "to /v1/completions"
        )


def read_chat_template(path: str | os.PathLike[str]) -> str:
    """A ``--chat-template`` file's text."""
    return Path(path).read_text(encoding="utf-8")


def default_template(template: str | dict[str, str] | None) -> str | None:
    """A folder may name several templates (tokenizer_config.json's list): the one named "default"."""
    return template.get("default") if isinstance(template, dict) else template


def hf_folder_template_source(folder: Path) -> str:
    """Which file of an HF folder its template comes from, as transformers looks for it."""
    return next((f"{folder.name}/{name}" for name in TEMPLATE_FILES if (folder / name).is_file()), "none")


def generation_config_eos(folder: Path) -> tuple[int, ...]:
    """The eos ids an HF folder's generation_config.json lists (Llama 3: end of text, of turn, of message)."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    return tuple(int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos]))


def stop_ids(
    eos_id: int | None, file_ids: Iterable[int], template: str | None, vocab: dict[str, int]
) -> tuple[int, ...]:
    """eos first, then the files' own stop ids, then the end-of-turn tokens the template writes; no repeats."""
    ids = [] if eos_id is None else [int(eos_id)]
    ids += [int(i) for i in file_ids]
    ids += [vocab[token] for token in END_OF_TURN_TOKENS if template and token in template and token in vocab]
    return tuple(dict.fromkeys(ids))
