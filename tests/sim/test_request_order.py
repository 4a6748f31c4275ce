"""The order in which the live scheduler serves one horizontal tick's requests
(loadgen/sim/requests.py), which the simulator applies a tick's decisions in."""
from __future__ import annotations

from dilu.loadgen.sim.requests import request_order
from dilu.services.horizontal_scaler.policy import Decision


def decision(place: int = 0, park: tuple[str, ...] = (), resume: tuple[str, ...] = (),
             retire: tuple[str, ...] = ()) -> Decision:
    return Decision("f", 0.0, 1, 1, 1, place=place, park=list(park), resume=list(resume), retire=list(retire))


def test_placements_are_served_before_the_parks_sent_one_task_later():
    """A tick whose last function scales out while the ones before it park (seed 1's BERT-base
    beside a parking ResNet-152): the placement first, then the parks in tick order."""
    tick = [decision(park=("a-1",)), decision(), decision(park=("c-1",)), decision(place=1)]
    assert request_order(tick) == [("place", 3), ("park", 0), ("park", 2)]


def test_with_several_placements_waiting_the_subjects_take_turns():
    """The scheduler answers each subject's requests one at a time under one first-come lock: a
    second placement waits behind the park that was waiting for the first one's lock."""
    tick = [decision(place=1), decision(park=("b-1",)), decision(retire=("c-1",)), decision(place=2),
            decision(park=("e-1",))]
    assert request_order(tick) == [("place", 0), ("park", 1), ("retire", 2), ("place", 3), ("park", 4)]


def test_a_function_places_only_after_its_own_resumes_are_answered():
    """Resume the parked instances, place the rest: the live tick awaits the resumes' answers
    before it asks for the placement, so every placement sent at once comes before it."""
    tick = [decision(resume=("a-1",), place=1), decision(place=1)]
    assert request_order(tick) == [("place", 1), ("park", 0), ("place", 0)]


def test_retirements_follow_their_own_placement_and_a_decision_without_requests_has_none():
    tick = [decision(place=1, retire=("a-2",)), decision(), decision(retire=("c-1", "c-2"))]
    assert request_order(tick) == [("place", 0), ("retire", 2), ("retire", 0)]
    assert request_order([decision(), decision()]) == [] and request_order([]) == []
