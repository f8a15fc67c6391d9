"""LLVM IR → a ctypes function for this CPU, through llvmlite (numba's own LLVM).

ctypes calls release the GIL, so the kernels run in parallel on a plain thread pool.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable

import llvmlite.binding as llvm

_ENGINES: list[object] = []  # keeps every JIT engine (and so its code) alive


@functools.cache
def host_features() -> str:
    return llvm.get_host_cpu_features().flatten()


@functools.cache
def host_is_x86() -> bool:
    return llvm.get_default_triple().startswith(("x86_64", "i386", "i686"))


@functools.cache
def has_avx2() -> bool:
    return "+avx2" in host_features().split(",")


@functools.cache
def has_vnni() -> bool:
    """vpdpbusd on 256-bit vectors: AVX512-VNNI with AVX512VL, or AVX-VNNI."""
    features = host_features().split(",")
    return ("+avx512vnni" in features and "+avx512vl" in features) or "+avxvnni" in features


@functools.cache
def _target_machine() -> llvm.TargetMachine:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=host_features(), opt=3)


@functools.cache
def _compile(ir: str, name: str, argtypes: tuple) -> Callable:
    module = llvm.parse_assembly(ir)
    engine = llvm.create_mcjit_compiler(module, _target_machine())
    engine.finalize_object()
    _ENGINES.append(engine)
    return ctypes.CFUNCTYPE(None, *argtypes)(engine.get_function_address(name))


def compile_function(ir: str, name: str, argtypes: list) -> Callable:
    """The void function `name` of module `ir`, compiled once per (ir, name) at -O3."""
    return _compile(ir, name, tuple(argtypes))
