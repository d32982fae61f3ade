"""The bench's outputs: the side-by-side table, the ceiling lines, and the JSON document."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

COLUMNS = [
    ("system", "", None),
    ("output_tok_s", "out tok/s", "{:.1f}"),
    ("total_tok_s", "total tok/s", "{:.1f}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.2f}"),
    ("ttft_p99_s", "TTFT p99 s", "{:.2f}"),
    ("e2e_p50_s", "E2E p50 s", "{:.2f}"),
    ("e2e_p99_s", "E2E p99 s", "{:.2f}"),
    ("peak_rss_mib", "peak RSS MiB", "{:.0f}"),
    ("avg_batch", "avg batch", "{:.1f}"),
    ("kiln_ratio", "kiln x", "{:.2f}"),
]


def _cells(systems: dict[str, dict], ratios: dict[str, float]) -> list[list[str]]:
    """One row of formatted cells per system (medians, plus kiln's ratio to it)."""
    rows = []
    for name, entry in systems.items():
        med = {**entry["median"], "kiln_ratio": ratios.get(name)}
        row = [name]
        for key, _, fmt in COLUMNS[1:]:
            value = med.get(key)
            row.append("-" if value is None or value != value else fmt.format(value))
        rows.append(row)
    return rows


def table(systems: dict[str, dict], ratios: dict[str, float]) -> str:
    rows = [[title for _, title, _ in COLUMNS], *_cells(systems, ratios)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def ceiling_lines(ceiling: dict) -> list[str]:
    hw = ceiling["hardware"]
    bw = hw["bandwidth"]
    flops = ", ".join(f"M={m}: {v:.0f}" for m, v in hw["matmul_gflop_s"].items())
    lines = [
        f"hardware: read {bw['read_gb_s']:.1f} GB/s, copy {bw['copy_gb_s']:.1f} GB/s; "
        f"{hw['dtype']} matmul GFLOP/s {flops}",
    ]
    for name, c in ceiling["per_system"].items():
        lines.append(
            f"ceiling at {name}'s avg batch {c['batch']:.1f}: decode {c['decode_tok_s']:.0f} tok/s "
            f"(step >= {c['decode_step_ms']:.1f} ms, {c['decode_bound']}-bound); workload "
            f"{c['output_tok_s']:.0f} output tok/s; {name} reaches {100 * c['fraction']:.0f}%"
        )
    if "kiln" in ceiling["per_system"]:
        c = ceiling["per_system"]["kiln"]
        split = ", ".join(f"{k} {v:.1f}s" for k, v in c["time_split_s"].items() if v)
        lines.append(f"what limits the ceiling for kiln: {c['limiter']} (best-case time split: {split})")
    return lines


def machine_info(threads: int) -> dict:
    import torch
    import transformers

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": threads,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    try:
        root = Path(__file__).resolve().parents[2]
        info["git_commit"] = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
        ).stdout.strip() or None
        # Uncommitted runtime changes make the commit alone not reproduce the figures.
        info["engine_dirty"] = bool(subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "engine"], capture_output=True, text=True,
            timeout=5,
        ).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info
