"""Compile every CUDA kernel that a set of simulator tests launches, for sm_90, without a GPU.

    python bench/probes/cuda_compile_check.py [--out DIR] [pytest args, default: tests/kernels]

Phase 1 runs the tests under NUMBA_ENABLE_CUDASIM=1 and records each kernel launch: the kernel
factory and parameters that built it (or its module-level name) and its argument types. Phase 2,
in a fresh process with the real numba.cuda, rebuilds each distinct kernel and compiles it to PTX
through NVVM (cuda.compile_ptx; no driver needed: the device-function compiles are told cc 9.0),
then, where `ptxas` is on PATH, to sm_90 machine code. It prints per kernel the NVVM compile time,
registers, stack frame and spills, and fails on any compile error: a check, before a device run,
that a change to the kernels (or to how numba compiles them) still builds and what it costs.
It also fails a chained kernel (jit.kernel) whose PTX touches global memory before its
griddepcontrol.wait: such an access would race with the kernel launched before it.

NVVM and NVRTC without a CUDA toolkit: `pip install --target DIR nvidia-cuda-nvrtc nvidia-nvvm`,
then
NUMBA_CUDA_NVRTC=DIR/nvidia/cu13/lib/libnvrtc.so.13 NUMBA_CUDA_NVVM=DIR/nvidia/cu13/lib/libnvvm.so.4
(and that folder on LD_LIBRARY_PATH). A `ptxas` for sm_90 and `cuobjdump` come with the `triton`
wheel under triton/backends/nvidia/bin (`pip download --no-deps triton`, unzip it; its ptxas takes
the PTX once its `.version` line is lowered, which _ptxas does).

With `cuobjdump` on PATH (or in $CUOBJDUMP), each kernel's line also
reads its SASS: the instructions of its largest loop body (a back-branch's span; loops holding
an mma first: the k step of a GEMM, a tile round of attention), the float64 instructions in the
kernel (an int literal times a float32 is a float64 in numba) and its SEL instructions
(selects: min/max and conditional expressions, and numba's wrap of a signed index around
negative values, a compare and a select an access, which unsigned indices do without).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGE = "sparkinfer_cli.kernels.cuda"


def kernel_modules() -> list[str]:
    """The op modules of the CUDA kernel package (the runtime package builds no kernels)."""
    package = importlib.import_module(PACKAGE)
    return [m.name for m in pkgutil.iter_modules(package.__path__) if not m.ispkg]


# ---- phase 1: record launches in the simulator ---------------------------------------------------
def _arg_spec(arg) -> list:
    """A JSON description of a launch argument's numba type."""
    import numpy as np

    ary = getattr(arg, "_ary", arg)  # the simulator's device arrays wrap a numpy array
    if isinstance(ary, np.ndarray):
        layout = "C" if ary.flags["C_CONTIGUOUS"] else "A"
        return ["array", ary.dtype.str, ary.ndim, layout]
    if isinstance(arg, tuple):
        return ["tuple", [_arg_spec(a) for a in arg]]
    if isinstance(arg, (bool, np.bool_)):
        return ["bool"]
    if isinstance(arg, np.generic):
        return ["scalar", arg.dtype.str]
    return ["int" if isinstance(arg, int) else "float"]


def record(out: Path, pytest_args: list[str]) -> int:
    """Run pytest in this (simulator) process, writing the distinct launches to `out`."""
    import pytest
    from numba.cuda.simulator import kernel as sim_kernel

    made: dict[int, list] = {}  # id(kernel fn) → [module, factory, params]
    for name in kernel_modules():
        module = importlib.import_module(f"{PACKAGE}.{name}")
        for attr, factory in vars(module).items():
            if callable(factory) and hasattr(factory, "cache_info"):
                setattr(module, attr, _recording(factory, name, attr, made))
    launches: dict[str, dict] = {}
    original_call = sim_kernel.FakeCUDAKernel.__call__

    def call(self, *args):
        fn = self.fn
        ours = id(fn) in made or (fn.__module__.startswith(PACKAGE) and "<locals>" not in
                                  fn.__qualname__)  # not the tests' own kernels
        if ours and not self._device and not sim_kernel._kernel_context:
            origin = made.get(id(fn), [fn.__module__.rsplit(".", 1)[-1], fn.__name__, None])
            entry = {"origin": origin, "args": [_arg_spec(a) for a in args],
                     "fastmath": self._fastmath}
            launches.setdefault(json.dumps(entry, sort_keys=True), entry)
        return original_call(self, *args)

    sim_kernel.FakeCUDAKernel.__call__ = call
    sys.path.insert(0, os.getcwd())  # as `python -m pytest` from the repo root: `tests.` imports
    code = pytest.main(["-q", "-p", "no:cacheprovider", "-m", "not gpu", *pytest_args])
    out.write_text(json.dumps(list(launches.values()), indent=1))
    return int(code)


def _recording(factory, module: str, name: str, made: dict):
    @functools.wraps(factory)
    def wrapper(*params):
        kernel = factory(*params)
        fn = getattr(kernel, "fn", None)
        if fn is not None:
            made[id(fn)] = [module, name, [_param(p) for p in params]]
        return kernel
    return wrapper


def _param(p):
    return int(p) if hasattr(p, "__index__") and not isinstance(p, bool) else p


# ---- phase 2: compile with the real numba.cuda ---------------------------------------------------
def _numba_type(spec):
    import numpy as np
    from numba import types
    from numba.np.numpy_support import from_dtype

    kind = spec[0]
    if kind == "array":
        return types.Array(from_dtype(np.dtype(spec[1])), spec[2], spec[3])
    if kind == "tuple":
        return types.Tuple([_numba_type(s) for s in spec[1]])
    if kind == "scalar":
        return from_dtype(np.dtype(spec[1]))
    return {"bool": types.boolean, "int": types.int64, "float": types.float64}[kind]


def compile_all(launches: list[dict], out_dir: Path) -> int:
    from types import SimpleNamespace

    import numba.cuda.dispatcher as dispatcher
    from numba import cuda

    # device functions compile for the current device's cc: tell them 9.0 (no driver here)
    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=(9, 0))
    has_ptxas = subprocess.run(["which", "ptxas"], capture_output=True).returncode == 0
    cuobjdump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    failures = 0
    for i, entry in enumerate(launches):
        module_name, name, params = entry["origin"]
        label = f"{module_name}.{name}{tuple(params) if params is not None else ''}"
        start = time.perf_counter()
        try:
            kernel = getattr(importlib.import_module(f"{PACKAGE}.{module_name}"), name)
            if params is not None:
                kernel = kernel(*params)
            sig = tuple(_numba_type(s) for s in entry["args"])
            ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=(9, 0),
                                      fastmath=entry["fastmath"],
                                      launch_bounds=kernel.targetoptions.get("launch_bounds"))
        except Exception as exc:  # noqa: BLE001 - report every kernel, fail at the end
            failures += 1
            print(f"FAILED {label}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        seconds = time.perf_counter() - start
        if _touches_memory_before_the_wait(kernel.py_func, ptx):
            failures += 1
            print(f"FAILED {label}: a global access before griddepcontrol.wait", flush=True)
        path = out_dir / f"k{i}.ptx"
        report = _ptxas(ptx, path, has_ptxas)
        if cuobjdump and has_ptxas and Path(f"{path}.cubin").exists():
            report += _sass_summary(cuobjdump, Path(f"{path}.cubin"))
        print(f"{label:60s} {seconds:6.1f} s  {report}", flush=True)
    return failures


def _touches_memory_before_the_wait(py_func, ptx: str) -> bool:
    from sparkinfer_cli.kernels.cuda.runtime import jit

    if not getattr(py_func, jit._CHAINED, False):
        return False
    body = ptx[ptx.find(".entry"):]
    wait = body.find("griddepcontrol.wait")
    first = re.search(r"\b(ld|st|atom|red)\.global|\bcp\.async", body)
    return wait < 0 or (first is not None and first.start() < wait)


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
_F64 = re.compile(r"\b(DFMA|DADD|DMUL|DSETP|DMNMX|F2F\.F64\.F32|F2F\.F32\.F64)\b")


def _sass_summary(cuobjdump: str, cubin: Path) -> str:
    """', loop N instr (M mma), f64 F, SEL S' from the cubin's SASS (see the module docstring)."""
    sass = subprocess.run([cuobjdump, "--dump-sass", str(cubin)], capture_output=True,
                          text=True).stdout
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in _SASS_LINE.finditer(sass)]
    loop: list[str] = []
    for at, text in code:
        back = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if back and int(back.group(1), 16) < at:
            body = [t for a, t in code if int(back.group(1), 16) <= a <= at]
            loop = max(loop, body, key=lambda x: (any("MMA" in t for t in x), len(x)))
    mma = sum("MMA" in t for t in loop)
    f64 = sum(bool(_F64.search(t)) for _, t in code)
    sel = sum(re.search(r"(^|\s)U?SEL\b", t) is not None for _, t in code)
    return f", loop {len(loop)} instr ({mma} mma), f64 {f64}, SEL {sel}"


def _ptxas(ptx: str, path: Path, has_ptxas: bool) -> str:
    if not has_ptxas:
        return ""
    path.write_text(re.sub(r"\.version \d+\.\d+", ".version 8.0", ptx))
    out = subprocess.run(["ptxas", "-arch=sm_90", "-v", str(path), "-o", f"{path}.cubin"],
                         capture_output=True, text=True).stderr
    regs = re.findall(r"Used (\d+) registers", out)
    frame = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", out)
    if not regs:
        return "ptxas: " + out.strip()[-200:]
    return f"{regs[0]} registers, stack {frame[0][0]} B, spills {frame[0][1]} B" if frame \
        else f"{regs[0]} registers"


def _record_in_simulator(out_dir: Path, pytest_args: list[str]) -> None:
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    code = subprocess.run([sys.executable, __file__, "--record-only", "--out", str(out_dir),
                           *pytest_args], env=env).returncode
    if code not in (0, 1) or not (out_dir / "launches.json").exists():
        raise SystemExit(f"the simulator tests did not run (pytest exit {code})")
    if code == 1:
        print("some simulator tests failed: compiling the launches they made", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for the launches JSON and PTX (default: a temp dir)")
    ap.add_argument("--launches", help="compile the launches recorded in this JSON (no tests)")
    ap.add_argument("--record-only", action="store_true", help=argparse.SUPPRESS)
    args, pytest_args = ap.parse_known_args()
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="cuda_compile_check."))
    out_dir.mkdir(parents=True, exist_ok=True)
    launches_path = out_dir / "launches.json"
    if args.record_only:  # phase 1, in its own simulator process
        raise SystemExit(record(launches_path, pytest_args or ["tests/kernels"]))
    if args.launches:
        launches_path = Path(args.launches)
    else:
        _record_in_simulator(out_dir, pytest_args)
    os.environ["NUMBA_ENABLE_CUDASIM"] = "0"  # phase 2, here: the real numba.cuda
    launches = json.loads(launches_path.read_text())
    print(f"{len(launches)} distinct launches; compiling for sm_90 ({out_dir})", flush=True)
    if compile_all(launches, out_dir):
        raise SystemExit("some kernels did not compile")


if __name__ == "__main__":
    main()
