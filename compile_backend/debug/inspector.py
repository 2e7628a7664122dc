"""Read a debug dump back: a text summary, one piece's code, and a picture of
the step as a row of segments (one row per Dynamo graph).

    mrv2 inspect DIR [--piece N] [--svg OUT.svg]

The picture is hand-written SVG: each piece is a `<rect class="segment
captured|eager">`, its width proportional to the piece's op count.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from compile_backend.debug.dump import MANIFEST


class DumpError(ValueError):
    """A folder that is not a readable dump; the message says which and why."""


def load_dump(path: str | Path) -> dict[str, Any]:
    root = Path(path)
    file = root / MANIFEST
    if not file.is_file():
        subs = sorted(p.parent.name for p in root.glob(f"*/{MANIFEST}"))
        hint = f"; it holds one dump per mode: inspect {root}/<mode> ({', '.join(subs)})" if subs else ""
        raise DumpError(f"{str(root)!r} is not a debug dump: no {MANIFEST}{hint}")
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise DumpError(f"{str(file)!r} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or "graphs" not in manifest:
        raise DumpError(f"{str(file)!r} has no 'graphs': not an mrv2 manifest")
    return manifest


def _role(piece: dict[str, Any], graph_mode: str) -> str:
    """captured | eager: in mode none nothing is captured, whatever the piece."""
    return "captured" if piece["captured"] and graph_mode != "none" else "eager"


def _label(piece: dict[str, Any], graph_mode: str) -> str:
    role = _role(piece, graph_mode)
    return f"{role} (mode none)" if graph_mode == "none" else role


# FX targets of torch functions that are aten ops under another Python name.
_ATEN_PREFIXES = ("torch._VariableFunctionsClass.", "torch._C._VariableFunctions.", "torch._C._nn.",
                  "torch._C._linalg.", "torch._C._special.", "torch._C._fft.")


def display_name(op: str) -> str:
    """An op as users write it: `aten.rsqrt` (not torch._VariableFunctionsClass.rsqrt),
    `mul` (not _operator.mul), `mrv2.unified_attention` (not mrv2::unified_attention)."""
    for prefix in _ATEN_PREFIXES:
        if op.startswith(prefix):
            return "aten." + op[len(prefix):]
    for prefix in ("_operator.", "operator.", "python::"):
        if op.startswith(prefix):
            return op[len(prefix):]
    return op.replace("::", ".")


def _op_counts(ops: list[str]) -> str:
    counts = collections.Counter(display_name(op) for op in ops)
    return ", ".join(f"{name} x{n}" if n > 1 else name for name, n in counts.items())


def summary(manifest: dict[str, Any]) -> str:
    out: list[str] = []
    cfg = manifest.get("config") or {}
    rt = manifest.get("runtime") or {}
    v = manifest.get("versions", {})
    out.append(f"mrv2 dump: torch {v.get('torch')}, triton {v.get('triton')}, python {v.get('python')}")
    out.append(f"config: mode {cfg.get('cudagraph_mode')}, piece compiler {cfg.get('piece_compiler')}, "
               f"capture sizes {cfg.get('capture_sizes')}")
    if rt:
        out.append(f"runtime mode: {rt['mode']} (requested {rt['requested_mode']})"
                   + (f": {rt['mode_reason']}" if rt.get("mode_reason") else ""))
    for g in manifest["graphs"]:
        pieces = g["pieces"]
        n_eager = sum(not p["captured"] for p in pieces)
        out.append("")
        out.append(f"graph {g['index']} ({g['dir']}): {len(pieces)} pieces, {n_eager} eager, "
                   f"mode {g['graph_mode']}, compiled in {g['compile_seconds']:.2f}s")
        for ps in g["passes"]:
            out.append(f"  pass {ps['name']}: {'changed' if ps['changed'] else 'unchanged'} "
                       f"(uuid {str(ps['uuid'])[:12]})")
        for p in pieces:
            out.append(f"  piece {p['index']:<3} {_label(p, g['graph_mode']):<8} {len(p['ops']):>4} ops  "
                       f"{_op_counts(p['ops'])}")
            if p.get("collectives"):  # across ranks: inside the graph unless a fallback says why
                out.append(f"        collectives: {_op_counts(p['collectives'])}")
            for r in p["eager_reasons"]:
                out.append(f"        fallback: {r}")
    out.append("")
    captures = manifest.get("captures") or []
    if captures:
        out.append(f"captures ({len(captures)}):")
        by_mode: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for c in captures:
            by_mode[c["mode"]].append(c)
        for mode, cs in by_mode.items():
            for c in cs:
                d = c["descriptor"]
                flags = ", ".join(f"{k}={'capture' if f else 'exact'}"
                                  for k, f in c["for_capture"].items())
                out.append(f"  {mode:<10} tokens={d['num_tokens']:<4} reqs={d.get('num_reqs')} "
                           f"uniform_decode={d.get('uniform_decode')}  {c['seconds'] * 1e3:.1f} ms  "
                           f"{c['pool_bytes']} B  metadata: {flags}")
    else:
        out.append("captures: none" + (f" (mode {rt['mode']})" if rt else " (no runtime recorded)"))
    fallbacks = manifest.get("fallbacks") or []
    out.append(f"fallbacks ({len(fallbacks)}):" if fallbacks else "fallbacks: none")
    for f in fallbacks:
        where = f" graph {f['graph']} piece {f['piece']}" if "piece" in f else ""
        count = f" x{f['count']}" if "count" in f else ""
        out.append(f"  {f['kind']}{where}{count}: {f['reason']}")
    depyf = manifest.get("depyf") or {}
    out.append(f"depyf: {depyf.get('dir')}/" if depyf.get("written") else f"depyf: not written ({depyf.get('note')})")
    return "\n".join(out)


def piece_code(path: str | Path, manifest: dict[str, Any], index: int, graph: int = 0) -> str:
    graphs = manifest["graphs"]
    if not 0 <= graph < len(graphs):
        raise DumpError(f"no graph {graph}: the dump has graphs 0..{len(graphs) - 1}")
    pieces = graphs[graph]["pieces"]
    match = [p for p in pieces if p["index"] == index]
    if not match:
        raise DumpError(f"no piece {index} in graph {graph}: it has pieces 0..{len(pieces) - 1}")
    p = match[0]
    header = f"# graph {graph} piece {index}: {_label(p, graphs[graph]['graph_mode'])}, {len(p['ops'])} ops\n"
    return header + (Path(path) / p["file"]).read_text()


# ---- picture ------------------------------------------------------------------------

COLOURS = {"captured": ("#4c9a5b", "#ffffff"), "eager": ("#e9a23b", "#1a1a1a")}
ROW_H, PAD, WIDTH, MIN_W = 56, 16, 960, 36


def svg(manifest: dict[str, Any]) -> str:
    graphs = manifest["graphs"]
    height = PAD * 3 + 24 + len(graphs) * (ROW_H + PAD + 18) + 24
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-family="monospace" font-size="11">',
        f'<text x="{PAD}" y="{PAD + 12}" font-size="14">mrv2 step: pieces in order, '
        'width proportional to op count</text>',
    ]
    y = PAD * 2 + 12
    for g in graphs:
        pieces = g["pieces"]
        parts.append(f'<text x="{PAD}" y="{y + 12}">graph {g["index"]} '
                     f'(mode {escape(g["graph_mode"])})</text>')
        y += 18
        weights = [max(len(p["ops"]), 1) for p in pieces]
        room = WIDTH - 2 * PAD - MIN_W * len(pieces)
        x = float(PAD)
        for p, w in zip(pieces, weights):
            width = MIN_W + max(room, 0) * w / sum(weights)
            role = _role(p, g["graph_mode"])
            fill, ink = COLOURS[role]
            title = f"piece {p['index']}: {_label(p, g['graph_mode'])}, {len(p['ops'])} ops"
            if p["eager_reasons"]:
                title += "; " + "; ".join(p["eager_reasons"])
            parts.append(
                f'<rect class="segment {role}" data-piece="{p["index"]}" x="{x:.1f}" y="{y}" '
                f'width="{width - 2:.1f}" height="{ROW_H}" fill="{fill}" stroke="#333">'
                f'<title>{escape(title)}</title></rect>')
            cx = x + (width - 2) / 2
            parts.append(f'<text x="{cx:.1f}" y="{y + 22}" text-anchor="middle" fill="{ink}">'
                         f'{p["index"]}:{"C" if p["captured"] else "E"}</text>')
            parts.append(f'<text x="{cx:.1f}" y="{y + 40}" text-anchor="middle" fill="{ink}">'
                         f'{len(p["ops"])}</text>')
            x += width
        y += ROW_H + PAD
    lx = PAD
    for role, (fill, _) in COLOURS.items():
        label = "C = captured (CUDA graph)" if role == "captured" else "E = eager (breakpoint or fallback)"
        parts.append(f'<rect class="legend {role}" x="{lx}" y="{y}" width="14" height="14" '
                     f'fill="{fill}" stroke="#333"/>')
        parts.append(f'<text x="{lx + 20}" y="{y + 11}">{escape(label)}</text>')
        lx += 300
    parts.append(f'<text x="{lx}" y="{y + 11}">number = ops in the piece</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_svg(manifest: dict[str, Any], out: str | Path) -> Path:
    out = Path(out)
    out.write_text(svg(manifest))
    return out
