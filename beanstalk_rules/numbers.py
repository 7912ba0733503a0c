"""Numbers from text: a setting is a finite number, everywhere one is read.

``float()`` accepts ``nan`` and ``inf``; as a timeout, an interval or a retry budget they
mean a busy loop, a wait that never ends or an OverflowError deep in a task. The connector's
options (``spark_beanstalk.options.get_float``) and the CLIs (:class:`FiniteFloat`, the one
click type for float flags) both refuse them here, naming the setting.
"""
from __future__ import annotations

import math
from typing import Any

import click

# Every float setting is seconds or a fraction: none needs more than ~31 years, and beyond
# time_t (1e300 as a sleep) time functions raise OverflowError.
LARGEST = 1e9


def finite_float(text: str | float, name: str | None = None) -> float:
    """``text`` as a float; ValueError (naming ``name`` if given) when it is not a number, not
    finite, or beyond LARGEST either way."""
    shown = f"{name}={text!r}" if name else repr(text)
    try:
        value = float(text.strip() if isinstance(text, str) else text)
    except ValueError:
        raise ValueError(f"{shown} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{shown} is not a finite number")
    if abs(value) > LARGEST:
        raise ValueError(f"{shown} is beyond {LARGEST:g}, larger than any setting needs")
    return value


class FiniteFloat(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (FloatRange lets nan through any bound)."""

    name = "finite float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:  # click's message names the flag already
            finite_float(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return super().convert(value, param, ctx)
