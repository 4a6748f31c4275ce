"""LLM trace replay and token-level report figures: the reader, the plan, the payload, TTFT/TPOT
percentiles, token SLO violations, training iterations/s, and check-report.py on built reports."""
from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from dilu.loadgen.arrivals import Invocation
from dilu.loadgen.clock import LoopClock, VirtualTimeEventLoop
from dilu.loadgen.generator import OpenLoopGenerator, Outcome, Record, token_times_ms
from dilu.loadgen.llm import (
    LlmInvocation, default_llm_trace, payload, plan_llm_replay, read_llm_trace,
)
from dilu.loadgen.report import (
    FunctionFacts, FunctionMeta, Report, RunFacts, RunInfo, TrainingFacts, build_report, read_report, render,
    render_compare, run_info, write_report,
)
from dilu.loadgen.trace import TraceError
from dilu.services.node_agent.handlers.emulated import parse_llm_payload

MS = 1_000_000
S = 1_000_000_000
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def write_csv(tmp_path: Path, body: str, header: str = HEADER) -> Path:
    path = tmp_path / "llm.csv"
    path.write_text(header + body)
    return path


def small_trace(tmp_path: Path):
    """Requests at 0, 1, 2, 100 (after an idle gap of 98 s) and 101 s; outputs 5, 50, 0, 7, 300."""
    rows = [("10:00:00", 10, 5), ("10:00:01", 20, 50), ("10:00:02", 30, 0), ("10:01:40", 40, 7),
            ("10:01:41", 50, 300)]
    body = "".join(f"2023-11-16 {t}.5000000,{p},{n}\n" for t, p, n in rows)
    return read_llm_trace(write_csv(tmp_path, body))


# ------------------------------------------------------------------------------------- reader


def test_bundled_trace_matches_its_csv():
    trace = read_llm_trace()
    with default_llm_trace().open(newline="") as fh:
        rows = list(csv.reader(fh))[1:]
    assert len(trace.requests) == len(rows) == 8819
    assert trace.first_timestamp == "2023-11-16 18:17:03.979960"
    first, second = trace.requests[:2]
    assert (first.offset_s, first.prompt_tokens, first.output_tokens) == (0.0, 4808, 10)
    assert second.offset_s == pytest.approx(0.052)  # 18:17:04.0319600 - 18:17:03.9799600
    assert trace.duration_s == pytest.approx(3435.948056)
    assert sum(r.output_tokens for r in trace.requests) == sum(int(r[2]) for r in rows)
    assert all(a.offset_s <= b.offset_s for a, b in zip(trace.requests, trace.requests[1:]))
    assert (default_llm_trace().parent / "ATTRIBUTION.md").is_file()


def test_rows_are_sorted_by_time_and_columns_found_by_name(tmp_path):
    path = write_csv(tmp_path, "7,2023-01-01T00:00:10,100\n3,2023-01-01T00:00:04,200\n",
                     header="GeneratedTokens,TIMESTAMP,ContextTokens\n")
    trace = read_llm_trace(path)
    assert [(r.offset_s, r.prompt_tokens, r.output_tokens) for r in trace.requests] == [(0.0, 200, 3), (6.0, 100, 7)]
    assert trace.source == str(path)


@pytest.mark.parametrize("body, line, reason", [
    ("2023-11-16 10:00:00,1,2\nyesterday,1,2\n", 3, "TIMESTAMP 'yesterday' is not an ISO 8601 date-time"),
    ("2023-11-16 10:00:00,1,2\n2023-11-16 10:00:01,-4,2\n", 3, "ContextTokens '-4' must be >= 0"),
    ("2023-11-16 10:00:00,1,2.5\n", 2, "GeneratedTokens '2.5' is not an integer"),
    ("2023-11-16 10:00:00,1,2\n\n2023-11-16 10:00:01,1\n", 4, "expected 3 columns, got 2"),
])
def test_bad_rows_name_their_file_and_line(tmp_path, body, line, reason):
    path = write_csv(tmp_path, body)
    with pytest.raises(TraceError) as err:
        read_llm_trace(path)
    assert str(err.value) == f"{path} line {line}: {reason}"
    assert err.value.line == line


def test_bad_files_get_one_line(tmp_path):
    with pytest.raises(TraceError, match="LLM trace file not found"):
        read_llm_trace(tmp_path / "absent.csv")
    with pytest.raises(TraceError, match="not a file"):
        read_llm_trace(tmp_path)
    with pytest.raises(TraceError, match="empty file"):
        read_llm_trace(write_csv(tmp_path, "", header=""))
    with pytest.raises(TraceError, match="line 1: header lacks column.s. GeneratedTokens"):
        read_llm_trace(write_csv(tmp_path, "2023-11-16 10:00:00,1\n", header="TIMESTAMP,ContextTokens\n"))
    with pytest.raises(TraceError, match="no request rows"):
        read_llm_trace(write_csv(tmp_path, ""))


# --------------------------------------------------------------------------------------- plan


def test_plan_keeps_inter_arrival_times_and_idle_gaps_divided_by_speedup(tmp_path):
    trace = small_trace(tmp_path)
    plan = plan_llm_replay(trace, function="llama", seed=0, duration_s=200, speedup=2)
    assert [i.scheduled_ns for i in plan.invocations] == [0, S // 2, S, 50 * S, 50 * S + S // 2]
    assert [i.prompt_tokens for i in plan.invocations] == [10, 20, 30, 40, 50]
    assert [i.output_tokens for i in plan.invocations] == [5, 50, 1, 7, 300]  # 0 asks for 1 token
    assert [i.trace_minute for i in plan.invocations] == [0, 0, 0, 1, 1]
    # the trace ends at 101 s: a 200 s replay at speedup 2 (400 trace s) is clipped to 50.5 s
    assert (plan.clipped, plan.duration_s, plan.requested_duration_s) == (True, 50.5, 200.0)
    assert plan.peak_rps == pytest.approx(3 * 2 / 60)


def test_plan_span_starts_at_start_s_and_is_half_open(tmp_path):
    trace = small_trace(tmp_path)
    plan = plan_llm_replay(trace, function="llama", seed=0, start_s=1.0, duration_s=99.0, speedup=1)
    # span [1, 100): the requests at 1 and 2 s; the one at exactly 100 s is the next span's
    assert [i.scheduled_ns for i in plan.invocations] == [0, S]
    assert (plan.clipped, plan.duration_s, plan.span_requests) == (False, 99.0, 2)
    tail = plan_llm_replay(trace, function="llama", seed=0, start_s=1.0, duration_s=100.0, speedup=1)
    assert [i.scheduled_ns for i in tail.invocations] == [0, S, 99 * S, 100 * S]  # to the last request


def test_plan_caps_output_and_names_invocations(tmp_path):
    trace = small_trace(tmp_path)
    plan = plan_llm_replay(trace, function="llama", seed=0, duration_s=200, max_new_tokens_cap=20, id_prefix="run1-")
    assert [i.output_tokens for i in plan.invocations] == [5, 20, 1, 7, 20]
    assert plan.capped == 2 and plan.max_new_tokens_cap == 20
    assert [i.id for i in plan.invocations][:2] == ["run1-llama-0000000", "run1-llama-0000001"]
    assert all(isinstance(i, Invocation) and i.function == "llama" for i in plan.invocations)
    assert plan.output_tokens == 53 and plan.prompt_tokens == 150


def test_plan_is_deterministic_per_seed_and_samples_the_span():
    trace = read_llm_trace()
    kw = dict(function="llama", duration_s=600, speedup=1, sample=0.25)
    a, b = plan_llm_replay(trace, seed=7, **kw), plan_llm_replay(trace, seed=7, **kw)
    other = plan_llm_replay(trace, seed=8, **kw)
    assert a == b and a.invocations != other.invocations
    full = plan_llm_replay(trace, seed=7, function="llama", duration_s=600, speedup=1)
    assert len(full.invocations) == full.span_requests == a.span_requests
    assert full.invocations == plan_llm_replay(trace, seed=99, function="llama", duration_s=600, speedup=1).invocations
    n = a.span_requests
    assert abs(len(a.invocations) - n / 4) < 5 * (n * 0.25 * 0.75) ** 0.5  # binomial, 5 sigma
    kept = {(i.scheduled_ns, i.prompt_tokens) for i in a.invocations}
    assert kept <= {(i.scheduled_ns, i.prompt_tokens) for i in full.invocations}  # thinned, not moved


@pytest.mark.parametrize("kw, message", [
    (dict(seed=-1), "seed"), (dict(duration_s=0), "duration"), (dict(speedup=0), "speedup"),
    (dict(start_s=101.0), "outside the trace"), (dict(max_new_tokens_cap=0), "max_new_tokens_cap"),
    (dict(sample=0.0), "sample"), (dict(function=""), "function"),
])
def test_plan_rejects_arguments_out_of_range(tmp_path, kw, message):
    args = dict(function="llama", seed=0, duration_s=10.0) | kw
    with pytest.raises(ValueError, match=message):
        plan_llm_replay(small_trace(tmp_path), **args)


def test_payload_is_the_json_the_emulated_llm_reads(tmp_path):
    inv = LlmInvocation(id="x", function="llama", scheduled_ns=0, trace_minute=0, prompt_tokens=4808,
                        output_tokens=10)
    assert payload(inv) == b'{"prompt_tokens":4808,"max_new_tokens":10}'
    plan = plan_llm_replay(small_trace(tmp_path), function="llama", seed=0, duration_s=200)
    assert [parse_llm_payload(payload(i)) for i in plan.invocations] == \
        [(10, 5), (20, 50), (30, 1), (40, 7), (50, 300)]


# ---------------------------------------------------------------------------------- generator


def test_token_times():
    assert token_times_ms(1000 * MS, 5, 1250 * MS, 1290 * MS) == (250.0, 10.0)
    assert token_times_ms(0, 1, 30 * MS, 30 * MS) == (30.0, None)
    assert token_times_ms(0, 0, 0, 0) == (None, None)
    assert token_times_ms(-5 * MS, 3, 0, 8 * MS) == (5.0, 4.0)  # a first chunk at 0 of the time base counts


def test_generator_records_token_times_of_a_streaming_server(tmp_path):
    """A one-at-a-time LLM server (prefill 0.1 ms a prompt token, 5 ms a token) in virtual time:
    TTFT includes the queueing from the scheduled send, TPOT is the decode step."""
    plan = plan_llm_replay(small_trace(tmp_path), function="llama", seed=0, duration_s=200, speedup=100)

    async def main(loop):
        lock = asyncio.Lock()

        async def invoke(inv: LlmInvocation) -> Outcome:
            asked = round(loop.time() * S)
            async with lock:
                await asyncio.sleep(inv.prompt_tokens * 1e-4)
                first = round(loop.time() * S)
                await asyncio.sleep((inv.output_tokens - 1) * 5e-3)
                last = round(loop.time() * S)
            ttft, tpot = token_times_ms(asked, inv.output_tokens, first, last)
            return Outcome(ttft_ms=ttft, tpot_ms=tpot, output_tokens=inv.output_tokens)

        return await OpenLoopGenerator(invoke, clock=LoopClock()).run(plan.invocations, duration_s=plan.duration_s)

    loop = VirtualTimeEventLoop()
    try:
        result = loop.run_until_complete(main(loop))
    finally:
        loop.close()
    by = {r.id: r for r in result.records}
    first, second, third = (by[f"llama-000000{i}"] for i in range(3))
    assert first.ttft_ms == pytest.approx(1.0, abs=1e-3) and first.tpot_ms == pytest.approx(5.0, abs=1e-3)
    # sent at 10 ms, the server is busy with the first until 21 ms: TTFT = 11 ms wait + 2 ms prefill
    assert second.ttft_ms == pytest.approx(13.0, abs=1e-3) and second.output_tokens == 50
    assert third.tpot_ms is None and third.output_tokens == 1  # one token: no gap measured
    # the third waits for the second's 245 ms of decode; the fifth for the fourth's 30 ms
    assert [r.ttft_ms for r in result.records] == pytest.approx([1, 13, 251, 4, 29], abs=1e-3)
    meta = {"llama": FunctionMeta(model="llama2", slo_ms=1000, kind="llm", ttft_ms=12.0, tpot_ms=6.0)}
    report = build_report(result.records, meta, RunFacts(), run_info(None, result, llm_plan=plan))
    # TTFTs of 13, 251 and 29 ms exceed 12 ms; every TPOT (5 ms) is within 6 ms
    f = report.functions[0]
    assert f.token_slo_violation_rate == pytest.approx(3 / 5)
    assert report.run.llm.requests == 5 and report.run.duration_s == plan.duration_s


# ------------------------------------------------------------------------------------- report


def rec(i: int, fn: str, latency_ms: float, status: str = "ok", ttft: float | None = None,
        tpot: float | None = None, tokens: int = 0) -> Record:
    return Record(id=f"{fn}-{i}", function=fn, scheduled_ns=0, sent_ns=0, done_ns=round(latency_ms * MS),
                  status=status, ttft_ms=ttft, tpot_ms=tpot, output_tokens=tokens)


LLM_META = {
    "chat": FunctionMeta(model="llama2", slo_ms=2000, kind="llm", ttft_ms=100, tpot_ms=20),
    "code": FunctionMeta(model="llama2", slo_ms=2000, kind="llm", ttft_ms=500, tpot_ms=None),
    "bert": FunctionMeta(model="bert_base", slo_ms=50),
    "trainer": FunctionMeta(model="resnet152", slo_ms=0, kind="training"),
}
FACTS = RunFacts(
    functions={"chat": FunctionFacts(instance_launches=2, quota_seconds=10.0),
               "trainer": FunctionFacts(instance_launches=1, quota_seconds=30.0)},
    training={"trainer": TrainingFacts(iterations=900, seconds=60.0), "orphan": TrainingFacts(iterations=5)},
)


def llm_records() -> list[Record]:
    """chat (TTFT 100 ms, TPOT 20 ms objectives):
    - 100 streamed replies: TTFT 1..100 ms, TPOT 10 ms, all within both objectives;
    - 10 with TTFT 150 ms (too slow) and TPOT 10 ms; 10 with TTFT 50 ms and TPOT 30 ms (too slow);
      5 too slow on both (count once);
    - 3 one-chunk replies at TTFT 50 ms (no TPOT); 2 unstreamed replies of latency 400 ms (TTFT =
      latency: too slow);
    - 4 dropped, 3 failed, 1 timed out.
    code (TTFT 500 ms, no TPOT objective): 10 replies at TTFT 600 ms, TPOT 300 ms.
    bert: 7 answers at 10 ms."""
    out = [rec(i, "chat", 1000, ttft=i + 1, tpot=10, tokens=32) for i in range(100)]
    out += [rec(100 + i, "chat", 1000, ttft=150, tpot=10) for i in range(10)]
    out += [rec(110 + i, "chat", 1000, ttft=50, tpot=30) for i in range(10)]
    out += [rec(120 + i, "chat", 1000, ttft=150, tpot=30) for i in range(5)]
    out += [rec(125 + i, "chat", 60, ttft=50, tokens=1) for i in range(3)]
    out += [rec(128 + i, "chat", 400) for i in range(2)]
    out += [rec(130 + i, "chat", 0, status=s) for i, s in enumerate(["dropped"] * 4 + ["error"] * 3 + ["timeout"])]
    out += [rec(i, "code", 3000, ttft=600, tpot=300) for i in range(10)]
    out += [rec(i, "bert", 10) for i in range(7)]
    return out


def llm_report() -> Report:
    return build_report(llm_records(), LLM_META, FACTS, RunInfo(wall_s=10.0, functions=4))


def test_token_slo_violations_follow_the_rule():
    by = {f.name: f for f in llm_report().functions}
    chat, code = by["chat"], by["code"]
    assert chat.offered == 138
    # 10 slow first + 10 slow rest + 5 both (once) + 2 unstreamed at 400 ms + 8 not completed
    assert chat.token_slo_violation_rate == pytest.approx((10 + 10 + 5 + 2 + 8) / 138)
    # no TPOT objective: only the TTFT counts, and every TTFT of 600 ms is over 500 ms
    assert code.token_slo_violation_rate == 1.0
    assert (chat.kind, chat.ttft_slo_ms, chat.tpot_slo_ms) == ("llm", 100, 20)
    assert (code.ttft_slo_ms, code.tpot_slo_ms) == (500, None)
    # request-level SLO stays against slo_ms: chat's 130 answers are within 2 s, code's 3 s are not
    assert chat.slo_violation_rate == pytest.approx(8 / 138) and code.slo_violation_rate == 1.0


def test_ttft_and_tpot_percentiles_are_hdr_over_completed_requests():
    by = {f.name: f for f in llm_report().functions}
    chat = by["chat"]
    # 130 TTFTs: 1..100 (100), 50 (13), 150 (15), 400 (2). Sorted: rank 65 -> 52 (1..50 and 13
    # fifties: 63 values up to 50) ... nearest rank p50 = 65th value = 52 ms; p99 = 129th = 400 ms
    assert chat.ttft_ms.p50 == pytest.approx(52, rel=1e-3)
    assert chat.ttft_ms.p99 == pytest.approx(400, rel=1e-3)
    # 125 TPOTs (one-chunk and unstreamed replies have none): 110 of 10 ms, 15 of 30 ms
    assert chat.tpot_ms.p50 == pytest.approx(10, rel=1e-3)
    assert chat.tpot_ms.p99 == pytest.approx(30, rel=1e-3)
    assert by["bert"].ttft_ms is None and by["bert"].token_slo_violation_rate is None


def test_totals_token_figures_cover_llm_requests_only():
    t = llm_report().totals
    assert t.offered == 138 + 10 + 7
    assert t.token_slo_violation_rate == pytest.approx((35 + 10) / 148)  # bert's 7 are not llm requests
    # 140 TTFTs; code's ten 600 ms values move p99 (nearest rank 139th) to 600: not an average
    assert t.ttft_ms.p99 == pytest.approx(600, rel=1e-3)
    assert t.tpot_ms.p99 == pytest.approx(300, rel=1e-3)


def test_training_section_and_functions():
    r = llm_report()
    assert [f.name for f in r.functions] == ["chat", "code", "bert"]  # the trainer takes no requests
    assert [(t.name, t.model, t.iterations, t.iterations_per_s) for t in r.training] == [
        ("orphan", "", 5, None), ("trainer", "resnet152", 900, 15.0)]
    assert (r.training[1].instance_launches, r.training[1].quota_seconds) == (1, 30.0)
    assert (r.totals.instance_launches, r.totals.quota_seconds) == (3, 40.0)
    with pytest.raises(ValueError, match="'trainer', which is a training job"):
        build_report([rec(0, "trainer", 1)], LLM_META, FACTS, RunInfo(wall_s=1))


def test_inference_only_reports_keep_their_json_shape(tmp_path):
    meta = {"bert": LLM_META["bert"]}
    d = build_report([rec(0, "bert", 10)], meta, RunFacts(), RunInfo(wall_s=1)).to_dict()
    assert set(d) == {"totals", "functions", "mechanism", "run"}
    assert not {"ttft_ms", "tpot_ms", "token_slo_violation_rate", "kind"} & (set(d["functions"][0]) | set(d["totals"]))
    full = llm_report().to_dict()
    chat = next(f for f in full["functions"] if f["name"] == "chat")
    assert {"ttft_ms", "tpot_ms", "token_slo_violation_rate", "ttft_slo_ms", "tpot_slo_ms", "kind"} <= set(chat)
    assert set(full["totals"]["ttft_ms"]) == {"p50", "p99", "p999"}
    assert [t["name"] for t in full["training"]] == ["orphan", "trainer"]
    path = tmp_path / "r.json"
    write_report(llm_report(), path)
    assert read_report(path) == llm_report()


def run_checker(checker: Path, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(checker), str(path)], capture_output=True, text=True, timeout=60)


def test_check_report_passes_on_built_reports(tmp_path, check_report):
    llm_path, old_path, both_path = tmp_path / "llm.json", tmp_path / "old.json", tmp_path / "compare.json"
    write_report(llm_report(), llm_path)
    write_report(build_report([rec(0, "bert", 10)], {"bert": LLM_META["bert"]}, RunFacts(), RunInfo(wall_s=1)),
                 old_path)
    both_path.write_text(json.dumps({"policies": {"dilu": llm_report().to_dict(),
                                                  "exclusive": json.loads(old_path.read_text())}}))
    for path in (llm_path, old_path, both_path):
        done = run_checker(check_report, path)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "PROBLEM" not in done.stdout
    broken = llm_report().to_dict()
    broken["functions"][0]["completed"] += 1  # the checker does catch a broken account
    llm_path.write_text(json.dumps(broken))
    assert run_checker(check_report, llm_path).returncode == 1


def test_render_shows_token_columns_only_with_an_llm_function():
    console = Console(record=True, width=320)
    render(llm_report(), console)
    text = console.export_text()
    for needle in ("TTFT p99 ms", "TPOT p50 ms", "token SLO viol.", "100.0 / 20.0", "25.4 %", "Training jobs",
                   "trainer", "15.00"):
        assert needle in text, needle
    plain = Console(record=True, width=320)
    render(build_report([rec(0, "bert", 10)], {"bert": LLM_META["bert"]}, RunFacts(), RunInfo(wall_s=1)), plain)
    text = plain.export_text()
    assert "TTFT" not in text and "Training jobs" not in text


def test_render_compare_adds_token_and_training_rows():
    plain = build_report([rec(0, "bert", 10)], {"bert": LLM_META["bert"]}, RunFacts(), RunInfo(wall_s=1))
    console = Console(record=True, width=200)
    render_compare({"dilu": llm_report(), "exclusive": plain}, console)
    lines = console.export_text().splitlines()
    row = next(line for line in lines if "token SLO violation rate" in line)
    assert "30.4 %" in row and row.rstrip(" │").endswith("–")
    assert any("trainer iterations/s" in line and "15.00" in line for line in lines)
    console = Console(record=True, width=200)
    render_compare({"a": plain, "b": plain}, console)
    assert "TTFT" not in console.export_text()


def test_run_info_describes_the_llm_trace_beside_the_functions_trace(tmp_path):
    from dilu.loadgen.arrivals import plan_replay
    from dilu.loadgen.generator import RunResult
    from dilu.loadgen.trace import read_trace

    result = RunResult(records=[], wall_s=12.0, started_unix_ns=0, late_sends=0, late_threshold_ms=10, max_late_ms=0)
    functions_plan = plan_replay(read_trace(), seed=3, duration_s=30, speedup=10, functions=4)
    llm_plan = plan_llm_replay(small_trace(tmp_path), function="llama", seed=3, duration_s=200, speedup=2,
                               max_new_tokens_cap=64)
    info = run_info(functions_plan, result, llm_plan=llm_plan)
    assert (info.functions, info.duration_s, info.seed) == (4, 30.0, 3)  # the functions trace's own
    assert (info.llm.function, info.llm.requests, info.llm.duration_s, info.llm.max_new_tokens_cap) == \
        ("llama", 5, 50.5, 64)
    console = Console(record=True, width=400)
    report = build_report([], {"llama": LLM_META["chat"]}, RunFacts(), info)
    render(report, console)
    caption = " ".join(console.export_text().split())
    assert "from minute 480, 30 s at speed-up 10" in caption
    assert ("LLM trace llm.csv -> llama from 0 s, 50.5 s at speed-up 2: 5 requests, output capped at 64 tokens"
            in caption)
    assert read_report_round_trip(report, tmp_path).run.llm == info.llm
    with pytest.raises(ValueError, match="needs a plan or an llm_plan"):
        run_info(None, result)


def read_report_round_trip(report: Report, tmp_path: Path) -> Report:
    path = tmp_path / "round.json"
    write_report(report, path)
    return read_report(path)
