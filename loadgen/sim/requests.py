"""The order in which the live scheduler serves one horizontal tick's requests.

The live horizontal scaler ticks each due function in a task of its own, all created before any
of them runs (``HorizontalScaler._loop``). A function's tick sends its placement
(``dilu.v1.scheduler.place``) before its task first waits, but its parks and resumes
(``dilu.v1.scheduler.park``) and its retirements (``dilu.v1.scheduler.retire``) through
``asyncio.gather``, whose tasks run only once every tick task has reached its first wait; a
function that parks or resumes sends its placement only when those are answered, and its
retirements only when its placement is. The scheduler answers each subject's requests one at a
time (``Bus.serve``), each under one lock held across its KV write and handed to its waiters first
come, first served, so with requests of several subjects waiting it serves them in turn: a
placement, a park, a retirement, the next placement, and so on, the subjects in the order their
first request came. (A live function whose backlog could not be read asks the stream what it
holds before it decides, so its placement comes later still; a simulated backlog is always
known.) The simulator applies a tick's decisions in this order
(``Simulation._horizontal_tick``), so a placement counts the room a park of the same tick frees
only where the live scheduler would have served that park first.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Literal

from dilu.services.horizontal_scaler.policy import Decision

Step = Literal["place", "park", "retire"]


def request_order(decisions: Sequence[Decision]) -> list[tuple[Step, int]]:
    """``decisions``: one tick's decisions in tick order (``HorizontalPolicy.decide``'s). Returns
    ``(step, k)`` pairs, decision ``k``'s requests in the order the live scheduler serves them
    (module docstring): ``"place"`` its placement, ``"park"`` its parks and then its resumes,
    ``"retire"`` its retirements. A decision asking for nothing has no pair."""
    queues: dict[Step, deque[int]] = {"place": deque(), "park": deque(), "retire": deque()}
    turn: list[Step] = []  # the subjects, in the order their first request came

    def send(step: Step, k: int) -> None:
        queues[step].append(k)
        if step not in turn:
            turn.append(step)

    for k, d in enumerate(decisions):  # before the tick tasks first wait
        if d.place and not (d.park or d.resume):
            send("place", k)
    for k, d in enumerate(decisions):  # one task later (asyncio.gather), in tick order
        if d.park or d.resume:
            send("park", k)
        elif d.retire and not d.place:
            send("retire", k)
    order: list[tuple[Step, int]] = []
    while any(queues.values()):
        for step in list(turn):
            if not queues[step]:
                continue
            k = queues[step].popleft()
            order.append((step, k))
            d = decisions[k]
            if step == "park" and d.place:  # sent once the parks and resumes are answered
                send("place", k)
            elif step != "retire" and d.retire:  # sent once what came before is answered
                send("retire", k)
    return order
