"""Reading the shipped systemd units and their environment file, as systemd would (for the deploy
tests). Importable from every test folder: pytest puts tests/ on sys.path (tests/conftest.py)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from dotenv import dotenv_values

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as section -> [(key, value)] in order (keys may repeat, e.g. Environment=)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        else:
            key, _, value = line.partition("=")
            current.append((key.strip(), value.strip()))
    return sections


def unit_value(unit: dict, section: str, key: str) -> str | None:
    """Last value of ``key`` in ``section`` (systemd's rule for single-valued keys), None if unset."""
    values = [v for k, v in unit.get(section, []) if k == key]
    return values[-1] if values else None


def env_file(path: Path) -> dict[str, str]:
    """An ``EnvironmentFile=`` (KEY=VALUE lines, # comments) as a dict."""
    return {k: v for k, v in dotenv_values(path).items() if v is not None}


def unit_environment(unit: dict) -> dict[str, str]:
    """The unit's ``Environment=`` assignments, in order (each line holds one or more K=V words)."""
    out: dict[str, str] = {}
    for key, value in unit.get("Service", []):
        if key == "Environment":
            for word in shlex.split(value):
                k, _, v = word.partition("=")
                out[k] = v
    return out


def exec_start(unit: dict, env: dict[str, str]) -> list[str]:
    """``ExecStart=`` split into words with ``${VAR}`` expanded from ``env``, as systemd does."""
    line = unit_value(unit, "Service", "ExecStart") or ""
    return [re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), w) for w in shlex.split(line)]
