"""`talaria.routing.held_calls`: calls held at the gateway are placed oldest first; a waiting
admitted call holds back the later calls of its model, a waiting new session only later new
sessions; deadlines and the bound on how many are held."""

from __future__ import annotations

from talaria.routing.decision import Reason, RouteDecision, RouteRequest
from talaria.routing.held_calls import HeldCall, HeldCalls


def held(name: str, model: str = "m", admitted: bool = True, deadline: float = 100.0, work_s: float = 1.0) -> HeldCall:
    return HeldCall(RouteRequest(model, name, 100, 4, name, new_session=not admitted), False, admitted,
                    0.0, deadline, work_s)


class Room:
    """Admits calls while it has room for them, in the order asked; records the order."""

    def __init__(self, room: dict[str, int]) -> None:
        self.room = room
        self.asked: list[str] = []

    def __call__(self, call: HeldCall) -> RouteDecision | None:
        self.asked.append(call.req.session)
        if self.room.get(call.req.model, 0) <= 0:
            return None
        self.room[call.req.model] -= 1
        return RouteDecision("a", Reason.RANKED)


def names(calls) -> list[str]:
    return [c.req.session if isinstance(c, HeldCall) else c[0].req.session for c in calls]


def test_room_for_one_goes_to_the_oldest_and_the_rest_keep_their_order():
    q = HeldCalls(limit=8)
    for name in ("first", "second", "third"):
        assert q.hold(held(name))
    room = Room({"m": 1})
    placed, expired = q.pump(room, now=1.0)
    assert (names(placed), expired) == (["first"], [])
    assert room.asked == ["first", "second"]  # "third" is not asked: it would overtake "second"
    room.room["m"] = 5
    placed, _ = q.pump(room, now=2.0)
    assert names(placed) == ["second", "third"] and len(q) == 0


def test_a_waiting_new_session_does_not_hold_back_admitted_sessions_calls():
    q = HeldCalls(limit=8)
    for call in (held("new-1", admitted=False), held("old-1"), held("new-2", admitted=False), held("old-2")):
        q.hold(call)

    def admitted_only(call: HeldCall) -> RouteDecision | None:
        return RouteDecision("a", Reason.RANKED) if call.admitted else None
    placed, _ = q.pump(admitted_only, now=1.0)
    assert names(placed) == ["old-1", "old-2"]
    assert names(q) == ["new-1", "new-2"]


def test_a_waiting_admitted_call_holds_back_new_sessions_and_other_models_go_on():
    q = HeldCalls(limit=8)
    for call in (held("old", "m"), held("new", "m", admitted=False), held("other", "n")):
        q.hold(call)
    room = Room({"n": 1})
    placed, _ = q.pump(room, now=1.0)
    assert names(placed) == ["other"] and room.asked == ["old", "other"]


def test_calls_past_their_deadline_leave_wherever_they_are():
    q = HeldCalls(limit=8)
    q.hold(held("patient", deadline=50.0))
    q.hold(held("late", deadline=10.0))
    placed, expired = q.pump(Room({}), now=10.0)
    assert (placed, names(expired), names(q)) == ([], ["late"], ["patient"])


def test_arrivals_join_the_back_behind_their_class_and_the_queue_is_bounded():
    q = HeldCalls(limit=2)
    assert not q.blocks("m", admitted=True) and not q.blocks("m", admitted=False)
    q.hold(held("new", admitted=False, work_s=2.0))
    assert not q.blocks("m", admitted=True)  # an admitted session's call does not queue behind a new one
    assert q.blocks("m", admitted=False) and not q.blocks("n", admitted=False)
    q.hold(held("old", work_s=3.0))
    assert q.blocks("m", admitted=True)
    assert (q.ahead_s("m", admitted=True), q.ahead_s("m", admitted=False)) == (3.0, 5.0)
    assert not q.hold(held("one-too-many"))
    q.remove(q._calls[0])
    assert names(q) == ["old"]
