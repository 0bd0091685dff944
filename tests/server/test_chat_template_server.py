"""A model without a chat template: /v1/chat/completions is a 400 naming --chat-template; with the flag
the server renders the given file (counted in prompt tokens: the word tokenizer maps "w3 w7" to [3, 7])."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server_process import ServerProcess

CHAT = {"model": "no-template", "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def untemplated_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its chat template removed (from chat_template.jinja and tokenizer_config.json)."""
    folder = tmp_path_factory.mktemp("models") / "no-template"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def bare_server(untemplated_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess("--log-level", "warning", model_path=untemplated_dir) as proc:
        yield proc


def test_chat_without_a_template_is_a_400_naming_the_flag(bare_server: ServerProcess) -> None:
    response = httpx.post(bare_server.url + "/v1/chat/completions", json=CHAT, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "--chat-template PATH" in error["message"] and error["code"] == "no_chat_template"
    info = httpx.get(bare_server.url + "/server_info", timeout=60).json()["engine"]
    assert info["chat_template_source"] == "none"
    completion = httpx.post(
        bare_server.url + "/v1/completions", json={"model": "no-template", "prompt": "w5", "max_tokens": 1}, timeout=60
    )
    assert completion.status_code == 200  # plain completions need no template


def test_chat_template_flag_renders_the_given_file(untemplated_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("w7 w8 {% for m in messages %}{{ m['content'] }} {% endfor %}w9", encoding="utf-8")
    with ServerProcess("--log-level", "warning", "--chat-template", str(template), model_path=untemplated_dir) as proc:
        response = httpx.post(proc.url + "/v1/chat/completions", json=CHAT, timeout=60)
        engine = httpx.get(proc.url + "/server_info", timeout=60).json()["engine"]
    assert response.status_code == 200, response.text
    assert engine["chat_template"] == str(template) and engine["chat_template_source"] == f"--chat-template {template}"
    assert engine["tokenizer_kind"] == "HF tokenizer.json"
    assert response.json()["usage"]["prompt_tokens"] == 5  # w7 w8 w5 w6 w9
