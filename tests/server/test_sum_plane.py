"""Both data planes answer every question the fleet asks (``SumPlane``), with its parameters: a
question added to the protocol and left out of one plane fails here, not in a run of that plane."""

from __future__ import annotations

import inspect

from userdp.server.fleet import Fleet
from userdp.server.group_plane import GroupPlane
from userdp.server.sum_plane import StreamedPlane, SumArrival, SumPlane


def questions() -> dict[str, inspect.Signature]:
    """The protocol's methods and their signatures."""
    return {
        name: inspect.signature(member)
        for name, member in vars(SumPlane).items()
        if inspect.isfunction(member) and not name.startswith("_")
    }


def test_both_planes_answer_every_question_with_its_parameters():
    asked = questions()
    assert {"start_gather", "complete_gather", "observe", "broadcast"} <= set(asked)
    for plane in (StreamedPlane, GroupPlane):
        for name, signature in asked.items():
            answer = getattr(plane, name, None)
            assert callable(answer), f"{plane.__name__} does not answer {name}"
            assert inspect.signature(answer).parameters.keys() == signature.parameters.keys(), (
                f"{plane.__name__}.{name}{inspect.signature(answer)} is not {name}{signature}"
            )
    assert StreamedPlane.arrival is SumArrival.IN_RESULTS
    assert GroupPlane.arrival is SumArrival.REDUCED


def test_the_fleet_is_one_class_for_both_planes():
    """The planes are composed into the fleet, not subclassed from it."""
    assert Fleet.__subclasses__() == []
    assert "plane" in inspect.signature(Fleet).parameters
