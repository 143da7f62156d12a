// A stand-in for NVRTC (libnvrtc.so) beside the emulated driver
// (driver.cpp). "Compiling" checks what the emulator takes for granted:
// that the program is exactly the kernels' source the emulated driver was
// built from (the .cu files in the backend's order), and that the options
// ask for the arithmetic the emulator does (no FMA contraction, denormals
// kept, IEEE division and square root). The "PTX" is a marker the emulated
// driver's cuModuleLoadData accepts and a real driver refuses.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <string>

#include "emu_ptx.h"
#include "emu_source.h"  // EMU_SOURCE: the .cu files, concatenated

#define API extern "C" __attribute__((visibility("default")))

typedef int nvrtcResult;
enum : int {
    NVRTC_OK = 0,
    NVRTC_ERROR_INVALID_INPUT = 3,
    NVRTC_ERROR_INVALID_PROGRAM = 4,
    NVRTC_ERROR_COMPILATION = 6,
};

struct Program {
    std::string src;
    std::string log;
    bool compiled = false;
};

API const char* nvrtcGetErrorString(nvrtcResult r) {
    switch (r) {
        case NVRTC_OK: return "NVRTC_SUCCESS";
        case NVRTC_ERROR_COMPILATION: return "NVRTC_ERROR_COMPILATION";
        default: return "NVRTC_ERROR (emulated)";
    }
}

// Not a real version, so the backend's PTX cache (keyed by NVRTC's
// version) never hands this marker to a real driver.
API nvrtcResult nvrtcVersion(int* major, int* minor) {
    *major = 0;
    *minor = 1;
    return NVRTC_OK;
}

API nvrtcResult nvrtcCreateProgram(void** prog, const char* src, const char*, int,
                                   const char* const*, const char* const*) {
    if (!prog || !src) return NVRTC_ERROR_INVALID_INPUT;
    *prog = new Program{src, "", false};
    return NVRTC_OK;
}

API nvrtcResult nvrtcDestroyProgram(void** prog) {
    if (!prog || !*prog) return NVRTC_ERROR_INVALID_PROGRAM;
    delete static_cast<Program*>(*prog);
    *prog = nullptr;
    return NVRTC_OK;
}

API nvrtcResult nvrtcCompileProgram(void* prog, int n, const char* const* opts) {
    auto* p = static_cast<Program*>(prog);
    if (!p) return NVRTC_ERROR_INVALID_PROGRAM;
    if (p->src != EMU_SOURCE) {
        p->log = "emulated NVRTC: the program is not the kernels' source this emulator was "
                 "built from (fathom-kernels-cuda's .cu files in SOURCE's order)";
        return NVRTC_ERROR_COMPILATION;
    }
    // The last setting of each option counts, as in NVRTC.
    const char* wanted[] = {"--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true"};
    for (const char* w : wanted) {
        const size_t key = strchr(w, '=') - w + 1;
        const char* last = nullptr;
        for (int i = 0; i < n; ++i)
            if (strncmp(opts[i], w, key) == 0) last = opts[i];
        if (!last || strcmp(last, w) != 0) {
            p->log = std::string("emulated NVRTC: the options do not end with ") + w +
                     ", which the kernels' bit-exactness (and this emulator) assume";
            return NVRTC_ERROR_COMPILATION;
        }
    }
    for (int i = 0; i < n; ++i)
        if (strstr(opts[i], "fast_math") || strstr(opts[i], "fast-math")) {
            p->log = std::string("emulated NVRTC: ") + opts[i] + " changes the kernels' rounding";
            return NVRTC_ERROR_COMPILATION;
        }
    p->compiled = true;
    return NVRTC_OK;
}

API nvrtcResult nvrtcGetProgramLogSize(void* prog, size_t* n) {
    *n = static_cast<Program*>(prog)->log.size() + 1;
    return NVRTC_OK;
}

API nvrtcResult nvrtcGetProgramLog(void* prog, char* out) {
    const std::string& l = static_cast<Program*>(prog)->log;
    memcpy(out, l.c_str(), l.size() + 1);
    return NVRTC_OK;
}

API nvrtcResult nvrtcGetPTXSize(void* prog, size_t* n) {
    if (!static_cast<Program*>(prog)->compiled) return NVRTC_ERROR_INVALID_PROGRAM;
    *n = strlen(EMU_PTX_MARK) + 1;
    return NVRTC_OK;
}

API nvrtcResult nvrtcGetPTX(void* prog, char* out) {
    if (!static_cast<Program*>(prog)->compiled) return NVRTC_ERROR_INVALID_PROGRAM;
    memcpy(out, EMU_PTX_MARK, strlen(EMU_PTX_MARK) + 1);
    return NVRTC_OK;
}
