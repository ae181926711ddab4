"""OpenAI request bodies for /v1/chat/completions and /v1/completions, parsed and validated.

`parse_request` turns a decoded JSON body into a frozen `ParsedRequest`: the prompt as token ids
(chat messages go through the model's chat template), the engine's `SamplingParams`, and the
gateway-side options (stream, usage in stream, stop strings, session). Every rejection is an
`APIError` 400 whose `param` names the field, so a client learns exactly what to fix; an unknown
model is 404 `model_not_found`, as with OpenAI.

Choices where OpenAI leaves room:
- `max_tokens` absent: the remaining context, capped at `DEFAULT_MAX_TOKENS[endpoint]` (1024 for
  chat; 16 for completions, OpenAI's documented legacy default).
- prompt tokens + max_tokens > context length: 400 `context_length_exceeded` (no silent clamping).
- `session_id` in the body wins over the `X-Session-Id` header.
- Features the engine lacks (n > 1, logprobs, penalties, echo, suffix) are 400s rather than being
  silently ignored; unknown fields are ignored, as most OpenAI servers do.
- Tools (talaria/gateway/tools.py) reach the chat template, tool calls and reasoning are parsed out
  of the output (talaria/gateway/output_parser.py), and a forced `tool_choice` or a JSON
  `response_format` constrains decoding with a grammar (talaria/gateway/grammar.py). Every field:
  docs/api.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from talaria.config.schema import TalariaConfig, ToolParser
from talaria.contracts.arch import ModelArch
from talaria.contracts.call import SamplingParams
from talaria.gateway.chat_prompt import build_chat_prompt
from talaria.gateway.errors import NOT_FOUND, APIError
from talaria.gateway.fields import Fields
from talaria.gateway.grammar import response_format_grammar
from talaria.gateway.output_parser import OutputParser, ParsedOutput, parse
from talaria.gateway.prompt_cache import PromptCache
from talaria.gateway.tools import parse_tools

if TYPE_CHECKING:
    from talaria.models.tokenizer import Tokenizer


class Endpoint(str, Enum):
    CHAT = "chat.completions"
    COMPLETIONS = "completions"
    MESSAGES = "messages"  # Anthropic's Messages API (talaria/gateway/anthropic_protocol.py)
    RESPONSES = "responses"  # OpenAI's Responses API (talaria/gateway/responses_protocol.py)


DEFAULT_MAX_TOKENS = {Endpoint.CHAT: 1024, Endpoint.COMPLETIONS: 16}
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_TOKEN_IDS = 64  # the engine checks every sampled token against them
MAX_TOP_K = 1 << 20  # larger than any vocabulary: no cut
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what a torch.Generator takes
MAX_SESSION_ID_CHARS = 256
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


class ModelCatalog(Protocol):
    """What parsing needs to know about models; the supervisor provides it."""

    config: TalariaConfig

    def model_names(self) -> list[str]: ...
    def tokenizer(self, model: str) -> Tokenizer: ...
    def arch(self, model: str) -> ModelArch: ...


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: Endpoint
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams  # what the instance sees (stop_token_ids include the tokenizer's EOS)
    stream: bool
    include_usage: bool  # stream_options.include_usage: a final usage chunk before [DONE]
    stop: tuple[str, ...]  # stop strings, matched by the gateway on detokenized text
    session_id: str | None  # body `session_id`, else header `X-Session-Id`
    tool_format: ToolParser | None = None  # parse tool calls of this format out of the output (None: don't)
    reasoning: bool = False  # the output starts with <think>...</think>: returned as reasoning_content
    messages: list[dict[str, Any]] | None = None  # a chat call's conversation (what session inference hashes)
    cache_salt: str | None = None  # body `cache_salt` (vLLM's): its prefixes are shared only with equal salts
    tool_schemas: dict[str, Any] | None = None  # the offered functions' parameter schemas by name (XML calls' types)
    reasoning_open: bool = False  # the prompt ends inside <think>: the output starts as reasoning
    reasoning_shown: bool = True  # the response carries the reasoning's text (Messages: not `display: "omitted"`)
    api: Any = None  # what one API's response needs beyond this (the Responses API's `ResponsesRequest`)

    def output_parser(self) -> OutputParser | None:
        """A fresh parser for this call's output; None when the output is plain text."""
        if self.tool_format is None and not self.reasoning:
            return None
        return OutputParser(self.tool_format, self.reasoning, self.tool_schemas, self.reasoning_open)

    def parse_output(self, text: str) -> ParsedOutput:
        """A chat call's whole output, parsed as `output_parser` parses it streamed."""
        return parse(text, self.tool_format, self.reasoning, self.tool_schemas, self.reasoning_open)


def request_fields(body: Any) -> Fields:
    if not isinstance(body, dict):
        raise APIError.invalid("the request body must be a JSON object")
    return Fields(body)


def served_model(f: Fields, catalog: ModelCatalog) -> str:
    """The request's `model`, which must be one the catalog serves (404 otherwise)."""
    model = f.string("model", required=True)
    if model not in catalog.model_names():
        raise APIError(404, f"The model {model!r} does not exist; GET /v1/models lists the served models.",
                       NOT_FOUND, "model", "model_not_found")
    return model


def parse_request(
    endpoint: Endpoint, body: Any, catalog: ModelCatalog, header_session_id: str | None = None,
    prompts: PromptCache | None = None,
) -> ParsedRequest:
    """Validate one request body against the model catalog; raise APIError on any problem.
    `prompts`: recent prompts to tokenize a conversation's next prompt from."""
    f = request_fields(body)
    model = served_model(f, catalog)
    _reject_unsupported(f, endpoint)
    stream = f.boolean("stream", False)
    include_usage = False
    options = f.object("stream_options")
    if options is not None:
        if not stream:
            raise APIError.invalid("stream_options is only allowed when stream is true", "stream_options")
        include_usage = Fields(options, "stream_options.").boolean("include_usage", False)

    max_param = "max_tokens"
    if endpoint is Endpoint.CHAT and f.get("max_completion_tokens") is not None:
        max_param = "max_completion_tokens"
    max_tokens = f.integer(max_param, minimum=1)
    temperature = f.number("temperature", 1.0, low=0.0, high=2.0)
    top_p = f.number("top_p", 1.0, low=0.0, high=1.0, low_open=True)
    top_k = f.integer("top_k", minimum=-1, maximum=MAX_TOP_K)
    seed = f.integer("seed", minimum=SEED_RANGE[0], maximum=SEED_RANGE[1])
    ignore_eos = f.boolean("ignore_eos", False)
    stops = _stops(f)
    session_id = f.string("session_id")
    if session_id is None and header_session_id:
        session_id = header_session_id
    if session_id is not None and len(session_id) > MAX_SESSION_ID_CHARS:
        raise APIError.invalid(f"session_id must be at most {MAX_SESSION_ID_CHARS} characters", "session_id")

    # Cheap checks are done; now the model-dependent (and, for long prompts, costly) part.
    tokenizer = catalog.tokenizer(model)
    arch = catalog.arch(model)
    stop_ids = f.int_list("stop_token_ids", minimum=0, below=arch.vocab_size, most=MAX_STOP_TOKEN_IDS)
    grammar, tool_format, reasoning, messages = None, None, False, None
    schemas, reasoning_open = None, False
    if endpoint is Endpoint.CHAT:
        prompt_param = "messages"
        messages = _messages(f)
        chat = build_chat_prompt(catalog, model, messages, parse_tools(f), response_format_grammar(f), prompts)
        prompt_ids, grammar, tool_format, reasoning = chat.ids, chat.grammar, chat.tool_format, chat.reasoning
        schemas, reasoning_open = chat.tool_schemas, chat.reasoning_open
    else:
        prompt_param = "prompt"
        prompt_ids = _completion_prompt(f, tokenizer, arch.vocab_size)
    if not prompt_ids:
        raise APIError.invalid("the prompt is empty", prompt_param)
    room = arch.max_position - len(prompt_ids)
    if room <= 0:
        raise APIError.invalid(
            f"This model's maximum context length is {arch.max_position} tokens. However, your "
            f"{prompt_param} resulted in {len(prompt_ids)} tokens. Please reduce the length of the {prompt_param}.",
            prompt_param, "context_length_exceeded")
    if max_tokens is not None and max_tokens > room:
        raise APIError.invalid(
            f"This model's maximum context length is {arch.max_position} tokens. However, you requested "
            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the {prompt_param}, {max_tokens} "
            f"in the completion). Please reduce the length of the {prompt_param} or completion.",
            max_param, "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(room, DEFAULT_MAX_TOKENS[endpoint])
    if not ignore_eos:  # chat models end turns with tokens the engine may not treat as EOS
        stop_ids = stop_ids + tuple(t for t in tokenizer.eos_token_ids if t not in stop_ids)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=0 if top_k in (None, -1) else top_k,
        seed=seed,
        ignore_eos=ignore_eos,
        stop_token_ids=stop_ids,
        grammar=grammar,
    )
    return ParsedRequest(endpoint, model, prompt_ids, sampling, stream, include_usage, stops, session_id,
                         tool_format, reasoning, messages, cache_salt(f),
                         tool_schemas=schemas, reasoning_open=reasoning_open)


def cache_salt(f: Fields) -> str | None:
    salt = f.string("cache_salt")
    if salt is not None and len(salt) > MAX_SESSION_ID_CHARS:
        raise APIError.invalid(f"cache_salt must be at most {MAX_SESSION_ID_CHARS} characters", "cache_salt")
    return salt


def _reject_unsupported(f: Fields, endpoint: Endpoint) -> None:
    """400 for features a client would otherwise believe were honoured."""
    n = f.integer("n", minimum=1)
    if n not in (None, 1):
        raise APIError.invalid("only n=1 is supported", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if f.number(name, 0.0, low=-2.0, high=2.0) != 0.0:
            raise APIError.invalid(f"{name} is not supported; omit it or send 0", name)
    if f.get("logit_bias"):
        raise APIError.invalid("logit_bias is not supported", "logit_bias")
    if endpoint is Endpoint.CHAT:
        for name, off in (("logprobs", False), ("top_logprobs", 0)):
            if f.get(name) not in (None, off):
                raise APIError.invalid(f"{name} is not supported", name)
    else:
        if f.get("logprobs") not in (None, 0):
            raise APIError.invalid("logprobs are not supported", "logprobs")
        if f.integer("best_of", minimum=1) not in (None, 1):
            raise APIError.invalid("only best_of=1 is supported", "best_of")
        if f.boolean("echo", False):
            raise APIError.invalid("echo is not supported", "echo")
        if f.get("suffix") not in (None, ""):
            raise APIError.invalid("suffix is not supported", "suffix")


def _messages(f: Fields) -> list[dict[str, Any]]:
    """Chat messages as the chat template expects them: content flattened to a string."""
    messages = f.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError.invalid("messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError.invalid(f"{where} must be an object", where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise APIError.invalid(f"{where}.role must be one of {sorted(CHAT_ROLES)}", f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):
            # joined with newlines, as talaria.models.chat_template and transformers do
            content = "\n".join(_text_part(p, f"{where}.content[{j}]") for j, p in enumerate(content))
        elif content is None:
            if not (role == "assistant" and m.get("tool_calls")):
                raise APIError.invalid(f"{where}.content is required", f"{where}.content")
        elif not isinstance(content, str):
            raise APIError.invalid(f"{where}.content must be a string or an array of text parts",
                                   f"{where}.content")
        if m.get("tool_calls") is not None:
            _check_tool_calls(m["tool_calls"], where, role)
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise APIError.invalid(f"{where}.tool_call_id must be the id of the call this message answers",
                                   f"{where}.tool_call_id")
        msg = dict(m)
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = content
        out.append(msg)
    return out


def _check_tool_calls(calls: Any, where: str, role: str) -> None:
    """An assistant message's earlier calls, as OpenAI returned them: id, type, name, arguments text."""
    if role != "assistant" or not isinstance(calls, list):
        raise APIError.invalid(f"{where}.tool_calls must be an array, on an assistant message", f"{where}.tool_calls")
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)
                and isinstance(call.get("id"), str)):
            raise APIError.invalid(f"{where}.tool_calls[{j}] must be {{\"id\": ..., \"type\": \"function\", "
                                   f"\"function\": {{\"name\": ..., \"arguments\": \"<JSON text>\"}}}}",
                                   f"{where}.tool_calls[{j}]")


IMAGE_PARTS = ("image_url", "input_image", "image", "video_url", "input_audio")  # what vision clients send


def _text_part(part: Any, where: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
        raise APIError.invalid(f"{where}: {part['type']} inputs are not supported: Talaria serves the text "
                               "model of vision-language checkpoints (Qwen3.5); send text parts", where)
    raise APIError.invalid(f"{where}: only text content parts are supported", where)


def _completion_prompt(f: Fields, tokenizer: Tokenizer, vocab_size: int) -> tuple[int, ...]:
    """A string, a list of token ids, or a one-element batch of either."""
    prompt = f.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError.invalid("only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tuple(tokenizer.encode(prompt))
    if isinstance(prompt, list):
        return Fields({"prompt": prompt}).int_list("prompt", minimum=0, below=vocab_size)
    raise APIError.invalid("prompt must be a string or an array of token ids", "prompt")


def _stops(f: Fields) -> tuple[str, ...]:
    stop = f.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError.invalid("stop must be a non-empty string or an array of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError.invalid(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
    return tuple(dict.fromkeys(stops))
