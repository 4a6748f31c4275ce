"""Fuzzing trace files: the Azure Functions 2019 reader and the LLM trace reader, on mutated CSVs,
give a trace or raise TraceError, one line naming the file (and the line when one is at fault);
nothing else escapes."""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from dilu.loadgen.llm import LlmTrace, default_llm_trace, read_llm_trace
from dilu.loadgen.trace import DURATIONS, INVOCATIONS, MEMORY, Trace, TraceError, default_trace_dir, read_trace

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SAMPLE = default_trace_dir()


def head(path: Path, rows: int, cols: int | None = None) -> str:
    """The first ``rows`` data rows of a CSV (and its first ``cols`` columns)."""
    lines = path.read_text().splitlines()[: rows + 1]
    if cols is not None:
        lines = [",".join(line.split(",")[:cols]) for line in lines]
    return "\n".join(lines) + "\n"


BASE = {  # a small valid trace: 6 functions, 12 minutes, with their durations and memory
    INVOCATIONS: head(SAMPLE / INVOCATIONS, 6, 4 + 12),
    DURATIONS: head(SAMPLE / DURATIONS, 8),
    MEMORY: head(SAMPLE / MEMORY, 8),
}
LLM_BASE = head(default_llm_trace(), 12)

cells = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "-1", "1.5", "3.0", "nan", "inf", "-inf", "1e400", "9" * 5000, "0x10", '"', "a,b",
                     '"a\nb"', "\x00", "2023-11-16 18:17:03.9799600", "9999-12-31T23:59:59-01:00",
                     "0001-01-01T00:00:00+01:00", "HashOwner", "TIMESTAMP"]),
)


@st.composite
def mutated(draw, text: str) -> str:
    """``text`` with one cell replaced, a line dropped or duplicated, or random text spliced in."""
    lines = text.splitlines()
    kind = draw(st.sampled_from(["cell", "cell", "drop", "dup", "splice", "truncate"]))
    i = draw(st.integers(0, len(lines) - 1))
    if kind == "cell":
        row = lines[i].split(",")
        j = draw(st.integers(0, len(row) - 1))
        row[j] = draw(cells)
        lines[i] = ",".join(row)
    elif kind == "drop":
        del lines[i]
    elif kind == "dup":
        lines.insert(i, lines[i])
    elif kind == "truncate":
        lines = lines[:i]
    else:
        at = draw(st.integers(0, len(lines[i])))
        lines[i] = lines[i][:at] + draw(st.text(max_size=8)) + lines[i][at:]
    return "\n".join(lines) + "\n"


def check_error(exc: TraceError, files: list[Path]) -> None:
    msg = str(exc)
    assert len(msg.splitlines()) == 1, msg
    assert exc.path in files or exc.path == files[0].parent, msg
    assert msg.startswith(str(exc.path)), msg
    if exc.line:
        assert f" line {exc.line}: " in msg


def read_azure(files: dict[str, str | bytes]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, text in files.items():
            (root / name).write_bytes(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
        try:
            trace = read_trace(root)
        except TraceError as exc:
            check_error(exc, [root / n for n in files])
        else:
            assert isinstance(trace, Trace) and trace.functions
            assert all(c >= 0 for f in trace.functions for c in f.counts)
            for f in trace.functions:
                assert f.duration_ms is None or 0 <= f.duration_ms < float("inf")
                assert f.memory_mb is None or 0 <= f.memory_mb < float("inf")


def read_llm(text: str | bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llm.csv"
        path.write_bytes(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
        try:
            trace = read_llm_trace(path)
        except TraceError as exc:
            check_error(exc, [path])
        else:
            assert isinstance(trace, LlmTrace) and trace.requests[0].offset_s == 0.0
            assert all(r.offset_s >= 0 and r.prompt_tokens >= 0 and r.output_tokens >= 0 for r in trace.requests)


@pytest.mark.parametrize("name", [INVOCATIONS, DURATIONS, MEMORY])
@FUZZ
@given(data=st.data())
def test_azure_trace_with_one_file_mutated(name, data):
    read_azure({**BASE, name: data.draw(mutated(BASE[name]))})


def one_cell(text: str, row: int, col: int, value: str) -> str:
    lines = text.splitlines()
    cells_ = lines[row].split(",")
    cells_[col] = value
    lines[row] = ",".join(cells_)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("value", ["nan", "inf", "1e400", "-nan"])
def test_a_count_that_is_not_finite_names_file_and_line(value):
    # float("nan") / float("inf") reached int() and raised ValueError / OverflowError before
    with pytest.raises(TraceError, match=r"invocations\.csv line 3: minute \d+: count"):
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / INVOCATIONS).write_text(one_cell(BASE[INVOCATIONS], 2, 6, value))
            read_trace(tmp)


@pytest.mark.parametrize("name,col", [(DURATIONS, 3), (MEMORY, 4)])
def test_an_infinite_duration_or_memory_is_refused(name, col):
    with pytest.raises(TraceError, match=rf"{name.replace('.', '[.]')} line 2: .* must be >= 0 and finite"):
        with tempfile.TemporaryDirectory() as tmp:
            for n, text in BASE.items():
                (Path(tmp) / n).write_text(one_cell(text, 1, col, "inf") if n == name else text)
            read_trace(tmp)


def test_a_header_with_a_line_break_is_reported_on_one_line():
    text = '"Hash\nOwner",HashApp,HashFunction,Trigger,1\na,b,c,http,1\n'
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / INVOCATIONS).write_text(text)
        with pytest.raises(TraceError) as info:
            read_trace(tmp)
    assert len(str(info.value).splitlines()) == 1 and "Hash\\nOwner" in str(info.value)


def app_memory(text: str) -> str:
    """The raw Azure 2019 layout of memory: one row per application (no HashFunction column)."""
    lines = text.splitlines()
    out = []
    for line in lines:
        c = line.split(",")
        out.append(",".join([c[1], c[2], *c[3:]]))  # HashOwner,HashApp,SampleCount,AverageAllocatedMb,...
    return "\n".join(out) + "\n"


def test_per_application_memory_is_joined_by_application():
    inv = "HashOwner,HashApp,HashFunction,Trigger,1,2\no1,a1,f1,http,1,0\no1,a1,f2,http,0,1\no2,a2,f3,timer,1,1\n"
    mem = "HashOwner,HashApp,SampleCount,AverageAllocatedMb,AverageAllocatedMb_pct1\no1,a1,10,150.5,100\n"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / INVOCATIONS).write_text(inv)
        (Path(tmp) / MEMORY).write_text(mem)
        trace = read_trace(tmp)
    memory = {f.function: f.memory_mb for f in trace.functions}
    assert memory == {"f1": 150.5, "f2": 150.5, "f3": None}  # each function of the app gets the app's


@FUZZ
@given(data=st.data())
def test_azure_trace_with_per_application_memory_mutated(data):
    read_azure({**BASE, MEMORY: data.draw(mutated(app_memory(BASE[MEMORY])))})


def test_the_bundled_sample_with_its_memory_per_application_reads():
    with tempfile.TemporaryDirectory() as tmp:
        for n in (INVOCATIONS, DURATIONS):
            (Path(tmp) / n).write_text((SAMPLE / n).read_text())
        (Path(tmp) / MEMORY).write_text(app_memory((SAMPLE / MEMORY).read_text()))
        trace = read_trace(tmp)
    assert len(trace.functions) == 100 and any(f.memory_mb for f in trace.functions)


@FUZZ
@given(data=st.binary(max_size=120))
@example(data=b"HashOwner,HashApp,HashFunction,Trigger,1\n\xff\xfe,a,b,c,1\n")
def test_azure_invocations_random_bytes(data):
    read_azure({INVOCATIONS: data})


@FUZZ
@given(data=st.data())
@example(data=None)  # the trace as it is
def test_llm_trace_mutated(data):
    text = LLM_BASE if data is None else data.draw(mutated(LLM_BASE))
    read_llm(text)


@pytest.mark.parametrize("stamp", ["9999-12-31T23:59:59-01:00", "0001-01-01T00:00:00+01:00"])
def test_llm_timestamp_whose_utc_time_is_out_of_range_names_file_and_line(stamp):
    # datetime.astimezone raised OverflowError before
    with pytest.raises(TraceError, match=r"llm\.csv line 3: TIMESTAMP"):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "llm.csv"
            path.write_text(one_cell(LLM_BASE, 2, 0, stamp))
            read_llm_trace(path)


@FUZZ
@given(data=st.binary(max_size=120))
@example(data=b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xff,1,1\n")
def test_llm_random_bytes(data):
    read_llm(data)
