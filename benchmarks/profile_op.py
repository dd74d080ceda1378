"""Profiles one worker operation with py-spy (sampling all threads, native frames).

    benchmarks/.venv/bin/pip install py-spy     # not in requirements: a dev tool
    python benchmarks/profile_op.py save --lib fop --workload b
    python benchmarks/profile_op.py restore --lib fop --workload b   # after a save

Writes collapsed stacks to benchmarks/results/tmp/profile-<op>-<lib>-<w>.txt and
prints the frames with the most samples: on-CPU self time, and inclusive time of
flax_orbax_plugin / tensorstore / jax frames. The worker's setup (tree generation,
imports) is in the profile too; look at the frames under the operation.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common as C  # noqa: E402


def summarize(path, top=25, focus=("flax_orbax_plugin", "tensorstore", "jax", "numpy"), under=None):
    """Top frames; with ``under``, only samples whose stack holds a frame matching it."""
    self_c, incl = collections.Counter(), collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            n = int(n)
            frames = stack.split(";")
            if under and not any(under in fr for fr in frames):
                continue
            total += n
            self_c[frames[-1]] += n
            for fr in set(frames):
                if any(k in fr for k in focus):
                    incl[fr] += n
    print(f"\n{total} samples{f' under {under!r}' if under else ''}; top self (leaf) frames:")
    for fr, n in self_c.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {fr[:160]}")
    print("top inclusive frames in plugin/tensorstore/jax/numpy:")
    for fr, n in incl.most_common(top):
        print(f"  {100 * n / total:5.1f}%  {fr[:160]}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("op", choices=["save", "restore", "params"])
    p.add_argument("--lib", default="fop")
    p.add_argument("--workload", default="b")
    p.add_argument("--rate", type=int, default=250)
    p.add_argument("--idle", action="store_true", help="count idle/waiting samples too")
    p.add_argument(
        "--under",
        action="append",
        default=[],
        help="also summarize only samples under frames matching this (repeatable)",
    )
    p.add_argument("--summarize-only", action="store_true", help="reuse the last profile")
    a = p.parse_args()
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    path = os.path.join(C.TMP, "profile", a.workload, a.lib)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    out = os.path.join(C.TMP, f"profile-{a.op}-{a.lib}-{a.workload}.txt")
    wargs = [
        "save" if a.op == "save" else "restore",
        "--lib",
        a.lib,
        "--workload",
        a.workload,
        "--path",
        path,
    ]
    if a.op == "params":
        wargs.append("--params")
    if a.workload == "c":
        wargs += ["--target", "4x2"]
    cmd = (
        [
            spy,
            "record",
            "--threads",
            "--native",
            "--rate",
            str(a.rate),
            "--format",
            "raw",
            "-o",
            out,
        ]
        + (["--idle"] if a.idle else [])
        + ["--", sys.executable, os.path.join(HERE, "worker.py")]
        + wargs
    )
    env = dict(os.environ, **C.env_for_layout(a.workload))
    if not a.summarize_only:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        for line in r.stdout.splitlines():
            if line.startswith("RESULT"):
                print(line)
        if r.returncode:
            print(r.stderr[-3000:])
    summarize(out)
    for u in a.under:
        summarize(out, under=u)


if __name__ == "__main__":
    main()
