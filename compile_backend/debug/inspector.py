"""Read a debug dump back: a text summary, one piece's code, and a picture of
the step as a row of segments (one row per Dynamo graph).

    mrv2 inspect DIR [--piece N] [--svg [OUT.svg]]

How a piece runs depends on the graph mode and on who drove the step (a
ModelRunner, or plain `torch.compile` use): `piece_role` says. The picture
is hand-written SVG: each piece is a `<rect class="segment
captured|eager|full">` (full: inside a FULL graph that holds the whole
step), its width proportional to the piece's op count.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from compile_backend.core.graph_mode import CUDAGraphMode
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


def ran_with_runner(manifest: dict[str, Any]) -> bool | None:
    """True: a ModelRunner reported the runtime; False: plain torch.compile
    use (recorded at exit or by update_manifest_runtime); None: not recorded."""
    rt = manifest.get("runtime")
    if not rt:
        return None
    return bool(rt.get("runner", True))  # runtime sections before "runner" were a runner's


def _whole_graph(manifest: dict[str, Any], graph: dict[str, Any]) -> tuple[bool | None, str | None]:
    """Plain use in a FULL mode: (is the whole graph one FULL graph, why not),
    as recorded at runtime when it was (a call can give the FULL graph up).
    (None, None) in modes without FULL graphs."""
    if not CUDAGraphMode.parse(graph["graph_mode"]).has_full:
        return None, None
    rt = manifest.get("runtime") or {}
    for held in rt.get("graphs_held") or []:
        if held.get("graph") == graph["index"] and "full_blocker" in held:
            return held["full_blocker"] is None, held["full_blocker"]
    return graph.get("full_graph_without_runner"), graph.get("full_blocker")


def piece_role(piece: dict[str, Any], graph: dict[str, Any],
               manifest: dict[str, Any] | None = None) -> tuple[str, str]:
    """(role, label) of a piece: role `captured` (a PIECEWISE graph of its
    own), `eager` or `full` (inside a FULL graph of the whole step); the
    label says it in words."""
    mode = graph["graph_mode"]
    own = ("captured", "captured") if piece["captured"] else ("eager", "eager")
    if mode == "none":
        return "eager", "eager (mode none)"
    if mode == "piecewise":
        return own
    manifest = manifest or {}
    if ran_with_runner(manifest):
        if mode == "full":
            return "full", "in FULL graph"
        if mode == "full_decode_only":
            return "full", "in FULL graph at decode, else eager"
        return own if piece["captured"] else ("eager", "eager; in FULL graph at decode")
    whole, _ = _whole_graph(manifest, graph)
    if whole:
        return "full", "in FULL graph"
    if whole is False and mode == "full_decode_only":
        return "eager", "eager (no FULL graph)"
    return own  # the FULL graph given up: pieces run PIECEWISE (or an old manifest)


def _label(piece: dict[str, Any], graph: dict[str, Any], manifest: dict[str, Any]) -> str:
    return piece_role(piece, graph, manifest)[1]


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
    runner = ran_with_runner(manifest)
    if rt:
        who = ("ModelRunner" if runner else
               f"plain torch.compile, no runner (recorded {rt.get('recorded', '?')})")
        out.append(f"runtime: {who}: mode {rt['mode']} (requested {rt['requested_mode']})"
                   + (f": {rt['mode_reason']}" if rt.get("mode_reason") else ""))
    else:
        out.append("runtime: not recorded. The dump is written when a graph compiles, before "
                   "any call, so it holds no captures or replays; a plain torch.compile run "
                   "records them when its process exits (or call "
                   "compile_backend.update_manifest_runtime(DIR)), a runner's owner calls "
                   "update_manifest_runtime(DIR, runner)")
    for g in manifest["graphs"]:
        pieces = g["pieces"]
        roles = collections.Counter(piece_role(p, g, manifest)[0] for p in pieces)
        how = ", ".join(f"{roles[r]} {'in FULL graph' if r == 'full' else r}"
                        for r in ("captured", "eager", "full") if roles[r])
        out.append("")
        out.append(f"graph {g['index']} ({g['dir']}): {len(pieces)} pieces ({how}), "
                   f"mode {g['graph_mode']}, compiled in {g['compile_seconds']:.2f}s")
        whole, blocker = _whole_graph(manifest, g)
        if not runner and whole:
            out.append("  no runner: the whole graph is one FULL graph, captured lazily per "
                       "input shape (its pieces run inside it)")
        elif not runner and blocker:
            out.append(f"  {blocker}")
        for ps in g["passes"]:
            out.append(f"  pass {ps['name']}: {'changed' if ps['changed'] else 'unchanged'} "
                       f"(uuid {str(ps['uuid'])[:12]})")
        for p in pieces:
            out.append(f"  piece {p['index']:<3} {_label(p, g, manifest):<8} {len(p['ops']):>4} ops  "
                       f"{_op_counts(p['ops'])}")
            if p.get("collectives"):  # across ranks: inside the graph unless a fallback says why
                out.append(f"        collectives: {_op_counts(p['collectives'])}")
            for r in p["eager_reasons"]:
                out.append(f"        fallback: {r}")
    out.append("")
    captures = manifest.get("captures") or []
    if captures:
        graphs = (manifest.get("counters") or {}).get("cudagraph_captures")
        out.append(f"captures ({len(captures)}" + (f"; {graphs} graphs" if graphs is not None else "")
                   + "):")  # a PIECEWISE step captures a graph per captured piece
        by_mode: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for c in captures:
            by_mode[c["graph"]["mode"]].append(c)
        for mode, cs in by_mode.items():
            for c in cs:
                d = c["graph"]
                flags = ", ".join(f"{k}={'capture' if f else 'exact'}"
                                  for k, f in c["for_capture"].items())
                out.append(f"  {mode:<10} tokens={d['num_tokens']:<4} reqs={d.get('num_reqs')} "
                           f"uniform_decode={d.get('uniform_decode')}  {c['seconds'] * 1e3:.1f} ms  "
                           f"{c['pool_bytes']} B  metadata: {flags}")
    elif runner is False and rt["mode"] != "none":
        n = manifest.get("counters") or {}
        held = "; ".join(
            f"graph {h['graph']}: " + ", ".join(
                f"{h[k]} {what}" for k, what in (("full", "FULL"), ("pieces", "of pieces")) if h[k])
            for h in rt.get("graphs_held") or [] if h["full"] or h["pieces"])
        out.append(f"captures (no runner: lazily, at the second call of each input shape; "
                   f"counters of the process): {n.get('cudagraph_captures', 0)} captured, "
                   f"{n.get('cudagraph_replays', 0)} replays, {n.get('lazy_warmups', 0)} warm-up "
                   f"calls" + (f"; graphs held {rt.get('recorded', '')}: {held}" if held else ""))
    elif runner is not None:
        out.append(f"captures: none (mode {rt['mode']})")
    else:
        out.append("captures: not recorded (see runtime above)")
    if runner and captures:
        out.append(f"replays: {(manifest.get('counters') or {}).get('cudagraph_replays', 0)} "
                   "(counters at the last update_manifest_runtime)")
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
    header = f"# graph {graph} piece {index}: {_label(p, graphs[graph], manifest)}, {len(p['ops'])} ops\n"
    return header + (Path(path) / p["file"]).read_text()


# ---- picture ------------------------------------------------------------------------

COLOURS = {"captured": ("#4c9a5b", "#ffffff"), "eager": ("#e9a23b", "#1a1a1a"),
           "full": ("#3b6ea8", "#ffffff")}
LETTERS = {"captured": "C", "eager": "E", "full": "F"}
LEGEND = {"captured": "C = captured (graph of the piece)",
          "eager": "E = eager (breakpoint, fallback, mode none)",
          "full": "F = in a FULL graph of the whole step"}
ROW_H, PAD, WIDTH, MIN_W = 56, 16, 960, 36


def svg(manifest: dict[str, Any]) -> str:
    graphs = manifest["graphs"]
    height = PAD * 3 + 24 + len(graphs) * (ROW_H + PAD + 18) + 44
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
            role, label = piece_role(p, g, manifest)
            fill, ink = COLOURS[role]
            title = f"piece {p['index']}: {label}, {len(p['ops'])} ops"
            if p["eager_reasons"]:
                title += "; " + "; ".join(p["eager_reasons"])
            parts.append(
                f'<rect class="segment {role}" data-piece="{p["index"]}" x="{x:.1f}" y="{y}" '
                f'width="{width - 2:.1f}" height="{ROW_H}" fill="{fill}" stroke="#333">'
                f'<title>{escape(title)}</title></rect>')
            cx = x + (width - 2) / 2
            parts.append(f'<text x="{cx:.1f}" y="{y + 22}" text-anchor="middle" fill="{ink}">'
                         f'{p["index"]}:{LETTERS[role]}</text>')
            parts.append(f'<text x="{cx:.1f}" y="{y + 40}" text-anchor="middle" fill="{ink}">'
                         f'{len(p["ops"])}</text>')
            x += width
        y += ROW_H + PAD
    lx = PAD
    roles = {piece_role(p, g, manifest)[0] for g in graphs for p in g["pieces"]}
    for role, (fill, _) in COLOURS.items():
        if role not in roles and role == "full":
            continue
        parts.append(f'<rect class="legend {role}" x="{lx}" y="{y}" width="14" height="14" '
                     f'fill="{fill}" stroke="#333"/>')
        parts.append(f'<text x="{lx + 20}" y="{y + 11}">{escape(LEGEND[role])}</text>')
        lx += 44 + int(len(LEGEND[role]) * 6.7)  # 11px monospace: about 6.7px a character
    parts.append(f'<text x="{PAD}" y="{y + 30}">number = ops in the piece</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_svg(manifest: dict[str, Any], out: str | Path) -> Path:
    out = Path(out)
    out.write_text(svg(manifest))
    return out
