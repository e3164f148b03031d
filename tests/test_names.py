import pytest

from tqstore.errors import InvalidName
from tqstore.names import is_valid_name, validate_name


@pytest.mark.parametrize("name", ["a", "Z", "0", "project-x", "v1.2_final", "a" * 128, "A.b-C_9", "x..y", "end."])
def test_valid_names_are_returned_unchanged(name):
    assert validate_name(name) == name


@pytest.mark.parametrize(
    "name",
    [
        "", "a" * 129, ".hidden", "..", "-flag", "_x", "a/b", "../etc", "a\\b", "a b", "a\nb", "a\x00b",
        "café", "ａ", "x:y", "name\n", "٣", "a*",
    ],
)
def test_invalid_names_are_refused_with_the_rule(name):
    with pytest.raises(InvalidName) as info:
        validate_name(name)
    message = str(info.value)
    assert "A-Z a-z 0-9 . _ -" in message and "128" in message and "starting with a letter or a digit" in message


def test_long_invalid_names_are_shortened_in_the_message():
    with pytest.raises(InvalidName) as info:
        validate_name("a" * 300)
    assert len(str(info.value)) < 250


@pytest.mark.parametrize("name", [None, 3, b"abc"])
def test_non_strings_are_refused(name):
    with pytest.raises(InvalidName, match="strings"):
        validate_name(name)


def test_is_valid_name_agrees_with_validate_name():
    assert is_valid_name("project-x") and not is_valid_name("../x") and not is_valid_name(None)
