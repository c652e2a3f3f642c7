"""Runtime protocol checks asked every round of the same object, remembered.

``isinstance(obj, P)`` for a ``runtime_checkable`` protocol walks P's members on every call
(~30 µs); the spine asks each round whether its strategy reports metrics, whether its
topology relays, whether its transport knows absent clients. :class:`Conforms` answers
from the last object it was asked about while that is still the object asked about
(identity, held weakly), so a part swapped for another is checked anew.
"""

from __future__ import annotations

import weakref
from typing import Any


class Conforms:
    """``Conforms(P)(obj)`` is ``isinstance(obj, P)``, remembered for the last ``obj``."""

    def __init__(self, protocol: type) -> None:
        self.protocol = protocol
        self._last: tuple[Any, bool] = (None, False)  # (weak reference to the object, its answer)

    def __call__(self, obj: object) -> bool:
        ref, answer = self._last
        if ref is not None and ref() is obj:
            return answer
        answer = isinstance(obj, self.protocol)
        try:
            self._last = (weakref.ref(obj), answer)
        except TypeError:  # an object that cannot be weakly referenced is checked every time
            pass
        return answer
