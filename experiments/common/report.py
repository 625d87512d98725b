"""Reporting: the common command-line options, a table printer, goals judged against measurements, and
the result JSON (the script's document plus machine.metadata's "machine" block; the summary JSON as the
last stdout line). Stdlib only at import.
"""

import argparse
import json
import pathlib
import re
import sys
import time

from common.machine import metadata


def arg_parser(doc: str, *, out: pathlib.Path | None = None, trace: bool = False) -> argparse.ArgumentParser:
    """A parser described by the first line of `doc`, with the common --out (default `out`) and --trace
    (default None: the conversation trace in $JAXINFER_TRACE_DIR, see paths.trace_or_default)."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    if out is not None:
        parser.add_argument("--out", type=pathlib.Path, default=out)
    if trace:
        parser.add_argument("--trace", type=pathlib.Path, default=None,
                            help="an Azure-format trace CSV (default: the conversation trace in $JAXINFER_TRACE_DIR)")
    return parser


def comma_list(parser: argparse.ArgumentParser, text: str, choices, what: str) -> list[str]:
    """The non-empty items of a comma list; a usage error naming `what` if one is not in `choices`."""
    items = [item for item in text.split(",") if item]
    unknown = sorted(set(items) - set(choices))
    if unknown:
        parser.error(f"unknown {what} {unknown}; choose from {', '.join(choices)}")
    return items


def log(script: str, message: str) -> None:
    """A timestamped progress line on stderr (stdout ends with the result JSON)."""
    print(f"[{script} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _cell(value, spec: str) -> str:
    """One table cell: a number in `spec`, or a string or None ("-") as text at the column's width."""
    align, width = spec[0] if spec[0] in "<>" else ">", re.match(r"[<>]?[+ -]?(\d*)", spec)[1]
    if value is None or isinstance(value, str):
        return f"{'-' if value is None else value:{align}{width}}"
    return f"{value:{align}{spec.lstrip('<>')}}"


def format_table(columns: list[tuple[str, str]], rows: list[list]) -> str:
    """Columns of (header, format spec: "<14", ">8.1f", "7.1%", aligned right unless "<"); a header
    aligns as its cells, and a cell that is a string or None ("-") prints as text at the column's width."""
    return "\n".join(" ".join(_cell(v, spec) for v, (_, spec) in zip(row, columns)) for row in [[h for h, _ in columns], *rows])


def judge(goals: dict[str, tuple[str, float, str]], measured: dict) -> dict:
    """{name: {what, target, how, measured, met}} for goals {name: (what, target, how)}, where how is "at_least",
    "at_most" or "within" (|measured| <= target); met is None where measured[name] is None (not measured)."""
    test = {"at_least": lambda m, t: m >= t, "at_most": lambda m, t: m <= t, "within": lambda m, t: abs(m) <= t}
    return {name: {"what": what, "target": target, "how": how, "measured": (m := measured.get(name)),
                   "met": None if m is None else bool(test[how](m, target))} for name, (what, target, how) in goals.items()}


def print_goals(judged: dict) -> None:
    print("\ngoals:")
    for goal in judged.values():
        state = "not measured" if goal["met"] is None else ("met" if goal["met"] else "NOT MET")
        measured = "-" if goal["measured"] is None else f"{goal['measured']:.4g}"
        print(f"  {state:<12} {goal['what']}: measured {measured} ({goal['how'].replace('_', ' ')} {goal['target']:g})")


def write_result(path: pathlib.Path, doc: dict, *, indent: int | None = 2, peaks: dict | None = None) -> dict:
    """Write `doc` to `path` as JSON with machine.metadata in its "machine" block; returns it."""
    doc = {**doc, "machine": {**metadata(peaks), **doc.get("machine", {})}}
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent, default=str) + "\n")
    return doc


def finish(path: pathlib.Path, doc: dict, summary: dict, *, correct: bool = True, **write) -> dict:
    """write_result(path, doc, **write), then `summary` as the last stdout line; exit 1 if not `correct`."""
    doc = write_result(path, doc, **write)
    print(json.dumps(summary))
    if not correct:
        sys.exit(1)
    return doc
