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


def finite_float(text: str | float, name: str) -> float:
    """``text`` as a float; ValueError naming ``name`` when it is not a number or not finite."""
    try:
        value = float(text.strip() if isinstance(text, str) else text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{name}={text!r} is not a finite number")
    return value


class FiniteFloat(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (FloatRange lets nan through any bound)."""

    name = "finite float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        label = param.get_error_hint(ctx) if param is not None and ctx is not None else "value"
        try:
            finite_float(value, label)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return super().convert(value, param, ctx)
