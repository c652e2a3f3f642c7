"""Tests of fedweave.schema: typed parsing of config sections, one-line errors naming the key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pytest

from fedweave.errors import ConfigError
from fedweave.schema import describe_fields, opt, parse, to_dict, unknown_key


@dataclass
class Inner:
    SHORTHAND = "rule"
    rule: Literal["mean", "median"] = opt("mean", help="how to combine")
    size: int = opt(1, ge=1, help="how many")


@dataclass
class Outer:
    count: int = opt(1, ge=1, le=10, help="a bounded integer")
    rate: float = opt(0.5, gt=0, lt=1)
    flag: bool = opt(False)
    label: str = opt("x")
    maybe: int | None = opt(None)
    items: list[int] = opt(factory=list)
    mapping: dict[str, Any] = opt(factory=dict)
    inner: Inner = opt(factory=Inner)


@dataclass
class Required:
    name: str


@dataclass
class Checked:
    low: int = 0
    high: int = 1

    def validate(self, prefix: str) -> None:
        if self.low > self.high:
            raise ConfigError(f"config key '{prefix}.low': {self.low} is above high={self.high}")


def error_of(cls: type, data: Any, prefix: str = "") -> str:
    """The message of the ConfigError that parsing ``data`` raises; asserts it is one line."""
    with pytest.raises(ConfigError) as info:
        parse(cls, data, prefix)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_parse_fills_values_and_defaults() -> None:
    parsed = parse(Outer, {"count": 3, "rate": 0.25, "items": [1, 2], "inner": {"size": 4}})
    assert parsed == Outer(count=3, rate=0.25, items=[1, 2], inner=Inner(size=4))
    assert parse(Outer, None) == Outer()
    assert parse(Outer, {}) == Outer()


def test_integers_widen_to_floats() -> None:
    @dataclass
    class Scale:
        factor: float = 1.0

    factor = parse(Scale, {"factor": 2}).factor
    assert factor == 2.0 and type(factor) is float
    assert type(parse(Inner, {"size": 2}).size) is int
    assert error_of(Outer, {"rate": 1}) == "config key 'rate': must be < 1, got 1.0"


def test_a_bare_string_stands_for_the_shorthand_field() -> None:
    assert parse(Outer, {"inner": "median"}).inner == Inner(rule="median")
    assert parse(Inner, "median") == Inner(rule="median")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"count": "3"}, "config key 'count': expected an integer, got '3'"),
        ({"count": True}, "config key 'count': expected an integer, got True"),
        ({"count": 2.0}, "config key 'count': expected an integer, got 2.0"),
        ({"rate": "fast"}, "config key 'rate': expected a number, got 'fast'"),
        ({"rate": False}, "config key 'rate': expected a number, got False"),
        ({"rate": float("nan")}, "config key 'rate': expected a finite number, got nan"),
        ({"rate": float("inf")}, "config key 'rate': expected a finite number, got inf"),
        ({"flag": 1}, "config key 'flag': expected true or false, got 1"),
        ({"label": 3}, "config key 'label': expected a string, got 3"),
        ({"maybe": "x"}, "config key 'maybe': expected an integer or null, got 'x'"),
        ({"items": "1,2"}, "config key 'items': expected a list (an integer each), got '1,2'"),
        ({"items": [1, "x"]}, "config key 'items[1]': expected an integer, got 'x'"),
        ({"mapping": [1]}, "config key 'mapping': expected a mapping, got [1]"),
        ({"inner": 5}, "config key 'inner': expected a mapping, got 5"),
        ({"inner": {"size": "big"}}, "config key 'inner.size': expected an integer, got 'big'"),
    ],
)
def test_wrong_types_name_the_key_and_what_is_expected(data: dict[str, Any], message: str) -> None:
    assert error_of(Outer, data) == message


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"count": 0}, "config key 'count': must be >= 1, got 0"),
        ({"count": 11}, "config key 'count': must be <= 10, got 11"),
        ({"rate": 0}, "config key 'rate': must be > 0, got 0.0"),
        ({"rate": 1.5}, "config key 'rate': must be < 1, got 1.5"),
        ({"inner": {"size": 0}}, "config key 'inner.size': must be >= 1, got 0"),
    ],
)
def test_values_out_of_range(data: dict[str, Any], message: str) -> None:
    assert error_of(Outer, data) == message


def test_bounds_hold_at_the_limits() -> None:
    assert parse(Outer, {"count": 1}).count == 1
    assert parse(Outer, {"count": 10}).count == 10


def test_a_value_outside_its_choices_suggests_the_closest() -> None:
    assert error_of(Outer, {"inner": {"rule": "meen"}}) == (
        "config key 'inner.rule': 'meen' is not allowed; expected one of 'mean', 'median' (did you mean 'mean'?)"
    )
    assert error_of(Outer, {"inner": "xyz"}) == (
        "config key 'inner.rule': 'xyz' is not allowed; expected one of 'mean', 'median'"
    )


def test_unknown_keys_suggest_the_closest_valid_key() -> None:
    assert error_of(Outer, {"cuont": 2}) == (
        "unknown config key 'cuont' (did you mean 'count'?); "
        "valid keys here: count, flag, inner, items, label, mapping, maybe, rate"
    )
    assert error_of(Outer, {"inner": {"sise": 2}}) == (
        "unknown config key 'inner.sise' (did you mean 'inner.size'?); valid keys here: rule, size"
    )
    assert error_of(Outer, {"zzzzzz": 1}).startswith("unknown config key 'zzzzzz'; valid keys here: ")


def test_unknown_key_under_a_prefix() -> None:
    error = unknown_key("local", "lrr", ["lr", "epochs"])
    assert str(error) == "unknown config key 'local.lrr' (did you mean 'local.lr'?); valid keys here: epochs, lr"


def test_required_keys_and_non_mappings() -> None:
    assert error_of(Required, {}) == "config key 'name' is required (a string)"
    assert error_of(Required, {}, "task") == "config key 'task.name' is required (a string)"
    assert error_of(Outer, [1, 2]) == "config key '<root>': expected a mapping, got [1, 2]"
    assert error_of(Outer, [1], "local") == "config key 'local': expected a mapping, got [1]"


def test_validate_hook_runs_with_the_prefix() -> None:
    assert parse(Checked, {"low": 1, "high": 2}) == Checked(1, 2)
    assert error_of(Checked, {"low": 3}, "section") == "config key 'section.low': 3 is above high=1"


def test_unsupported_schema_types_are_a_programming_error() -> None:
    @dataclass
    class Odd:
        values: set = opt(factory=set)

    with pytest.raises(TypeError, match="schema type .* of 'values' is not supported"):
        parse(Odd, {"values": [1]})


def test_to_dict_round_trips() -> None:
    parsed = parse(Outer, {"count": 4, "maybe": 7, "items": [3], "mapping": {"a": [1]}, "inner": "median"})
    plain = to_dict(parsed)
    assert plain == {
        "count": 4,
        "rate": 0.5,
        "flag": False,
        "label": "x",
        "maybe": 7,
        "items": [3],
        "mapping": {"a": [1]},
        "inner": {"rule": "median", "size": 1},
    }
    assert parse(Outer, plain) == parsed


def test_describe_fields_flattens_sections() -> None:
    rows = {key: (kind, default, help_text) for key, kind, default, help_text in describe_fields(Outer)}
    assert rows["count"] == ("an integer", 1, "a bounded integer")
    assert rows["maybe"] == ("an integer or null", None, "")
    assert rows["items"] == ("a list (an integer each)", [], "")
    assert rows["inner.rule"] == ("one of 'mean', 'median'", "mean", "how to combine")
    assert rows["inner.size"] == ("an integer", 1, "how many")
    assert "inner" not in rows
