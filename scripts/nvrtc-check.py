#!/usr/bin/env python3
"""Compiles fathom's CUDA kernels with NVIDIA's own NVRTC, no GPU needed.

The CUDA backend compiles `crates/kernels-cuda/src/*.cu` with NVRTC when it
opens a device; CI has no GPU, so its tests run the kernels on the host
emulator, which is a C++ compiler, not NVRTC. This script catches source
that the emulator takes but NVRTC would refuse (a missing builtin, a
misplaced attribute): it joins the files in the order `cu_files!` in
`crates/kernels-cuda/src/kernel_list.rs` gives and compiles them with the options
`kernels_ptx` in `device.rs` passes (keep the two in step) for every
architecture the backend may pick. (It shows that this NVRTC accepts the
source; an older NVRTC at run time is not covered.) CI installs NVRTC from the
`nvidia-cuda-nvrtc-cu12` wheel:

  python3 scripts/nvrtc-check.py [LIBNVRTC] [--ptx DIR]

LIBNVRTC defaults to the wheel's library in this Python's site-packages;
with --ptx each architecture's PTX is written to DIR/<arch>.ptx (for
`ptxas -arch=sm_90 -v DIR/compute_90.ptx`, from the nvidia-cuda-nvcc-cu12
wheel, to read registers and spills). Exits 1 with NVRTC's log when a
compile fails. FATHOM_CUDA_DEFINES (the backend's tuning knobs, e.g.
"BF16_MINB=4") is passed as -D options, as the backend passes it.
"""
import ctypes
import glob
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SRC = os.path.join(ROOT, "crates", "kernels-cuda", "src")
OPTIONS = [b"--ftz=false", b"--prec-div=true", b"--prec-sqrt=true", b"--fmad=false", b"--std=c++17"]
# Every architecture `arch_name` in device.rs returns.
ARCHS = [
    "compute_75", "compute_80", "compute_86", "compute_87", "compute_89",
    "compute_90", "compute_100", "compute_120",
]


def arguments():
    args, ptx_dir = list(sys.argv[1:]), None
    if "--ptx" in args:
        i = args.index("--ptx")
        if i + 1 >= len(args):
            sys.exit("--ptx needs a folder: --ptx DIR")
        ptx_dir = args[i + 1]
        del args[i : i + 2]
    return (args[0] if args else None), ptx_dir


def library(path):
    if path:
        return path
    try:
        import nvidia.cuda_nvrtc  # the wheel's package
    except ImportError:
        sys.exit("NVRTC not found: pip install nvidia-cuda-nvrtc-cu12, or pass the path of a libnvrtc.so")

    base = list(nvidia.cuda_nvrtc.__path__)[0]
    found = sorted(glob.glob(os.path.join(base, "lib", "libnvrtc.so.*")))
    if not found:
        sys.exit(f"no libnvrtc.so.* under {base}")
    return found[0]


def source():
    listing = open(os.path.join(SRC, "kernel_list.rs")).read()
    block = re.search(r"macro_rules! cu_files \{.*?\$then!\((.*?)\)", listing, re.S)
    files = re.findall(r'"([^"]+\.cu)"', block.group(1)) if block else []
    if not files:
        sys.exit("crates/kernels-cuda/src/kernel_list.rs: no `cu_files!` list of .cu files found")
    return files, "".join(open(os.path.join(SRC, f)).read() for f in files).encode()


def compile_for(lib, src, arch, ptx_dir):
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"fathom.cu", 0, None, None)
    if rc != 0:
        sys.exit(f"nvrtcCreateProgram failed ({rc})")
    defines = os.environ.get("FATHOM_CUDA_DEFINES", "").replace(",", " ").split()
    opts = OPTIONS + [b"-D" + d.encode() for d in defines] + [b"--gpu-architecture=" + arch.encode()]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    ptx = 0
    if rc == 0:
        if lib.nvrtcGetPTXSize(prog, ctypes.byref(size)) != 0:
            sys.exit(f"{arch}: nvrtcGetPTXSize failed")
        ptx = size.value
        if ptx_dir:
            text = ctypes.create_string_buffer(ptx)
            if lib.nvrtcGetPTX(prog, text) != 0:
                sys.exit(f"{arch}: nvrtcGetPTX failed")
            os.makedirs(ptx_dir, exist_ok=True)
            with open(os.path.join(ptx_dir, arch + ".ptx"), "w") as f:
                f.write(text.value.decode())
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(errors="replace"), ptx


def main():
    given, ptx_dir = arguments()
    path = library(given)
    lib = ctypes.CDLL(path)
    major, minor = ctypes.c_int(), ctypes.c_int()
    if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
        sys.exit(f"{path}: nvrtcVersion failed (not an NVRTC library?)")
    files, src = source()
    failed = False
    for arch in ARCHS:
        rc, log, ptx = compile_for(lib, src, arch, ptx_dir)
        if rc != 0:
            failed = True
            print(f"{arch}: NVRTC refused the kernels (error {rc}):\n{log}")
        else:
            print(f"{arch}: {ptx} bytes of PTX")
    print(f"NVRTC {major.value}.{minor.value} ({path}); files: {', '.join(files)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
