"""Fuzzing spec files: parse_spec on any text gives a LoadedSpec or raises SpecError whose
message is one line; nothing else escapes."""
from __future__ import annotations

import math
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings, strategies as st

from dilu.client.spec import LoadedSpec, SpecError, parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SPECS = sorted(p.read_text() for p in EXAMPLES.glob("*/function.toml"))
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def toml_float(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(x)


scalars = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1).map(str),
    st.floats().map(toml_float),
    st.booleans().map(lambda b: "true" if b else "false"),
    st.text(max_size=20).filter(lambda s: "'" not in s and "\n" not in s and "\r" not in s).map(lambda s: f"'{s}'"),
    st.sampled_from(['"a\\nb"', '"\\u0000"', "1979-05-27T07:32:00Z", "07:32:00", "0x7fffffff", "1_000", "-0.0",
                     '"resnet152"', '"llama2"', '"llm"', '"training"', '"inference"', '"best-effort"', '""']),
)
toml_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3).map(lambda xs: "[" + ", ".join(xs) + "]")
    | st.dictionaries(st.sampled_from(["a", "model", "x"]), inner, max_size=2).map(
        lambda d: "{" + ", ".join(f"{k} = {v}" for k, v in d.items()) + "}"),
    max_leaves=6,
)
keys = st.sampled_from(["name", "entry", "code", "kind", "priority", "slo_ms", "ttft_ms", "tpot_ms", "max_batch",
                        "memory_bytes", "min_instances", "max_instances", "initial_scale", "keep_alive_s",
                        "cold_start_ms", "emulation", "profile", "config", "model", "request_quota", "limit_quota",
                        "batch_size", "batch", '"a\\nb"', '"x\\ty"', "unknown"])


def check(text: str | bytes) -> None:
    try:
        loaded = parse_spec(text, source="f.toml", base_dir=EXAMPLES / "trainer")
    except SpecError as exc:
        msg = str(exc)
        assert msg.startswith("f.toml: ") and len(msg.splitlines()) == 1, msg
    else:
        assert isinstance(loaded, LoadedSpec)


@FUZZ
@given(text=st.text(max_size=200))
@example(text="a = " + "[" * 2000)  # nesting past tomllib's recursion: RecursionError escaped
@example(text='name = "x"\nentry = "m:C"\nslo_ms = 1\nmemory_bytes = 1\n"a\\nb" = 1')  # a key with a newline
def test_random_text(text):
    check(text)


@FUZZ
@given(data=st.binary(max_size=200))
@example(data=b'name = "\xff"')
def test_random_bytes(data):
    check(data)


@FUZZ
@given(base=st.sampled_from(SPECS), key=keys, value=toml_values, where=st.integers(0, 40))
@example(base=SPECS[0], key='"a\\nb"', value="1", where=0)
@example(base=SPECS[0], key="code", value='"\\u0000"', where=0)  # a NUL in the code folder's path
@example(base=SPECS[0], key="config", value='{"a\\nb" = 1}', where=0)
def test_a_valid_spec_with_one_field_mutated(base, key, value, where):
    lines = base.splitlines()
    bare = key.split(".")[-1]
    hits = [i for i, line in enumerate(lines) if line.split("=")[0].strip() == bare]
    if hits:  # replace that key's value
        lines[hits[where % len(hits)]] = f"{key} = {value}"
    else:  # add it, at the top or below some table
        lines.insert(where % (len(lines) + 1), f"{key} = {value}")
    check("\n".join(lines))


def test_the_examples_parse():
    for text in SPECS:
        check(text)
        parse_spec(text, base_dir=EXAMPLES / "trainer")


def test_a_line_break_from_the_file_is_written_as_its_escape():
    text = 'name = "x"\nentry = "m:C"\ncode = ""\nslo_ms = 1\nmemory_bytes = 1\n[config]\n"a\\nb" = 1\n'
    try:
        parse_spec(text, source="f.toml")
    except SpecError as exc:
        assert str(exc).startswith("f.toml: config.a\\nb: values are strings")
    else:
        raise AssertionError("a non-string config value was accepted")
