"""Builds lora_ops._C: CPU kernels always, CUDA kernels when torch has CUDA and nvcc is found, the Ascend backend when
ASCEND_HOME_PATH names a CANN toolkit and torch_npu is installed (docs/design.md §4). Also builds lora_ops._ascend_model,
a test-only library that runs the Ascend host code and kernels on a CPU model of the AscendC API.

_C is a plain shared library of op registrations (no Python symbols): lora_ops/__init__.py loads it with
torch.ops.load_library, and the C++ unit tests link against the same file.
"""
import glob
import json
import os
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cuda_home():
    """CUDA_HOME if set, else the toolkit's usual place, else wherever a real nvcc is on PATH."""
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and os.path.exists(os.path.join(candidate, "bin", "nvcc")):
            return candidate
    nvcc = shutil.which("nvcc")
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None


def _configure_cutlass(arch_list):
    """The sm_90a grouped_gemm (csrc/cuda/grouped_gemm_sm90.cu) builds when the arch list has 9.0a and the
    nvidia-cutlass package (pinned in scripts/install.sh) provides CUTLASS's headers (docs/design.md §4)."""
    if "9.0a" not in arch_list.replace(";", " ").split():
        return {"built": False, "reason": f"TORCH_CUDA_ARCH_LIST={arch_list!r} has no 9.0a"}
    try:
        import cutlass_library
    except ImportError as exc:
        print(f"lora_ops: nvidia-cutlass not importable ({exc}); building without the sm_90a grouped_gemm")
        return {"built": False, "reason": f"nvidia-cutlass not importable at build time: {exc}"}
    include = os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")
    if not os.path.exists(os.path.join(include, "cutlass", "cutlass.h")):
        return {"built": False, "reason": f"nvidia-cutlass has no headers at {include}"}
    from importlib.metadata import version
    return {"built": True, "include": include, "nvidia_cutlass": version("nvidia-cutlass")}


def _find_cublaslt(cuda_home, cuda_major):
    """(include dir, library dir, library file name) of the cuBLASLt of torch's CUDA major version, which fold_linear
    calls (csrc/cuda/fold_linear_lt.cpp): first in the nvidia pip packages torch loads it from (its copy is the one
    in the process: _C.so's libcublasLt.so.N resolves to it by name), then in the toolkit; None where neither has
    both the header and that library."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = [r for d in (spec.submodule_search_locations if spec else []) for r in sorted(glob.glob(f"{d}/*"))]
    candidates = [(os.path.join(r, "include"), os.path.join(r, "lib")) for r in roots]
    candidates.append((os.path.join(cuda_home, "include"), os.path.join(cuda_home, "lib64")))
    library = f"libcublasLt.so.{cuda_major}"
    for include, lib in candidates:
        if os.path.exists(os.path.join(include, "cublasLt.h")) and os.path.exists(os.path.join(lib, library)):
            return include, lib, library
    return None


def _configure_ascend():
    """The Ascend backend builds when ASCEND_HOME_PATH names a CANN toolkit and torch_npu is importable."""
    cann = os.environ.get("ASCEND_HOME_PATH")
    if not cann:
        print("lora_ops: CANN not found (ASCEND_HOME_PATH unset); building without the Ascend backend")
        return {"built": False, "reason": "CANN not found at build time (ASCEND_HOME_PATH unset); the AscendC "
                                          "kernels were only tested on the CPU model (lora_ops._ascend_model)"}
    try:
        import torch_npu  # noqa: F401  (registers the "npu" PrivateUse1 backend the kernels serve)
    except ImportError as exc:
        print(f"lora_ops: CANN found but torch_npu is not importable ({exc}); building without the Ascend backend")
        return {"built": False, "reason": f"torch_npu not importable at build time: {exc}"}
    return {"built": True, "cann": cann, "torch_npu": os.path.dirname(torch_npu.__file__),
            "soc": os.environ.get("LORA_OPS_ASCEND_SOC", "Ascend910B1")}


def _build_ascend_kernels(ascend, out_dirs):
    """Compiles csrc/ascend's kernels with CANN's AscendC cmake modules into liblora_ops_ascend_kernels.so, copied
    into each of out_dirs. Makefiles: the modules' post-build step reads CMakeFiles/<target>.dir/link.txt, which
    only the Makefile generators write (a CMAKE_GENERATOR=Ninja in the environment would break it)."""
    import subprocess

    build = os.path.join(ROOT, "build", "ascend")
    subprocess.check_call(["cmake", "-S", os.path.join(ROOT, "csrc", "ascend"), "-B", build, "-G", "Unix Makefiles",
                           "-DCMAKE_BUILD_TYPE=Release", f"-DSOC_VERSION={ascend['soc']}",
                           f"-DASCEND_HOME_PATH={ascend['cann']}"])
    subprocess.check_call(["cmake", "--build", build, "-j", os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))])
    for out_dir in out_dirs:
        os.makedirs(out_dir, exist_ok=True)
        shutil.copy2(os.path.join(build, "lib", "liblora_ops_ascend_kernels.so"), out_dir)


def _configure():
    """Pick the backends to build; returns the build_info dict (also written to lora_ops/_build_info.json)."""
    import torch

    info = {"torch": torch.__version__, "backends": {"cpu": {"built": True}}}
    cuda_home = None
    if os.environ.get("LORA_OPS_NO_CUDA") == "1":
        info["backends"]["cuda"] = {"built": False, "reason": "LORA_OPS_NO_CUDA=1 was set at build time"}
    elif torch.version.cuda is None:
        info["backends"]["cuda"] = {"built": False, "reason": f"torch {torch.__version__} was built without CUDA"}
    else:
        cuda_home = _cuda_home()
        if cuda_home is None:
            info["backends"]["cuda"] = {"built": False, "reason": "nvcc not found (set CUDA_HOME)"}
        else:
            # Without a GPU torch would index an empty arch list and pick a wrong toolkit path (docs/design.md §4).
            os.environ.setdefault("CUDA_HOME", cuda_home)
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
            cuda_major = torch.version.cuda.split(".")[0]
            cublaslt = _find_cublaslt(cuda_home, cuda_major)
            if cublaslt is None:
                reason = (f"cuBLASLt's header and libcublasLt.so.{cuda_major} not found (the nvidia-cublas package "
                          "torch depends on, or the toolkit at CUDA_HOME)")
                print(f"lora_ops: {reason}; building without the CUDA backend")
                info["backends"]["cuda"] = {"built": False, "reason": reason}
            else:
                info["backends"]["cuda"] = {"built": True, "arch_list": os.environ["TORCH_CUDA_ARCH_LIST"],
                                            "cuda_home": cuda_home, "torch_cuda": torch.version.cuda,
                                            "cublaslt": cublaslt,
                                            "grouped_gemm_sm90": _configure_cutlass(os.environ["TORCH_CUDA_ARCH_LIST"])}
    info["backends"]["ascend"] = _configure_ascend()
    return info


def _extensions(info):
    from torch.utils import cpp_extension

    rel = lambda pattern: sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    sources = rel("csrc/bindings.cpp") + rel("csrc/common/*.cpp") + rel("csrc/cpu/*.cpp")
    # -fopenmp: at::parallel_for (the CPU kernels' row blocks) runs serially without it (torch's OpenMP build;
    # libgomp.so.1 resolves to the copy torch has loaded, so one OpenMP runtime)
    cxx = ["-O3", "-fopenmp"]
    link = ["-fopenmp"]
    # Test-only: the Ascend host path and kernels on the CPU model of the AscendC API, as lora_ops_ascend_model::*
    # ops on CPU tensors (tests/test_ascend_model.py). registration.cpp is compiled against stand-ins for
    # torch_npu and ACL. The op table (csrc/common/op_table.cpp) stays out: _C holds it.
    model = cpp_extension.CppExtension(
        "lora_ops._ascend_model",
        [s for s in rel("csrc/common/*.cpp") if s != "csrc/common/op_table.cpp"] + rel("csrc/ascend/cpu_model/*.cpp")
        + rel("csrc/ascend/*.cpp"),
        include_dirs=[os.path.join(ROOT, "csrc", "ascend", "cpu_model"),
                      os.path.join(ROOT, "csrc", "ascend", "cpu_model", "standin")],
        define_macros=[("LORA_OPS_ASCEND_CPU_MODEL", None), ("LORA_OPS_ASCEND_LIBRARY", "lora_ops_ascend_model"),
                       ("LORA_OPS_ASCEND_DISPATCH_KEY", "CPU")],
        extra_compile_args={"cxx": ["-O2", "-fno-strict-aliasing"]}, py_limited_api=True)
    ascend = info["backends"]["ascend"]
    ext_kwargs = {}
    if ascend["built"]:
        # Host side of the real backend in _C; the kernels come from liblora_ops_ascend_kernels.so (CANN build).
        sources += [f"csrc/ascend/{name}.cpp" for name in ("plan", "launcher", "registration")]
        ext_kwargs = dict(include_dirs=[os.path.join(ascend["torch_npu"], "include"),
                                        os.path.join(ascend["cann"], "include")],
                          library_dirs=[os.path.join(ROOT, "lora_ops"), os.path.join(ascend["torch_npu"], "lib"),
                                        os.path.join(ascend["cann"], "lib64")],
                          libraries=["lora_ops_ascend_kernels", "torch_npu", "ascendcl"])
        link.append("-Wl,-rpath,$ORIGIN")
    if not info["backends"]["cuda"]["built"]:
        return [cpp_extension.CppExtension("lora_ops._C", sources, extra_compile_args={"cxx": cxx},
                                           extra_link_args=link, py_limited_api=True, **ext_kwargs), model]
    sources += rel("csrc/cuda/*.cpp") + rel("csrc/cuda/*.cu")
    nvcc = ["-O3", "-lineinfo", "--expt-relaxed-constexpr", "-DLORA_OPS_WITH_CUDA"]
    cutlass = info["backends"]["cuda"]["grouped_gemm_sm90"]
    if cutlass["built"]:
        # CUTLASS's headers as system headers (their warnings are not ours); only grouped_gemm_sm90.cu includes them
        nvcc += ["-isystem", cutlass["include"], "-DLORA_OPS_GG_SM90"]
    include, lib, library = info["backends"]["cuda"]["cublaslt"]
    ext_kwargs.setdefault("include_dirs", []).append(include)
    return [cpp_extension.CUDAExtension("lora_ops._C", sources, py_limited_api=True, **ext_kwargs,
                                        extra_compile_args={"cxx": cxx + ["-DLORA_OPS_WITH_CUDA"], "nvcc": nvcc},
                                        # no rpath: torch's loaded copy answers the name; a RUNPATH on _C.so
                                        # would also hide the C++ tests' RPATH from _C.so's other dependencies
                                        extra_link_args=link + [f"-L{lib}", f"-l:{library}"]),
            model]


def _build_ext(info):
    """torch's BuildExtension, incremental; with CANN it first builds the AscendC kernel library that _C links."""
    from torch.utils.cpp_extension import BuildExtension

    class IncrementalBuildExtension(BuildExtension.with_options(no_python_abi_suffix=True)):
        """pip's editable install compiles in a fresh temporary directory, i.e. everything every time. One fixed
        object directory lets ninja rebuild only the objects whose sources or included headers changed; `force`
        hands that decision to ninja (setuptools would compare .cpp times only and miss a changed header)."""

        def finalize_options(self):
            super().finalize_options()
            self.build_temp = os.path.join(ROOT, "build", "temp")
            self.force = True

    ascend = info["backends"]["ascend"]
    if not ascend["built"]:
        return IncrementalBuildExtension

    class BuildWithAscendKernels(IncrementalBuildExtension):
        def run(self):
            # _C links the library from lora_ops/ (rpath $ORIGIN): the source tree's (editable installs, and the
            # link itself) and, for a wheel, the build tree's, whose package data build_py collected before the
            # library existed.
            out_dirs = [os.path.join(ROOT, "lora_ops")]
            if not self.inplace:
                out_dirs.append(os.path.join(self.build_lib, "lora_ops"))
            _build_ascend_kernels(ascend, out_dirs)
            super().run()

    return BuildWithAscendKernels


# The files beside the Python modules that a wheel must hold: lora_ops reads its GPU's op table at import
# (op_table.install_default), the serving layer its routes, lora_ops.info the build record; _C links the Ascend
# kernel library (CANN builds). tests/test_packaging.py checks every JSON file of the package is listed.
PACKAGE_DATA = {"lora_ops": ["_build_info.json", "op_tables/*.json", "route_tables/*.json", "liblora_ops_ascend_kernels.so"]}


def main():
    info = _configure()
    # torch.utils.cpp_extension is imported only now (in _build_ext): it reads CUDA_HOME when first imported.
    with open(os.path.join(ROOT, "lora_ops", "_build_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    setup(
        name="lora_ops",
        version="0.1.0",
        packages=find_packages(include=["lora_ops", "lora_ops.*"]),
        package_data=PACKAGE_DATA,
        ext_modules=_extensions(info),
        cmdclass={"build_ext": _build_ext(info)},
        options={"bdist_wheel": {"py_limited_api": "cp39"}},
        python_requires=">=3.10",
        install_requires=["torch>=2.6"],
        extras_require={"hf": ["transformers", "peft", "safetensors", "tqdm"], "test": ["pytest", "numpy"]},
    )


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
