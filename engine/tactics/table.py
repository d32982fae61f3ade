"""A tactic table: per linear shape, the candidates' times per row bucket, the layout its weight is packed in
and the kernel that runs each bucket; plus model-level choices (the decoder stack, the attention backend).

Choosing. A linear's weight is packed once, so first a layout: for each layout, the best time any of its
candidates reaches in each bucket, divided by the bucket's rows (the cost per token), summed over the
buckets; the lowest sum wins (``choose``). Then each bucket runs the fastest candidate of that layout
(``runs``); ``winner`` is the fastest of all, so the report shows where the layout cost something.

On disk (``tactics.json`` in an artifact, or a re-timed copy beside it) the table is one JSON document
with a ``sha256`` of its canonical form: a table that does not parse, whose checksum does not match, that
names a candidate this kiln does not know, or that runs a candidate outside its layout is refused
(:class:`TacticsError`, naming the file and the fix), never half used.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.engine.errors import ConfigError
from kiln.engine.kernels.candidates import LAYOUTS, LINEAR, SECOND_COPY, second_copy_margin, why_not
from kiln.engine.kernels.formats import SITE_KEYS as QUANT_KEYS
from kiln.engine.tactics.timing import BucketTiming, LinearSite

FORMAT = "kiln-tactics/1"
DTYPES = ("float32", "bfloat16")


class TacticsError(ConfigError):
    """A tactic table that cannot be used as it is (corrupt, or another model's)."""


@dataclass
class LinearChoice:
    key: str  # "<dtype>:<n>x<k>"
    layout: str
    buckets: list[dict[str, Any]]  # rows, runs, winner, runner_up, us {candidate: microseconds}, pruned, inferred_from
    scores: dict[str, float] = field(default_factory=dict)  # layout -> summed seconds per row
    timed_columns: int | None = None

    def kernels(self, layout: str | None = None, python_margin: float | None = None) -> list[str]:
        """The candidate that runs each row bucket (buckets 0..; the caller repeats the last past them): the
        table's choice, or with ``layout`` the fastest timed candidate of that layout. ``python_margin``: a
        candidate that runs from Python (``onednn-panels``: a step it runs leaves the decoder stack) must be
        that many times faster than kiln's C kernels to run a bucket."""
        if (layout is None or layout == self.layout) and python_margin is None:
            return [b["runs"] for b in self.buckets]
        layout = layout or self.layout
        out = []
        for b in self.buckets:
            times = {n: t for n, t in (b.get("us") or {}).items() if LINEAR[n].layout == layout}
            if not times:
                if layout == self.layout:  # untimed (a forced table): as chosen
                    out.append(b["runs"])
                    continue
                raise TacticsError(f"tactic table entry {self.key} has no {layout} candidate timed at {b['rows']} rows")
            best = min(times, key=times.get)
            in_c = {n: t for n, t in times.items() if LINEAR[n].gemm_kernel in ("fma", "amx", "w8a8", "w8a8_amx")}
            if python_margin and in_c and LINEAR[best].gemm_kernel == "onednn":
                c_best = min(in_c, key=in_c.get)
                best = best if times[best] * python_margin < in_c[c_best] else c_best
            out.append(best)
        return out


def second_copy(choice: LinearChoice, site: LinearSite, native, exclude, one_kernel: bool) -> float | None:
    """The margin by which each side must win some bucket for this site to hold a second copy (None: it holds none:
    ``one_kernel``, turned off, or a timed ``SECOND_COPY`` candidate that cannot run here)."""
    margin = None if one_kernel else second_copy_margin()
    timed = {n for b in choice.buckets for n in (b.get("us") or {}) if n in SECOND_COPY}
    if margin is None or not timed or any(why_not(n, site.dtype, native, site.quant, exclude) for n in timed):
        return None
    return margin


def both_copies(choice: LinearChoice, margin: float | None, python_margin: float | None = None,
                stacked: bool = False) -> list[str] | None:
    """The candidate per bucket with kiln's panels and a ``SECOND_COPY`` candidate's copy both held, or None: one
    copy, the table's layout, is all the weight needs. Outside the decoder stack (the LM head) each bucket runs the
    table's layout unless the other side wins it by ``margin``, and the copy is held where some bucket does. A
    decoder layer's linear (``stacked``) runs kiln's side wherever it is faster at all, the copy where it is (by
    ``python_margin`` where the stack would run the bucket: the copy is called from Python), and holds the copy
    where it wins some bucket by ``margin``.

    Kiln's side wins by any margin in the stack because these timings run one weight over and over in cache, while
    a decode step streams every weight from memory through the decoder stack, which needs kiln's panels: llama-bench
    int8, batch 1, AVX2 tiles, the 4096x768 gate_up timed 78.8 us on kiln's against 80.4 on FBGEMM's, and the model
    decoded 230 tok/s on kiln's W8A8 against 104 on FBGEMM's (quantization.md)."""
    if margin is None:
        return None
    runs, copy_by_margin = [], False
    for b in choice.buckets:
        us = b.get("us") or {}
        kiln = {n: t for n, t in us.items() if LINEAR[n].layout == "kiln"}
        copies = {n: us[n] for n in SECOND_COPY if n in us}
        if not kiln or not copies:
            return None
        k, c = min(kiln, key=kiln.get), min(copies, key=copies.get)
        copy_by_margin |= copies[c] * margin <= kiln[k]
        if stacked:
            runs.append(c if copies[c] * (python_margin or 1.0) < kiln[k] else k)
        elif choice.layout == "kiln":
            runs.append(c if copies[c] * margin <= kiln[k] else k)
        else:
            runs.append(k if kiln[k] * margin <= copies[c] else c)
    mixed = {n in SECOND_COPY for n in runs} == {True, False}
    return runs if mixed and (copy_by_margin or not stacked) else None


def choose(key: str, timings: list[BucketTiming], timed_columns: int | None = None) -> LinearChoice:
    scores: dict[str, float] = {}
    for layout in LAYOUTS:
        per_row = []
        for t in timings:
            times = [s for name, s in t.seconds.items() if LINEAR[name].layout == layout]
            if not times:
                break
            per_row.append(min(times) / t.rows)
        else:
            if per_row:
                scores[layout] = sum(per_row)
    layout = min(scores, key=scores.get)
    buckets = []
    for t in timings:
        ranked = sorted(t.seconds, key=t.seconds.get)
        runs = min((n for n in t.seconds if LINEAR[n].layout == layout), key=t.seconds.get)
        buckets.append({"rows": t.rows, "runs": runs, "winner": ranked[0],
                        "runner_up": ranked[1] if len(ranked) > 1 else None,
                        "us": {n: round(s * 1e6, 2) for n, s in sorted(t.seconds.items())},
                        "pruned": sorted(t.pruned), "inferred_from": t.inferred_from})
    return LinearChoice(key, layout, buckets, {k: round(v * 1e6, 4) for k, v in scores.items()}, timed_columns)


@dataclass
class TacticTable:
    host: dict[str, Any]
    linear: dict[str, LinearChoice] = field(default_factory=dict)
    model: dict[str, dict[str, Any]] = field(default_factory=dict)  # op -> {winner, us: {...}}
    seconds: float = 0.0  # how long measuring took

    def to_json(self) -> dict[str, Any]:
        doc = {"format": FORMAT, "host": self.host, "seconds": round(self.seconds, 3),
               "linear": [{"key": c.key, "layout": c.layout, "scores": c.scores, "timed_columns": c.timed_columns,
                           "buckets": c.buckets} for c in self.linear.values()],
               "model": self.model}
        doc["sha256"] = _digest(doc)
        return doc

    def save(self, path: Path) -> Path:
        """Write atomically (a reader never sees half a table)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tactics-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_json(), f, indent=1, sort_keys=True)
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: Path) -> TacticTable:
        path = Path(path)
        fix = "rebuild the engine, or delete the file so that it is measured again"
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise TacticsError(f"tactic table {path} is unreadable ({exc}); {fix}") from None
        return cls.from_json(doc, f"tactic table {path}", fix)

    @classmethod
    def from_json(cls, doc: Any, what: str = "tactic table", fix: str = "measure it again") -> TacticTable:
        def bad(why: str) -> TacticsError:
            return TacticsError(f"{what} is refused: {why}; {fix}")

        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise bad(f"format is {doc.get('format') if isinstance(doc, dict) else type(doc).__name__!r}, "
                      f"this kiln reads {FORMAT!r}")
        if doc.get("sha256") != _digest(doc):
            raise bad("its sha256 does not match its content (corrupt or edited)")
        table = cls(host=doc.get("host") or {}, model=doc.get("model") or {}, seconds=float(doc.get("seconds", 0)))
        for entry in doc.get("linear") or []:
            key, layout, buckets = entry.get("key"), entry.get("layout"), entry.get("buckets")
            dtype, _, shape = str(key).partition(":")
            if dtype.partition("+")[0] not in DTYPES or dtype.partition("+")[2] not in ("", *QUANT_KEYS) \
                    or not _is_shape(shape):
                raise bad(f"linear key {key!r} is not <{'|'.join(DTYPES)}>[+{'|'.join(QUANT_KEYS)}]:<n>x<k>")
            if layout not in LAYOUTS or not isinstance(buckets, list) or not buckets:
                raise bad(f"linear {key}: layout {layout!r} or its buckets are not valid")
            for b in buckets:
                runs = b.get("runs") if isinstance(b, dict) else None
                if runs not in LINEAR:
                    raise bad(f"linear {key} runs {runs!r}, which is not a candidate of this kiln "
                              f"({', '.join(LINEAR)})")
                if LINEAR[runs].layout != layout:
                    raise bad(f"linear {key} runs {runs} on weights packed for {layout}")
            table.linear[key] = LinearChoice(key, layout, buckets, entry.get("scores") or {}, entry.get("timed_columns"))
        return table


def _is_shape(text: str) -> bool:
    n, _, k = text.partition("x")
    return n.isdigit() and k.isdigit() and int(n) > 0 and int(k) > 0


def _digest(doc: dict[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
