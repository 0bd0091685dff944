"""route_key_for: the front's routing key is exactly the prompt and namespace the replica will use.

The tiny tokenizer is word-level ("w40 w41" -> [40, 41]). Its own chat template ignores
roles and always ends in w99, so chat tests use a copy of the model folder whose template
marks each role (system w10, user w11, assistant w12; any other role is an error) and adds
w99 only as the generation prompt: then 'developer' read as 'system' and shared system
prompts are visible in the tokens.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from starlette.datastructures import Headers

from radixserve.engine import Engine, EngineConfig
from radixserve.model.tokenizer import Tokenizer
from radixserve.router.asgi_bridge import ASGIBridge, HTTPCall
from radixserve.router.deployments import route_key_for
from radixserve.router.table import RouteKey
from radixserve.server.app import build_tenancy, create_app, shared_heads
from radixserve.server.args import ServerArgs
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.tenancy import ADMIN, Tenancy, key_tenant, salt_namespace, tenant_namespace

MODEL = "tiny-llama"  # the served name: the model folder's name
KEY_A, KEY_B, ROOT = "key-alpha-0001", "key-bravo-0002", "root-key-0003"
ROLE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}w10{% elif m['role'] == 'user' %}w11{% elif m['role'] == 'assistant' %}w12"
    "{% else %}{{ raise_exception('no such role: ' + m['role']) }}{% endif %} {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}w99{% endif %}"
)


class Front(NamedTuple):
    """What the front deployment holds (deployments.make_front: Front.__init__)."""

    tokenizer: Tokenizer
    tenancy: Tenancy
    heads: list[list[int]]

    def key(self, path: str, payload: Any, headers: dict[str, str] | None = None) -> RouteKey | None:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        return route_key_for(path, body, Headers(headers or {}), self.tokenizer, self.tenancy, self.heads)


def make_front(model_dir: Path, **options: Any) -> Front:
    args = ServerArgs(engine=EngineConfig(model_path=str(model_dir)), **options)
    tokenizer = Tokenizer.from_model_path(args.engine.model_path)
    return Front(tokenizer, build_tenancy(args), shared_heads(tokenizer, args))


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def chat(*messages: tuple[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": r, "content": c} for r, c in messages], **extra}


@pytest.fixture(scope="module")
def chat_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a role-aware chat template (same folder name, so the same served name)."""
    folder = tmp_path_factory.mktemp("role-template") / MODEL
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").write_text(ROLE_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> Front:
    return make_front(tiny_model_dir)


@pytest.fixture(scope="module")
def roles(chat_dir: Path) -> Front:
    return make_front(chat_dir)


# ---- prompts --------------------------------------------------------------------------------------


def test_completion_string_prompt(plain: Front) -> None:
    key = plain.key("/v1/completions", {"model": MODEL, "prompt": "w40 w41 w42"})
    assert key == RouteKey(tuple(plain.tokenizer.encode("w40 w41 w42")), None, 0)
    assert key.tokens == (40, 41, 42)


def test_completion_list_of_strings_routes_by_the_first(plain: Front) -> None:
    key = plain.key("/v1/completions", {"model": MODEL, "prompt": ["w40 w41", "w50 w51 w52"]})
    assert key is not None and key.tokens == tuple(plain.tokenizer.encode("w40 w41")) == (40, 41)


def test_completion_token_ids(plain: Front) -> None:
    key = plain.key("/v1/completions", {"model": MODEL, "prompt": [7, 8, 9, 120]})
    assert key is not None and key.tokens == (7, 8, 9, 120)


def test_completion_batch_of_token_lists_routes_by_the_first(plain: Front) -> None:
    key = plain.key("/v1/completions", {"model": MODEL, "prompt": [[7, 8], [9, 10, 11]]})
    assert key is not None and key.tokens == (7, 8)


def test_chat_tokens_are_the_replicas_chat_template(roles: Front) -> None:
    payload = chat(
        ("developer", "w20 w21"),
        ("user", "w40 w41"),
        ("assistant", "w42"),
        ("user", [{"type": "text", "text": "w43"}, {"type": "text", "text": "w44"}]),
    )
    key = roles.key("/v1/chat/completions", payload)
    # What ChatCall.begin tokenizes: the request's template_messages() through the chat template.
    replica_ids = roles.tokenizer.apply_chat_template(ChatCompletionRequest.model_validate(payload).template_messages())
    assert key is not None and key.tokens == tuple(replica_ids)
    # 'developer' is read as 'system' (w10) and text parts are joined: spelled out by hand.
    assert key.tokens == (10, 20, 21, 11, 40, 41, 12, 42, 11, 43, 44, 99)


def test_chat_on_the_stock_tiny_template(plain: Front) -> None:
    messages = [{"role": "system", "content": "w20"}, {"role": "user", "content": "w40 w41"}]
    key = plain.key("/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert key is not None and key.tokens == tuple(plain.tokenizer.apply_chat_template(messages))
    assert key.tokens == (4, 20, 5, 40, 41, 99)


def test_generate_text_and_input_ids(plain: Front) -> None:
    assert plain.key("/generate", {"text": "w60 w61"}) == RouteKey((60, 61), None, 0)
    assert plain.key("/generate", {"text": ["w62", "w63 w64"]}) == RouteKey((62,), None, 0)
    assert plain.key("/generate", {"input_ids": [5, 6, 7]}) == RouteKey((5, 6, 7), None, 0)
    assert plain.key("/generate", {"input_ids": [[8, 9], [10]]}) == RouteKey((8, 9), None, 0)


# ---- namespaces -----------------------------------------------------------------------------------


def test_cache_salt_and_extra_key_give_the_salt_namespace(plain: Front) -> None:
    s1 = plain.key("/v1/completions", {"model": MODEL, "prompt": "w40", "cache_salt": "s1"})
    s2 = plain.key("/v1/completions", {"model": MODEL, "prompt": "w40", "cache_salt": "s2"})
    assert s1 is not None and s2 is not None
    assert s1.namespace == plain.tenancy.namespace(None, "s1") == salt_namespace("s1")
    assert s2.namespace == plain.tenancy.namespace(None, "s2")
    assert s1.namespace != s2.namespace and None not in (s1.namespace, s2.namespace)
    chat_key = plain.key("/v1/chat/completions", chat(("user", "w40"), cache_salt="s1"))
    native = plain.key("/generate", {"text": "w40", "extra_key": "s1"})
    assert chat_key is not None and native is not None
    assert chat_key.namespace == native.namespace == s1.namespace  # one salt, one namespace, any endpoint


def test_tenant_isolation_separates_tenants_and_a_bad_key_gives_none(tiny_model_dir: Path) -> None:
    front = make_front(tiny_model_dir, api_keys=(KEY_A, KEY_B), tenant_isolation=True)
    body = {"model": MODEL, "prompt": "w40 w41"}
    a, b = front.key("/v1/completions", body, bearer(KEY_A)), front.key("/v1/completions", body, bearer(KEY_B))
    assert a is not None and b is not None and a.tokens == b.tokens == (40, 41)
    assert a.namespace == tenant_namespace(key_tenant(KEY_A)) and b.namespace == tenant_namespace(key_tenant(KEY_B))
    assert a.namespace != b.namespace
    salted = front.key("/v1/completions", {**body, "cache_salt": "s"}, bearer(KEY_A))
    assert salted is not None and salted.namespace == front.tenancy.namespace(key_tenant(KEY_A), "s")
    assert salted.namespace not in (a.namespace, salt_namespace("s"))
    assert front.key("/v1/completions", body, bearer("not-a-key")) is None  # the replica answers 401
    assert front.key("/v1/completions", body) is None  # no key at all: 401 as well


def test_keys_without_isolation_share_one_namespace(tiny_model_dir: Path) -> None:
    front = make_front(tiny_model_dir, api_keys=(KEY_A, KEY_B))
    body = {"model": MODEL, "prompt": "w40 w41"}
    a, b = front.key("/v1/completions", body, bearer(KEY_A)), front.key("/v1/completions", body, bearer(KEY_B))
    assert a == b == RouteKey((40, 41), None, 0)


def test_tenant_header_and_admin_key(tiny_model_dir: Path) -> None:
    by_header = make_front(tiny_model_dir, tenant_header="x-tenant", tenant_isolation=True)
    body = {"model": MODEL, "prompt": "w40"}
    t1 = by_header.key("/v1/completions", body, {"x-tenant": "t1"})
    t2 = by_header.key("/v1/completions", body, {"X-Tenant": "t2"})  # header names are case-insensitive
    assert t1 is not None and t2 is not None
    assert (t1.namespace, t2.namespace) == (tenant_namespace("t1"), tenant_namespace("t2"))
    assert by_header.key("/v1/completions", body) is None  # header missing: 401
    admin = make_front(tiny_model_dir, api_keys=(KEY_A,), admin_api_key=ROOT, tenant_isolation=True)
    key = admin.key("/v1/completions", {**body, "cache_salt": "s"}, bearer(ROOT))
    assert key is not None and key.namespace == admin.tenancy.namespace(ADMIN, "s") == salt_namespace("s")


def test_shared_heads_set_shared_len_in_a_private_namespace(chat_dir: Path) -> None:
    front = make_front(chat_dir, shared_system_prompts=("w20 w21",), shared_prefixes=("w30 w31", "w30 w31 w32"))
    system = [{"role": "system", "content": "w20 w21"}]
    system_head = front.tokenizer.apply_chat_template(system, add_generation_prompt=False)
    assert system_head == [10, 20, 21] and system_head in front.heads
    salted = front.key("/v1/chat/completions", chat(("system", "w20 w21"), ("user", "w40"), cache_salt="s"))
    assert salted is not None and salted.tokens[:3] == (10, 20, 21) and salted.shared_len == len(system_head)
    developer = front.key("/v1/chat/completions", chat(("developer", "w20 w21"), ("user", "w40"), cache_salt="s"))
    assert developer is not None and developer.shared_len == 3
    unsalted = front.key("/v1/chat/completions", chat(("system", "w20 w21"), ("user", "w40")))
    assert unsalted is not None and unsalted.shared_len == 0  # the shared namespace already
    other = front.key("/v1/chat/completions", chat(("system", "w20 w22"), ("user", "w40"), cache_salt="s"))
    assert other is not None and other.shared_len == 0
    longest = front.key("/v1/completions", {"model": MODEL, "prompt": "w30 w31 w32 w33", "cache_salt": "s"})
    shorter = front.key("/v1/completions", {"model": MODEL, "prompt": "w30 w31 w35", "cache_salt": "s"})
    assert longest is not None and shorter is not None and (longest.shared_len, shorter.shared_len) == (3, 2)


def test_shared_heads_under_tenant_isolation(chat_dir: Path) -> None:
    front = make_front(chat_dir, api_keys=(KEY_A,), tenant_isolation=True, shared_system_prompts=("w20 w21",))
    key = front.key("/v1/chat/completions", chat(("system", "w20 w21"), ("user", "w40")), bearer(KEY_A))
    assert key is not None and key.namespace == tenant_namespace(key_tenant(KEY_A)) and key.shared_len == 3


# ---- not routed by prompt -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b""),
        ("/v1/chat/completions", b'{"model": "tiny-llama"'),
        ("/v1/completions", json.dumps({"prompt": "w40"}).encode()),  # no model
        ("/v1/chat/completions", json.dumps({"model": MODEL}).encode()),  # no messages
        ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode()),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": "w40", "max_tokens": "5"}).encode()),  # strict
        ("/generate", json.dumps({"text": "w40", "surprise": 1}).encode()),  # native: unknown fields refused
        ("/health", b""),
        ("/v1/models", b""),
        ("/v1/completions/", json.dumps({"model": MODEL, "prompt": "w40"}).encode()),
    ],
    ids=[
        "bad-json",
        "empty-body",
        "truncated-json",
        "no-model",
        "no-messages",
        "empty-messages",
        "string-max-tokens",
        "native-unknown-field",
        "health",
        "models",
        "trailing-slash",
    ],
)
def test_invalid_or_non_generation_calls_give_none(plain: Front, path: str, body: bytes) -> None:
    assert plain.key(path, body) is None


def test_a_template_error_gives_none(roles: Front) -> None:
    assert roles.key("/v1/chat/completions", chat(("user", "w40"))) is not None
    assert roles.key("/v1/chat/completions", chat(("tool", "w40"))) is None  # the template refuses the role


# ---- against the replica itself -------------------------------------------------------------------
# The single-process server app (create_app) on a real tiny engine, driven through the bridge as an
# EngineReplica drives it. Its engine's make_request records the prompt ids, namespace (extra_key)
# and shared_len the server computed, then refuses (a 400), so nothing is ever queued or run.

CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "heads": {"shared_system_prompts": ("w20 w21",), "shared_prefixes": ("w30 w31",)},
    "isolated": {
        "api_keys": (KEY_A, KEY_B),
        "tenant_isolation": True,
        "admin_api_key": ROOT,
        "shared_system_prompts": ("w20 w21",),
        "shared_prefixes": ("w30 w31",),
    },
    "by-header": {"tenant_header": "x-tenant", "tenant_isolation": True},
}
COMPLETION = {"model": MODEL, "prompt": "w30 w31 w40"}
CASES: list[tuple[str, str, str, Any, dict[str, str], bool]] = [
    # id, config, path, body, headers, whether the replica gets as far as making a request
    ("completion-text", "plain", "/v1/completions", COMPLETION, {}, True),
    ("completion-texts", "plain", "/v1/completions", {"model": MODEL, "prompt": ["w41 w42", "w43"]}, {}, True),
    ("completion-ids", "plain", "/v1/completions", {"model": MODEL, "prompt": [7, 8, 9]}, {}, True),
    ("completion-id-batch", "plain", "/v1/completions", {"model": MODEL, "prompt": [[7, 8], [9]]}, {}, True),
    ("completion-salt", "plain", "/v1/completions", {**COMPLETION, "cache_salt": "s1"}, {}, True),
    (
        "chat-developer-parts",
        "plain",
        "/v1/chat/completions",
        chat(("developer", "w20"), ("user", [{"type": "text", "text": "w40"}, {"type": "text", "text": "w41"}])),
        {},
        True,
    ),
    ("chat-salt", "plain", "/v1/chat/completions", chat(("user", "w40"), cache_salt="s2"), {}, True),
    ("generate-text", "plain", "/generate", {"text": "w50 w51"}, {}, True),
    ("generate-texts", "plain", "/generate", {"text": ["w52", "w53"]}, {}, True),
    ("generate-ids", "plain", "/generate", {"input_ids": [11, 12, 13]}, {}, True),
    ("generate-id-batch", "plain", "/generate", {"input_ids": [[14, 15], [16]]}, {}, True),
    ("generate-extra-key", "plain", "/generate", {"text": "w50", "extra_key": "s1"}, {}, True),
    (
        "heads-system-salt",
        "heads",
        "/v1/chat/completions",
        chat(("system", "w20 w21"), ("user", "w40"), cache_salt="s"),
        {},
        True,
    ),
    (
        "heads-developer-salt",
        "heads",
        "/v1/chat/completions",
        chat(("developer", "w20 w21"), ("user", "w40"), cache_salt="s"),
        {},
        True,
    ),
    ("heads-prefix-salt", "heads", "/v1/completions", {**COMPLETION, "cache_salt": "s"}, {}, True),
    ("heads-no-salt", "heads", "/v1/completions", COMPLETION, {}, True),
    ("tenant-a", "isolated", "/v1/completions", COMPLETION, bearer(KEY_A), True),
    ("tenant-b-salt", "isolated", "/v1/completions", {**COMPLETION, "cache_salt": "s"}, bearer(KEY_B), True),
    (
        "tenant-a-chat",
        "isolated",
        "/v1/chat/completions",
        chat(("system", "w20 w21"), ("user", "w40")),
        bearer(KEY_A),
        True,
    ),
    ("tenant-a-generate", "isolated", "/generate", {"text": "w30 w31 w9", "extra_key": "k"}, bearer(KEY_A), True),
    ("admin", "isolated", "/v1/completions", {**COMPLETION, "cache_salt": "s"}, bearer(ROOT), True),
    ("bad-key", "isolated", "/v1/completions", COMPLETION, bearer("not-a-key"), False),
    ("no-key", "isolated", "/v1/completions", COMPLETION, {}, False),
    ("header-tenant", "by-header", "/v1/completions", COMPLETION, {"x-tenant": "t1"}, True),
    ("header-missing", "by-header", "/v1/completions", COMPLETION, {}, False),
    ("bad-json", "plain", "/v1/completions", b"{not json", {}, False),
    ("no-messages", "plain", "/v1/chat/completions", {"model": MODEL}, {}, False),
    ("template-refuses", "plain", "/v1/chat/completions", chat(("tool", "w40")), {}, False),
    ("health", "plain", "/health", b"", {}, False),
]


@pytest.fixture(scope="module")
def engine(chat_dir: Path) -> Engine:
    return Engine.create(model_path=str(chat_dir), max_total_tokens=256, device="cpu", num_threads=1)


def replica_request(
    engine: Engine, args: ServerArgs, call: HTTPCall, monkeypatch: pytest.MonkeyPatch
) -> tuple[int, RouteKey | None]:
    """The status the server app answers ``call`` with, and its first request's (ids, extra_key, shared_len)."""
    seen: list[RouteKey] = []

    def record(
        prompt: Any, params: Any, extra_key: str | None = None, arrival_time: float | None = None, shared_len: int = 0
    ) -> Any:
        seen.append(RouteKey(tuple(int(t) for t in prompt), extra_key, shared_len))
        raise ValueError("recorded by the test; nothing is queued")

    monkeypatch.setattr(engine, "make_request", record)
    app = create_app(engine, args)

    async def status() -> int:
        async for part in ASGIBridge(app).request(call):
            if isinstance(part, dict):
                return int(part["status"])
        raise AssertionError("no response head")

    try:
        code = asyncio.run(asyncio.wait_for(status(), 10))
    finally:
        app.state.radixserve.tokenizer_pool.shutdown(wait=True)
    return code, seen[0] if seen else None


@pytest.mark.parametrize(
    ("config", "path", "payload", "headers", "reaches_engine"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_the_route_key_is_what_the_replica_computes(
    engine: Engine,
    chat_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    config: str,
    path: str,
    payload: Any,
    headers: dict[str, str],
    reaches_engine: bool,
) -> None:
    args = ServerArgs(engine=EngineConfig(model_path=str(chat_dir)), **CONFIGS[config])
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    method = "GET" if path == "/health" else "POST"
    call = HTTPCall(method, path, headers=(("content-type", "application/json"), *headers.items()), body=body)
    front = make_front(chat_dir, **CONFIGS[config])  # the front's own tokenizer, tenancy and heads
    key = route_key_for(path, body, Headers(headers), front.tokenizer, front.tenancy, front.heads)
    status, replica = replica_request(engine, args, call, monkeypatch)
    assert (replica is not None) == reaches_engine, (status, replica)
    assert key == replica, f"front {key} != replica {replica} (replica status {status})"
    if reaches_engine:
        assert status == 400  # the recorder's refusal, not an earlier error
    elif path != "/health":
        assert status in (400, 401, 422), status


def test_the_replica_check_sees_a_wrong_namespace(
    engine: Engine, chat_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The oracle itself can fail: a front that forgot the tenant (no isolation) disagrees with the replica."""
    isolated = ServerArgs(engine=EngineConfig(model_path=str(chat_dir)), **CONFIGS["isolated"])
    body = json.dumps(COMPLETION).encode()
    call = HTTPCall("POST", "/v1/completions", headers=tuple(bearer(KEY_A).items()), body=body)
    _, replica = replica_request(engine, isolated, call, monkeypatch)
    careless = make_front(chat_dir, api_keys=(KEY_A, KEY_B))  # the same keys, isolation forgotten
    key = careless.key("/v1/completions", COMPLETION, bearer(KEY_A))
    assert replica is not None and key is not None
    assert key.tokens == replica.tokens and key.namespace != replica.namespace
