"""The official `openai` client parses the gateway's responses, streams and errors without help."""

import openai
import pytest
from starlette.testclient import TestClient

from talaria.gateway.gateway import create_app

from .fakes import MODEL, FakeEchoSupervisor


@pytest.fixture
def sup():
    return FakeEchoSupervisor(api_key="k")


@pytest.fixture
def client(sup):
    http = TestClient(create_app(sup), raise_server_exceptions=False)
    return openai.OpenAI(api_key="k", base_url="http://testserver/v1", http_client=http, max_retries=0)


def test_chat_whole_and_streamed(client):
    msgs = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, seed=1)
    assert whole.choices[0].message.content == "<|im" and whole.choices[0].finish_reason == "length"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 4
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "<|im"
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []


def test_completions_with_extensions(client, sup):
    out = client.completions.create(model=MODEL, prompt="xy", max_tokens=3,
                                    extra_body={"top_k": 5, "ignore_eos": True, "session_id": "s9"})
    assert out.choices[0].text == "xyx"
    call = sup.groups[0].calls[0]
    assert call.sampling.top_k == 5 and call.sampling.ignore_eos and call.session_id == "s9"


def test_errors_map_to_typed_sdk_exceptions(client, sup):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="x")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", n=2)
    assert info.value.param == "n"
    bad = openai.OpenAI(api_key="wrong", base_url="http://testserver/v1", http_client=client._client,
                        max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    sup.groups[0].fail_after = 1
    with pytest.raises(openai.APIError, match="hot0 died"):
        list(client.completions.create(model=MODEL, prompt="x", max_tokens=3, stream=True))
