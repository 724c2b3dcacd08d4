"""A progress bar on stderr."""
from __future__ import annotations

import sys


class Progress:
    """A progress bar on stderr: tqdm when it is installed, else one rewritten line."""

    def __init__(self, total: int, title: str):
        self.total, self.title, self.done = total, title, 0
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, desc=title, file=sys.stderr, leave=False)

    def describe(self, label: str) -> None:
        """Say what runs now."""
        if self._bar is not None:
            self._bar.set_postfix_str(label)
        else:
            print(f"\r{self.title} [{self.done}/{self.total}] {label}\033[K", end="", file=sys.stderr)

    def advance(self) -> None:
        """Count one more item done."""
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            print(file=sys.stderr)
