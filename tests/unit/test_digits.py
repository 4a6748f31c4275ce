from dilu.services.common.digits import as_count


def test_only_ascii_digits_make_a_count():
    assert as_count("42") == 42 and as_count(" 7\n") == 7 and as_count("0") == 0
    for text in ("", " ", "-1", "+1", "1.5", "²", "٣", "1 2", "0x10", "١٢"):
        assert as_count(text) is None, text
