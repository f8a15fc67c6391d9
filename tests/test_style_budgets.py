"""The function-length budgets of docs/STYLE.md §11, checked over the package's source.

Median ≤ 10 lines, p90 ≤ 30, hard cap 60 (a kernel factory counts its nested kernel); the
scheduler's main method ≤ 80; CLI command bodies (after the Typer signature) ≤ 25.
"""

from __future__ import annotations

import ast
import statistics
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "sparkinfer_cli"
EXCEPTIONS = {("engine/scheduler.py", "schedule"): 80}


def _functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((path.relative_to(PACKAGE).as_posix(), node))
    return found


def _length(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_function_lengths_stay_within_budget() -> None:
    functions = _functions()
    lengths = sorted(_length(node) for _, node in functions)
    assert len(lengths) > 100, "the package's functions were not found"
    assert statistics.median(lengths) <= 10
    assert lengths[int(0.9 * len(lengths))] <= 30
    too_long = [f"{path}:{node.lineno} {node.name} ({_length(node)} lines)"
                for path, node in functions
                if _length(node) > EXCEPTIONS.get((path, node.name), 60)]
    assert not too_long, "over the 60-line cap: " + ", ".join(too_long)


def test_cli_commands_parse_then_delegate() -> None:
    commands = [node for path, node in _functions() if path == "cli.py" and any(
        isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "command"
        for d in node.decorator_list)]
    assert len(commands) >= 5, "download, inspect, generate, bench and serve"
    bodies = {node.name: node.end_lineno - node.body[0].lineno + 1 for node in commands}
    assert all(n <= 25 for n in bodies.values()), bodies
