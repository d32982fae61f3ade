"""A tactic table for people: one row per linear shape and row bucket (op, bucket, what runs, the fastest,
the runner-up, their times), and one short line per shape for summaries."""

from __future__ import annotations

from typing import Any

from kiln.engine.tactics.table import TacticTable


def rows(table: TacticTable) -> list[dict[str, Any]]:
    out = []
    for key, choice in table.linear.items():
        for b in choice.buckets:
            us = b.get("us") or {}
            out.append({"op": "linear", "shape": key, "layout": choice.layout, "rows": b["rows"], "runs": b["runs"],
                        "winner": b["winner"], "runner_up": b.get("runner_up"), "runs_us": us.get(b["runs"]),
                        "runner_up_us": us.get(b.get("runner_up")), "us": us,
                        "inferred_from": b.get("inferred_from")})
    for op, choice in table.model.items():
        us = choice.get("us") or {}
        ranked = sorted(us, key=us.get)
        winner = None if choice.get("winner") is None else str(choice["winner"])
        out.append({"op": op, "shape": "model", "layout": None, "rows": None, "runs": winner, "winner": winner,
                    "runner_up": next((r for r in ranked if r != winner), None), "runs_us": us.get(winner),
                    "runner_up_us": us.get(next((r for r in ranked if r != winner), None)), "us": us,
                    "inferred_from": None})
    return out


def _us(v: float | None) -> str:
    return "-" if v is None else (f"{v:.1f}" if v < 1000 else f"{v / 1000:.2f}ms")


def format_table(table: TacticTable) -> str:
    """The whole table, aligned, with every candidate's time per bucket."""
    head = ("op", "shape", "rows", "runs", "winner", "runner-up", "runs us", "runner-up us", "all (us)")
    body = [(r["op"], r["shape"], "" if r["rows"] is None else str(r["rows"])
             + (f" (as {r['inferred_from']})" if r["inferred_from"] else ""), r["runs"] or "-", r["winner"] or "-",
             r["runner_up"] or "-", _us(r["runs_us"]), _us(r["runner_up_us"]),
             " ".join(f"{k}={_us(v)}" for k, v in sorted(r["us"].items(), key=lambda kv: kv[1])))
            for r in rows(table)]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in (head, *body)]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def summary(table: TacticTable) -> list[str]:
    """One line per linear shape: its layout and which kernel runs which rows; then the model-level choices."""
    lines = []
    for key, choice in table.linear.items():
        spans: list[list] = []
        for b in choice.buckets:
            if spans and spans[-1][2] == b["runs"]:
                spans[-1][1] = b["rows"]
            else:
                spans.append([b["rows"], b["rows"], b["runs"]])
        lines.append(f"{key} [{choice.layout}]: " + ", ".join(
            f"rows {lo}-{hi} {name}" if lo != hi else f"rows {lo} {name}" for lo, hi, name in spans))
    for op, choice in table.model.items():
        lines.append(f"{op}: {choice.get('winner')}"
                     + (f" ({', '.join(f'{k} {_us(v)}' for k, v in sorted(choice['us'].items()))})"
                        if choice.get("us") else ""))
    return lines
