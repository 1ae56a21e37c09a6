"""The text functions every reader uses: the line and byte of the first byte that is not
UTF-8, the place of a lone surrogate in parsed values, and untrusted strings made valid."""

import pytest

from async_grpo.errors import UserError
from async_grpo.text import not_unicode, read_text, text_lines, valid_text


def test_the_first_byte_that_is_not_utf8_is_named_by_line_column_and_offset(tmp_path):
    path = tmp_path / "f.txt"
    # line 1 is 4 bytes ("ab\r\n": only \n ends a line); line 2 "é" is 2 valid bytes, then
    # 0xff at column 3, byte 4 + 2 = 6 of the file
    path.write_bytes(b"ab\r\n\xc3\xa9\xffz\nnext\n")
    lines = text_lines(path)
    assert next(lines) == "ab\r\n"
    with pytest.raises(UserError) as e:
        next(lines)
    assert str(e.value) == (
        f"{path}:2: not UTF-8: byte 0xff at column 3 (byte 6 of the file); expected UTF-8 text"
    )
    # a sequence cut short (0xc3 then a newline) is the byte that starts it
    path.write_bytes(b"x\xc3\n")
    with pytest.raises(UserError, match=r":1: not UTF-8: byte 0xc3 at column 2 \(byte 1 "):
        read_text(path)
    path.write_bytes("é\n€".encode())
    assert read_text(path) == "é\n€"


def test_a_lone_surrogate_is_found_in_keys_values_and_lists():
    assert not_unicode({"a": ["ok", {"b": "é😀"}], 1: 2.0}) is None
    assert not_unicode({"a": ["ok", {"b": "x\ud800"}]}) == "a[1].b"
    assert not_unicode({"a": {"\udce9": 1}}) == "a.\udce9"
    assert not_unicode(["\udfff"], "row") == "row[0]"


@pytest.mark.parametrize(
    "text, fixed, replaced",
    [
        ("plain é 😀", "plain é 😀", 0),
        ("a\ud800b", "a\ufffdb", 1),
        ("caf\udce9 \udce8", "caf\ufffd \ufffd", 2),  # bytes 0xe9 0xe8 by surrogateescape
        ("\ud83d\ude00", "😀", 0),  # a UTF-16 pair in two code points is its character
        ("\ufffd\udc00", "\ufffd\ufffd", 1),  # a U+FFFD already there is not counted
    ],
)
def test_untrusted_text_is_made_valid_and_the_replacements_counted(text, fixed, replaced):
    assert valid_text(text) == (fixed, replaced)
    fixed.encode("utf-8")
