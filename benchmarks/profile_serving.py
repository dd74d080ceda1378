"""Where a cold ``fop.restore_params`` of workload (a)'s params spends its time.

Wall-clock phase timers (each wrapped function's inclusive time, and its start and end
from the call's start), and optionally a cProfile of the call. The checkpoint is the one
``bench_serving.py`` saved (``--root``); its files are evicted from the page cache first.

    python benchmarks/profile_serving.py [--cprofile] [--warm]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common as C  # noqa: E402
from bench_serving import evict  # noqa: E402

T0 = [0.0]
PHASES: list[tuple[str, float, float]] = []


def timed(owner, name: str, label: str | None = None) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            e = time.perf_counter()
            PHASES.append((label or name, t - T0[0], e - T0[0]))

    setattr(owner, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", default=os.path.join(C.TMP, "serving"))
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--warm", action="store_true")
    a = p.parse_args()
    import jax

    import flax_orbax_plugin as fop
    from flax_orbax_plugin._core import formats as F
    from flax_orbax_plugin._core import reads as targets
    from flax_orbax_plugin._core import restore as read_data
    from flax_orbax_plugin._core import restore as restore
    from flax_orbax_plugin._format import layout, steps
    from flax_orbax_plugin._like import onto_like
    from flax_orbax_plugin._zarr import packed_reader

    print("module", fop.__file__)
    specs = C.params_specs(C.tree_specs("a"))
    like = C.build_like(specs, "single")["params"]
    path = os.path.join(a.root, "fop")
    timed(steps, "committed_steps")
    timed(layout, "read_manifest")
    timed(restore, "read_document")
    timed(restore, "restore_with")
    timed(packed_reader, "read_index")
    timed(packed_reader, "open_packed")
    timed(F, "check_claims")
    timed(read_data, "_read_targets_with", "reads+placement (_read_targets_with)")
    timed(targets.Placer, "flush", "Placer.flush")
    timed(onto_like, "match", "onto_like.match (targets)")
    timed(packed_reader.PackedReader, "_fill_segment", "chunk reads (a reader thread)")
    if not a.warm:
        evict(path)
    jax.devices()
    t = time.perf_counter()
    restore_params = fop.restore_params  # the first use imports the public API
    print(f"first use of fop.restore_params (imports): {time.perf_counter() - t:.3f} s")
    prof = cProfile.Profile() if a.cprofile else None
    T0[0] = time.perf_counter()
    if prof:
        prof.enable()
    tree = restore_params(path, like=like)
    jax.block_until_ready(tree)
    if prof:
        prof.disable()
    total = time.perf_counter() - T0[0]
    print(f"restore_params: {total:.3f} s ({'warm' if a.warm else 'cold'})")
    agg: dict[str, list] = {}
    for label, s, e in PHASES:
        agg.setdefault(label, []).append((s, e))
    for label, spans in sorted(agg.items(), key=lambda kv: kv[1][0][0]):
        inc = sum(e - s for s, e in spans)
        print(
            f"  {label:<40} n={len(spans):>3} incl {inc:7.3f} s  "
            f"first start {spans[0][0]:.3f} last end {spans[-1][1]:.3f}"
        )
    reads = sorted((s, e) for label, s, e in PHASES if label.startswith("chunk reads"))
    if reads:
        busy, end = 0.0, 0.0
        for s, e in reads:
            busy += max(0.0, e - max(s, end))
            end = max(end, e)
        print(
            f"  chunk reads: first starts {reads[0][0]:.3f} s, last ends {end:.3f} s, "
            f"some read in flight {busy:.3f} s; after the last read: {total - end:.3f} s"
        )
    if prof:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(45)
        print(out.getvalue())
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())


if __name__ == "__main__":
    main()
