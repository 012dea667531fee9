"""Range checks for config dataclasses: a setting out of range is refused where the config is
built (from flags, a file or Python), not found later as a hang or a crash deep in a run."""

from __future__ import annotations

import operator
from typing import Any

_TESTS = (("at least", operator.ge), ("above", operator.gt), ("at most", operator.le))


def check_bounds(
    config: Any,
    least: dict[str, float] | None = None,
    above: dict[str, float] | None = None,
    most: dict[str, float] | None = None,
) -> None:
    """Raises ValueError naming the first field out of its range (None: unset, allowed). NaN is
    never in range."""
    for (words, within), bounds in zip(_TESTS, (least, above, most), strict=True):
        for name, bound in (bounds or {}).items():
            value = getattr(config, name)
            if value is not None and not within(value, bound):
                raise ValueError(f"{name} must be {words} {bound}, not {value}")
