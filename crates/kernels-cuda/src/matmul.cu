// Matrix products y[T, rows] = x[T, cols] · Wᵀ on the GPU, with the reduction
// order of fathom's CPU kernels (fathom-kernels `formats::block_scalar`):
// a warp per weight row (two rows with their own sums for bf16, and for
// MXFP4 with one position); lane l accumulates fmaf(x[i], w[i], acc) over the
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

// E2M1 by its bits: exponent e = bits 2..1, mantissa m = bit 0; e = 0 gives
// 0 or 0.5, else (1 + m/2)·2^(e−1). The same values as the CPU's table, sign
// included. The MXFP4 kernels build their shared-memory table with it.
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
#define CHUNK (UNROLL * 32)
#define FULL 0xffffffffu

// A chunk loader: `load(r, c, lane)` issues the loads of the full chunk of
// CHUNK columns starting at c and returns them raw; `decode(raw, lane, wv)`
// fills wv[u] = W[r][c + lane + 32u] for u < UNROLL. `plain` reads each
// value with `at` (the load is the decode); a format may load its bytes more
// widely and hand them round the warp. A pass issues the loads of G chunks
// before it decodes and accumulates the first (G = 1: one chunk at a time).
template <typename At>
struct Plain {
    At at;
    struct Raw {
        float v[UNROLL];
    };
    __device__ __forceinline__ Raw load(int r, int c, int lane) const {
        Raw raw;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) raw.v[u] = at(r, c + u * 32 + lane);
        return raw;
    }
    __device__ __forceinline__ void decode(const Raw& raw, int, float (&wv)[UNROLL]) const {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) wv[u] = raw.v[u];
    }
};

template <typename At>
__device__ __forceinline__ Plain<At> plain(At at) {
    return Plain<At>{at};
}

// P positions' sums over one decoded chunk at column c, in column order.
template <int P>
__device__ __forceinline__ void chunk_fma(const float* __restrict__ x, const float (&wv)[UNROLL],
                                          int c, int lane, int cols, int j0, int t,
                                          float (&acc)[P]) {
#pragma unroll
    for (int k = 0; k < P; ++k) {
        if (j0 + k < t) {
            const float* xr = x + (size_t)(j0 + k) * cols + c + lane;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) acc[k] = fmaf(xr[u * 32], wv[u], acc[k]);
        }
    }
}

// One pass of P positions over row r: lane `lane`'s sums over the columns
// lane, lane + 32, … in that order (full chunks first, G chunks' loads
// issued together, then the tail one column per lane at a time).
template <int G, int P, typename Chunk, typename At>
__device__ __forceinline__ void row_pass(const Chunk& chunk, At at, const float* __restrict__ x,
                                         int r, int lane, int cols, int j0, int t,
                                         float (&acc)[P]) {
    using Raw = decltype(chunk.load(r, 0, lane));
    const int full = cols - cols % CHUNK;
    int c = 0;
    for (; c + G * CHUNK <= full; c += G * CHUNK) {
        Raw raw[G];
#pragma unroll
        for (int g = 0; g < G; ++g) raw[g] = chunk.load(r, c + g * CHUNK, lane);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float wv[UNROLL];
            chunk.decode(raw[g], lane, wv);
            chunk_fma<P>(x, wv, c + g * CHUNK, lane, cols, j0, t, acc);
        }
    }
    for (; c < full; c += CHUNK) {
        float wv[UNROLL];
        chunk.decode(chunk.load(r, c, lane), lane, wv);
        chunk_fma<P>(x, wv, c, lane, cols, j0, t, acc);
    }
    for (c = full; c < cols; c += 32) {
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
template <int G, int P, typename Chunk, typename At, typename Fin>
__device__ __forceinline__ void rows_product_p(const Chunk& chunk, At at, Fin fin,
                                               const float* __restrict__ x,
                                               float* __restrict__ y, int r, int out, int lane,
                                               int rows_out, int cols, int t) {
    for (int j0 = 0; j0 < t; j0 += P) {
        float acc[P];
#pragma unroll
        for (int k = 0; k < P; ++k) acc[k] = 0.0f;
        row_pass<G, P>(chunk, at, x, r, lane, cols, j0, t, acc);
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
// y[g] = y + g·t·rows_g. A row's sums are the same in either form. Row r's
// results (a warp of `rows_product`, which gives warp w row w).
template <int G, typename Chunk, typename At, typename Fin>
__device__ __forceinline__ void rows_product_row(const Chunk& chunk, At at, Fin fin,
                                                 const float* __restrict__ x,
                                                 float* __restrict__ y, int r, int lane,
                                                 int cols, int t, int rows_g) {
    const int g = r / rows_g;
    const float* xg = x + (size_t)g * t * cols;
    float* yg = y + (size_t)g * t * rows_g;
    const int out = r - g * rows_g;
    if (t == 1) {
        rows_product_p<G, 1>(chunk, at, fin, xg, yg, r, out, lane, rows_g, cols, t);
    } else {
        rows_product_p<G, TP>(chunk, at, fin, xg, yg, r, out, lane, rows_g, cols, t);
    }
}

template <int G, typename Chunk, typename At, typename Fin>
__device__ __forceinline__ void rows_product(const Chunk& chunk, At at, Fin fin,
                                             const float* __restrict__ x, float* __restrict__ y,
                                             int rows, int cols, int t, int rows_g) {
    const int r = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= rows) return;  // whole warps leave together
    rows_product_row<G>(chunk, at, fin, x, y, r, lane, cols, t, rows_g);
}

// Each kernel: `at(r, i)` decodes one weight as the CPU does, `fin` is the
// format's finish; `plain(at)` loads full chunks with it unless the format
// has a wider loader.
#define PRODUCT(at, fin) rows_product<1>(plain(at), at, fin, x, y, rows, cols, t, rows_g)
#define SAME [](int, float s) { return s; }

extern "C" __global__ void mm_f32(const float* __restrict__ w, const float* __restrict__ x,
                                  float* __restrict__ y, int rows, int cols, int t, int rows_g) {
    auto at = [=](int r, int i) { return w[(size_t)r * cols + i]; };
    PRODUCT(at, SAME);
}

// A lane's sums over one chunk of a row (columns c + lane + 32u, in order).
__device__ __forceinline__ void sum_chunk(const float* __restrict__ x, const float (&w)[UNROLL],
                                          int c, int lane, float& a) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) a = fmaf(x[c + u * 32 + lane], w[u], a);
}

// Two rows' sums over one chunk each (columns c + lane + 32u, in order) when
// the rows read the same input: each input value loaded once for both.
__device__ __forceinline__ void sum_chunk2(const float* __restrict__ x,
                                           const float (&w0)[UNROLL],
                                           const float (&w1)[UNROLL], int c, int lane,
                                           float& a0, float& a1) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const float xv = x[c + u * 32 + lane];
        a0 = fmaf(xv, w0[u], a0);
        a1 = fmaf(xv, w1[u], a1);
    }
}

// Both rows' sums over the chunk at c: the input loaded once when the rows
// share it (`same`), else each row's own.
__device__ __forceinline__ void sum_pair(const float* __restrict__ x0,
                                         const float* __restrict__ x1, bool same,
                                         const float (&w0)[UNROLL], const float (&w1)[UNROLL],
                                         int c, int lane, float& a0, float& a1) {
    if (same) {
        sum_chunk2(x0, w0, w1, c, lane, a0, a1);
    } else {
        sum_chunk(x0, w0, c, lane, a0);
        sum_chunk(x1, w1, c, lane, a1);
    }
}

// Rows r0 and r0 + 1 (when there is one) of `rows2_product1`.
template <int G, typename Chunk, typename At>
__device__ __forceinline__ void pair_product1(const Chunk& chunk, At at,
                                              const float* __restrict__ x,
                                              float* __restrict__ y, int r0, int rows, int cols,
                                              int rows_g, int lane) {
    using Raw = decltype(chunk.load(0, 0, 0));
    const bool two = r0 + 1 < rows;
    const int r1 = two ? r0 + 1 : r0;
    const float* x0 = x + (size_t)(r0 / rows_g) * cols;
    const float* x1 = x + (size_t)(r1 / rows_g) * cols;
    const bool same = x0 == x1;  // the same for the whole warp
    float a0 = 0.0f, a1 = 0.0f;
    const int full = cols - cols % CHUNK;
    int c = 0;
    // G chunks of both rows loaded, then summed chunk by chunk.
    for (; c + G * CHUNK <= full; c += G * CHUNK) {
        Raw raw[2 * G];
#pragma unroll
        for (int g = 0; g < G; ++g) {
            raw[2 * g] = chunk.load(r0, c + g * CHUNK, lane);
            raw[2 * g + 1] = chunk.load(r1, c + g * CHUNK, lane);
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float w0[UNROLL], w1[UNROLL];
            chunk.decode(raw[2 * g], lane, w0);
            chunk.decode(raw[2 * g + 1], lane, w1);
            sum_pair(x0, x1, same, w0, w1, c + g * CHUNK, lane, a0, a1);
        }
    }
    for (; c < full; c += CHUNK) {
        const Raw raw0 = chunk.load(r0, c, lane), raw1 = chunk.load(r1, c, lane);
        float w0[UNROLL], w1[UNROLL];
        chunk.decode(raw0, lane, w0);
        chunk.decode(raw1, lane, w1);
        sum_pair(x0, x1, same, w0, w1, c, lane, a0, a1);
    }
    for (c = full; c < cols; c += 32) {
        const int i = c + lane;
        const bool in = i < cols;
        a0 = fmaf(in ? x0[i] : 0.0f, in ? at(r0, i) : 0.0f, a0);
        a1 = fmaf(in ? x1[i] : 0.0f, in ? at(r1, i) : 0.0f, a1);
    }
    const float s0 = fold32(a0), s1 = fold32(a1);
    if (lane == 0) {
        y[r0] = s0;
        if (two) y[r1] = s1;
    }
}

// The row pairs r0 (rows r0 and r0 + 1) of this warp, as `rows2_product1`
// below strides them: pair(r0, lane) for each.
template <typename Pair>
__device__ __forceinline__ void rows2_pairs(int rows, int bx, int nbx, Pair pair) {
    const int stride = 2 * nbx * (int)(blockDim.x >> 5);
    const int lane = threadIdx.x & 31;
    // Whole warps leave together.
    for (int r0 = (int)((bx * blockDim.x + threadIdx.x) >> 5) * 2; r0 < rows; r0 += stride)
        pair(r0, lane);
}

// One position (t == 1), two rows a warp (`rows_product`'s sums for each:
// its own accumulator, the same column order and fold) with G chunks of
// both rows' loads in flight together (`chunk`'s loader, so a format may
// load its bytes widely and hand them round the warp) and the input loaded
// once for both rows when they share it. Row r reads x + (r / rows_g)·cols
// and writes y[r]. The product's blocks are `nbx` (gridDim.x but in a set
// launch), this one `bx` among them: warp w of the W = nbx · blockDim/32
// takes the row pairs w, w + W, w + 2W, … — one pair when the launch has a
// block for every 2 · blockDim/32 rows; the host launches fewer, smaller
// blocks, each warp taking several pairs, when more warps than the device
// holds at once would fill their waves poorly (`launch.rs`). A row's sums
// do not depend on which warp makes them.
template <int G, typename Chunk, typename At>
__device__ __forceinline__ void rows2_product1(const Chunk& chunk, At at,
                                               const float* __restrict__ x,
                                               float* __restrict__ y, int rows, int cols,
                                               int rows_g, int bx, int nbx) {
    rows2_pairs(rows, bx, nbx, [&](int r0, int lane) {
        pair_product1<G>(chunk, at, x, y, r0, rows, cols, rows_g, lane);
    });
}

// bf16 in VRAM when cols is a multiple of 8 (each row then starts 16-byte
// aligned): each full chunk of 256 columns of a row (512 bytes) rearranged
// once, when its copy up lands (`bf16_lanes`), so that lane l's eight
// values — columns c + l + 32u, u = 0..7 — are 16 contiguous bytes, value u
// at half u. A warp's chunk is then one 512-byte load, a 16-byte load a
// lane. Columns past the last full chunk keep the host's layout (`at`).
// Sixteen bytes, so that a lane's share of a chunk is one 16-byte load.
struct __align__(16) U32x4 {
    unsigned x, y, z, w;
};

// The bf16 weights' loads leave the L1 cache alone
// (`ld.global.nc.L1::no_allocate`), so that the input, which every warp of
// a multiprocessor reads, stays there while the weights stream past. On an
// H100 at de442fa (where plain loads were the default), two runs each of
// `fathom run --model K3DIM --prompt-ids 1,2,3,4,5,6,7,8 --max-new 64
// --ignore-eos --experts resident --device cuda --context 4096 --json`
// (K3DIM: docs/bench.md) gave kernels of 3.99/3.96 ms a token
// (`stats.gpu_decode.kernel_ms`) plainly, 3.82/3.83 with
// FATHOM_CUDA_DEFINES=BF16_NA=1. BF16_NA=0 (a tuning knob) loads them
// plainly. The same bits either way (only where a value is cached changes).
// On a GPU only: the host emulator loads plainly.
#ifndef BF16_NA
#define BF16_NA 1
#endif

__device__ __forceinline__ U32x4 load_weights(const U32x4* p) {
#if BF16_NA && defined(__CUDA_ARCH__)
    U32x4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
#else
    return *p;
#endif
}

struct Bf16Lanes {
    const unsigned short* __restrict__ w;
    int cols;
    struct Raw {
        U32x4 v;
    };
    __device__ __forceinline__ Raw load(int r, int c, int lane) const {
        return Raw{load_weights(reinterpret_cast<const U32x4*>(w + (size_t)r * cols + c) + lane)};
    }
    __device__ __forceinline__ void decode(const Raw& raw, int, float (&wv)[UNROLL]) const {
        const unsigned q[4] = {raw.v.x, raw.v.y, raw.v.z, raw.v.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            wv[2 * u] = __uint_as_float(q[u] << 16);
            wv[2 * u + 1] = __uint_as_float(q[u] & 0xFFFF0000u);
        }
    }
};

// The rearrangement above, in place: a warp per full chunk (rows · cols/256
// warps), through shared memory. Every thread of the block reaches the
// barrier; a warp past the last chunk only waits.
extern "C" __global__ void bf16_lanes(unsigned short* __restrict__ w, int rows, int cols) {
    __shared__ __align__(16) unsigned short tile[8][CHUNK];
    const int per_row = cols >> 8;
    const long long k = (long long)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 7;
    const bool in = per_row > 0 && k < (long long)rows * per_row;
    U32x4* chunk = nullptr;
    if (in) {
        const long long r = k / per_row, j = k % per_row;
        chunk = reinterpret_cast<U32x4*>(w + (size_t)r * cols + (size_t)j * CHUNK);
        reinterpret_cast<U32x4*>(tile[warp])[lane] = chunk[lane];
    }
    __syncthreads();
    if (in) {
        unsigned q[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
            q[u] = (unsigned)tile[warp][lane + 64 * u] |
                   ((unsigned)tile[warp][lane + 64 * u + 32] << 16);
        chunk[lane] = U32x4{q[0], q[1], q[2], q[3]};
    }
}

// More than one position, two rows a warp (16 rows a block): each of the
// warp's rows summed on its own by `rows_product_p` (its inputs read from
// global memory). `mm_bf16`'s path for such launches, and `rows2_staged`'s
// for a block whose rows straddle two groups.
template <typename Chunk, typename At>
__device__ __forceinline__ void rows2_each(const Chunk& chunk, At at, const float* __restrict__ x,
                                           float* __restrict__ y, int rows, int cols, int t,
                                           int rows_g, int bx) {
    const int lane = threadIdx.x & 31;
    const int r0 = (int)((bx * blockDim.x + threadIdx.x) >> 5) * 2;
    for (int r = r0; r < r0 + 2 && r < rows; ++r) {
        const int g = r / rows_g;
        rows_product_p<1, TP>(chunk, at, SAME, x + (size_t)g * t * cols,
                              y + (size_t)g * t * rows_g, r, r - g * rows_g, lane, rows_g, cols,
                              t);
    }
}

#define XG 2
#define XS (2 * XG * TP * CHUNK)

// Stages inputs j0 .. j0 + np of columns c .. c + nc · CHUNK in `st`:
// st[(q · TP + k) · CHUNK + col] = input j0 + k's column c + q · CHUNK +
// col (0 past np or nc). Thread j stages column j of every (q, k), all its
// loads issued before the first store (a loop storing each load as it came
// waited out one round trip after another).
__device__ __forceinline__ void stage_inputs(float* st, const float* __restrict__ xg, int cols,
                                             int c, int j0, int nc, int np) {
    float v[XG * TP];
#pragma unroll
    for (int e = 0; e < XG * TP; ++e) {
        const int q = e / TP, k = e % TP;
        v[e] = q < nc && k < np ? xg[(size_t)(j0 + k) * cols + c + q * CHUNK + (int)threadIdx.x]
                                : 0.0f;
    }
#pragma unroll
    for (int e = 0; e < XG * TP; ++e) st[e * CHUNK + (int)threadIdx.x] = v[e];
}

// Rows r0 and r1's sums over the staged chunks of one pass (q < nc), for
// inputs k < np, in column order.
template <typename Chunk, typename Raw>
__device__ __forceinline__ void sum_staged(const Chunk& chunk, const Raw (&raw)[2 * XG],
                                           const float* st, int nc, int np, int lane,
                                           float (&a0)[TP], float (&a1)[TP]) {
#pragma unroll
    for (int q = 0; q < XG; ++q) {
        if (q >= nc) break;
        float w0[UNROLL], w1[UNROLL];
        chunk.decode(raw[2 * q], lane, w0);
        chunk.decode(raw[2 * q + 1], lane, w1);
#pragma unroll
        for (int k = 0; k < TP; ++k) {
            if (k >= np) break;
            const float* xk = st + (q * TP + k) * CHUNK + lane;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                a0[k] = fmaf(xk[32 * u], w0[u], a0[k]);
                a1[k] = fmaf(xk[32 * u], w1[u], a1[k]);
            }
        }
    }
}

// Rows r0 and r1's sums over the columns past the last full chunk (one a
// lane at a time, as `row_pass`), then folded and written for inputs
// j0 .. j0 + np at their places `o0`, `o1` among yg's rows_g (r1 only when
// `two`).
template <typename At>
__device__ __forceinline__ void finish_pair(At at, const float* __restrict__ xg,
                                            float* __restrict__ yg, int r0, int r1, bool two,
                                            int o0, int o1, int full, int cols, int rows_g,
                                            int j0, int np, int lane, float (&a0)[TP],
                                            float (&a1)[TP]) {
    for (int c = full; c < cols; c += 32) {
        const int i = c + lane;
        const bool in = i < cols;
        const float w0 = in ? at(r0, i) : 0.0f, w1 = in ? at(r1, i) : 0.0f;
#pragma unroll
        for (int k = 0; k < TP; ++k) {
            if (k < np) {
                const float xv = in ? xg[(size_t)(j0 + k) * cols + i] : 0.0f;
                a0[k] = fmaf(xv, w0, a0[k]);
                a1[k] = fmaf(xv, w1, a1[k]);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < TP; ++k) {
        const float s0 = fold32(a0[k]), s1 = fold32(a1[k]);
        if (lane == 0 && k < np) {
            yg[(size_t)(j0 + k) * rows_g + o0] = s0;
            if (two) yg[(size_t)(j0 + k) * rows_g + o1] = s1;
        }
    }
}

// More than one position, two rows a warp and 16 rows a block (the
// `mm_bf16_rows` kernels): each row's sums for every position as
// `rows_product` makes them (the same column order, the same fold). The
// block stages the positions' inputs of XG chunks at a time in shared
// memory `xs` (2 · XG · TP · CHUNK floats) once for its 16 rows (read from
// global memory by every warp, eight positions' inputs are 32 bytes for each
// 2-byte weight), the rows' weight chunks loaded before the staging. Two
// stages alternate, so one barrier a pass keeps a stage from being
// rewritten while a warp still reads it. A block whose rows straddle two
// groups (rows_g), or a launch of other than CHUNK (256) threads a block
// (the host launches 256), takes `rows2_each`: thread j stages column j.
template <typename Chunk, typename At>
__device__ __forceinline__ void rows2_staged(const Chunk& chunk, At at, float* xs,
                                             const float* __restrict__ x,
                                             float* __restrict__ y, int rows, int cols, int t,
                                             int rows_g, int bx) {
    using Raw = decltype(chunk.load(0, 0, 0));
    const int lane = threadIdx.x & 31;
    const int per_block = (int)(blockDim.x >> 4);
    const int rb = bx * per_block;
    const int r0 = (int)((bx * blockDim.x + threadIdx.x) >> 5) * 2;
    const int last = (rb + per_block < rows ? rb + per_block : rows) - 1;
    if (rb >= rows) return;  // no such block in the host's grids
    // Alike for the whole block: none of its threads skips a barrier.
    if (blockDim.x != CHUNK || rb / rows_g != last / rows_g) {
        rows2_each(chunk, at, x, y, rows, cols, t, rows_g, bx);
        return;
    }
    const int g = rb / rows_g;
    const float* xg = x + (size_t)g * t * cols;
    float* yg = y + (size_t)g * t * rows_g;
    const bool live = r0 < rows, two = r0 + 1 < rows;
    const int r1 = two ? r0 + 1 : r0;
    const int full = cols - cols % CHUNK;
    int stage = 0;
    for (int j0 = 0; j0 < t; j0 += TP) {
        const int np = t - j0 < TP ? t - j0 : TP;
        float a0[TP], a1[TP];
#pragma unroll
        for (int k = 0; k < TP; ++k) a0[k] = a1[k] = 0.0f;
        for (int c = 0; c < full; c += XG * CHUNK, stage ^= 1) {
            const int nc = (full - c) / CHUNK < XG ? (full - c) / CHUNK : XG;
            float* st = xs + stage * (XG * TP * CHUNK);
            Raw raw[2 * XG];
#pragma unroll
            for (int q = 0; q < XG; ++q) {
                if (live && q < nc) {
                    raw[2 * q] = chunk.load(r0, c + q * CHUNK, lane);
                    raw[2 * q + 1] = chunk.load(r1, c + q * CHUNK, lane);
                }
            }
            stage_inputs(st, xg, cols, c, j0, nc, np);
            __syncthreads();
            if (live) sum_staged(chunk, raw, st, nc, np, lane, a0, a1);
        }
        if (live)
            finish_pair(at, xg, yg, r0, r1, two, r0 - g * rows_g, r1 - g * rows_g, full, cols,
                        rows_g, j0, np, lane, a0, a1);
    }
}

// bf16 products, two rows a warp (16 rows a block of 256): with one
// position G chunks of both rows in flight, else `rows2_staged`; full
// chunks from the rearranged layout when cols is a multiple of 8. G = 2:
// with the weights' loads past L1 (BF16_NA), the grouped and set kernels
// need 72 and 80 registers at G = 2 against 96 at 4 (three blocks an SM
// instead of two; ptxas -v on scripts/nvrtc-check.py --ptx), and on an
// H100 at 5c57824 (G = 4 then) the K3DIM decode above gave kernels of
// 3.72 ms a token with FATHOM_CUDA_DEFINES=BF16G=2 against 3.78 (two runs
// each).
#ifndef BF16G
#define BF16G 2
#endif
// BF16_MINB (unset by default): blocks of 256 threads the bf16 products
// ask to fit an SM at once, their registers capped to fit. A tuning knob
// set at run time (FATHOM_CUDA_DEFINES), as BF16G and MXG are: none
// changes a sum or its order.
#ifdef BF16_MINB
#define BF16_BOUNDS __launch_bounds__(256, BF16_MINB)
#else
#define BF16_BOUNDS
#endif

// `xs`: the staging of `rows2_staged` for more than one position, or null
// for `rows2_each`; `bx` the block's index among the product's `nbx`.
__device__ __forceinline__ void bf16_product(const unsigned short* __restrict__ w,
                                             const float* __restrict__ x, float* __restrict__ y,
                                             int rows, int cols, int t, int rows_g, float* xs,
                                             int bx, int nbx) {
    auto at = [=](int r, int i) { return bf16f(w[(size_t)r * cols + i]); };
    if (cols % 8 == 0) {
        const Bf16Lanes chunk{w, cols};
        if (t == 1) {
            rows2_product1<BF16G>(chunk, at, x, y, rows, cols, rows_g, bx, nbx);
        } else if (xs) {
            rows2_staged(chunk, at, xs, x, y, rows, cols, t, rows_g, bx);
        } else {
            rows2_each(chunk, at, x, y, rows, cols, t, rows_g, bx);
        }
    } else if (t == 1) {
        rows2_product1<2>(plain(at), at, x, y, rows, cols, rows_g, bx, nbx);
    } else if (xs) {
        rows2_staged(plain(at), at, xs, x, y, rows, cols, t, rows_g, bx);
    } else {
        rows2_each(plain(at), at, x, y, rows, cols, t, rows_g, bx);
    }
}

extern "C" __global__ void BF16_BOUNDS mm_bf16(const unsigned short* __restrict__ w,
                                   const float* __restrict__ x, float* __restrict__ y, int rows,
                                   int cols, int t, int rows_g) {
    bf16_product(w, x, y, rows, cols, t, rows_g, nullptr, (int)blockIdx.x, (int)gridDim.x);
}

// More than one position (the host's pick for t > 1): `mm_bf16`'s sums,
// the inputs staged in shared memory for the block's rows. Kernels of their
// own, so that the decode kernels keep their registers and no shared memory.
extern "C" __global__ void mm_bf16_rows(const unsigned short* __restrict__ w,
                                        const float* __restrict__ x, float* __restrict__ y,
                                        int rows, int cols, int t, int rows_g) {
    __shared__ float xs[XS];
    bf16_product(w, x, y, rows, cols, t, rows_g, xs, (int)blockIdx.x, (int)gridDim.x);
}

extern "C" __global__ void mm_int8(const signed char* __restrict__ q,
                                   const float* __restrict__ scale, const float* __restrict__ x,
                                   float* __restrict__ y, int rows, int cols, int t, int rows_g) {
    auto at = [=](int r, int i) { return (float)q[(size_t)r * cols + i]; };
    PRODUCT(at, [=](int r, float s) { return s * scale[r]; });
}

// MXFP4: cols is a multiple of 32 (one E8M0 scale per 32 columns, two E2M1
// codes per byte, the even column in the low nibble, as on the host). In
// VRAM each full chunk of 256 columns of a row (128 bytes) is rearranged
// once, when its copy up lands (`mxfp4_lanes`): word l of the chunk holds
// the eight codes lane l sums, columns c + l + 32u in nibble u. A warp's
// chunk is then one 128-byte load with nothing handed round; the columns
// past the last full chunk keep the host's layout and are read by `at`.
// The chunk's eight scales are one 8-byte load when cols is a multiple of
// 256 (every lane the same address), else lanes 0..7 load one each and
// hand them round. The sixteen E2M1 values sit in shared memory
// (`e2m1_table`, filled by the kernel before any warp leaves): one load
// instead of decoding the bits. MXG chunks' loads go out together (the sums
// still run chunk by chunk), and with one position a warp takes two rows
// (`pair_product1` over `rows2_pairs`, 16 rows a block) as bf16 does; with
// several, a row (`rows_product_row`). A warp first reads its
// rows' scales whole (cols a multiple of 256): when none is 0 or 0xFF, as
// in every checkpoint seen, e8m0 is the byte shifted into the exponent
// field (`Mxfp4Chunk<true>`), without the per-value tests for 2^-127 and
// NaN (04e112f against its parent on an H100, ncu of the K3DIM decode as
// scripts/ncu-steps.py's header gives it: a layer's 8 MXFP4 products of
// 3,072 x 7,168 in 87.6 -> 53.4 us, 56.3M -> 28.9M warp instructions).
#ifndef MXG
#define MXG 2
#endif

__device__ __forceinline__ void e2m1_table(float* lut) {
    if (threadIdx.x < 16) lut[threadIdx.x] = e2m1(threadIdx.x);
    __syncthreads();
}

// The rearrangement above, in place: a warp per full chunk (rows · cols/256
// warps). Lane l reads word l (columns 8l..8l+7 in the host's order), then
// gathers nibble l mod 8 of words l/8 + 4u into nibble u of its new word;
// every lane has read its word before any writes (the shuffles wait for the
// whole warp).
extern "C" __global__ void mxfp4_lanes(unsigned* __restrict__ packed, int rows, int cols) {
    const int per_row = cols >> 8;
    const long long w = (long long)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (per_row == 0 || w >= (long long)rows * per_row) return;  // whole warps leave together
    const long long r = w / per_row, k = w % per_row;
    unsigned* chunk = packed + ((size_t)r * (size_t)(cols >> 1) + (size_t)k * 128) / 4;
    const unsigned word = chunk[lane];
    unsigned out = 0;
#pragma unroll
    for (int u = 0; u < 8; ++u) {
        const unsigned wd = __shfl_sync(FULL, word, (lane >> 3) + 4 * u);
        out |= ((wd >> (4 * (lane & 7))) & 0x0Fu) << (4 * u);
    }
    chunk[lane] = out;
}

// With ORDINARY, the caller has seen that every scale byte of the row is
// 1..254 (`ordinary_scales`): e8m0 is then the byte moved into a float's
// exponent field, the same value without the tests for 0 and 0xFF.
template <bool ORDINARY>
struct Mxfp4Chunk {
    const unsigned char* __restrict__ packed;
    const unsigned char* __restrict__ scales;
    const float* __restrict__ lut;
    int cols;
    struct Raw {
        unsigned word;
        // The chunk's eight scale bytes (cols a multiple of 256), else
        // lane mod 8's.
        unsigned long long sc;
    };
    __device__ __forceinline__ Raw load(int r, int c, int lane) const {
        const unsigned* row = reinterpret_cast<const unsigned*>(packed + (size_t)r * (cols >> 1));
        const unsigned char* s = scales + (size_t)r * (cols >> 5) + (c >> 5);
        const unsigned long long sc =
            (cols & 255) == 0 ? *reinterpret_cast<const unsigned long long*>(s) : s[lane & 7];
        return Raw{row[(c >> 3) + lane], sc};
    }
    __device__ __forceinline__ void decode(const Raw& raw, int, float (&wv)[UNROLL]) const {
        if ((cols & 255) == 0) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const unsigned b = (unsigned)(raw.sc >> (8 * u)) & 0xFFu;
                const float s = ORDINARY ? __uint_as_float(b << 23) : e8m0((unsigned char)b);
                wv[u] = lut[(raw.word >> (4 * u)) & 0x0Fu] * s;
            }
        } else {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const float s = e8m0((unsigned char)__shfl_sync(FULL, (unsigned)raw.sc, u));
                wv[u] = lut[(raw.word >> (4 * u)) & 0x0Fu] * s;
            }
        }
    }
};

// Whether row r's scale bytes (cols a multiple of 256: cols / 256 words of
// eight) are all 1..254, by this lane's words; the warp's answer is the
// AND of its lanes' (a vote).
__device__ __forceinline__ bool ordinary_scales(const unsigned char* __restrict__ scales, int r,
                                                int cols, int lane) {
    const unsigned long long* s =
        reinterpret_cast<const unsigned long long*>(scales + (size_t)r * (cols >> 5));
    const unsigned long long ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
    unsigned long long bad = 0;
    for (int i = lane; i < (cols >> 8); i += 32) {
        const unsigned long long v = s[i];
        bad |= ((v - ones) & ~v & highs) | ((~v - ones) & v & highs);  // a byte 0x00 or 0xFF
    }
    return bad == 0;
}

__device__ __forceinline__ void mxfp4_product(const unsigned char* __restrict__ packed,
                                              const unsigned char* __restrict__ scales,
                                              const float* __restrict__ lut,
                                              const float* __restrict__ x, float* __restrict__ y,
                                              int rows, int cols, int t, int rows_g) {
    auto at = [=](int r, int i) {
        const size_t e = (size_t)r * cols + i;
        const unsigned b = packed[e >> 1];
        const unsigned code = (i & 1) ? (b >> 4) : (b & 0x0Fu);
        return e2m1(code) * e8m0(scales[e >> 5]);
    };
    const Mxfp4Chunk<false> any{packed, scales, lut, cols};
    const Mxfp4Chunk<true> ordinary{packed, scales, lut, cols};
    const bool whole = (cols & 255) == 0;  // every scale in 8-byte words
    if (t == 1) {
        rows2_pairs(rows, (int)blockIdx.x, (int)gridDim.x, [&](int r0, int lane) {
            const int r1 = r0 + 1 < rows ? r0 + 1 : r0;
            const bool o = whole && __all_sync(FULL, ordinary_scales(scales, r0, cols, lane) &&
                                                         ordinary_scales(scales, r1, cols, lane));
            if (o) {
                pair_product1<MXG>(ordinary, at, x, y, r0, rows, cols, rows_g, lane);
            } else {
                pair_product1<MXG>(any, at, x, y, r0, rows, cols, rows_g, lane);
            }
        });
    } else {
        // rows_product's warp a row, its loader picked by the row's scales.
        const int r = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
        const int lane = threadIdx.x & 31;
        if (r >= rows) return;  // whole warps leave together
        if (whole && __all_sync(FULL, ordinary_scales(scales, r, cols, lane))) {
            rows_product_row<MXG>(ordinary, at, SAME, x, y, r, lane, cols, t, rows_g);
        } else {
            rows_product_row<MXG>(any, at, SAME, x, y, r, lane, cols, t, rows_g);
        }
    }
}

extern "C" __global__ void mm_mxfp4(const unsigned char* __restrict__ packed,
                                    const unsigned char* __restrict__ scales,
                                    const float* __restrict__ x, float* __restrict__ y, int rows,
                                    int cols, int t, int rows_g) {
    __shared__ float lut[16];
    e2m1_table(lut);
    mxfp4_product(packed, scales, lut, x, y, rows, cols, t, rows_g);
}

// E4M3 codes with block scales: value = e4m3[q] · scale[((row0 + r) >> sh_r) · grid_cols + (i >> sh_c)].
extern "C" __global__ void mm_fp8(const unsigned char* __restrict__ q,
                                  const float* __restrict__ scale, const float* __restrict__ e4m3,
                                  int row0, int sh_r, int sh_c, int grid_cols,
                                  const float* __restrict__ x, float* __restrict__ y, int rows,
                                  int cols, int t, int rows_g) {
    auto at = [=](int r, int i) {
        const float s = scale[(size_t)((row0 + r) >> sh_r) * grid_cols + (i >> sh_c)];
        return e4m3[q[(size_t)r * cols + i]] * s;
    };
    PRODUCT(at, SAME);
}

// Symmetric INT4 (code − 8) with bf16 group scales: scale[(r·cols + i) >> sh_g].
extern "C" __global__ void mm_int4(const unsigned char* __restrict__ packed,
                                   const unsigned short* __restrict__ scale, int sh_g,
                                   const float* __restrict__ x, float* __restrict__ y, int rows,
                                   int cols, int t, int rows_g) {
    auto at = [=](int r, int i) {
        const size_t e = (size_t)r * cols + i;
        const unsigned b = packed[e >> 1];
        const unsigned code = (i & 1) ? (b >> 4) : (b & 0x0Fu);
        return (float)((int)(code & 0x0Fu) - 8) * bf16f(scale[e >> sh_g]);
    };
    PRODUCT(at, SAME);
}
