"""The printed report fits 100 columns, cuts no cell, defines every column, and compare says how
each policy stands against the first (ratio, or percentage points for rates)."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from dilu.loadgen.generator import Record
from dilu.loadgen.report import (
    LEGEND, FunctionFacts, FunctionMeta, Mechanism, Report, RunFacts, RunInfo, TrainingFacts, build_report,
    legend_text, render, render_compare, split_columns, versus,
)

MS = 1_000_000
MODELS = [("gpt2_large", 250), ("bert_base", 100), ("resnet152", 80), ("llama2_7b", 2000)]


def big_report(llm: bool = False) -> Report:
    """16 functions with five-digit latencies and counts (the widths of a real demo), optionally an
    llm function and a training job."""
    meta = {f"fn-{i:08x}": FunctionMeta(model=MODELS[i % 4][0], slo_ms=MODELS[i % 4][1]) for i in range(16)}
    if llm:
        meta["llm-code"] = FunctionMeta(model="llama2_7b", slo_ms=30000, kind="llm", ttft_ms=2000, tpot_ms=150)
        meta["train-0"] = FunctionMeta(model="resnet50", slo_ms=0, kind="training")
    records = []
    for i, fn in enumerate(n for n, m in meta.items() if m.kind != "training"):
        tok = fn == "llm-code"
        for j in range(40 * (i + 1)):
            s = j * 3
            records.append(Record(id=f"{fn}-{j}", function=fn, scheduled_ns=s * MS, sent_ns=s * MS,
                                  done_ns=(s + 25_000 + 97 * j) * MS, status="ok" if j % 9 else "timeout",
                                  cold_start=j < 3, ttft_ms=1234.5 if tok else None, tpot_ms=20.0 if tok else None))
    facts = RunFacts(
        functions={f: FunctionFacts(instance_launches=1234, quota_seconds=123_456.7) for f in meta},
        training={"train-0": TrainingFacts(iterations=12_000, seconds=130.0)} if llm else {},
        active_gpu_seconds=48_000.2, allocation_fragmentation=0.486, idle_fragmentation=0.131,
        mechanism=Mechanism(profiler_trials=170, grant_changes=900, token_wait_ms=12_345.4, scale_outs=20,
                            retirements=10, scale_to_zero=1, parks=9_710, resumes=6_120, vertical_reaction_ms_p50=3.2,
                            vertical_reaction_ms_p99=20.5))
    run = RunInfo(wall_s=130.0, policy="horizontal-only", functions=16, trace="/t/azurefunctions-2019",
                  duration_s=120, speedup=10, seed=2, share=0.4, late_sends=3, late_threshold_ms=10)
    return build_report(records, meta, facts, run)


def printed(draw, width: int = 100) -> str:
    console = Console(width=width, record=True)
    draw(console)
    return console.export_text()


def fits(text: str, width: int = 100) -> None:
    long = [line for line in text.splitlines() if len(line.rstrip()) > width]
    assert not long, long[:3]
    assert "…" not in text  # no cell cut


def legend_names(text: str) -> set[str]:
    """The names the legend defines: a line that starts with a name, two spaces, then its meaning."""
    out = set()
    for line in text.splitlines():
        for name in LEGEND:
            if line.startswith(name + "  ") or line.rstrip() == name:
                out.add(name)
    return out


def headers(text: str) -> set[str]:
    """Column names in the tables' header rows."""
    out = set()
    for line in text.splitlines():
        if line.startswith("┃"):
            out |= {cell.strip() for cell in line.strip("┃").split("┃")}
    return out


@pytest.mark.parametrize("llm", [False, True])
def test_a_16_function_report_fits_100_columns_and_defines_every_column(llm):
    r = big_report(llm)
    text = printed(lambda c: render(r, c))
    fits(text)
    cols = headers(text) - {"figure", "value", "meaning"}  # the GPU table carries its own meanings
    assert "p99 ms" in cols and "quota·s" in cols and ("TTFT p99 ms" in cols) == llm
    assert cols <= legend_names(text), cols - legend_names(text)
    # every function is on a row of each split part, in full, with its p99 in full
    parts = len(re.findall(r"Dilu replay — policy horizontal-only \(\d/\d\)", text))
    assert parts >= 2
    for f in r.functions:
        assert text.count(f.name) == parts
    p99 = f"{r.totals.latency_ms.p99:,.0f}"
    assert any(line.startswith("│ total ") and f" {p99} " in line for line in text.splitlines())
    # the GPU figures, one per line with their meaning
    for name in ("active GPU·s", "alloc. frag.", "idle frag.", "parks", "resumes", "reaction p50/p99 ms"):
        line = next(line for line in text.splitlines() if line.startswith(f"│ {name} "))
        assert LEGEND[name].split()[0] in line
    assert " 9,710 " in next(line for line in text.splitlines() if line.startswith("│ parks "))
    assert " 6,120 " in next(line for line in text.splitlines() if line.startswith("│ resumes "))
    assert "48.6 %" in text and "13.1 %" in text and "seed 2" in text
    # with training jobs (the llm case here) the legend says the total row counts their launches
    assert ("total" in legend_names(text)) == bool(r.training)


def test_a_wide_console_keeps_one_table():
    text = printed(lambda c: render(big_report(), c), width=250)
    assert "(1/" not in text and "Dilu replay — policy horizontal-only" in text


def test_compare_prints_ratios_and_point_differences():
    first = big_report()
    d = first.to_dict()
    t = d["totals"]
    second = Report.from_dict({**d, "totals": {
        **t, "cold_start_requests": 53, "slo_violation_rate": 0.036, "active_gpu_seconds": 24_000.1,
        "dropped": 7}})
    second = Report.from_dict({**second.to_dict(), "mechanism": {**d["mechanism"], "parks": 4_855, "resumes": 0}})
    first = Report.from_dict({**d, "totals": {**t, "cold_start_requests": 100, "slo_violation_rate": 0.030}})
    text = printed(lambda c: render_compare({"dilu": first, "horizontal-only": second}, c))
    fits(text)

    def row(label):
        return next(line for line in text.splitlines() if line.startswith(f"│ {label} "))

    assert row("cold-start requests").rstrip(" │").endswith("0.53x")
    assert row("SLO violation rate").rstrip(" │").endswith("+0.6 pp")
    assert row("active GPU·s").rstrip(" │").endswith("0.50x")
    assert row("dropped").rstrip(" │").endswith("–")  # 7 against 0: no ratio
    assert "9,710" in row("parks") and row("parks").rstrip(" │").endswith("0.50x")
    assert "6,120" in row("resumes") and row("resumes").rstrip(" │").endswith("0.00x")
    assert "horizontal-only / dilu" in headers(text)
    labels = {line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│ ")}
    defined = {line.split("  ")[0] for line in text.splitlines() if "  " in line and not line.startswith(("│", "┃"))}
    assert labels <= defined, labels - defined
    assert "horizontal-only / dilu" in defined


def test_compare_of_many_policies_splits_within_100_columns():
    r = big_report(llm=True)
    reports = {name: r for name in ("dilu", "horizontal-only", "static-mps", "exclusive", "dilu-published")}
    text = printed(lambda c: render_compare(reports, c))
    fits(text)
    assert {f"{p} / dilu" for p in reports if p != "dilu"} <= headers(text)


def test_versus():
    assert versus(100, 53) == "0.53x"
    assert versus(0.030, 0.036, rate=True) == "+0.6 pp"
    assert versus(0.5, 0.25, rate=True) == "-25.0 pp"
    # the difference of the rates as printed, 5.6 % and 5.8 %: +0.2, not the +0.1 of 5.649 and 5.751
    assert versus(0.05649, 0.05751, rate=True) == "+0.2 pp"
    assert versus(0, 5) == "–" and versus(None, 5) == "–" and versus(3, None, rate=True) == "–"
    assert versus(0, 0, rate=True) == "+0.0 pp"


@settings(max_examples=200, deadline=None)
@given(widths=st.lists(st.integers(1, 40), min_size=2, max_size=30), keys=st.integers(0, 2),
       width=st.integers(20, 200))
def test_split_columns_covers_every_column_once_within_the_width(widths, keys, width):
    keys = min(keys, len(widths) - 1)
    groups = split_columns(widths, keys, width)
    assert [i for g in groups for i in g] == list(range(keys, len(widths)))
    base = 1 + sum(w + 3 for w in widths[:keys])
    for g in groups:
        assert len(g) == 1 or base + sum(widths[i] + 3 for i in g) <= width


def test_legend_text_defines_every_key_within_its_width():
    text = legend_text(width=78)
    assert all(len(line) <= 78 for line in text.splitlines())
    starts = {line.split("  ")[0] for line in text.splitlines() if not line.startswith(" ")}
    assert set(LEGEND) == starts
    assert legend_text(["p99 ms"]).startswith("p99 ms  99th percentile")
