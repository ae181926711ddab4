"""What admission learns from first tokens (`InstanceLoad.scale`): every call placed, a new session's
first or an admitted session's later one, is predicted to start after the other sessions' calls
hold it back (processor sharing, `bound_s`) and its own prefill; the first token it measured corrects
that, and with it the load new sessions are admitted against. On the dispatcher tests' echo
instance (tests/routing/test_admission_line.py's `Node`: prefill 1 ms a token, a 2 s TTFT target)."""

from __future__ import annotations

import pytest

from talaria.contracts.call import Usage
from talaria.routing.session_lengths import ALPHA
from tests.gateway.fakes import MODEL
from tests.routing.test_admission_line import Node
from tests.routing.test_dispatcher import place


def test_every_calls_first_token_corrects_the_load_new_sessions_are_admitted_against():
    n = Node()
    load = n.d.load.on("hot0")

    def call(session: str, prompt: int, slower: float) -> tuple[float, float]:
        """Place a call of `session` and finish it, its first token `slower` times its predicted start:
        (that prediction, the call's own prefill)."""
        n.fresh()
        p = place(n.d, n.call(session, prompt))
        n.d.finished(p, Usage(prompt, 4, 0), None, (), ttft_s=slower * p.decision.start_bound_s)
        return p.decision.start_bound_s, p.decision.cost.prefill_s + p.decision.cost.c_kv_s

    n.d.sync()
    c_act = n.d.router.costs.terms(n.d.router.views["hot0"], MODEL).c_act_s  # the model active: 0
    assert call("a", 100, 2.0) == pytest.approx((0.1 + c_act, 0.1))  # nothing else here: its own prefill
    assert load.scale == pytest.approx(1 - ALPHA + ALPHA * 2.0) and load.samples == 1
    work_a = load.work[("a", MODEL)]  # in its tool gap: its next call
    # a new session's first call: held back by a's next call, as far as its own prefill (1 s)
    assert call("b", 1000, 2.0) == pytest.approx((min(1.0, work_a) + 1.0 + c_act, 1.0))
    assert load.samples == 2
    # a's next call, a later one: held back by b's next call, not by its own (a charges it in its tool gap)
    n.clock.now += 1.0
    work_b = load.work[("b", MODEL)]
    bound, own = call("a", 1604, 0.5)  # it started sooner than predicted
    assert own == pytest.approx(1.501) and bound == pytest.approx(min(own, work_b) + own + c_act)
    scale = 1 - ALPHA + ALPHA * 2.0
    scale = (1 - ALPHA) * scale + ALPHA * 2.0
    assert load.scale == pytest.approx((1 - ALPHA) * scale + ALPHA * 0.5) and load.samples == 3
    assert load.ahead_s(1.0) == pytest.approx(load.scale * load.bound_s(1.0))
