"""The command line's progress bar: tqdm's when it is installed, else a plain text one.

    with progress_bar(total, unit="step") as advance:
        advance("compile llama")   # that step starts: the one before it is done

Both draw on stderr, so a command's own output (stdout) stays clean.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def progress_bar(total: int, unit: str = "step") -> Iterator[Callable[[str], None]]:
    """A bar of `total` steps; the function it yields names the step that starts."""
    try:
        from tqdm import tqdm
    except ImportError:
        yield from _plain(total, unit)
        return
    with tqdm(total=total, file=sys.stderr, unit=unit, dynamic_ncols=True) as bar:

        def advance(step: str) -> None:
            if bar.desc:
                bar.update()
            bar.set_description_str(step[:48])

        yield advance
        bar.update(total - bar.n)


def _plain(total: int, unit: str) -> Iterator[Callable[[str], None]]:
    done = [-1]

    def draw(count: int, label: str, end: str = "") -> None:
        filled = 20 * count // max(total, 1)
        bar = "#" * filled + "." * (20 - filled)
        print(f"\r[{bar}] {count}/{total} {unit}s {label[:30]:<30}", end=end, file=sys.stderr)
        sys.stderr.flush()

    def advance(step: str) -> None:
        done[0] += 1
        draw(done[0], step)

    yield advance
    draw(total, "done", end="\n")
