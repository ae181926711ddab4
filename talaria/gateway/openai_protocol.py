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
- Features the engine lacks (n > 1, logprobs, penalties, JSON mode, forced tool_choice, echo,
  suffix) are 400s rather than being silently ignored; unknown fields are ignored, as most OpenAI
  servers do. `tools` reach the chat template, but tool calls come back as text in `content`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from jinja2 import TemplateError

from talaria.contracts.arch import ModelArch
from talaria.contracts.call import SamplingParams
from talaria.gateway.errors import NOT_FOUND, APIError
from talaria.models.errors import ChatTemplateError

if TYPE_CHECKING:
    from talaria.models.tokenizer import Tokenizer


class Endpoint(str, Enum):
    CHAT = "chat.completions"
    COMPLETIONS = "completions"


DEFAULT_MAX_TOKENS = {Endpoint.CHAT: 1024, Endpoint.COMPLETIONS: 16}
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_SESSION_ID_CHARS = 256
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


class ModelCatalog(Protocol):
    """What parsing needs to know about models; the supervisor provides it."""

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


def parse_request(
    endpoint: Endpoint, body: Any, catalog: ModelCatalog, header_session_id: str | None = None
) -> ParsedRequest:
    """Validate one request body against the model catalog; raise APIError on any problem."""
    if not isinstance(body, dict):
        raise APIError.invalid("the request body must be a JSON object")
    f = _Fields(body)
    model = f.string("model", required=True)
    if model not in catalog.model_names():
        raise APIError(404, f"The model {model!r} does not exist; GET /v1/models lists the served models.",
                       NOT_FOUND, "model", "model_not_found")
    _reject_unsupported(f, endpoint)
    stream = f.boolean("stream", False)
    include_usage = False
    options = f.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise APIError.invalid("stream_options must be an object", "stream_options")
        if not stream:
            raise APIError.invalid("stream_options is only allowed when stream is true", "stream_options")
        include_usage = _Fields(options, "stream_options.").boolean("include_usage", False)

    max_param = "max_tokens"
    if endpoint is Endpoint.CHAT and f.get("max_completion_tokens") is not None:
        max_param = "max_completion_tokens"
    max_tokens = f.integer(max_param, minimum=1)
    temperature = f.number("temperature", 1.0, low=0.0, high=2.0)
    top_p = f.number("top_p", 1.0, low=0.0, high=1.0, low_open=True)
    top_k = f.integer("top_k", minimum=-1)
    seed = f.integer("seed")
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
    stop_ids = f.int_list("stop_token_ids", minimum=0, below=arch.vocab_size)
    if endpoint is Endpoint.CHAT:
        prompt_param = "messages"
        prompt_ids = _chat_prompt(tokenizer, _messages(f), _tools(f))
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
    )
    return ParsedRequest(endpoint, model, prompt_ids, sampling, stream, include_usage, stops, session_id)


def _reject_unsupported(f: _Fields, endpoint: Endpoint) -> None:
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
        if f.get("logprobs") not in (None, False) or f.get("top_logprobs") not in (None, 0):
            raise APIError.invalid("logprobs are not supported", "logprobs")
        fmt = f.get("response_format")
        if fmt is not None and fmt != {"type": "text"}:
            raise APIError.invalid("only response_format {\"type\": \"text\"} is supported", "response_format")
    else:
        if f.get("logprobs") not in (None, 0):
            raise APIError.invalid("logprobs are not supported", "logprobs")
        if f.integer("best_of", minimum=1) not in (None, 1):
            raise APIError.invalid("only best_of=1 is supported", "best_of")
        if f.boolean("echo", False):
            raise APIError.invalid("echo is not supported", "echo")
        if f.get("suffix") not in (None, ""):
            raise APIError.invalid("suffix is not supported", "suffix")


def _messages(f: _Fields) -> list[dict[str, Any]]:
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
        msg = dict(m)
        msg["role"] = "system" if role == "developer" else role
        msg["content"] = content
        out.append(msg)
    return out


def _tools(f: _Fields) -> list[dict[str, Any]] | None:
    """Tool definitions for the chat template, or None. Tool calls come back as plain text in
    `content`: there is no tool-call parser yet, so `tool_choice` cannot be forced."""
    tools = f.get("tools")
    choice = f.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise APIError.invalid("only tool_choice \"auto\" or \"none\" is supported", "tool_choice")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError.invalid("tools must be an array", "tools")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):
            raise APIError.invalid(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                                   f"tools[{i}]")
    return tools if tools and choice != "none" else None


def _chat_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None) -> tuple[int, ...]:
    """The conversation through the model's chat template (which writes its own BOS); a template
    that rejects the messages is the client's 400, not ours."""
    try:
        return tuple(tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools))
    except (ChatTemplateError, TemplateError) as e:  # e.g. "roles must alternate user/assistant"
        raise APIError.invalid(f"the model's chat template rejected the messages: {e}", "messages") from e


def _text_part(part: Any, where: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
        return part["text"]
    raise APIError.invalid(f"{where}: only text content parts are supported", where)


def _completion_prompt(f: _Fields, tokenizer: Tokenizer, vocab_size: int) -> tuple[int, ...]:
    """A string, a list of token ids, or a one-element batch of either."""
    prompt = f.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError.invalid("only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tuple(tokenizer.encode(prompt))
    if isinstance(prompt, list):
        return _Fields({"prompt": prompt}).int_list("prompt", minimum=0, below=vocab_size)
    raise APIError.invalid("prompt must be a string or an array of token ids", "prompt")


def _stops(f: _Fields) -> tuple[str, ...]:
    stop = f.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError.invalid("stop must be a non-empty string or an array of non-empty strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError.invalid(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
    return tuple(dict.fromkeys(stops))


class _Fields:
    """Typed reads from a JSON object; each bad value becomes a 400 naming the field.

    JSON booleans are Python ints, so every numeric reader rejects bool explicitly.
    """

    def __init__(self, data: dict[str, Any], prefix: str = "") -> None:
        self._data = data
        self._prefix = prefix

    def get(self, name: str) -> Any:
        return self._data.get(name)

    def _bad(self, name: str, what: str) -> APIError:
        return APIError.invalid(f"{self._prefix}{name} must be {what}", self._prefix + name)

    def string(self, name: str, required: bool = False) -> str | None:
        value = self._data.get(name)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value:
            raise self._bad(name, "a non-empty string")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self._data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self._bad(name, "a boolean")
        return value

    def integer(self, name: str, minimum: int | None = None) -> int | None:
        value = self._data.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(name, "an integer")
        if minimum is not None and value < minimum:
            raise self._bad(name, f"an integer >= {minimum}")
        return value

    def number(self, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
        value = self._data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(name, "a number")
        if value > high or value < low or (low_open and value == low):
            raise self._bad(name, f"in {'(' if low_open else '['}{low:g}, {high:g}]")
        return float(value)

    def int_list(self, name: str, minimum: int, below: int) -> tuple[int, ...]:
        value = self._data.get(name)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and minimum <= v < below for v in value
        ):
            raise self._bad(name, f"an array of token ids in [{minimum}, {below})")
        return tuple(value)
