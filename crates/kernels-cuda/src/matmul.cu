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

// E2M1 by its bits (no table: a dynamically indexed array lives in local
// memory): exponent e = bits 2..1, mantissa m = bit 0; e = 0 gives 0 or 0.5,
// else (1 + m/2)·2^(e−1). The same values as the CPU's table, sign included.
__device__ __forceinline__ float e2m1(unsigned code) {
    const unsigned e = (code >> 1) & 3u, m = code & 1u;
    const float v = e ? __uint_as_float(((e + 126u) << 23) | (m << 22)) : (m ? 0.5f : 0.0f);
    return (code & 8u) ? -v : v;
}

__device__ __forceinline__ float e8m0(unsigned char b) {
    if (b == 0xFF) return __uint_as_float(0x7FC00000u);
    if (b == 0) return __uint_as_float(0x00400000u);
    return __uint_as_float(((unsigned)b) << 23);
}

// Columns per lane loaded before they are accumulated: the loads of a chunk
// are in flight together, the fused multiply-adds still run in column order.
#define UNROLL 8

// One pass of P positions over row r: lane `lane`'s sums over the columns
// lane, lane + 32, … in that order (full chunks of UNROLL·32 columns first,
// their loads issued together, then the tail one column per lane at a time).
template <int P, typename At>
__device__ __forceinline__ void row_pass(At at, const float* __restrict__ x, int r, int lane,
                                         int cols, int j0, int t, float (&acc)[P]) {
    const int full = cols - cols % (UNROLL * 32);
    for (int c = 0; c < full; c += UNROLL * 32) {
        float wv[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) wv[u] = at(r, c + u * 32 + lane);
#pragma unroll
        for (int k = 0; k < P; ++k) {
            if (j0 + k < t) {
                const float* xr = x + (size_t)(j0 + k) * cols + c + lane;
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) acc[k] = fmaf(xr[u * 32], wv[u], acc[k]);
            }
        }
    }
    for (int c = full; c < cols; c += 32) {
        const int i = c + lane;
        const bool in = i < cols;
        const float wv = in ? at(r, i) : 0.0f;
#pragma unroll
        for (int k = 0; k < P; ++k) {
            if (j0 + k < t) {
                const float xv = in ? x[(size_t)(j0 + k) * cols + i] : 0.0f;
                acc[k] = fmaf(xv, wv, acc[k]);
            }
        }
    }
}

// Row r's results for every position, written at column `out` of y's
// `[t, rows_out]` rows.
template <int P, typename At, typename Fin>
__device__ __forceinline__ void rows_product_p(At at, Fin fin, const float* __restrict__ x,
                                               float* __restrict__ y, int r, int out, int lane,
                                               int rows_out, int cols, int t) {
    for (int j0 = 0; j0 < t; j0 += P) {
        float acc[P];
#pragma unroll
        for (int k = 0; k < P; ++k) acc[k] = 0.0f;
        row_pass<P>(at, x, r, lane, cols, j0, t, acc);
#pragma unroll
        for (int k = 0; k < P; ++k) {
            const float s = fold32(acc[k]);
            if (lane == 0 && j0 + k < t) y[(size_t)(j0 + k) * rows_out + out] = fin(r, s);
        }
    }
}

// A position's sums do not depend on how many positions share the call:
// each position has its own accumulators with the same column order.
// Grouped products: the rows split into blocks of rows_g (rows_g == rows for
// one product); block g reads its own x[g] = x + g·t·cols and writes
// y[g] = y + g·t·rows_g. A row's sums are the same in either form.
template <typename At, typename Fin>
__device__ __forceinline__ void rows_product(At at, Fin fin, const float* __restrict__ x,
                                             float* __restrict__ y, int rows, int cols, int t,
                                             int rows_g) {
    const int r = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;  // whole warps leave together
    const int g = r / rows_g;
    const float* xg = x + (size_t)g * t * cols;
    float* yg = y + (size_t)g * t * rows_g;
    const int out = r - g * rows_g;
    if (t == 1) {
        rows_product_p<1>(at, fin, xg, yg, r, out, lane, rows_g, cols, t);
    } else {
        rows_product_p<TP>(at, fin, xg, yg, r, out, lane, rows_g, cols, t);
    }
}

extern "C" __global__ void mm_f32(const float* __restrict__ w, const float* __restrict__ x,
                                  float* __restrict__ y, int rows, int cols, int t,
                                  int rows_g) {
    rows_product([=](int r, int i) { return w[(size_t)r * cols + i]; },
                 [](int, float s) { return s; }, x, y, rows, cols, t, rows_g);
}

extern "C" __global__ void mm_bf16(const unsigned short* __restrict__ w,
                                   const float* __restrict__ x, float* __restrict__ y, int rows,
                                   int cols, int t, int rows_g) {
    rows_product([=](int r, int i) { return bf16f(w[(size_t)r * cols + i]); },
                 [](int, float s) { return s; }, x, y, rows, cols, t, rows_g);
}

extern "C" __global__ void mm_int8(const signed char* __restrict__ q,
                                   const float* __restrict__ scale, const float* __restrict__ x,
                                   float* __restrict__ y, int rows, int cols, int t,
                                  int rows_g) {
    rows_product([=](int r, int i) { return (float)q[(size_t)r * cols + i]; },
                 [=](int r, float s) { return s * scale[r]; }, x, y, rows, cols, t, rows_g);
}

extern "C" __global__ void mm_mxfp4(const unsigned char* __restrict__ packed,
                                    const unsigned char* __restrict__ scales,
                                    const float* __restrict__ x, float* __restrict__ y, int rows,
                                    int cols, int t, int rows_g) {
    rows_product(
        [=](int r, int i) {
            const size_t e = (size_t)r * cols + i;
            const unsigned b = packed[e >> 1];
            const unsigned code = (i & 1) ? (b >> 4) : (b & 0x0Fu);
            return e2m1(code) * e8m0(scales[e >> 5]);
        },
        [](int, float s) { return s; }, x, y, rows, cols, t, rows_g);
}

// E4M3 codes with block scales: value = e4m3[q] · scale[((row0 + r) >> sh_r) · grid_cols + (i >> sh_c)].
extern "C" __global__ void mm_fp8(const unsigned char* __restrict__ q,
                                  const float* __restrict__ scale, const float* __restrict__ e4m3,
                                  int row0, int sh_r, int sh_c, int grid_cols,
                                  const float* __restrict__ x, float* __restrict__ y, int rows,
                                  int cols, int t, int rows_g) {
    rows_product(
        [=](int r, int i) {
            const float s = scale[(size_t)((row0 + r) >> sh_r) * grid_cols + (i >> sh_c)];
            return e4m3[q[(size_t)r * cols + i]] * s;
        },
        [](int, float s) { return s; }, x, y, rows, cols, t, rows_g);
}

// Symmetric INT4 (code − 8) with bf16 group scales: scale[(r·cols + i) >> sh_g].
extern "C" __global__ void mm_int4(const unsigned char* __restrict__ packed,
                                   const unsigned short* __restrict__ scale, int sh_g,
                                   const float* __restrict__ x, float* __restrict__ y, int rows,
                                   int cols, int t, int rows_g) {
    rows_product(
        [=](int r, int i) {
            const size_t e = (size_t)r * cols + i;
            const unsigned b = packed[e >> 1];
            const unsigned code = (i & 1) ? (b >> 4) : (b & 0x0Fu);
            return (float)((int)(code & 0x0Fu) - 8) * bf16f(scale[e >> sh_g]);
        },
        [](int, float s) { return s; }, x, y, rows, cols, t, rows_g);
}
