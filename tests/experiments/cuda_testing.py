"""What the CUDA-source tests share: compiling a kernels/*.cu file with nvcc for sm_90 (no GPU
needed) and reading which kernels it exports."""
from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from xstage_lab.kernel_sources import cuda_options

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def elf_function_symbols(blob: bytes) -> set[str]:
    """Names of the global function symbols of an ELF64 little-endian file (a cubin)."""
    assert blob[:4] == b"\x7fELF" and blob[4] == 2 and blob[5] == 1
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", blob, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize)
                for i in range(shnum)]
    names = set()
    for sh in sections:
        if sh[1] != 2:  # SHT_SYMTAB
            continue
        strtab = sections[sh[6]]
        str_off = strtab[4]
        off, size, entsize = sh[4], sh[5], sh[9]
        for k in range(size // entsize):
            st_name, st_info, _, _, _, _ = struct.unpack_from("<IBBHQQ", blob, off + k * entsize)
            if st_info & 0xF == 2 and st_info >> 4 == 1:  # STT_FUNC, STB_GLOBAL
                end = blob.index(b"\0", str_off + st_name)
                names.add(blob[str_off + st_name:end].decode())
    return names


def compile_sm90(cu: Path, out_dir: Path) -> tuple[set[str], set[str], str]:
    """``cu`` compiled by nvcc for sm_90 to a cubin and to PTX, with the options NVRTC gets at run
    time (``cuda_options``): the cubin's global function symbols, the PTX's visible entries (the
    same names where the kernels are ``extern "C"``) and the PTX text."""
    cubin, ptx = out_dir / f"{cu.stem}.cubin", out_dir / f"{cu.stem}.ptx"
    for flag, out in (("--cubin", cubin), ("-ptx", ptx)):
        r = subprocess.run(["nvcc", "-arch=sm_90", *cuda_options(), flag, "-o", str(out), str(cu)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    text = ptx.read_text()
    entries = set(re.findall(r"\.visible\s+\.entry\s+(\w+)\s*\(", text))
    return elf_function_symbols(cubin.read_bytes()), entries, text
