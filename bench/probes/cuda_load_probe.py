"""What a CUDA model load costs: wall time and the host memory the process holds for it.

    python bench/probes/cuda_load_probe.py OUT.json [--preset qwen3.6-35b-a3b] [--file PATH]
        [--reps 1]

Writes the preset's synthetic GGUF to PATH (default: the cache `sparkinfer bench` uses) unless the
file exists, then loads it --reps times, each in a fresh child process (this Python, this
environment, --tree (default: this checkout) first on PYTHONPATH): `load_model(path, "cuda")` and a
device synchronize, timed inside the child. Per load: the seconds, the child's peak RSS (VmHWM, its
whole life: imports included), its RSS right after the load (VmRSS, and the file-backed part of it,
RssFile: pages of a mapped GGUF count there) and the bytes of weights on the device.

Peak RSS is VmHWM, not getrusage's ru_maxrss (also given): Linux carries the high-water mark of the
memory a process had before exec into ru_maxrss, and subprocess execs from a vfork of this
process, so ru_maxrss would never read below this process's own peak (writing the GGUF, say).

Page cache: the file was just written (or read by the previous load), so it is most likely in the
page cache for every rep; the first rep is "cold" only in that its process is the first to start
CUDA and read numba's caches. To time a read from disk, drop the cache between runs yourself
(`echo 1 > /proc/sys/vm/drop_caches`, as root).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30

# Run by each child as `python -c CHILD PATH`: its last stdout line is the measurement's JSON.
CHILD = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from cuda_load_probe import measure_load
measure_load(sys.argv[1])
"""


def proc_status_kib(field: str) -> int:
    """A `Field:  N kB` line of /proc/self/status, in KiB (0 where the field is missing)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def measure_load(path: str) -> None:
    """(In the child) loads the model once and prints the figures as one JSON line."""
    import resource
    import time

    from numba import cuda

    from sparkinfer_cli.model.loader import load_model

    rss_before = proc_status_kib("VmRSS")
    t0 = time.perf_counter()
    model = load_model(path, "cuda")
    cuda.synchronize()
    load_s = time.perf_counter() - t0
    weight_bytes = getattr(model, "weight_bytes", None)
    print(json.dumps({
        "load_s": load_s,
        "peak_rss_gib": proc_status_kib("VmHWM") / (1 << 20),
        "ru_maxrss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20),
        "rss_after_gib": proc_status_kib("VmRSS") / (1 << 20),
        "rss_file_after_gib": proc_status_kib("RssFile") / (1 << 20),
        "rss_before_gib": rss_before / (1 << 20),
        "weight_gib": None if weight_bytes is None else weight_bytes / GIB,
    }), flush=True)


def run_child(path: Path, tree: Path) -> dict:
    """One load in a fresh process importing sparkinfer_cli from tree; its progress output goes
    to this one's stderr."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH")) if p)
    run = subprocess.run([sys.executable, "-c", CHILD, str(path)], env=env, cwd=tree,
                         stdout=subprocess.PIPE, text=True)
    if run.returncode != 0:
        raise SystemExit(f"the loading process failed (exit status {run.returncode})")
    return json.loads(run.stdout.strip().splitlines()[-1])


def ensure_file(path: Path, preset: str) -> Path:
    from sparkinfer_cli.gguf.synthetic import write_synthetic

    if not path.is_file():
        print(f"writing {path} ({preset})", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(path, preset)
    return path


def tree_name(tree: Path) -> str | None:
    """This checkout as git names it (None outside one); another tree by its path."""
    if tree.resolve() != ROOT:
        return str(tree)
    try:
        run = subprocess.run(["git", "describe", "--always", "--dirty", "--tags"], cwd=ROOT,
                             capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return run.stdout.strip() or None if run.returncode == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="where the JSON goes")
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--file", type=Path, default=None,
                    help="the GGUF to load (written from --preset if missing; default: the "
                         "synthetic cache of `sparkinfer bench`)")
    ap.add_argument("--reps", type=int, default=1, help="loads, each in a fresh process")
    ap.add_argument("--tree", type=Path, default=ROOT,
                    help="the folder whose sparkinfer_cli the loads import (default: this "
                         "checkout; e.g. an older commit's `git archive` for a baseline)")
    args = ap.parse_args()
    if args.file is None:
        from sparkinfer_cli.bench.runner import synthetic_path
        args.file = synthetic_path(args.preset)
    path = ensure_file(args.file, args.preset)
    runs = []
    for rep in range(args.reps):
        r = run_child(path, args.tree.resolve())
        runs.append(r)
        print(f"load {rep + 1}/{args.reps}: {r['load_s']:.2f} s, peak RSS "
              f"{r['peak_rss_gib']:.2f} GiB, after {r['rss_after_gib']:.2f} GiB "
              f"(file-backed {r['rss_file_after_gib']:.2f}), weights "
              f"{r['weight_gib'] or 0:.2f} GiB", flush=True)
    Path(args.out).write_text(json.dumps({"preset": args.preset, "file": str(path),
                                          "file_bytes": path.stat().st_size, "runs": runs,
                                          "tree": tree_name(args.tree)},
                                         indent=1))


if __name__ == "__main__":
    main()
