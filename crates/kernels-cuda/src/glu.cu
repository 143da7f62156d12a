
// Gated activations between a gated MLP's products (fathom-kernels
// `ops::GluAct`), with the CPU's operations one for one: every multiply,
// add and divide rounded on its own, fused multiply-adds only where the
// CPU calls mul_add, the hand-written exp (kda.cu) and tanh below.

// fathom-kernels `ops::tanh_fixed`: the odd series x + x·s·P(s), s = x²,
// below |x| = 0.5 (TANH_SERIES, the f32 bits of the CPU's constants:
// −929569/638512875, 21844/6081075, −1382/155925, 62/2835, −17/315, 2/15,
// −1/3), else (1 − e)/(1 + e), e = exp(−2|x|); x's sign either way.
__device__ __forceinline__ float tanh_fixed(float x) {
    const float a = fabsf(x);
    if (a < 0.5f) {
        const float s = __fmul_rn(x, x);
        float p = __uint_as_float(0xbabed1b2u);
        p = __fmaf_rn(p, s, __uint_as_float(0x3b6b69e8u));
        p = __fmaf_rn(p, s, __uint_as_float(0xbc11371bu));
        p = __fmaf_rn(p, s, __uint_as_float(0x3cb327a4u));
        p = __fmaf_rn(p, s, __uint_as_float(0xbd5d0dd1u));
        p = __fmaf_rn(p, s, __uint_as_float(0x3e088889u));
        p = __fmaf_rn(p, s, __uint_as_float(0xbeaaaaabu));
        return copysignf(__fmaf_rn(__fmul_rn(x, s), p, x), x);
    }
    const float e = exp_fixed(__fmul_rn(-2.0f, a));
    return copysignf(__fdiv_rn(__fsub_rn(1.0f, e), __fadd_rn(1.0f, e)), x);
}

// g[i] = act(g[i], u[i]) for i < n. kind 0: SwiGLU, SiLU(g)·u; 1: SiTU-GLU
// [β·tanh(g/β)·σ(g)]·[β_lin·tanh(u/β_lin)]; 2: SiTU-GLU without β_lin (·u).
extern "C" __global__ void glu_act(float* __restrict__ g, const float* __restrict__ u,
                                   long long n, int kind, float beta, float beta_lin) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float a = g[i], b = u[i];
        if (kind == 0) {
            g[i] = __fmul_rn(__fmul_rn(a, sigmoid_fixed(a)), b);
        } else {
            const float act =
                __fmul_rn(__fmul_rn(beta, tanh_fixed(__fdiv_rn(a, beta))), sigmoid_fixed(a));
            const float up =
                kind == 1 ? __fmul_rn(beta_lin, tanh_fixed(__fdiv_rn(b, beta_lin))) : b;
            g[i] = __fmul_rn(act, up);
        }
    }
}

// Each row's routed experts summed in rank order (fathom-kernels
// `backend::moe_tail_cpu`): s[r][c] = Σ_j w[r·k + j] · o[off[r·k + j] + c],
// from zero, each product rounded and then added; with `norm`, the row's
// RMSNorm (`ops::rms_norm`: its sum of squares in dot_lanes' order) scaled
// by `nw`. One block a row. A column's k loads go out four at a time
// before they are summed in order; a row of up to COMBINE_SHARED values is
// also kept in shared memory, where the norm's eight lane threads read it
// (from global memory each of their loads was a round trip).
#define COMBINE_SHARED 4096
#define COMBINE_COLS 4

// dst[c] = (v[c] · inv) · nw[c] for c < n, by the block, eight columns' loads
// of a thread in flight together (`v` may be `dst`).
__device__ __forceinline__ void scale_row(float* dst, const float* v, float inv,
                                          const float* __restrict__ nw, int n) {
    const int step = blockDim.x;
    for (int c0 = threadIdx.x; c0 < n; c0 += 8 * step) {
        float a[8], b[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            const int c = c0 + q * step;
            a[q] = c < n ? v[c] : 0.0f;
            b[q] = c < n ? nw[c] : 0.0f;
        }
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            const int c = c0 + q * step;
            if (c < n) dst[c] = __fmul_rn(__fmul_rn(a[q], inv), b[q]);
        }
    }
}

extern "C" __global__ void moe_combine(const float* __restrict__ o,
                                       const unsigned* __restrict__ off,
                                       const float* __restrict__ w, int k, int width, int norm,
                                       const float* __restrict__ nw, float eps,
                                       float* __restrict__ s) {
    __shared__ float inv, lanes[8], row[COMBINE_SHARED];
    const size_t r = blockIdx.x;
    const unsigned* offr = off + r * k;
    const float* wr = w + r * k;
    float* sr = s + r * width;
    const bool kept = width <= COMBINE_SHARED;
    const int step = blockDim.x;
    // COMBINE_COLS of a thread's columns at a time, so that their loads go
    // out together (a column at a time waited out a round trip each).
    for (int c0 = threadIdx.x; c0 < width; c0 += COMBINE_COLS * step) {
        float a[COMBINE_COLS];
#pragma unroll
        for (int q = 0; q < COMBINE_COLS; ++q) a[q] = 0.0f;
        int j = 0;
        for (; j + 4 <= k; j += 4) {
            float v[COMBINE_COLS][4];
#pragma unroll
            for (int q = 0; q < COMBINE_COLS; ++q) {
                const int c = c0 + q * step;
#pragma unroll
                for (int e = 0; e < 4; ++e) v[q][e] = c < width ? o[(size_t)offr[j + e] + c] : 0.0f;
            }
#pragma unroll
            for (int q = 0; q < COMBINE_COLS; ++q) {
#pragma unroll
                for (int e = 0; e < 4; ++e) a[q] = __fadd_rn(a[q], __fmul_rn(wr[j + e], v[q][e]));
            }
        }
        for (; j < k; ++j) {
#pragma unroll
            for (int q = 0; q < COMBINE_COLS; ++q) {
                const int c = c0 + q * step;
                const float v = c < width ? o[(size_t)offr[j] + c] : 0.0f;
                a[q] = __fadd_rn(a[q], __fmul_rn(wr[j], v));
            }
        }
#pragma unroll
        for (int q = 0; q < COMBINE_COLS; ++q) {
            const int c = c0 + q * step;
            if (c < width) {
                sr[c] = a[q];
                if (kept) row[c] = a[q];
            }
        }
    }
    if (!norm) return;
    __syncthreads();
    const float* v = kept ? row : sr;
    // sum_sq_lanes(v, width) with its eight lanes on eight threads.
    const int body = width / 8 * 8;
    if (threadIdx.x < 8) {
        float a = 0.0f;
        for (int i = threadIdx.x; i < body; i += 8) a = __fmaf_rn(v[i], v[i], a);
        lanes[threadIdx.x] = a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const float ms = __fdiv_rn(fold_lanes(lanes, v, v, body, width), (float)width);
        inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
    }
    __syncthreads();
    scale_row(sr, v, inv, nw, width);
}

// The rest of a layer before its experts are chosen, its first part
// (fathom-kernels `backend::then_mix`), in three launches. `v` holds nb
// earlier blocks then the residual, each [n, d]. Its sums are `dot32`s,
// the matrix products' order (`formats::block_scalar`): lane l of a warp
// sums fmaf over the columns l, l + 32, … (past the end fmaf(0, 0, ·)),
// the 32 sums fold in halves (fold32, matmul.cu). Their operands come
// from shared memory, staged by the whole block in tiles of MIX_TILE
// columns (a multiple of 32: a lane's chain goes on across tiles).
#define MIX_TILE 4096
#define MIX_ROW 8192
#define MIX_MAX_SOURCES 64

// A lane's part of dot32(a, b) over a tile's columns [0, cols), going on
// from `acc` (eight chunks' loads in flight before they are summed in
// order); `last`: the row ends in this tile (its partial chunk padded
// with zeros).
__device__ __forceinline__ float mix_chunks(float acc, const float* a, const float* b, int lane,
                                            int cols, bool last) {
    const int full = cols / 32 * 32;
    int c = 0;
    for (; c + 256 <= full; c += 256) {
        float xs[8], ys[8];
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            xs[q] = a[c + 32 * q + lane];
            ys[q] = b[c + 32 * q + lane];
        }
#pragma unroll
        for (int q = 0; q < 8; ++q) acc = fmaf(xs[q], ys[q], acc);
    }
    for (; c < full; c += 32) acc = fmaf(a[c + lane], b[c + lane], acc);
    if (last && full < cols) {
        const int i = full + lane;
        acc = i < cols ? fmaf(a[i], b[i], acc) : fmaf(0.0f, 0.0f, acc);
    }
    return acc;
}

// `cols` values from `src` into shared memory at `dst` by the block, and
// as many from `src2` into `dst2` when it is not null: MIX_ILP loads of a
// thread in flight before they are stored (a tile of 4096 of each is one
// round trip with 256 threads).
// (`src` may be rows the same kernel just wrote: no __restrict__ on it.)
#define MIX_ILP 16
__device__ __forceinline__ void mix_stage(float* dst, const float* src, int cols,
                                          float* dst2 = nullptr, const float* src2 = nullptr) {
    const int step = blockDim.x;
    for (int c = threadIdx.x; c < cols; c += MIX_ILP * step) {
        float vs[MIX_ILP], ws[MIX_ILP];
#pragma unroll
        for (int q = 0; q < MIX_ILP; ++q) {
            const bool in = c + q * step < cols;
            vs[q] = in ? src[c + q * step] : 0.0f;
            ws[q] = in && src2 ? src2[c + q * step] : 0.0f;
        }
#pragma unroll
        for (int q = 0; q < MIX_ILP; ++q) {
            if (c + q * step < cols) {
                dst[c + q * step] = vs[q];
                if (dst2) dst2[c + q * step] = ws[q];
            }
        }
    }
}

// `res_mix_dots`, a block per source j and row r (grid (sources, n)): for
// the residual (j = nb) p = partial + a, written over it; then, with a
// query, warp 0 finds dot32(V_j, query) and warp 1 dot32(V_j, V_j), into
// `dots[(r·sources + j)·2 + …]`. Without a query the grid has one
// source, the residual.
extern "C" __global__ void res_mix_dots(float* __restrict__ v, const float* __restrict__ a,
                                        int nb, int n, int d, const float* __restrict__ query,
                                        float* __restrict__ dots) {
    __shared__ float tv[MIX_TILE], tq[MIX_TILE];
    const int j = query != nullptr ? (int)blockIdx.x : nb, sources = gridDim.x;
    const size_t r = blockIdx.y, nd = (size_t)n * d;
    float* vj = v + (size_t)j * nd + r * (size_t)d;
    if (j == nb) {
        const float* ar = a + r * (size_t)d;
        const int step = blockDim.x;
        for (int c0 = threadIdx.x; c0 < d; c0 += 8 * step) {
            float p[8], q[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const bool in = c0 + e * step < d;
                p[e] = in ? vj[c0 + e * step] : 0.0f;
                q[e] = in ? ar[c0 + e * step] : 0.0f;
            }
#pragma unroll
            for (int e = 0; e < 8; ++e)
                if (c0 + e * step < d) vj[c0 + e * step] = __fadd_rn(p[e], q[e]);
        }
        __syncthreads();
    }
    if (query == nullptr) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float acc = 0.0f;
    for (int c0 = 0; c0 < d; c0 += MIX_TILE) {
        const int cols = min(MIX_TILE, d - c0);
        mix_stage(tv, vj + c0, cols, tq, query + c0);
        __syncthreads();
        if (warp < 2) acc = mix_chunks(acc, tv, warp == 0 ? tq : tv, lane, cols, c0 + cols == d);
        __syncthreads();
    }
    if (warp < 2) {
        acc = fold32(acc);
        if (lane == 0) dots[(r * sources + j) * 2 + warp] = acc;
    }
}

// The sources' weights (thread 0 of a block): each score rms_inv32(V_j) ·
// dot32(V_j, query) from its dots, then the softmax with exp_fixed (the
// maximum by fmaxf from −∞, the sum in order); `backend::depth_mix`.
__device__ void mix_weights(const float* dots, int ns, size_t r, int d, float eps, float* p) {
    float m = __uint_as_float(0xFF800000u);
    for (int j = 0; j < ns; ++j) {
        const float* dj = dots + (r * ns + j) * 2;
        const float ri = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(dj[1], (float)d), eps)));
        p[j] = __fmul_rn(ri, dj[0]);
        m = fmaxf(m, p[j]);
    }
    float s = 0.0f;
    for (int j = 0; j < ns; ++j) {
        p[j] = exp_fixed(__fsub_rn(p[j], m));
        s = __fadd_rn(s, p[j]);
    }
    for (int j = 0; j < ns; ++j) p[j] = __fdiv_rn(p[j], s);
}

// `res_mix_sum`, a thread per column (grid (column blocks, n)): with a
// query, the weighted sum of the sources from zero in source order, each
// product rounded and then added (each block finds the weights itself);
// without one, p itself; into `x`.
extern "C" __global__ void res_mix_sum(const float* __restrict__ v,
                                       const float* __restrict__ dots, int nb, int n, int d,
                                       const float* __restrict__ query, float eps,
                                       float* __restrict__ x) {
    __shared__ float p[MIX_MAX_SOURCES];
    const size_t r = blockIdx.y, nd = (size_t)n * d;
    const int ns = nb + 1, c = blockIdx.x * blockDim.x + threadIdx.x;
    const float* vr = v + r * (size_t)d;
    if (query == nullptr) {
        if (c < d) x[r * (size_t)d + c] = vr[(size_t)nb * nd + c];
        return;
    }
    if (threadIdx.x == 0) mix_weights(dots, ns, r, d, eps, p);
    __syncthreads();
    if (c >= d) return;
    float o = 0.0f;
    for (int j = 0; j < ns; ++j) o = __fadd_rn(o, __fmul_rn(p[j], vr[(size_t)j * nd + c]));
    x[r * (size_t)d + c] = o;
}

// `res_mix_norm`, a block per row (d ≤ MIX_ROW): the RMSNorm with
// rms_inv32 (warp 0's dot32 of the staged row with itself) of `x`'s row,
// scaled by `nw`, in place.
extern "C" __global__ void res_mix_norm(float* __restrict__ x, int d,
                                        const float* __restrict__ nw, float eps) {
    __shared__ float row[MIX_ROW], inv;
    float* xr = x + (size_t)blockIdx.x * d;
    mix_stage(row, xr, d);
    __syncthreads();
    if (threadIdx.x < 32) {
        const float ss = fold32(mix_chunks(0.0f, row, row, threadIdx.x, d, true));
        if (threadIdx.x == 0)
            inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)d), eps)));
    }
    __syncthreads();
    scale_row(xr, row, inv, nw, d);
}
