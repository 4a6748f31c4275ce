"""Trace reader: the bundled sample, synthetic traces, and clear errors for malformed files."""
from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from dilu.loadgen.trace import TraceError, default_trace_dir, read_trace, write_trace

SUBJECT_SAFE = re.compile(r"^[A-Za-z0-9_-]+$")


def test_bundled_sample_matches_its_csv():
    trace = read_trace()
    with (default_trace_dir() / "invocations.csv").open(newline="") as fh:
        rows = list(csv.reader(fh))
    assert trace.first_minute == int(rows[0][4]) == 480
    assert trace.n_minutes == len(rows[0]) - 4 == 480
    assert len(trace.functions) == len(rows) - 1 == 100
    assert sum(f.total for f in trace.functions) == sum(int(c) for r in rows[1:] for c in r[4:])
    names = [f.name for f in trace.functions]
    assert len(set(names)) == len(names)
    assert all(SUBJECT_SAFE.match(n) for n in names)
    # durations.csv and memory.csv are joined on (owner, app, function)
    assert sum(f.duration_ms is not None for f in trace.functions) > 90
    assert sum(f.memory_mb is not None for f in trace.functions) > 90
    assert (default_trace_dir() / "ATTRIBUTION.md").is_file()


def test_synthetic_trace_round_trips(tmp_path):
    write_trace(tmp_path, {"aaaa": [1, 0, 2], "bbbb": [0, 0, 7]}, first_minute=10)
    trace = read_trace(tmp_path)
    assert list(trace.minutes) == [10, 11, 12]
    assert {f.name: f.counts for f in trace.functions} == {"fn-aaaa": (1, 0, 2), "fn-bbbb": (0, 0, 7)}
    assert all(f.duration_ms is None and f.memory_mb is None for f in trace.functions)


def test_names_stay_unique_when_hash_prefixes_collide(tmp_path):
    write_trace(tmp_path, {"abcdefgh1": [1], "abcdefgh2": [1], "ABCDEFGH1": [1]})
    names = [f.name for f in read_trace(tmp_path).functions]
    assert len(set(names)) == 3
    assert names[0].startswith("fn-abcdefgh1")


def test_integral_floats_are_accepted(tmp_path):
    (tmp_path / "invocations.csv").write_text("HashOwner,HashApp,HashFunction,Trigger,1,2\no,a,f,http,3.0,0\n")
    assert read_trace(tmp_path).functions[0].counts == (3, 0)


HEADER = "HashOwner,HashApp,HashFunction,Trigger,1,2,3\n"


@pytest.mark.parametrize(
    ("text", "line", "needle"),
    [
        ("", 0, "empty file"),
        ("Owner,App,Function,Trigger,1\n", 1, "header must start with"),
        ("HashOwner,HashApp,HashFunction,Trigger\n", 1, "no minute columns"),
        ("HashOwner,HashApp,HashFunction,Trigger,a,b\n", 1, "must be integers"),
        ("HashOwner,HashApp,HashFunction,Trigger,1,3\n", 1, "consecutive"),
        (HEADER, 0, "no function rows"),
        (HEADER + "o,a,f,http,1,2,3\no,a,g,http,1,2\n", 3, "expected 7 columns, got 6"),
        (HEADER + "o,a,f,http,1,-2,3\n", 2, "minute 2"),
        (HEADER + "o,a,f,http,1,2,1.5\n", 2, "non-negative integer"),
        (HEADER + "o,a,f,http,x,2,3\n", 2, "is not a number"),
        (HEADER + "o,a,f,http,1,99999999999,3\n", 2, "above the 10,000,000"),
        (HEADER + "o,a,f,http,1,99999999999999999999999,3\n", 2, "above the 10,000,000"),
        (HEADER + "o,a,f,http,1,2,3\n\no,a,f,http,1,2,3\n", 4, "duplicate function f (first on line 2)"),
        (HEADER + "o,a,,http,1,2,3\n", 2, "empty HashOwner"),
    ],
)
def test_malformed_invocations_name_file_and_line(tmp_path, text, line, needle):
    path = tmp_path / "invocations.csv"
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        read_trace(tmp_path)
    assert info.value.path == path
    assert info.value.line == line
    assert needle in str(info.value)
    assert str(path) in str(info.value)
    if line:
        assert f"line {line}" in str(info.value)


@pytest.mark.parametrize(
    ("name", "text", "line", "needle"),
    [
        ("durations.csv", "HashOwner,HashApp,HashFunction,Average\no,a,f,fast\n", 2, "Average 'fast' is not a number"),
        ("durations.csv", "HashOwner,HashApp,HashFunction\no,a,f\n", 1, "lacks column(s) Average"),
        ("memory.csv", "HashFunction,HashOwner,HashApp,AverageAllocatedMb\nf,o,a,-1\n", 2, "must be >= 0"),
        ("memory.csv", "HashFunction,HashOwner,HashApp,AverageAllocatedMb\nf,o,a,1,2\n", 2, "expected 4 columns"),
    ],
)
def test_malformed_optional_files_name_file_and_line(tmp_path, name, text, line, needle):
    (tmp_path / "invocations.csv").write_text(HEADER + "o,a,f,http,1,2,3\n")
    (tmp_path / name).write_text(text)
    with pytest.raises(TraceError) as info:
        read_trace(tmp_path)
    assert info.value.path == tmp_path / name
    assert info.value.line == line
    assert needle in str(info.value)


def test_optional_files_are_joined(tmp_path):
    (tmp_path / "invocations.csv").write_text(HEADER + "o,a,f,http,1,2,3\no,a,g,timer,0,0,1\n")
    (tmp_path / "durations.csv").write_text("HashOwner,HashApp,HashFunction,Average,Count\no,a,f,12.5,3\n")
    (tmp_path / "memory.csv").write_text("HashFunction,HashOwner,HashApp,SampleCount,AverageAllocatedMb\ng,o,a,9,256\n")
    by = {f.function: f for f in read_trace(tmp_path).functions}
    assert (by["f"].duration_ms, by["f"].memory_mb) == (12.5, None)
    assert (by["g"].duration_ms, by["g"].memory_mb) == (None, 256.0)


def test_missing_directory_and_file(tmp_path):
    with pytest.raises(TraceError, match="trace directory not found"):
        read_trace(tmp_path / "nope")
    with pytest.raises(TraceError, match="missing; a trace directory needs invocations.csv"):
        read_trace(tmp_path)
    (tmp_path / "invocations.csv").mkdir()
    with pytest.raises(TraceError, match="not a file; a trace directory needs invocations.csv"):
        read_trace(tmp_path)


def test_binary_garbage_is_a_clear_error(tmp_path):
    Path(tmp_path / "invocations.csv").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match="not UTF-8"):
        read_trace(tmp_path)
