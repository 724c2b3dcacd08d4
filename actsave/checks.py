"""Argument checks shared by the public functions: numbers as users pass them.

Integral numbers are accepted whatever their type (``int``, ``numpy.int64``, a 0-d
integer tensor: anything with ``__index__``, as Python's own indexing does), except
``bool``, which is never meant as a count or an index.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Optional


def integral(value) -> Optional[int]:
    """``value`` as an ``int`` if it is an integral number other than a bool, else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def byte_count(value) -> bool:
    """Whether ``value`` can be a budget: a real number of bytes above 0 and finite."""
    return real_number(value) and 0 < float(value) < math.inf


def real_number(value) -> bool:
    """Whether ``value`` is a real number other than a bool and NaN (``numpy`` scalars
    included)."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and not math.isnan(float(value)))
