"""Tenants against a real `talaria up`: each key's tenant has its own cached prefixes and sessions,
a `cache_salt` separates calls within a tenant, and a user key opens no admin endpoint."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Server, served, tiny_llama_toml, wait_for

pytestmark = pytest.mark.slow

CONFIG = f"""
[server]
admin_key = "adm"

[[server.api_keys]]
key = "key-a"
tenant = "team-a"

[[server.api_keys]]
key = "key-b"
tenant = "team-b"

{tiny_llama_toml("tiny-llama", 1)}
[[instances]]
name = "hot-0"
pool = "hot"
models = ["tiny-llama"]
arena_bytes = "64MiB"
"""

PROMPT = "The tenants of this node share its instances but never each other's cached prefixes. " * 4


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Server:
    with served(tmp_path_factory.mktemp("tenants"), CONFIG) as srv:
        yield srv


def cached(node: Server, key: str, **extra) -> int:
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, **extra}
    r = httpx.post(node.api + "/completions", json=body, headers={"authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_tenant_never_hits_another_tenants_cached_prompt(node):
    assert cached(node, "key-a") == 0
    assert cached(node, "key-b") == 0  # team-a just ran it: a hit would tell team-b so
    assert cached(node, "key-a") > 0 and cached(node, "key-b") > 0  # each hits its own
    assert cached(node, "key-a", cache_salt="alice") == 0  # a salt separates calls within a tenant
    assert cached(node, "key-a", cache_salt="alice") > 0


def test_the_same_session_id_in_two_tenants_is_two_sessions(node):
    for key in ("key-a", "key-b"):
        body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 1, "session_id": "s-1"}
        assert httpx.post(node.api + "/completions", json=body, headers={"authorization": f"Bearer {key}"},
                          timeout=60).status_code == 200

    def ours() -> list[str]:  # the instance's next snapshot lists them (one every 0.25 s)
        telemetry = httpx.get(node.base_url + "/talaria/telemetry", headers={"authorization": "Bearer adm"}).json()
        sessions = [s["session"] for s in telemetry["instances"]["hot-0"]["stats"]["sessions"]]
        found = [s for s in sessions if s.endswith("/s-1")]
        return found if len(found) == 2 else []

    ours = wait_for(ours, 10, "both sessions in telemetry")
    assert len(ours) == 2 and ours[0] != ours[1] and {s.split("/")[0] for s in ours} == {"team-a", "team-b"}


@pytest.mark.parametrize("method, path", [("GET", "/talaria/telemetry"), ("GET", "/talaria/events"),
                                          ("POST", "/talaria/admin/switch")])
def test_a_user_key_opens_no_admin_endpoint(node, method, path):
    r = httpx.request(method, node.base_url + path, headers={"authorization": "Bearer key-a"}, json={}, timeout=10)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    assert httpx.request(method, node.base_url + path, json={}, timeout=10).status_code == 401
