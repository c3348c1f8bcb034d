"""Progress for long work: a tqdm bar on a terminal, plain log lines elsewhere."""

from __future__ import annotations

import logging
import sys
import time

from tqdm.auto import tqdm

log = logging.getLogger("replayrl")


class _LogProgress:
    """tqdm's update/set_postfix/close, reported as a log line at most every `every_s`."""

    def __init__(self, *, total: int, desc: str, every_s: float = 15.0):
        self.total, self.desc, self.every_s = total, desc, every_s
        self.n = 0
        self.postfix: dict[str, str] = {}
        self._last = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self._last >= self.every_s:
            self._emit()

    def set_postfix(self, **kw) -> None:
        self.postfix = {k: str(v) for k, v in kw.items()}

    def _emit(self) -> None:
        self._last = time.monotonic()
        extra = " ".join(f"{k}={v}" for k, v in self.postfix.items())
        log.info("%s: %d/%d %s", self.desc, self.n, self.total, extra)

    def close(self) -> None:
        self._emit()


def progress(*, total: int, desc: str, initial: int = 0):
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, initial=initial, dynamic_ncols=True, leave=False)
    bar = _LogProgress(total=total, desc=desc)
    bar.n = initial
    return bar
