"""`talaria.executor.grammar_masks` through the real engine: constrained calls follow their grammar,
end by themselves, and change nothing for the calls they share batches with.

A tiny float64 llama with the byte tokenizer runs in-process (TP=1). Its random weights would never
write JSON by themselves, so every well-formed call here is the mask's doing.
"""

from __future__ import annotations

import json

import jsonschema

from talaria.config.schema import ToolParser
from talaria.contracts.call import FinishReason, SamplingParams
from talaria.gateway.grammar import tool_call_grammar
from talaria.gateway.output_parser import parse
from talaria.gateway.tools import Function
from talaria.models.tokenizer import Tokenizer
from tests.tiny_models import call, engine, run, tiny_files, tokens

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["city", "days"], "additionalProperties": False}
FUNCTIONS = (Function("forecast", None, SCHEMA), Function("noop", None, {"type": "object", "properties": {},
                                                                          "additionalProperties": False}))
PROMPT = list(range(60, 90))


def constrained(grammar: str, max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=grammar)


def test_a_constrained_call_writes_a_valid_tool_call_and_ends_there(model_cache):
    files = tiny_files("llama", model_cache)
    text_of = Tokenizer.load(files.directory).decode
    grammar = tool_call_grammar(ToolParser.HERMES, FUNCTIONS, parallel=False)
    core = engine([files], arena_bytes=64 << 20)
    out = run(core, [call("c", files.name, PROMPT, constrained(grammar))])["c"]
    assert out[-1].finish is FinishReason.STOP  # the grammar completed, so only the end of turn was allowed
    ids = tokens(out)
    assert ids[-1] in files.arch.eos_token_ids
    parsed = parse(text_of(ids[:-1]), ToolParser.HERMES, reasoning=False)
    assert parsed.content == "" and len(parsed.tool_calls) == 1
    name, arguments = parsed.tool_calls[0]
    schema = next(f.parameters for f in FUNCTIONS if f.name == name)
    jsonschema.validate(json.loads(arguments), schema)


def test_unconstrained_calls_in_the_same_batches_decode_as_alone(model_cache):
    files = tiny_files("llama", model_cache)
    grammar = tool_call_grammar(ToolParser.HERMES, FUNCTIONS, parallel=True)
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = tokens(run(engine([files], arena_bytes=64 << 20), [call("f", files.name, PROMPT[:9], free)])["f"])
    core = engine([files], arena_bytes=64 << 20)
    outs = run(core, [call("g1", files.name, PROMPT, constrained(grammar)),
                      call("f", files.name, PROMPT[:9], free),
                      call("g2", files.name, PROMPT[3:], constrained(grammar))])
    assert tokens(outs["f"]) == alone


def test_a_grammar_is_compiled_once_and_every_later_call_starts_from_a_copy(model_cache):
    files = tiny_files("llama", model_cache)
    grammar = tool_call_grammar(ToolParser.HERMES, FUNCTIONS, parallel=False)
    core = engine([files], arena_bytes=64 << 20)
    first = run(core, [call("a", files.name, PROMPT, constrained(grammar))])["a"]
    stats = core.sampler.grammars.stats
    assert (stats.compiles, stats.reuses) == (1, 0) and stats.compile_s > 0
    again = run(core, [call("b", files.name, PROMPT, constrained(grammar)),
                       call("c", files.name, PROMPT[5:], constrained(grammar))])
    assert (stats.compiles, stats.reuses) == (1, 2)
    assert tokens(again["b"]) == tokens(first)  # same prompt, same grammar, greedy: the same call


def test_a_grammar_the_vocabulary_cannot_follow_fails_that_call_only(model_cache):
    files = tiny_files("llama", model_cache)
    core = engine([files], arena_bytes=64 << 20)
    free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = run(core, [call("bad", files.name, PROMPT, constrained('{"grammars": [{"lark_grammar": "start: ???"}]}')),
                      call("ok", files.name, PROMPT[:9], free)])
    assert outs["bad"][-1].finish is FinishReason.ERROR and "grammar" in outs["bad"][-1].error
    assert outs["ok"][-1].finish is FinishReason.LENGTH and len(tokens(outs["ok"])) == 6
