"""Attributes the kernels of a Chrome trace (``bench_layer.py --profile --trace DIR``) to the host
op that launched them: the autograd node for backward kernels, the outermost > innermost aten op
for forward ones; GEMMs and Triton kernels are grouped apart from the small kernels, so the
fixed cost around the indexer, the selection and the loss shows by the code that causes it.

The GPU's idle time is attributed the same way: each gap between GPU events is charged to the
group of the kernel that ends it, whose launch the GPU was waiting for. Where the host issues a
step more slowly than the GPU runs it, these waits show which host work the GPU waits on.

With ``--against DENSE_TRACE`` each trace is also compared with that one (the dense layer's step
on the same row): GPU busy and idle time, every group's time and every group's waits as this
trace minus that one, so what the MSA step adds over the dense step shows by site.

Usage::

    python benchmarks/layer_bench/trace_attribution.py TRACE.json[.gz] [...] [--top N]
        [--top-waits N] [--against DENSE_TRACE.json]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")


def load(path: str) -> dict:
    """The trace's events (gzip or plain JSON)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def host_stack(launch: dict, ops_by_thread: dict) -> list[str]:
    """Names of the host ops enclosing a kernel launch, outermost first."""
    t = launch["ts"]
    around = [op for op in ops_by_thread[launch["tid"]] if op["ts"] <= t <= op["ts"] + op["dur"]]
    around.sort(key=lambda op: (op["ts"], -op["dur"]))
    return [op["name"] for op in around]


def kernel_kind(name: str) -> str:
    """GEMM (cuBLAS), TRITON:<kernel> (ours: Triton names start with '_') or small."""
    if "nvjet" in name or "gemm" in name or "gemv" in name:
        return "GEMM"
    return f"TRITON:{name}" if name.startswith("_") else "small"


def gpu_span(trace: dict) -> float:
    """Time (us) from the first GPU event's start to the last one's end (busy plus idle)."""
    kernels = [e for e in trace["traceEvents"] if e.get("cat") in GPU_CATEGORIES]
    if not kernels:
        return 0.0
    return max(k["ts"] + k["dur"] for k in kernels) - min(k["ts"] for k in kernels)


def _groups(trace: dict):
    """The trace's GPU events in start order, each with its (kind, launching op) group."""
    events = trace["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    ops_by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op":
            ops_by_thread[e["tid"]].append(e)
    for k in kernels:
        launch = launches.get(k.get("args", {}).get("correlation"))
        stack = host_stack(launch, ops_by_thread) if launch else []
        backward = [s.split(": ")[-1] for s in stack if s.startswith("autograd::engine")]
        owner = backward[0] if backward else (stack[0] if stack else "?")
        kind = kernel_kind(k["name"])
        if kind == "small":
            owner = f"{owner} > {stack[-1] if stack else '?'}"
        yield k, (kind, owner)


def _tally(trace: dict) -> tuple[float, collections.Counter, collections.Counter,
                                  collections.Counter]:
    """One pass over the trace: GPU busy time (us), and per group its time (us), count and
    waits (us; see :func:`waits`)."""
    time, count, wait = collections.Counter(), collections.Counter(), collections.Counter()
    busy, end = 0.0, None
    for k, group in _groups(trace):
        time[group] += k["dur"]
        count[group] += 1
        busy += k["dur"]
        if end is not None and k["ts"] > end:
            wait[group] += k["ts"] - end
        end = k["ts"] + k["dur"] if end is None else max(end, k["ts"] + k["dur"])
    return busy, time, count, wait


def attribute(trace: dict) -> tuple[float, collections.Counter, collections.Counter]:
    """GPU busy time (us), and time (us) and count per (kind, launching op) group."""
    return _tally(trace)[:3]


def waits(trace: dict) -> collections.Counter:
    """GPU idle time (us) per (kind, launching op) group: each gap between GPU events (after
    the latest end so far, so overlapping events leave none) goes to the event that ends it.
    Where no two events overlap, the values sum to the trace's idle time (:func:`summarize`)."""
    return _tally(trace)[3]


def by_kind(time: collections.Counter) -> collections.Counter:
    """Time (us) per kind (GEMM, TRITON, small) from the per-group times."""
    kinds = collections.Counter()
    for (kind, _), us in time.items():
        kinds[kind.split(":")[0]] += us
    return kinds


def summarize(trace: dict) -> dict:
    """A trace's GPU span, busy and idle time (us), and its per-group times, counts and waits.

    Returns:
        ``{"span", "busy", "idle": float, "time", "count", "wait": Counter}`` (groups as
        :func:`attribute`'s; ``wait`` as :func:`waits`).
    """
    busy, time, count, wait = _tally(trace)
    span = gpu_span(trace)
    return {"span": span, "busy": busy, "idle": span - busy, "time": time, "count": count,
            "wait": wait}


def difference(a: dict, b: dict) -> dict:
    """Summary ``a`` minus summary ``b`` (:func:`summarize`; us): GPU span, busy and idle time,
    and per kind and group, of the kernels' time and of the GPU's waits.

    Returns:
        ``{"span", "busy", "idle": float, "kinds", "groups", "waits": Counter}``; a group
        present on one side only counts as zero on the other. Counters keep negative values
        (what ``b`` spends more).
    """
    def minus(field: str) -> collections.Counter:
        return collections.Counter({key: a[field][key] - b[field][key]
                                    for key in set(a[field]) | set(b[field])})

    groups, wait = minus("time"), minus("wait")
    return {"span": a["span"] - b["span"], "busy": a["busy"] - b["busy"],
            "idle": a["idle"] - b["idle"], "kinds": by_kind(groups), "groups": groups,
            "waits": wait}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--top-waits", type=int, default=15,
                    help="groups listed by the GPU idle time before their kernels")
    ap.add_argument("--against", default=None, metavar="TRACE",
                    help="also print each trace minus this one (the dense step of the same row)")
    args = ap.parse_args()
    base = summarize(load(args.against)) if args.against else None
    for path in args.traces:
        this = summarize(load(path))
        time, count = this["time"], this["count"]
        print(f"== {path}: GPU busy {this['busy'] / 1e3:.1f} ms over {sum(count.values())} "
              f"kernels, idle {this['idle'] / 1e3:.1f} ms")
        print("  by kind (ms):", {k: round(v / 1e3, 1) for k, v in by_kind(time).items()})
        for key, us in time.most_common(args.top):
            print(f"  {us / 1e3:8.3f} ms {count[key]:4d}  {key[0][:22]:22s} {key[1][:110]}")
        print("  GPU idle before the kernels of (ms):")
        for key, us in this["wait"].most_common(args.top_waits):
            print(f"  {us / 1e3:8.3f} ms  {key[0][:22]:22s} {key[1][:110]}")
        if base is not None:
            diff = difference(this, base)
            print(f"  -- minus {args.against}: span {diff['span'] / 1e3:+.1f} ms, busy "
                  f"{diff['busy'] / 1e3:+.1f} ms, idle {diff['idle'] / 1e3:+.1f} ms")
            print("  by kind (ms):", {k: round(v / 1e3, 1) for k, v in diff["kinds"].items()})
            ranked = sorted(diff["groups"].items(), key=lambda kv: -abs(kv[1]))
            for key, us in ranked[: args.top]:
                print(f"  {us / 1e3:+8.3f} ms  {key[0][:22]:22s} {key[1][:110]}")
            print("  GPU idle before the kernels of, minus the base's (ms):")
            ranked = sorted(diff["waits"].items(), key=lambda kv: -abs(kv[1]))
            for key, us in ranked[: args.top_waits]:
                print(f"  {us / 1e3:+8.3f} ms  {key[0][:22]:22s} {key[1][:110]}")


if __name__ == "__main__":
    main()
