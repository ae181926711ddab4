"""bench/agent_api_parity.py's check that the one prompt, decoded greedily, gives chat's output
through every API in every round."""

from __future__ import annotations

from tests.bench.scripts import load_bench


def test_the_apis_greedy_outputs_must_all_be_chats() -> None:
    parity = load_bench("agent_api_parity")
    call = {"ttft_s": 0.05, "tok_s": 30.0, "tokens": 64, "text": "A prefix cache keeps the pages of a prompt"}
    samples = {api: [dict(call), dict(call)] for api in parity.APIS}
    assert parity.outputs_agree(samples)
    samples["messages"][1]["text"] = "A prefix cache keeps the pages of the prompt"  # one round parts greedily
    assert not parity.outputs_agree(samples)
    samples = {api: [dict(call)] for api in parity.APIS}
    samples["responses"][0]["tokens"] = 63
    assert not parity.outputs_agree(samples)
