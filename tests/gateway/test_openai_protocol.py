"""parse_request: valid bodies become the right ParsedRequest; each invalid one a 400 naming the field."""

import pytest

from talaria.config.schema import ToolParser
from talaria.gateway.errors import APIError
from talaria.gateway.openai_protocol import DEFAULT_MAX_TOKENS, Endpoint, parse_request
from talaria.models.tokenizer import PromptTokens

from .fakes import EOS_ID, MODEL, FakeEchoSupervisor

CHAT, COMPLETIONS = Endpoint.CHAT, Endpoint.COMPLETIONS
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def catalog():
    return FakeEchoSupervisor(max_position=64)


def chat(**extra):
    return {"model": MODEL, "messages": MSGS, **extra}


def completion(**extra):
    return {"model": MODEL, "prompt": "hello", **extra}


def test_chat_uses_the_chat_template_and_defaults(catalog):
    p = parse_request(CHAT, chat(), catalog)
    tok = catalog.tokenizer(MODEL)
    assert p.prompt_token_ids == tuple(tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"))
    assert p.sampling.temperature == 1.0 and p.sampling.top_p == 1.0 and p.sampling.top_k == 0
    assert p.sampling.stop_token_ids == (EOS_ID,)  # the tokenizer's EOS set
    assert not p.stream and not p.include_usage and p.stop == () and p.session_id is None
    # default max_tokens: remaining context (64 - 52 prompt tokens) capped at the chat default
    assert len(p.prompt_token_ids) == 52
    assert p.sampling.max_tokens == min(64 - len(p.prompt_token_ids), DEFAULT_MAX_TOKENS[CHAT])


def test_completion_accepts_string_token_ids_and_singleton_batches(catalog):
    assert parse_request(COMPLETIONS, completion(), catalog).prompt_token_ids == tuple(b"hello")
    ids = [104, 105]
    assert parse_request(COMPLETIONS, completion(prompt=ids), catalog).prompt_token_ids == (104, 105)
    assert parse_request(COMPLETIONS, completion(prompt=[ids]), catalog).prompt_token_ids == (104, 105)
    assert parse_request(COMPLETIONS, completion(prompt=["hi"]), catalog).prompt_token_ids == (104, 105)
    p = parse_request(COMPLETIONS, completion(), catalog)
    assert p.sampling.max_tokens == DEFAULT_MAX_TOKENS[COMPLETIONS]


def test_all_options_parsed(catalog):
    p = parse_request(CHAT, chat(stream=True, stream_options={"include_usage": True}, stop=["a", "b"],
                                 seed=7, temperature=0, top_p=0.5, top_k=40, ignore_eos=True,
                                 max_completion_tokens=9, session_id="s-1", stop_token_ids=[5]), catalog)
    s = p.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.ignore_eos) == (9, 0.0, 0.5, 40, 7, True)
    assert s.stop_token_ids == (5,)  # ignore_eos: the tokenizer's EOS is not added
    assert p.stream and p.include_usage and p.stop == ("a", "b") and p.session_id == "s-1"


def test_content_parts_developer_role_and_single_stop_string(catalog):
    body = chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "be "},
                                                              {"type": "text", "text": "brief"}]}], stop="\n")
    p = parse_request(CHAT, body, catalog)
    text = catalog.tokenizer(MODEL).decode(list(p.prompt_token_ids))
    assert text.startswith("<|im_start|>system\nbe \nbrief<|im_end|>") and p.stop == ("\n",)


def test_tools_reach_a_template_that_takes_them(catalog):
    class RecordingTokenizer:
        eos_token_ids = (EOS_ID,)
        chat_template_source = "{% for tool in tools %}{{ tool | tojson }}{% endfor %} <tool_call>"

        def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
            self.seen = (messages, add_generation_prompt, tools)
            return "rendered"

        def encode_prompt(self, text, prior=None):
            return PromptTokens((1, 2, 3), (), ())

    class Catalog:
        tok = RecordingTokenizer()
        config = catalog.config

        def model_names(self):
            return [MODEL]

        def tokenizer(self, model):
            return self.tok

        def arch(self, model):
            return catalog.arch(model)

    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    cat = Catalog()
    p = parse_request(CHAT, chat(tools=tools), cat)
    assert p.prompt_token_ids == (1, 2, 3) and cat.tok.seen == (MSGS, True, tools)
    assert p.tool_format is ToolParser.HERMES and p.sampling.grammar is None  # auto: parsed, not forced
    history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}]
    parse_request(CHAT, chat(messages=history, tools=tools), cat)
    assert cat.tok.seen[0][1]["tool_calls"][0]["function"]["arguments"] == {"path": "."}  # as HF templates take it
    p = parse_request(CHAT, chat(tools=tools, tool_choice="none"), cat)
    assert cat.tok.seen[2] is None and p.tool_format is None  # "none": not told about tools, nothing parsed


@pytest.fixture(scope="module")
def roomy():
    """A catalog whose byte-level model has room for tool descriptions."""
    return FakeEchoSupervisor(max_position=4096)


def test_a_template_without_tools_gets_the_default_hermes_rendering(roomy):
    tools = [{"type": "function", "function": {"name": "ls", "description": "list files",
                                               "parameters": {"type": "object"}}}]
    history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py"}]
    p = parse_request(CHAT, chat(messages=history, tools=tools), roomy)
    text = roomy.tokenizer(MODEL).decode(p.prompt_token_ids)
    assert '<tools>\n{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}, ' \
           '"description": "list files"}}\n</tools>' in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\na.py\n</tool_response><|im_end|>" in text


def test_a_forced_tool_choice_or_json_format_constrains_decoding(roomy):
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    named = parse_request(CHAT, chat(tools=tools, tool_choice={"type": "function", "function": {"name": "ls"}}),
                          roomy)
    assert named.sampling.grammar and "ls" in named.sampling.grammar
    assert parse_request(CHAT, chat(tools=tools, tool_choice="required"), roomy).sampling.grammar
    assert parse_request(CHAT, chat(response_format={"type": "json_object"}), roomy).sampling.grammar
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    assert parse_request(CHAT, chat(response_format=fmt), roomy).sampling.grammar
    assert parse_request(CHAT, chat(tools=tools), roomy).sampling.grammar is None


def test_session_id_body_wins_over_header(catalog):
    assert parse_request(CHAT, chat(), catalog, header_session_id="h").session_id == "h"
    assert parse_request(CHAT, chat(session_id="b"), catalog, header_session_id="h").session_id == "b"


def test_extreme_sampling_values_in_range_are_accepted(catalog):
    p = parse_request(CHAT, chat(seed=2**64 - 1, temperature=1e-300, top_p=1e-300, top_k=2**20), catalog)
    assert p.sampling.seed == 2**64 - 1 and p.sampling.greedy  # a temperature below GREEDY_BELOW is greedy
    assert parse_request(CHAT, chat(seed=-(2**63)), catalog).sampling.seed == -(2**63)


def test_top_k_minus_one_means_disabled(catalog):
    assert parse_request(CHAT, chat(top_k=-1), catalog).sampling.top_k == 0


def test_max_tokens_exactly_filling_the_context_is_accepted(catalog):
    n = len(parse_request(COMPLETIONS, completion(), catalog).prompt_token_ids)
    assert parse_request(COMPLETIONS, completion(max_tokens=64 - n), catalog).sampling.max_tokens == 64 - n


@pytest.mark.parametrize(
    "endpoint, body, status, param, code",
    [
        (CHAT, [], 400, None, None),
        (CHAT, {"messages": MSGS}, 400, "model", None),
        (CHAT, {"model": 3, "messages": MSGS}, 400, "model", None),
        (CHAT, chat(model="nope"), 404, "model", "model_not_found"),
        (CHAT, chat(messages=[]), 400, "messages", None),
        (CHAT, chat(messages="hi"), 400, "messages", None),
        (CHAT, chat(messages=["hi"]), 400, "messages[0]", None),
        (CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", None),
        (CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", None),
        (CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content", None),
        (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
         400, "messages[0].content[0]", None),
        (CHAT, chat(messages=[{"role": "assistant", "content": "x"}]), 400, "messages", None),  # template error
        (CHAT, chat(max_tokens=0), 400, "max_tokens", None),
        (CHAT, chat(max_tokens=-3), 400, "max_tokens", None),
        (CHAT, chat(max_tokens=2.0), 400, "max_tokens", None),
        (CHAT, chat(max_tokens=True), 400, "max_tokens", None),
        (CHAT, chat(max_tokens="5"), 400, "max_tokens", None),
        (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens", None),
        (CHAT, chat(temperature=2.5), 400, "temperature", None),
        (CHAT, chat(temperature=-0.1), 400, "temperature", None),
        (CHAT, chat(temperature="hot"), 400, "temperature", None),
        (CHAT, chat(temperature=True), 400, "temperature", None),
        (CHAT, chat(top_p=0), 400, "top_p", None),
        (CHAT, chat(top_p=1.01), 400, "top_p", None),
        (CHAT, chat(top_k=-2), 400, "top_k", None),
        (CHAT, chat(top_k=1.5), 400, "top_k", None),
        (CHAT, chat(seed="1"), 400, "seed", None),
        (CHAT, chat(seed=2**64), 400, "seed", None),  # beyond a torch.Generator: it took the worker down
        (CHAT, chat(seed=-(2**63) - 1), 400, "seed", None),
        (CHAT, chat(temperature=float("inf")), 400, "temperature", None),  # a JSON 1e400
        (CHAT, chat(top_p=float("nan")), 400, "top_p", None),
        (CHAT, chat(top_k=2**70), 400, "top_k", None),
        (CHAT, chat(stop_token_ids=list(range(65))), 400, "stop_token_ids", None),
        (CHAT, chat(seed=False), 400, "seed", None),
        (CHAT, chat(n=2), 400, "n", None),
        (CHAT, chat(n=0), 400, "n", None),
        (CHAT, chat(stream="yes"), 400, "stream", None),
        (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options", None),
        (CHAT, chat(stream=True, stream_options=[]), 400, "stream_options", None),
        (CHAT, chat(stream=True, stream_options={"include_usage": 1}), 400, "stream_options.include_usage", None),
        (CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
        (CHAT, chat(stop=[""]), 400, "stop", None),
        (CHAT, chat(stop=5), 400, "stop", None),
        (CHAT, chat(stop=["a", 1]), 400, "stop", None),
        (CHAT, chat(ignore_eos="no"), 400, "ignore_eos", None),
        (CHAT, chat(session_id=""), 400, "session_id", None),
        (CHAT, chat(session_id="x" * 300), 400, "session_id", None),
        (CHAT, chat(stop_token_ids=[999]), 400, "stop_token_ids", None),
        (CHAT, chat(logprobs=True), 400, "logprobs", None),
        (CHAT, chat(presence_penalty=0.5), 400, "presence_penalty", None),
        (CHAT, chat(frequency_penalty=9), 400, "frequency_penalty", None),
        (CHAT, chat(logit_bias={"1": 5}), 400, "logit_bias", None),
        (CHAT, chat(tools={"type": "function"}), 400, "tools", None),
        (CHAT, chat(tools=[{"type": "function", "function": {}}]), 400, "tools[0].function.name", None),
        (CHAT, chat(tools=[{"type": "retrieval"}]), 400, "tools[0]", None),
        (CHAT, chat(tool_choice="required"), 400, "tool_choice", None),
        (CHAT, chat(tool_choice={"type": "function", "function": {"name": "f"}}), 400, "tool_choice", None),
        (CHAT, chat(response_format={"type": "xml"}), 400, "response_format.type", None),
        (CHAT, chat(response_format={"type": "json_schema", "json_schema": {}}), 400,
         "response_format.json_schema.schema", None),
        (CHAT, chat(tools=[{"type": "function", "function": {"name": "a b"}}]), 400, "tools[0].function.name", None),
        (CHAT, chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages[0].tool_call_id", None),
        (CHAT, chat(messages=[{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}]), 400,
         "messages[0].tool_calls[0]", None),
        (CHAT, chat(messages=[{"role": "user", "content": "x" * 70}]), 400, "messages", "context_length_exceeded"),
        (CHAT, chat(max_tokens=60), 400, "max_tokens", "context_length_exceeded"),
        (COMPLETIONS, completion(prompt=None), 400, "prompt", None),
        (COMPLETIONS, completion(prompt=""), 400, "prompt", None),
        (COMPLETIONS, completion(prompt=[]), 400, "prompt", None),
        (COMPLETIONS, completion(prompt=["a", "b"]), 400, "prompt", None),
        (COMPLETIONS, completion(prompt=[1, "a"]), 400, "prompt", None),
        (COMPLETIONS, completion(prompt=[1, 259]), 400, "prompt", None),
        (COMPLETIONS, completion(prompt=[-1]), 400, "prompt", None),
        (COMPLETIONS, completion(prompt=[True]), 400, "prompt", None),
        (COMPLETIONS, completion(prompt=[1] * 64), 400, "prompt", "context_length_exceeded"),
        (COMPLETIONS, completion(max_tokens=60), 400, "max_tokens", "context_length_exceeded"),
        (COMPLETIONS, completion(echo=True), 400, "echo", None),
        (COMPLETIONS, completion(best_of=3), 400, "best_of", None),
        (COMPLETIONS, completion(suffix="x"), 400, "suffix", None),
        (COMPLETIONS, completion(logprobs=2), 400, "logprobs", None),
    ],
)
def test_invalid_requests(catalog, endpoint, body, status, param, code):
    with pytest.raises(APIError) as info:
        parse_request(endpoint, body, catalog)
    err = info.value
    assert (err.status, err.param, err.code) == (status, param, code), err.message
    assert err.body()["error"]["param"] == param and err.body()["error"]["message"] == err.message


def test_an_image_part_is_refused_saying_only_text_is_served(catalog):
    body = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                       {"type": "image_url", "image_url": {"url": "data:,"}}]}])
    with pytest.raises(APIError) as info:
        parse_request(CHAT, body, catalog)
    assert (info.value.status, info.value.param) == (400, "messages[0].content[1]")
    assert "image_url inputs are not supported" in info.value.message and "text model" in info.value.message
