"""A stand-in for the copy engine's completion events, for pure-Python scheduler and planner tests."""

from __future__ import annotations


class CopyEventsStandIn:
    """A `CopyEvents`: stands in for the copy engine's completion events: the test says which copies have finished.

    `wait_save` / `wait_staging` are what the planner calls when it would block on an event; here
    they record the wait and mark the copy finished, as the event would once it fired.
    """

    def __init__(self) -> None:
        self.saves_finished: set[int] = set()  # tickets whose D2H copies finished on rank 0
        self.staging_finished = False
        self.waited: list[int | str] = []  # tickets waited on, and "staging"

    def save_done(self, ticket: int) -> bool:
        return ticket in self.saves_finished

    def staging_done(self) -> bool:
        return self.staging_finished

    def wait_save(self, ticket: int) -> None:
        self.waited.append(ticket)
        self.saves_finished.add(ticket)

    def wait_staging(self) -> None:
        self.waited.append("staging")
        self.staging_finished = True
