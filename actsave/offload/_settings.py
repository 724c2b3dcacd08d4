"""What the offload settings share: the check of a count (their scoped setters are
actsave/settings.py's)."""
from __future__ import annotations


def is_count(value) -> bool:
    """Whether ``value`` is an ``int`` >= 0 (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
