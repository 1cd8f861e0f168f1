"""Which instructions of a kernel wait on which scoreboard: `cuobjdump -sass` output (a file, or - for stdin) and
a regular expression naming the kernel. Prints, from the first griddepcontrol.wait (ACQBULK) on, every load, store,
mma and vote, and every instruction that waits, with the scoreboard a load writes (wr) and those an instruction
waits for (wait). Why: ptxas has six scoreboards; loads that share one are waited for together, so a kernel that
issues loads early can find a later use waiting for all of them (csrc/cuda/NOTES.md, session 23).

    cuobjdump -sass kernels.o | python3 scripts/sass_waits.py - 'expand_rows_kernelI13__nv_bfloat16S3_S3_Li1E'

(cuobjdump ships with triton's wheel: triton/backends/nvidia/bin.) Control bits, Volta and later: bits 41 up of an
instruction's second 64-bit word hold the stall count (4 bits), yield (1), write and read scoreboards (3 each; 7:
none) and the mask of scoreboards waited for (6)."""
import re
import sys

SHOWN = ("LDG", "LDS", "LDL", "STG", "ACQBULK", "HMMA", "VOTE", "SHFL")


def instructions(lines, kernel):
    inside = False
    for i, line in enumerate(lines):
        if "Function :" in line:
            inside = re.search(kernel, line) is not None
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if inside and m and i + 1 < len(lines):
            hi = re.search(r"/\* (0x[0-9a-f]+) \*/", lines[i + 1])
            if hi:
                control = int(hi.group(1), 16) >> 41
                yield m.group(1), m.group(2).strip(), (control >> 5) & 7, (control >> 11) & 0x3F


def main() -> None:
    source, kernel = sys.argv[1], sys.argv[2]
    lines = (sys.stdin if source == "-" else open(source)).read().split("\n")
    started = False
    for address, text, written, waited in instructions(lines, kernel):
        started = started or "ACQBULK" in text
        if started and (waited or any(k in text for k in SHOWN)):
            waits = [b for b in range(6) if waited >> b & 1]
            print(f"{address} {text[:64]:64s} wr={written if written != 7 else '-'} wait={waits}")


if __name__ == "__main__":
    main()
