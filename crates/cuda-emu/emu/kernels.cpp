// fathom's CUDA kernels (fathom-kernels-cuda/src/*.cu, concatenated in the
// order the backend hands them to NVRTC) built for the host emulator, each
// behind a C entry point that takes the launch's shape first.
#include "emu.h"

#include "../../kernels-cuda/src/matmul.cu"
#include "../../kernels-cuda/src/grouped.cu"
#include "../../kernels-cuda/src/kda.cu"
#include "../../kernels-cuda/src/glu.cu"
#include "../../kernels-cuda/src/mla.cu"
#include "../../kernels-cuda/src/gqa.cu"

struct EmuLaunch {
    unsigned grid_x, grid_y, grid_z, block_x;
    unsigned shared;
};

static void run(const EmuLaunch* l, const std::function<void()>& body) {
    emu::launch(dim3{l->grid_x, l->grid_y, l->grid_z}, dim3{l->block_x, 1, 1}, l->shared, body);
}

#define MM_TAIL const float *x, float *y, int rows, int cols, int t, int rows_g
#define MM_ARGS x, y, rows, cols, t, rows_g

extern "C" {

void emu_mm_f32(const EmuLaunch* l, const float* w, MM_TAIL) {
    run(l, [&] { mm_f32(w, MM_ARGS); });
}

// bf16 takes the kernels the CUDA backend picks (device/queue.rs): the
// staged ones for several positions.
void emu_mm_bf16(const EmuLaunch* l, const unsigned short* w, MM_TAIL) {
    if (t > 1) {
        run(l, [&] { mm_bf16_rows(w, MM_ARGS); });
    } else {
        run(l, [&] { mm_bf16(w, MM_ARGS); });
    }
}

void emu_mm_int8(const EmuLaunch* l, const signed char* q, const float* scale, MM_TAIL) {
    run(l, [&] { mm_int8(q, scale, MM_ARGS); });
}

void emu_mm_mxfp4(const EmuLaunch* l, const unsigned char* packed, const unsigned char* scales,
                  MM_TAIL) {
    run(l, [&] { mm_mxfp4(packed, scales, MM_ARGS); });
}

void emu_mm_fp8(const EmuLaunch* l, const unsigned char* q, const float* scale,
                const float* e4m3, int row0, int sh_r, int sh_c, int grid_cols, MM_TAIL) {
    run(l, [&] { mm_fp8(q, scale, e4m3, row0, sh_r, sh_c, grid_cols, MM_ARGS); });
}

void emu_mm_int4(const EmuLaunch* l, const unsigned char* packed, const unsigned short* scale,
                 int sh_g, MM_TAIL) {
    run(l, [&] { mm_int4(packed, scale, sh_g, MM_ARGS); });
}

void emu_mm_bf16_many(const EmuLaunch* l, const unsigned long long* tab, int rows, int cols,
                      int t) {
    if (t > 1) {
        run(l, [&] { mm_bf16_rows_many(tab, rows, cols, t); });
    } else {
        run(l, [&] { mm_bf16_many(tab, rows, cols, t); });
    }
}

void emu_bf16_lanes(const EmuLaunch* l, unsigned short* w, int rows, int cols) {
    run(l, [&] { bf16_lanes(w, rows, cols); });
}

void emu_mxfp4_lanes(const EmuLaunch* l, unsigned* packed, int rows, int cols) {
    run(l, [&] { mxfp4_lanes(packed, rows, cols); });
}

void emu_mm_mxfp4_many(const EmuLaunch* l, const unsigned long long* tab, int rows, int cols,
                       int t) {
    run(l, [&] { mm_mxfp4_many(tab, rows, cols, t); });
}

void emu_glu_act(const EmuLaunch* l, float* g, const float* u, long long n, int kind, float beta,
                 float beta_lin) {
    run(l, [&] { glu_act(g, u, n, kind, beta, beta_lin); });
}

void emu_moe_combine(const EmuLaunch* l, const float* o, const unsigned* off, const float* w,
                     int k, int width, int norm, const float* nw, float eps, float* s) {
    run(l, [&] { moe_combine(o, off, w, k, width, norm, nw, eps, s); });
}

}  // extern "C"

extern "C" void emu_kda_step(const EmuLaunch* l, float* S, float* win_q, float* win_k,
                             float* win_v, const float* pre_q, const float* pre_k,
                             const float* pre_v, const float* f, const float* b, const float* g,
                             const float* taps_q, const float* taps_k, const float* taps_v,
                             const float* a, const float* dt, const float* onorm, float* out,
                             int row0, int t, int heads, int kd, int kernel, float q_scale,
                             float l2_eps, float norm_eps, int bounded, float lb, float* hin,
                             int n_rows) {
    run(l, [&] {
        kda_step(S, win_q, win_k, win_v, pre_q, pre_k, pre_v, f, b, g, taps_q, taps_k, taps_v, a,
                 dt, onorm, out, row0, t, heads, kd, kernel, q_scale, l2_eps, norm_eps, bounded, lb, hin,
                 n_rows);
    });
}

extern "C" void emu_mla_split(const EmuLaunch* l, const unsigned long long* blocks,
                              const int* boff, const float* q_lat, long long q_qs, long long q_hs,
                              const float* q_rope, const int* ns, int heads, int lora, int rope,
                              float scale, int max_splits, float* ps, float* pm, float* pl,
                              float* pc) {
    run(l, [&] {
        mla_split(blocks, boff, q_lat, q_qs, q_hs, q_rope, ns, heads, lora, rope, scale,
                  max_splits, ps, pm, pl, pc);
    });
}

extern "C" void emu_mla_merge(const EmuLaunch* l, const int* ns, int heads, int lora,
                              int max_splits, const float* pm, const float* pl, const float* pc,
                              float* out, long long o_qs, long long o_hs) {
    run(l, [&] { mla_merge(ns, heads, lora, max_splits, pm, pl, pc, out, o_qs, o_hs); });
}

extern "C" void emu_mla_gate(const EmuLaunch* l, const float* vals, const float* gate, int gated,
                             int heads, int t, int dv, float* cat) {
    run(l, [&] { mla_gate(vals, gate, gated, heads, t, dv, cat); });
}
