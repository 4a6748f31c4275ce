"""JSON Schema of every event, exported from the msgspec types and checked in under schema/.

``python -m dilu.contracts.schema --write`` regenerates the files; ``--check`` exits 1 when the
checked-in schema drifted from the types (a test runs the same comparison).
"""
from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import msgspec

from .events import EVENT_TYPES

SCHEMA_DIR = Path(__file__).parent / "schema"


def _clean(node):
    """Descriptions through ``inspect.cleandoc``: msgspec versions differ in how they dedent
    docstrings, and the checked-in schema must not depend on which one is installed."""
    if isinstance(node, dict):
        return {k: inspect.cleandoc(v) if k == "description" and isinstance(v, str) else _clean(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_clean(v) for v in node]
    return node


def schemas() -> dict[str, str]:
    """File name -> JSON Schema text (sorted keys, 2-space indent, trailing newline)."""
    out = {}
    for kind in EVENT_TYPES:
        doc = _clean(msgspec.json.schema(kind))
        out[f"{kind.__name__}.json"] = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    return out


def drift() -> list[str]:
    """Names of schema files that are missing, stale or no longer produced."""
    want = schemas()
    have = {p.name for p in SCHEMA_DIR.glob("*.json")}
    bad = [n for n, text in want.items() if not (SCHEMA_DIR / n).exists() or (SCHEMA_DIR / n).read_text() != text]
    return bad + sorted(have - set(want))


def main(argv: list[str]) -> int:
    if "--write" in argv:
        SCHEMA_DIR.mkdir(exist_ok=True)
        for p in SCHEMA_DIR.glob("*.json"):
            p.unlink()
        for name, text in schemas().items():
            (SCHEMA_DIR / name).write_text(text)
        return 0
    bad = drift()
    for n in bad:
        print(f"schema drift: {n} (run `make schema`)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
