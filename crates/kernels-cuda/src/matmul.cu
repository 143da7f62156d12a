// Matrix products y[T, rows] = x[T, cols] · Wᵀ on the GPU, with the reduction
// order of fathom's CPU kernels (fathom-kernels `formats::block_scalar`):
// one warp per weight row; lane l accumulates fmaf(x[i], w[i], acc) over the
// columns i = l, l + 32, l + 64, … (a lane past the end adds fmaf(0, 0, acc)),
// then the 32 partial sums fold in halves, acc[i] += acc[i + h] for
// h = 16, 8, 4, 2, 1, which is a shuffle-down reduction; then the format's
// finish (int8: · scale[r]). Every weight is decoded exactly as on the CPU.
// Compiled by NVRTC with --fmad=false --ftz=false: no contraction, denormals kept.

#define TP 8  // positions accumulated per pass over a weight row

__device__ __forceinline__ float fold32(float a) {
#pragma unroll
    for (int h = 16; h > 0; h >>= 1) a += __shfl_down_sync(0xffffffffu, a, h);
    return a;
}

__device__ __forceinline__ float bf16f(unsigned short b) {
    return __uint_as_float(((unsigned)b) << 16);
}

__device__ __forceinline__ float e2m1(unsigned code) {
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float m = mag[code & 7u];
    return (code & 8u) ? -m : m;
}

__device__ __forceinline__ float e8m0(unsigned char b) {
    if (b == 0xFF) return __uint_as_float(0x7FC00000u);
    if (b == 0) return __uint_as_float(0x00400000u);
    return __uint_as_float(((unsigned)b) << 23);
}

template <typename At, typename Fin>
__device__ __forceinline__ void rows_product(At at, Fin fin, const float* __restrict__ x,
                                             float* __restrict__ y, int rows, int cols, int t) {
    const int r = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;  // whole warps leave together
    for (int j0 = 0; j0 < t; j0 += TP) {
        float acc[TP];
#pragma unroll
        for (int k = 0; k < TP; ++k) acc[k] = 0.0f;
        for (int c = 0; c < cols; c += 32) {
            const int i = c + lane;
            const bool in = i < cols;
            const float wv = in ? at(r, i) : 0.0f;
#pragma unroll
            for (int k = 0; k < TP; ++k) {
                if (j0 + k < t) {
                    const float xv = in ? x[(size_t)(j0 + k) * cols + i] : 0.0f;
                    acc[k] = fmaf(xv, wv, acc[k]);
                }
            }
        }
#pragma unroll
        for (int k = 0; k < TP; ++k) {
            const float s = fold32(acc[k]);
            if (lane == 0 && j0 + k < t) y[(size_t)(j0 + k) * rows + r] = fin(r, s);
        }
    }
}

extern "C" __global__ void mm_f32(const float* __restrict__ w, const float* __restrict__ x,
                                  float* __restrict__ y, int rows, int cols, int t) {
    rows_product([=](int r, int i) { return w[(size_t)r * cols + i]; },
                 [](int, float s) { return s; }, x, y, rows, cols, t);
}

extern "C" __global__ void mm_bf16(const unsigned short* __restrict__ w,
                                   const float* __restrict__ x, float* __restrict__ y, int rows,
                                   int cols, int t) {
    rows_product([=](int r, int i) { return bf16f(w[(size_t)r * cols + i]); },
                 [](int, float s) { return s; }, x, y, rows, cols, t);
}

extern "C" __global__ void mm_int8(const signed char* __restrict__ q,
                                   const float* __restrict__ scale, const float* __restrict__ x,
                                   float* __restrict__ y, int rows, int cols, int t) {
    rows_product([=](int r, int i) { return (float)q[(size_t)r * cols + i]; },
                 [=](int r, float s) { return s * scale[r]; }, x, y, rows, cols, t);
}

extern "C" __global__ void mm_mxfp4(const unsigned char* __restrict__ packed,
                                    const unsigned char* __restrict__ scales,
                                    const float* __restrict__ x, float* __restrict__ y, int rows,
                                    int cols, int t) {
    rows_product(
        [=](int r, int i) {
            const size_t e = (size_t)r * cols + i;
            const unsigned b = packed[e >> 1];
            const unsigned code = (i & 1) ? (b >> 4) : (b & 0x0Fu);
            return e2m1(code) * e8m0(scales[e >> 5]);
        },
        [](int, float s) { return s; }, x, y, rows, cols, t);
}

// E4M3 codes with block scales: value = e4m3[q] · scale[((row0 + r) >> sh_r) · grid_cols + (i >> sh_c)].
extern "C" __global__ void mm_fp8(const unsigned char* __restrict__ q,
                                  const float* __restrict__ scale, const float* __restrict__ e4m3,
                                  int row0, int sh_r, int sh_c, int grid_cols,
                                  const float* __restrict__ x, float* __restrict__ y, int rows,
                                  int cols, int t) {
    rows_product(
        [=](int r, int i) {
            const float s = scale[(size_t)((row0 + r) >> sh_r) * grid_cols + (i >> sh_c)];
            return e4m3[q[(size_t)r * cols + i]] * s;
        },
        [](int, float s) { return s; }, x, y, rows, cols, t);
}

// Symmetric INT4 (code − 8) with bf16 group scales: scale[(r·cols + i) >> sh_g].
extern "C" __global__ void mm_int4(const unsigned char* __restrict__ packed,
                                   const unsigned short* __restrict__ scale, int sh_g,
                                   const float* __restrict__ x, float* __restrict__ y, int rows,
                                   int cols, int t) {
    rows_product(
        [=](int r, int i) {
            const size_t e = (size_t)r * cols + i;
            const unsigned b = packed[e >> 1];
            const unsigned code = (i & 1) ? (b >> 4) : (b & 0x0Fu);
            return (float)((int)(code & 0x0Fu) - 8) * bf16f(scale[e >> sh_g]);
        },
        [](int, float s) { return s; }, x, y, rows, cols, t);
}
