"""A duration as text: the unit switches when the next one counts to 2, and the digits are the caller's."""

from maester.durations import format_duration


def test_units_and_digits():
    assert format_duration(5) == "5.0 s"
    assert format_duration(119, digits=0) == "119 s"
    assert format_duration(150, digits=0) == "2 min"
    assert format_duration(3 * 3600) == "3.0 h"
    assert format_duration(3 * 86400, digits=0) == "3 days"
    assert format_duration(-4, digits=0) == "0 s"  # clocks that disagree
