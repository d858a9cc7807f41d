"""Device arrays a reader in the background still needs, and the wait before a graph takes one.

A checkpoint save with a host budget (state/checkpoint.py) copies the arrays it was handed
to the host a batch at a time, after it returned: the next step may run meanwhile. A graph
that writes its inputs in place is handed their buffers (donated): the call deletes the
arrays, so a save that has not yet copied one would read a deleted array. `before_donating`
is called with the arrays a call is about to donate: where one is held by a reader, the call
first waits for that reader to finish (counted in `stats["waits"]`), so what is read is the
values at the save and the step then goes on in place (no second copy of the state on the
devices). A reader registers with `hold(arrays, wait)` and leaves with `release(arrays)`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

# id(array) -> (the array, kept alive while held; the reader's wait)
_held: dict[int, tuple[object, Callable[[], None]]] = {}
stats = {"waits": 0}


def hold(arrays: Iterable, wait: Callable[[], None]) -> None:
    """`arrays` are read in the background until `wait()` returns (which releases them)."""
    for array in arrays:
        _held[id(array)] = (array, wait)


def release(arrays: Iterable) -> None:
    """`arrays` are read no more (their reader finished)."""
    for array in arrays:
        entry = _held.get(id(array))
        if entry is not None and entry[0] is array:
            del _held[id(array)]


def any_held() -> bool:
    """Whether a reader holds any array (the hot path's one check)."""
    return bool(_held)


def before_donating(arrays: Iterable) -> None:
    """Wait for the reader of any of `arrays` (about to be donated, hence deleted) to finish."""
    for array in arrays:
        entry = _held.get(id(array))
        if entry is not None and entry[0] is array:
            stats["waits"] += 1
            log.info(
                "A step donates an array a checkpoint save has not yet copied to the host: "
                "it waits for the save (save_checkpoint's host_bytes bounds the copy; "
                "without it the save copies everything before it returns)."
            )
            entry[1]()
