"""What a process's first CUDA-graph capture allocates outside the graph's
own tensors, and where (issue #23, "explain the 34 MiB").

    python bench/first_capture.py [--out bench/results]

Two fresh processes capture the same small GEMM step (bf16 linear with bias
and a plain matmul, [64, 4096] x [4096, 4096]) through the runtime's capture
path (`TorchCUDAGraphs.capture`, one graph in a new pool):
  cold  the capture path as it was: the capture stream's first GEMM happens
        inside the capture (`warm_capture_stream` bypassed);
  warm  the capture path as it is: `warm_capture_stream` gives the capture
        stream its cuBLAS workspaces before the first capture.
Each records the allocator's history with C++ stacks and reports the blocks
allocated during the capture that are not the step's output, with the pool
they landed in (the graph's private pool or the default one), the stream,
the size and the frames that name cuBLAS. Results: <out>/first_capture.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 1 << 20
JSON_PREFIX = "FIRST_CAPTURE_JSON "


def child(variant: str) -> dict:
    from compile_backend.runtime import graph_pool

    if variant == "cold":  # the first capture meets an unwarmed stream
        graph_pool._warmed_streams.add(torch.cuda.current_device())
    g = torch.Generator(device="cuda").manual_seed(23)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g) / 64
    b = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=g)

    def step():
        return torch.nn.functional.linear(x, w, b) + x @ w

    step()  # eager on the default stream: its workspace exists before we look
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="all")
    before = torch.cuda.memory_allocated()
    old = {blk["address"] for seg in torch.cuda.memory._snapshot()["segments"] for blk in seg["blocks"]
           if blk["state"] == "active_allocated"}
    graphs = graph_pool.TorchCUDAGraphs()
    graph = graphs.new_graph()
    with graphs.capture(graph, graphs.pool()):
        out = step()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    graph.replay()
    torch.cuda.synchronize()
    expect = torch.nn.functional.linear(x, w, b) + x @ w
    out_ptr = out.untyped_storage().data_ptr()
    blocks = []
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            if (blk["state"] != "active_allocated" or blk["size"] < MiB or blk["address"] == out_ptr
                    or blk["address"] in old):
                continue
            names = [f["name"] for f in blk.get("frames", [])]
            blas = [n for n in names if "blas" in n.lower() or "workspace" in n.lower()][:4]
            blocks.append({"size": blk["size"], "requested": blk.get("requested_size", blk["size"]),
                           "pool": list(seg.get("segment_pool_id", (0, 0))),
                           "stream": seg["stream"], "frames": blas})
    return {"variant": variant, "allocated_growth": after - before,
            "output_bytes": out.untyped_storage().nbytes(), "blocks": blocks,
            "replay_max_err": (out.float() - expect.float()).abs().max().item(),
            "default_stream": torch.cuda.default_stream().cuda_stream,
            "capture_stream": graph_pool.capture_stream().cuda_stream}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--child", choices=["cold", "warm"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(JSON_PREFIX + json.dumps(child(args.child)), flush=True)
        return 0
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    rows = []
    for variant in ("cold", "warm"):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", variant],
                             capture_output=True, text=True, timeout=300)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith(JSON_PREFIX)), None)
        if line is None:
            raise SystemExit(f"{variant}: no answer (rc {out.returncode}): {out.stderr[-2000:]}")
        rows.append(json.loads(line[len(JSON_PREFIX):]))
    L = [f"# First capture in a process ({torch.cuda.get_device_name()}, torch {torch.__version__})", "",
         "Command: `python bench/first_capture.py`. One graph of a bf16 GEMM step "
         "([64, 4096] x [4096, 4096], linear with bias + matmul), captured in a fresh process; "
         "blocks of 1 MiB or more allocated during the capture, other than the step's output. "
         "pool (0, 0) is the default pool; any other is a graph's private pool.", "",
         "| variant | allocated growth MiB | output MiB | extra block MiB | pool | stream | frames naming cuBLAS | replay max err |",
         "|---|---:|---:|---:|---|---|---|---:|"]
    for r in rows:
        extra = r["blocks"] or [{"size": 0, "pool": "-", "stream": "-", "frames": []}]
        for blk in extra:
            stream = ("capture" if blk["stream"] == r["capture_stream"] else
                      "default" if blk["stream"] == r["default_stream"] else str(blk["stream"]))
            L.append(f"| {r['variant']} | {r['allocated_growth'] / MiB:.1f} | {r['output_bytes'] / MiB:.2f} | "
                     f"{blk['size'] / MiB:.1f} | {tuple(blk['pool']) if blk['pool'] != '-' else '-'} | "
                     f"{stream if blk['size'] else '-'} | {'; '.join(blk['frames'][:3]) or '-'} | "
                     f"{r['replay_max_err']:.3g} |")
    text = "\n".join(L) + "\n"
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "first_capture.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "first_capture.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
