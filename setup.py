"""Builds lora_ops._C: CPU kernels always, CUDA kernels when torch has CUDA and nvcc is found (docs/design.md §4).

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
            info["backends"]["cuda"] = {"built": True, "arch_list": os.environ["TORCH_CUDA_ARCH_LIST"],
                                        "cuda_home": cuda_home, "torch_cuda": torch.version.cuda}
    if os.environ.get("ASCEND_HOME_PATH"):
        info["backends"]["ascend"] = {"built": False, "reason": "AscendC kernels are not written yet"}
    else:
        info["backends"]["ascend"] = {"built": False, "reason": "CANN not found (ASCEND_HOME_PATH unset)"}
        print("lora_ops: CANN not found (ASCEND_HOME_PATH unset); building without the Ascend backend")
    return info


def _extensions(info):
    from torch.utils import cpp_extension

    rel = lambda pattern: sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    sources = rel("csrc/bindings.cpp") + rel("csrc/common/*.cpp") + rel("csrc/cpu/*.cpp")
    cxx = ["-O3"]
    if not info["backends"]["cuda"]["built"]:
        return [cpp_extension.CppExtension("lora_ops._C", sources, extra_compile_args={"cxx": cxx},
                                           py_limited_api=True)]
    sources += rel("csrc/cuda/*.cpp") + rel("csrc/cuda/*.cu")
    nvcc = ["-O3", "-lineinfo", "--expt-relaxed-constexpr", "-DLORA_OPS_WITH_CUDA"]
    return [cpp_extension.CUDAExtension("lora_ops._C", sources, py_limited_api=True,
                                        extra_compile_args={"cxx": cxx + ["-DLORA_OPS_WITH_CUDA"], "nvcc": nvcc})]


def main():
    info = _configure()
    # Imported only now: torch.utils.cpp_extension reads CUDA_HOME when it is first imported.
    from torch.utils.cpp_extension import BuildExtension

    class IncrementalBuildExtension(BuildExtension.with_options(no_python_abi_suffix=True)):
        """pip's editable install compiles in a fresh temporary directory, i.e. everything every time. One fixed
        object directory lets ninja rebuild only the objects whose sources or included headers changed; `force`
        hands that decision to ninja (setuptools would compare .cpp times only and miss a changed header)."""

        def finalize_options(self):
            super().finalize_options()
            self.build_temp = os.path.join(ROOT, "build", "temp")
            self.force = True

    with open(os.path.join(ROOT, "lora_ops", "_build_info.json"), "w") as f:
        json.dump(info, f, indent=1)
    setup(
        name="lora_ops",
        version="0.1.0",
        packages=find_packages(include=["lora_ops", "lora_ops.*"]),
        package_data={"lora_ops": ["_build_info.json"]},
        ext_modules=_extensions(info),
        cmdclass={"build_ext": IncrementalBuildExtension},
        options={"bdist_wheel": {"py_limited_api": "cp39"}},
        python_requires=">=3.10",
        install_requires=["torch>=2.6"],
        extras_require={"hf": ["transformers", "peft", "safetensors", "tqdm"], "test": ["pytest", "numpy"]},
    )


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
