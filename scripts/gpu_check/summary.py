"""The one JSON summary of a gpu_check run: every step's status and result.

    python summary.py STEPS_TSV RESULTS_DIR [OUT_JSON]

STEPS_TSV has one line per step the shell ran: name, status (ok | failed | timeout | skipped),
exit code, seconds. RESULTS_DIR/<step>.json is what the step saved (absent when it died first).
Prints one labelled line per step, then ``== summary (JSON)`` and the JSON; writes it to OUT_JSON
when given. Standard library only, so it runs with any Python 3 even when the set-up failed.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _join(rows: list[dict], key: str, fmt: str) -> str:
    return "/".join(fmt.format(r[key]) if r.get(key) is not None else "-" for r in rows)


def headline(name: str, res: dict) -> str:
    """The figure that matters most of one step's result, one line ('' when none)."""
    try:
        if name == "inventory":
            gpus = res.get("gpus") or []
            return (f"{len(gpus)} GPU(s) {sorted({g['name'] for g in gpus})}, mps={res.get('mps', {}).get('state')}"
                    + (f" ({res['mps']['reason']})" if res.get("mps", {}).get("reason") else ""))
        if name == "throughput":  # per model and mode, at each quota: throughput vs none, events share
            groups: dict[str, list[dict]] = {}
            for r in res.get("rows", []):
                if r.get("quota") is not None:
                    groups.setdefault(f"{r['model']}/{r['mode']}", []).append(r)
            return "; ".join(f"{k} at {_join(rs, 'quota', '{}')}: throughput x{_join(rs, 'vs_none', '{:.2f}')}, "
                             f"share {_join(rs, 'share_events', '{:.2f}')}" for k, rs in groups.items())
        if name == "resize":
            up = res.get("summary", {}).get("up", {})
            return f"0.25->1.0 applied {up.get('applied_us_median')} us, rate changed {up.get('rate_change_ms_median')} ms (median)"
        if name == "memory":
            return (f"over-allocation OOM={res.get('over_allocation_oom')}, neighbour unaffected={res.get('neighbour_unaffected')}")
        if name == "platform":
            fns = res.get("load", {}).get("functions", {})
            return "; ".join(f"{fn}: {r['completed']}/{r['offered']} ok, p50 {r['latency_ms'].get('p50')} ms, "
                             f"p99 {r['latency_ms'].get('p99')} ms" for fn, r in fns.items())
    except (KeyError, TypeError, ValueError, AttributeError):
        return ""
    return ""


def build(steps_tsv: Path, results: Path) -> dict:
    steps: dict[str, dict] = {}
    if steps_tsv.exists():
        for line in steps_tsv.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) < 4:
                continue
            name, status, rc, secs = parts[:4]
            entry = {"status": status, "rc": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": float(secs or 0)}
            if len(parts) > 4 and parts[4]:
                entry["note"] = parts[4]
            steps[name] = entry
    for path in sorted(results.glob("*.json")) if results.exists() else []:
        try:
            res = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            res = {"ok": False, "error": f"unreadable result: {exc}"}
        entry = steps.setdefault(path.stem, {"status": "ok" if res.get("ok") else "failed"})
        entry["result"] = res
        if entry.get("status") == "ok" and not res.get("ok", False):
            entry["status"] = "failed"  # a step may exit 0 yet say its check did not hold
        if "error" in res and "error" not in entry:
            entry["error"] = res["error"]
    failed = sorted(n for n, e in steps.items() if e.get("status") != "ok")
    return {"ok": bool(steps) and not failed, "failed_steps": failed, "generated_unix_s": int(time.time()), "steps": steps}


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    summary = build(Path(argv[1]), Path(argv[2]))
    for name, entry in summary["steps"].items():
        line = f"[summary] {name:12} {entry.get('status', '?'):8}"
        if entry.get("seconds") is not None:
            line += f" {entry['seconds']:6.1f} s"
        extra = entry.get("error") or entry.get("note") or headline(name, entry.get("result") or {})
        print(f"{line}  {extra}".rstrip())
    print(f"[summary] overall: {'ok' if summary['ok'] else 'FAILED: ' + ', '.join(summary['failed_steps'])}")
    text = json.dumps(summary, indent=1, default=str)
    print("== summary (JSON)")
    print(text)
    if len(argv) > 3 and argv[3]:
        Path(argv[3]).parent.mkdir(parents=True, exist_ok=True)
        Path(argv[3]).write_text(text + "\n")
        print(f"[summary] written to {argv[3]}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
