"""Numeric bounds as regular expressions: the JSON numbers within ``minimum`` / ``maximum`` / ``exclusive*``.

outlines-core 0.2.14 writes every ``integer`` as ``-?(0|[1-9][0-9]*)`` and every ``number`` as that plus an optional
fraction and exponent, whatever the bounds. ``bounded_regex`` builds the exact language instead, for any finite
decimal bounds (``0.5`` and ``-1.25`` as well as integers), by comparing digit strings:

- the number is split at the sign: non-negative values are written without ``-``, negative ones with it, and ``-0``
  (``-0.0``, ...) is zero, allowed exactly when zero is in range (JSON allows ``-0``; jsonschema reads it as 0);
- a magnitude is an integer part (no leading zeros, as JSON requires) and, for ``number``, an optional fraction; the
  integer parts strictly between the bounds' take any fraction, those equal to a bound's integer part take the
  fractions on the right side of the bound's fraction (``_fraction``: a digit-by-digit comparison);
- a bounded ``number`` is written **without an exponent**: ``1e3`` would need the comparison done on the scaled value,
  and a model writing a bounded value has no need for one; an unbounded number keeps outlines-core's exponent.

Bounds with more than ``MAX_BOUND_DIGITS`` digits before or after the point are refused (the regex grows with them).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from decimal import Decimal

MAX_BOUND_DIGITS = 40
_ANY_FRACTION = r"(?:\.[0-9]+)?"


@dataclasses.dataclass(frozen=True)
class Bound:
    """One side of a range: the bound's value and whether the bound itself is excluded."""

    value: Decimal
    exclusive: bool = False


def to_decimal(value: int | float) -> Decimal:
    """A JSON number as written: ``repr`` of a float is the shortest text that reads back as it (``0.1``, not
    ``0.1000000000000000055...``), which is what the schema's author wrote."""
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


def check_digits(value: Decimal) -> str | None:
    """Why a bound cannot be compiled (too many digits, not finite), or None."""
    if not value.is_finite():
        return "it is not a finite number"
    whole, _, fraction = format(abs(value), "f").partition(".")
    if len(whole) > MAX_BOUND_DIGITS or len(fraction.rstrip("0")) > MAX_BOUND_DIGITS:
        return f"it has more than {MAX_BOUND_DIGITS} digits before or after the point"
    return None


def in_range(value: int | float, low: Bound | None, high: Bound | None) -> bool:
    number = to_decimal(value)
    above = low is None or number > low.value or (number == low.value and not low.exclusive)
    below = high is None or number < high.value or (number == high.value and not high.exclusive)
    return above and below


def bounded_regex(integer: bool, low: Bound | None, high: Bound | None) -> str | None:
    """The regex of the JSON integers (``integer``) or numbers within the bounds, or None when none is."""
    zero = in_range(0, low, high)
    pieces = []
    if high is None or high.value > 0 or (high.value == 0 and zero):  # non-negative values, written without "-"
        start = low if low is not None and low.value >= 0 else Bound(Decimal(0))
        magnitudes = _magnitudes(integer, start, high)
        if magnitudes is not None:
            pieces.append(_group(magnitudes))
    if low is None or low.value < 0 or zero:  # "-" then a magnitude m: the value -m (m = 0 only if zero is in range)
        end = Bound(-low.value, low.exclusive) if low is not None else None
        start = Bound(Decimal(0), not zero)
        if high is not None and high.value < 0:
            start = Bound(-high.value, high.exclusive)
        magnitudes = _magnitudes(integer, start, end)
        if magnitudes is not None:
            pieces.append("-" + _group(magnitudes))
    return _alternation(pieces)


# ---------------------------------------------------------------------------------------------------------------
# Magnitudes: non-negative values between two bounds (the upper one optional), as digit strings


def _magnitudes(integer: bool, low: Bound, high: Bound | None) -> str | None:
    if high is not None and (high.value < low.value or (high.value == low.value and (low.exclusive or high.exclusive))):
        return None
    if integer:
        first = math.ceil(low.value) + (1 if low.exclusive and low.value == math.ceil(low.value) else 0)
        last = None
        if high is not None:
            last = math.floor(high.value) - (1 if high.exclusive and high.value == math.floor(high.value) else 0)
            if last < first:
                return None
        return _alternation(_integers(first, last))
    low_whole, low_fraction = _split(low.value)
    pieces = []
    if high is None:
        pieces.append(_with_fraction(str(low_whole), _fraction_part(low_fraction, low.exclusive, None, False)))
        pieces.append(_group(_alternation(_integers(low_whole + 1, None))) + _ANY_FRACTION)
        return _alternation([p for p in pieces if p is not None])
    high_whole, high_fraction = _split(high.value)
    if low_whole == high_whole:
        fraction = _fraction_part(low_fraction, low.exclusive, high_fraction, high.exclusive)
        return _with_fraction(str(low_whole), fraction)
    pieces.append(_with_fraction(str(low_whole), _fraction_part(low_fraction, low.exclusive, None, False)))
    if low_whole + 1 <= high_whole - 1:
        pieces.append(_group(_alternation(_integers(low_whole + 1, high_whole - 1))) + _ANY_FRACTION)
    pieces.append(_with_fraction(str(high_whole), _fraction_part(None, False, high_fraction, high.exclusive)))
    return _alternation([p for p in pieces if p is not None])


def _with_fraction(whole: str, fraction: str | None) -> str | None:
    return None if fraction is None else whole + fraction


def _split(value: Decimal) -> tuple[int, str]:
    """A non-negative decimal -> its integer part and its fraction's digits without trailing zeros."""
    whole, _, fraction = format(value, "f").partition(".")
    return int(whole), fraction.rstrip("0")


def _integers(first: int, last: int | None) -> list[str]:
    """Alternatives spelling the integers first..last (last None: no end) without leading zeros."""
    pieces = []
    top = len(str(first)) if last is None else len(str(last))
    for length in range(len(str(first)), top + 1):
        low = max(first, 10 ** (length - 1) if length > 1 else 0)
        high = 10**length - 1 if last is None else min(last, 10**length - 1)
        if low <= high:
            pieces.append(_same_length(str(low), str(high)))
    if last is None:  # every longer integer
        pieces.append(f"[1-9][0-9]{{{len(str(first))},}}")
    return pieces


def _same_length(low: str, high: str) -> str:
    """The digit strings of one length between ``low`` and ``high`` (inclusive, ``low <= high``)."""
    if not low:
        return ""
    if low[0] == high[0]:
        return low[0] + _group(_same_length(low[1:], high[1:]))
    rest = len(low) - 1
    pieces = []
    first, last = int(low[0]), int(high[0])
    if low[1:] != "0" * rest:  # the first digit of low with the rest at least low's rest
        pieces.append(low[0] + _group(_same_length(low[1:], "9" * rest)))
        first += 1
    upper = None
    if high[1:] != "9" * rest:
        upper = high[0] + _group(_same_length("0" * rest, high[1:]))
        last -= 1
    if first <= last:
        pieces.append(_digit_class(first, last) + (f"[0-9]{{{rest}}}" if rest else ""))
    if upper is not None:
        pieces.append(upper)
    return "|".join(pieces)


# ---------------------------------------------------------------------------------------------------------------
# Fractions: the digits after the point, compared with a bound's digits one position at a time


def _fraction_part(low: str | None, low_exclusive: bool, high: str | None, high_exclusive: bool) -> str | None:
    """The optional ``.digits`` of a value whose fraction 0.digits lies between 0.``low`` and 0.``high`` (None: no
    bound on that side); no fraction reads as 0. "" when only "no fraction" fits, None when no fraction does."""
    digits, empty = _fraction(low, low_exclusive, high, high_exclusive)
    if digits is None:
        return "" if empty else None
    return rf"(?:\.{_group(digits)})?" if empty else rf"\.{_group(digits)}"


@functools.cache
def _fraction(low: str | None, low_exclusive: bool, high: str | None, high_exclusive: bool) -> tuple[str | None, bool]:
    """Digit strings d with 0.d between 0.low and 0.high -> (regex of the non-empty ones or None, whether the empty
    one fits). ``low`` / ``high`` have no trailing zeros ("" is 0); None means no bound on that side."""
    if low == "" and not low_exclusive:
        low = None  # at least 0: no bound
    if low is None and high is None:
        return "[0-9]+", True
    empty = (low is None or (low == "" and not low_exclusive)) and (high is None or high != "" or not high_exclusive)
    outcomes: dict[int, tuple | None] = {}
    for digit in range(10):
        outcomes[digit] = _after_digit(digit, low, low_exclusive, high, high_exclusive)
    here = (low, low_exclusive, high, high_exclusive)
    loops = outcomes[0] == here  # a leading 0 changes nothing (a bound of 0): 0* then the rest
    pieces = []
    for first, last, outcome in _runs(outcomes, skip_zero=loops):
        digits, rest_empty = _fraction(*outcome)
        if digits == "[0-9]+" and rest_empty:
            pieces.append(_digit_class(first, last) + "[0-9]*")
        elif digits is not None:
            pieces.append(_digit_class(first, last) + (f"(?:{digits})?" if rest_empty else _group(digits)))
        elif rest_empty:
            pieces.append(_digit_class(first, last))
    if loops:
        if empty:
            pieces.append("0")
        return (f"0*{_group(_alternation(pieces))}" if pieces else None), empty
    return _alternation(pieces), empty


def _after_digit(digit: int, low: str | None, low_exclusive: bool, high: str | None, high_exclusive: bool):
    """The bounds on the remaining digits after ``digit``, or None when ``digit`` already leaves the range."""
    if low is None:
        after_low: tuple = (None, False)
    elif low == "":
        after_low = (None, False) if digit > 0 or not low_exclusive else ("", True)
    elif digit > int(low[0]):
        after_low = (None, False)
    elif digit == int(low[0]):
        after_low = (low[1:], low_exclusive)
    else:
        return None
    if high is None:
        after_high: tuple = (None, False)
    elif high == "":
        if digit != 0:
            return None
        after_high = ("", high_exclusive)
    elif digit < int(high[0]):
        after_high = (None, False)
    elif digit == int(high[0]):
        after_high = (high[1:], high_exclusive)
    else:
        return None
    return after_low + after_high


def _runs(outcomes: dict[int, tuple | None], skip_zero: bool):
    """Consecutive digits with the same outcome -> (first, last, outcome), the failing ones left out."""
    runs: list[list] = []
    for digit, outcome in outcomes.items():
        if outcome is None or (skip_zero and digit == 0):
            continue
        if runs and runs[-1][2] == outcome and runs[-1][1] == digit - 1:
            runs[-1][1] = digit
        else:
            runs.append([digit, digit, outcome])
    return [tuple(run) for run in runs]


# ---------------------------------------------------------------------------------------------------------------


def _digit_class(first: int, last: int) -> str:
    return str(first) if first == last else f"[{first}-{last}]"


def _group(regex: str) -> str:
    return f"(?:{regex})" if "|" in regex else regex


def _alternation(pieces: list[str]) -> str | None:
    return "|".join(pieces) if pieces else None
