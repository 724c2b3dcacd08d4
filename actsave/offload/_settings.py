"""What the offload settings share: the check of a count, and a setter that a
with-statement scopes."""
from __future__ import annotations

import contextlib


def is_count(value) -> bool:
    """Whether ``value`` is an ``int`` >= 0 (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def undone_on_exit(undo) -> contextlib.ExitStack:
    # The setting has taken effect already; a with-statement around the call undoes it
    # on exit, so that global switches can be scoped (docs/architecture.md).
    stack = contextlib.ExitStack()
    stack.callback(undo)
    return stack
