"""Type-check the Ascend kernels against asc-devkit's own AscendC headers, for arch 2201 (Atlas A2, "910B").

    python3 scripts/check_ascend_headers.py /path/to/asc-devkit     # a checkout of asc-devkit (gitcode.com/cann/asc-devkit; GitHub mirror mirror-cann/asc-devkit)

The kernels are otherwise built only against the CPU model (csrc/ascend/cpu_model), which declares the API from the
docs; this compiles every kernel file with g++ -fsyntax-only against the real headers, once as the cube core (AIC)
and once as the vector core (AIV) of a MIX kernel, since each core's code is discarded (`if ASCEND_IS_AIC`) in the
other's pass. Wrong parameter structs, overloads, template arguments, enum names, or an API the arch lacks, fail.
What g++ cannot check (field order of same-typed positional initialisers, units, runtime range checks) is in
csrc/ascend/NOTES.md.

The headers' device mode needs the AscendC compiler's builtins; csrc/ascend/header_check/compiler_standins.h stands
in for them. The intrinsics (snake_case functions such as copy_gm_to_ubuf) are declared here from g++'s errors, only
where the error lies inside asc-devkit's tree, so nothing a kernel itself calls is ever stubbed.
Exit status 0 when every file compiles on both cores; else 1, with g++'s errors.
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
CORES = {"AIC": ("__DAV_C220_CUBE__", "__DAV_CUBE__"), "AIV": ("__DAV_C220_VEC__", "__DAV_VEC__")}
UNDECLARED = re.compile(
    r"^(?P<file>[^:\s]+):(?P<line>\d+):(?P<col>\d+): error: (?:‘(?P<a>\w+)’ was not declared in this scope"
    r"|there are no arguments to ‘(?P<b>\w+)’ that depend)", re.M)
# An intrinsic returning void, stood in for by one returning a value, in `return intrinsic(...);` of a void function.
VOID_RETURNED = re.compile(
    r"^(?P<file>[^:\s]+):(?P<line>\d+):(?P<col>\d+): error: return-statement with a value, in function returning", re.M)
INTRINSIC = re.compile(r"^[a-z_][a-z0-9_]*$")


def inside(path, devkit):
    return pathlib.Path(path).resolve().is_relative_to(devkit)


def called_name(path, line, col):
    """The function named just before g++'s caret (the call's parenthesis) on that line."""
    text = pathlib.Path(path).read_text(errors="replace").splitlines()[int(line) - 1][: int(col) - 1]
    match = re.search(r"(\w+)\s*$", text)
    return match.group(1) if match else None


def compile_errors(devkit, kernels, work, source, core):
    flags = ["-std=c++17", "-fsyntax-only", "-D__NPU_ARCH__=2201", "-D__DAV_C220__",
             *(f"-D{d}" for d in CORES[core]), "-DLORA_OPS_ASCEND_HEADER_CHECK",
             "-include", str(ASCEND / "header_check" / "compiler_standins.h"),
             f"-I{ASCEND / 'header_check'}", f"-I{work}", f"-I{kernels}",
             *(f"-I{devkit / d}" for d in ("include", "include/basic_api", "include/utils", "impl",
                                            "impl/basic_api", "."))]
    return subprocess.run(["g++", *flags, str(kernels / source)], capture_output=True, text=True).stderr


def check(devkit, kernels=ASCEND, rounds=30):
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
                    errors = compile_errors(devkit, kernels, work, source, core)
                    found = {m["a"] or m["b"] for m in UNDECLARED.finditer(errors)
                             if inside(m["file"], devkit) and INTRINSIC.match(m["a"] or m["b"])}
                    returned = {called_name(m["file"], m["line"], m["col"]) for m in VOID_RETURNED.finditer(errors)
                                if inside(m["file"], devkit)} & declared
                    if not (found - declared or returned - void):
                        break
                    declared |= found
                    void |= returned
                status = "ok" if "error:" not in errors else "FAILED"
                print(f"{source:20} {core}: {status}")
                if status != "ok":
                    failed += 1
                    print(errors)
    print(f"{len(declared)} intrinsics stood in for ({len(void)} returning void)")
    return failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("devkit", type=pathlib.Path, help="a checkout of asc-devkit")
    parser.add_argument("--kernels", type=pathlib.Path, default=ASCEND,
                        help="the kernels' directory (default csrc/ascend; tests pass an altered copy)")
    args = parser.parse_args()
    sys.exit(1 if check(args.devkit, args.kernels.resolve()) else 0)


if __name__ == "__main__":
    main()
