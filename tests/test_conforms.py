from __future__ import annotations

from typing import Protocol, runtime_checkable

from fedweave.conforms import Conforms


@runtime_checkable
class Quacks(Protocol):
    def quack(self) -> str: ...


class Duck:
    def quack(self) -> str:
        return "quack"


class Stone:
    pass


def test_conforms_answers_as_isinstance_and_rechecks_a_swapped_object() -> None:
    quacks = Conforms(Quacks)
    duck, stone = Duck(), Stone()
    assert quacks(duck) and quacks(duck)
    assert not quacks(stone) and not quacks(stone)
    assert quacks(duck)  # the answer follows the object asked about, not the last answer
    assert not quacks(None) and not quacks(3)  # objects that cannot be weakly referenced: checked each time


def test_conforms_does_not_answer_for_a_dead_object() -> None:
    quacks = Conforms(Quacks)
    assert quacks(Duck())  # a temporary: dead once the call returns
    assert not quacks(Stone())
