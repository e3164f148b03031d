"""tqstore.units: the one size and duration grammar of settings and flags (edge cases included)."""

import argparse

import pytest

from tqstore.errors import ConfigError
from tqstore.units import flag_type, format_size, parse_duration, parse_number, parse_size


@pytest.mark.parametrize(
    "raw, expected",
    [(4096, 4096), ("4096", 4096), ("10GB", 10 * 10**9), ("512MiB", 512 << 20), ("1.5GiB", 3 << 29),
     (" 2 kb ", 2000), ("3tib", 3 << 40), ("0", 0), (0, 0), ("0KiB", 0), ("7B", 7), ("1.5KiB", 1536),
     ("2MIB", 2 << 20), ("0.5kb", 500)],
)
def test_sizes(raw, expected):
    assert parse_size(raw) == expected


@pytest.mark.parametrize("raw", ["10 GBs", "-1", -1, "-1MiB", "abc", "", "  ", True, False, 1.5, "5M", None,
                                 "MiB", "1e3", "1,000", "0x10", "1 2MiB", "1.MiB", ".5MiB", [1]])
def test_bad_sizes_name_the_units(raw):
    with pytest.raises(ConfigError, match="MiB"):
        parse_size(raw, "store.x")


def test_a_size_must_be_whole_bytes_not_rounded():
    with pytest.raises(ConfigError, match="not a whole number of bytes"):
        parse_size("0.5", "store.x")
    with pytest.raises(ConfigError, match="not a whole number of bytes"):
        parse_size("1.0001KB", "store.x")


def test_a_bad_size_names_where_it_came_from_and_the_value():
    with pytest.raises(ConfigError, match=r"^TQSTORE_SEGMENT_SIZE='lots' is not a size"):
        parse_size("lots", "TQSTORE_SEGMENT_SIZE")
    with pytest.raises(ConfigError, match=r"^store.x=-3 is negative"):
        parse_size(-3, "store.x")


@pytest.mark.parametrize(
    "raw, expected",
    [(90, 90.0), (1.5, 1.5), ("90", 90.0), ("90s", 90.0), ("30m", 1800.0), ("12H", 43200.0), (" 7d ", 604800.0),
     ("1w", 604800.0), ("1W", 604800.0), ("1.5h", 5400.0), ("0.25s", 0.25), ("2 m", 120.0)],
)
def test_durations(raw, expected):
    assert parse_duration(raw) == expected


@pytest.mark.parametrize("raw", ["-1", -1, -0.5, "-1h", "abc", "", "10y", "5 ms", "1min", True, None, "0", 0,
                                 "0.0h", 0.0, "h", "1e3", float("inf"), float("nan"), "1h30m"])
def test_bad_durations_name_the_units(raw):
    with pytest.raises(ConfigError, match="12h"):
        parse_duration(raw, "ttl")


@pytest.mark.parametrize("raw", ["100000000000000000000000", "9" * 400, "5300w", 10**12])
def test_durations_past_a_century_are_refused(raw):
    # `save --ttl 1e23` was stored, then `info` crashed formatting the expiry (time_t overflow).
    with pytest.raises(ConfigError, match="over 100 years"):
        parse_duration(raw, "--ttl")


def test_a_century_is_the_longest_duration():
    assert parse_duration("5200w") == 5200 * 604800.0


def test_zero_duration_only_where_it_means_something():
    assert parse_duration("0", "--save-ttl", allow_zero=True) == 0.0
    assert parse_duration(0, "--save-ttl", allow_zero=True) == 0.0
    with pytest.raises(ConfigError, match=r"^--save-ttl='0' must be positive"):
        parse_duration("0", "--save-ttl")
    with pytest.raises(ConfigError, match="is not a duration"):  # zero allowed, negatives still not
        parse_duration("-1", "--save-ttl", allow_zero=True)


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (1536, "1.5 KiB"), (5 << 20, "5 MiB"), (10**9, "953.7 MiB"),
     (3 << 40, "3 TiB")],
)
def test_format_size(n, text):
    assert format_size(n) == text


def test_formatted_sizes_parse_back():
    for n in (0, 7, 4 << 10, 5 << 20, 3 << 30, 2 << 40):
        assert parse_size(format_size(n).replace(" ", "")) == n


def test_flag_type_makes_a_bad_value_a_usage_error():
    parser = argparse.ArgumentParser(prog="t", exit_on_error=False)
    parser.add_argument("--ttl", type=flag_type(parse_duration, "--ttl", allow_zero=True))
    parser.add_argument("--max", type=flag_type(parse_size, "--max"))
    args = parser.parse_args(["--ttl", "0", "--max", "1KiB"])
    assert (args.ttl, args.max) == (0.0, 1024)
    with pytest.raises(argparse.ArgumentError, match=r"--ttl='-1' is not a duration: use seconds"):
        parser.parse_args(["--ttl=-1"])


@pytest.mark.parametrize("raw,expected", [("0", 0.0), ("2", 2.0), ("0.7", 0.7), (1, 1.0), (" 1e-3 ", 0.001)])
def test_numbers_in_range(raw, expected):
    assert parse_number(raw, "--temp", high=2.0) == expected


@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "Infinity", "-0.1", "2.5", "hot", "", None, True, [1]])
def test_numbers_out_of_range_or_not_finite_are_refused(raw):
    with pytest.raises(ConfigError, match=r"--temp=.* is out of range: use a number from 0 up to 2"):
        parse_number(raw, "--temp", high=2.0)


def test_a_number_above_its_low_end():
    assert parse_number("1", "--top-p", high=1.0, above=True) == 1.0
    with pytest.raises(ConfigError, match="above 0 up to 1"):
        parse_number("0", "--top-p", high=1.0, above=True)


def test_whole_numbers():
    from tqstore.units import parse_integer

    assert parse_integer("7", "--seed") == 7 and parse_integer(" 0 ") == 0 and parse_integer(5, low=1) == 5
    assert parse_integer(str((1 << 64) - 1), high=(1 << 64) - 1) == (1 << 64) - 1
    for raw in ("-1", "1.5", "1e3", "", "x", True, None, str(1 << 64)):
        with pytest.raises(ConfigError, match="is out of range: use a whole number from 0"):
            parse_integer(raw, "--seed", high=(1 << 64) - 1)
    with pytest.raises(ConfigError, match="from 1"):
        parse_integer("0", "--max-tokens", low=1)
