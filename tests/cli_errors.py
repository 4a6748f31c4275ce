"""What a command-line refusal looks like: click's one ``Error:`` line, no traceback."""
from __future__ import annotations


def one_line_error(result, *codes: int) -> str:
    """The single ``Error`` line of a click ``result`` that exited with one of ``codes`` (default:
    1 or 2) without a traceback; fails the test otherwise."""
    assert result.exit_code in (codes or (1, 2)), result.output
    assert "Traceback" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(lines) == 1, result.output
    return lines[0]
