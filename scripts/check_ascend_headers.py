"""Type-check the Ascend backend against the real AscendC, torch_npu and ACL headers, without CANN.

    python3 scripts/check_ascend_headers.py --devkit /path/to/asc-devkit       # the kernels (arch 2201)
    python3 scripts/check_ascend_headers.py --torch-npu build/torch_npu/include  # the host code (install.sh fetches)

Otherwise the backend is built only against the CPU model (csrc/ascend/cpu_model), which declares the AscendC API
from the docs, and stand-ins for torch_npu and ACL; a name or type they got wrong would pass every test there.

--devkit: every kernel file with g++ -fsyntax-only against asc-devkit's headers (gitcode.com/cann/asc-devkit; GitHub
mirror mirror-cann/asc-devkit) in their device mode, once as the cube core (AIC) and once as the vector core (AIV)
of a MIX kernel, since each core's code is discarded (`if ASCEND_IS_AIC`) in the other's pass. Wrong parameter
structs, overloads, template arguments, enum names, or an API the arch lacks, fail. What the AscendC compiler
provides there, csrc/ascend/header_check/compiler_standins.h stands in for; its intrinsics (snake_case functions
such as copy_gm_to_ubuf) are declared here from g++'s errors, only where the error lies inside asc-devkit's tree, so
nothing a kernel itself calls is ever stubbed. What g++ cannot check (field order of same-typed positional
initialisers, units, runtime range checks) is in csrc/ascend/NOTES.md.

--devkit also checks the launch as CANN's build makes it: ascendc_library reads each kernel's signature out of the
preprocessed source (asc-devkit's cmake/asc/legacy_modules/util/extract_host_stub.py, run here on g++'s
preprocessed output with the AscendC compiler's spellings of the qualifiers), copies the struct parameters'
definitions into generated host code, and declares aclrtlaunch_<kernel> (tiling by pointer) in a header it
force-includes into the kernel files' host pass. The check generates those with asc-devkit's own code, compiles
the copied definitions alone, and compiles each kernel file with that header and launch.h's toolchain branch.

--torch-npu: the host files the CANN build compiles into _C (plan, launcher, registration) against the include
directory of the torch_npu wheel (its c10_npu streams and its copy of ACL's headers) and the installed torch's.

Exit status 0 when everything compiles; else 1, with g++'s errors.
"""

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
ASCEND = ROOT / "csrc" / "ascend"
KERNELS = ("sgmv.cpp", "lora_expand.cpp", "grouped_gemm.cpp", "build_segments.cpp")
HOST = ("plan.cpp", "launcher.cpp", "registration.cpp")
KERNEL_TYPES = {"sgmv.cpp": "KERNEL_TYPE_MIX_AIC_1_2", "lora_expand.cpp": "KERNEL_TYPE_MIX_AIC_1_2",
                "grouped_gemm.cpp": "KERNEL_TYPE_MIX_AIC_1_2", "build_segments.cpp": "KERNEL_TYPE_AIV_ONLY"}
CORES = {"AIC": ("__DAV_C220_CUBE__", "__DAV_CUBE__"), "AIV": ("__DAV_C220_VEC__", "__DAV_VEC__")}
UNDECLARED = re.compile(
    r"^(?P<file>[^:\s]+):(?P<line>\d+):(?P<col>\d+): error: (?:‘(?P<a>\w+)’ was not declared in this scope"
    r"|there are no arguments to ‘(?P<b>\w+)’ that depend)", re.M)
# An intrinsic returning void, stood in for by one returning a value, in `return intrinsic(...);` of a void function.
VOID_RETURNED = re.compile(
    r"^(?P<file>[^:\s]+):(?P<line>\d+):(?P<col>\d+): error: return-statement with a value, in function returning", re.M)
INTRINSIC = re.compile(r"^[a-z_][a-z0-9_]*$")


def inside(path, tree):
    return pathlib.Path(path).resolve().is_relative_to(tree)


def called_name(path, line, col):
    """The function named just before g++'s caret (the call's parenthesis) on that line."""
    text = pathlib.Path(path).read_text(errors="replace").splitlines()[int(line) - 1][: int(col) - 1]
    match = re.search(r"(\w+)\s*$", text)
    return match.group(1) if match else None


def report(source, label, errors):
    ok = "error:" not in errors
    print(f"{source:20} {label}: {'ok' if ok else 'FAILED'}")
    if not ok:
        print(errors)
    return ok


def kernel_flags(devkit, kernels, work, core, launch=False):
    """g++'s flags for a kernel file against asc-devkit's headers: the type check's (its plain-call launch), or with
    launch=True launch.h's toolchain branch (the launch check's host pass)."""
    return ["-std=c++17", "-D__NPU_ARCH__=2201", "-D__DAV_C220__",
            *(f"-D{d}" for d in CORES[core]), *([] if launch else ["-DLORA_OPS_ASCEND_HEADER_CHECK"]),
            "-include", str(ASCEND / "header_check" / "compiler_standins.h"),
            f"-I{ASCEND / 'header_check'}", f"-I{work}", f"-I{kernels}",
            *(f"-I{devkit / d}" for d in ("include", "include/basic_api", "include/utils", "impl",
                                           "impl/basic_api", "."))]


def kernel_errors(devkit, kernels, work, source, core):
    flags = kernel_flags(devkit, kernels, work, core)
    return subprocess.run(["g++", "-fsyntax-only", *flags, str(kernels / source)], capture_output=True,
                          text=True).stderr


def check_kernels(devkit, kernels, rounds=30):
    """The number of (file, core) passes that fail."""
    devkit = devkit.resolve()
    if not (devkit / "include" / "kernel_operator.h").is_file():
        sys.exit(f"{devkit}: not an asc-devkit checkout (no include/kernel_operator.h)")
    declared, void = set(), set()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        for source in KERNELS:
            for core in CORES:
                for _ in range(rounds):
                    (work / "intrinsics.h").write_text(
                        "".join(f"LORA_OPS_INTRINSIC({n})\n" for n in sorted(declared - void))
                        + "".join(f"LORA_OPS_INTRINSIC_VOID({n})\n" for n in sorted(void)))
                    errors = kernel_errors(devkit, kernels, work, source, core)
                    found = {m["a"] or m["b"] for m in UNDECLARED.finditer(errors)
                             if inside(m["file"], devkit) and INTRINSIC.match(m["a"] or m["b"])}
                    returned = {called_name(m["file"], m["line"], m["col"]) for m in VOID_RETURNED.finditer(errors)
                                if inside(m["file"], devkit)} & declared
                    if not (found - declared or returned - void):
                        break
                    declared |= found
                    void |= returned
                failed += not report(source, core, errors)
        print(f"{len(declared)} intrinsics stood in for ({len(void)} returning void)")
        for source, errors in launch_stub_errors(devkit, kernels, work):
            failed += not report(source, "launch", errors)
    return failed


def launch_stub_errors(devkit, kernels, work):
    """(file, errors) of the launch check (module docstring), one entry per compilation."""
    sys.path.insert(0, str(devkit / "cmake" / "asc" / "legacy_modules" / "util"))
    import extract_host_stub as stub  # asc-devkit's own generator

    sources = []
    for source in KERNELS:
        out = work / (source + ".i")
        # __CHECK_FEATURE_AT_PRECOMPILE: as CANN's build preprocesses, so the kernel type (KERNEL_TASK_TYPE_DEFAULT)
        # shows in the text the generator reads
        cmd = ["g++", "-E", *kernel_flags(devkit, kernels, work, "AIV", launch=True), "-DLORA_OPS_ASCEND_STUB_SOURCE",
               "-D__CHECK_FEATURE_AT_PRECOMPILE", "-o", str(out), str(kernels / source)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return [(source, done.stderr)]
        sources.append(str(out))
    stub.IS_V220_MODE = True
    groups = list(stub.parse_func_signature_by_filepaths(sources, "c220"))
    # the kernel type each file declares (KERNEL_TASK_TYPE_DEFAULT), which the build reads to link its cores
    types = {pathlib.Path(g.filepath).name[:-2]: g.kernel_type and g.kernel_type.name for g in groups}
    wrong = {f: t for f, t in types.items() if t != KERNEL_TYPES[f]}
    results = [("kernel_types", "".join(f"error: {f} declares {t}, expected {KERNEL_TYPES[f]}\n" for f, t in
                                        wrong.items()))]
    definitions = stub.generate_type_definition_content_by_func_sign_groups(groups)
    launch_signs = stub.func_signs_in_groups(list(map(stub.trans_func_sign_group, groups)))
    headers = dict(stub.generate_save_stub_header_commands(launch_signs, str(work)))
    header = work / "aclrtlaunch_triple_chevrons_func.h"
    header.write_text(headers[str(header)])
    (work / "definitions.cpp").write_text("#include <stdint.h>\n" + definitions + "\n")
    results.append(("struct_definitions", subprocess.run(["g++", "-std=c++17", "-fsyntax-only",
                                                          str(work / "definitions.cpp")],
                                                         capture_output=True, text=True).stderr))
    for source in KERNELS:  # the host pass: launch.h's toolchain branch calls the generated aclrtlaunch_<kernel>
        flags = kernel_flags(devkit, kernels, work, "AIV", launch=True)
        results.append((source, subprocess.run(["g++", "-fsyntax-only", *flags, "-include", str(header),
                                                str(kernels / source)],
                                               capture_output=True, text=True).stderr))
    return results


def check_host(torch_npu_include, kernels):
    """The number of host files that fail."""
    from torch.utils import cpp_extension

    include = torch_npu_include.resolve()
    if not (include / "torch_npu" / "csrc" / "core" / "npu" / "NPUStream.h").is_file():
        sys.exit(f"{include}: not torch_npu's include directory (no torch_npu/csrc/core/npu/NPUStream.h)")
    flags = ["-std=c++20", "-fsyntax-only", f"-I{include}", f"-I{ROOT / 'csrc'}", f"-I{kernels}",
             *(f"-I{p}" for p in cpp_extension.include_paths())]
    failed = 0
    for source in HOST:
        errors = subprocess.run(["g++", *flags, str(kernels / source)], capture_output=True, text=True).stderr
        failed += not report(source, "host", errors)
    return failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devkit", type=pathlib.Path, help="a checkout of asc-devkit: check the kernels")
    parser.add_argument("--torch-npu", type=pathlib.Path,
                        help="the torch_npu wheel's include directory: check the host code")
    parser.add_argument("--kernels", type=pathlib.Path, default=ASCEND,
                        help="the backend's directory (default csrc/ascend; tests pass an altered copy)")
    args = parser.parse_args()
    if not (args.devkit or args.torch_npu):
        parser.error("nothing to check: give --devkit, --torch-npu or both")
    kernels = args.kernels.resolve()
    failed = (check_kernels(args.devkit, kernels) if args.devkit else 0) + (
        check_host(args.torch_npu, kernels) if args.torch_npu else 0)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
