"""Progress for people and for log files: a tqdm bar on a terminal; elsewhere (a slurm log, a
pipe) plain lines only: the step lines as written and a progress line every few seconds, with
no carriage return and no cursor code, so a log reads line by line (`progress_bar`)."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

#: seconds between two plain progress lines
EVERY_S = 10.0


def is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # a closed or file-less stream
        return False


class PlainProgress:
    """tqdm's interface (`n`, `update`, `write`, `close`, a context manager) as plain lines:
    `write` prints its line as given; `update` prints `desc: n/total unit (p%)` when `every_s`
    seconds passed since the last one (None: never; the step lines are the progress)."""

    def __init__(self, total=None, initial=0, desc="", unit="it", disable=False, file=None,
                 every_s: float | None = EVERY_S, clock=time.monotonic, **_ignored):
        self.total, self.n, self.desc, self.unit = total, initial, desc, unit
        self.disable, self.file, self.every_s, self.clock = disable, file, every_s, clock
        self.last = clock()

    def update(self, k: int = 1) -> None:
        self.n += k
        if self.disable or self.every_s is None or self.clock() - self.last < self.every_s:
            return
        self.last = self.clock()
        of = f"/{self.total}" if self.total else ""
        pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        print(f"{self.desc}: {self.n}{of} {self.unit}{pct}", file=self.file or sys.stderr, flush=True)

    def write(self, line: str, file=None) -> None:
        print(line, file=file or sys.stdout, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(total=None, desc="", unit="it", disable=False, initial=0, file=None,
                 every_s: float | None = EVERY_S, **tqdm_options):
    """A tqdm bar when `file` (stderr) is a terminal, else a PlainProgress."""
    stream = file or sys.stderr
    if is_terminal(stream):
        return tqdm(total=total, desc=desc, unit=unit, disable=disable, initial=initial, file=stream,
                    **tqdm_options)
    return PlainProgress(total, initial, desc, unit, disable, stream, every_s)
