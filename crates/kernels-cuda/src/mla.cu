
// Absorbed MLA attention over a latent cache (fathom-kernels `attention`:
// `mla_attend_scalar` defines the order). Per query, split of 256 rows
// and head (`mla_split`): the head's score per row, (dot_lanes(lat, q_lat)
// + dot_lanes(kr, q_rope)) · scale; the head's max; then in row order
// p = exp(s − max) (exp_fixed), l += p, c = fmaf(p, lat, c) per latent
// value. Then per query and head (`mla_merge`) the splits in order by the
// online-softmax rule, e^ by exp_fixed, and ctx = C · (1/L). Every
// operation rounded as on the CPU (--fmad=false), so the bits are the
// CPU's.

#define MLA_SPLIT 256

// One (split, query, head) per block (grid: max splits × queries × heads):
// `blocks` the caches' row blocks (MLA_SPLIT rows of lora + rope values
// each, the last of each cache may be shorter), boff[T] where each query's
// cache starts in `blocks`, q_lat with query qi's head hh at qi·q_qs +
// hh·q_hs ([T, H, lora]: q_qs = H·lora, q_hs = lora; [H, T, lora]: q_qs =
// lora, q_hs = T·lora), q_rope [T, H, rope], ns[T] the rows each query
// sees. Scratch per (query, split): ps [H, MLA_SPLIT] (scores, then
// weights), pm, pl [H], pc [H, lora], at index qi·max_splits + k. The
// rows' scores and weights are computed in parallel, each as above; the
// max and the sum of weights run in row order on one thread.
extern "C" __global__ void mla_split(const unsigned long long* __restrict__ blocks,
                                     const int* __restrict__ boff,
                                     const float* __restrict__ q_lat, long long q_qs,
                                     long long q_hs, const float* __restrict__ q_rope,
                                     const int* __restrict__ ns, int heads, int lora, int rope,
                                     float scale, int max_splits, float* ps, float* pm,
                                     float* pl, float* pc) {
    __shared__ float mx;
    const int k = blockIdx.x, qi = blockIdx.y, hh = blockIdx.z;
    const int n = ns[qi];
    if (k * MLA_SPLIT >= n) return;  // the whole block leaves together
    const int len = min(MLA_SPLIT, n - k * MLA_SPLIT);
    const int w = lora + rope;
    const float* rows = (const float*)blocks[boff[qi] + k];
    const size_t at = (size_t)qi * max_splits + k;
    float* s = ps + (at * heads + hh) * MLA_SPLIT;
    const float* ql = q_lat + qi * q_qs + hh * q_hs;
    const float* qr = q_rope + ((size_t)qi * heads + hh) * rope;
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        const float* r = rows + (size_t)j * w;
        const float a = dot_lanes(r, ql, lora);
        const float b = dot_lanes(r + lora, qr, rope);
        s[j] = __fmul_rn(__fadd_rn(a, b), scale);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = __uint_as_float(0xff800000u);  // −∞
        for (int j = 0; j < len; ++j) m = fmaxf(m, s[j]);
        mx = m;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < len; j += blockDim.x) s[j] = exp_fixed(__fsub_rn(s[j], mx));
    __syncthreads();
    if (threadIdx.x == 0) {
        float l = 0.0f;
        for (int j = 0; j < len; ++j) l = __fadd_rn(l, s[j]);
        pm[at * heads + hh] = mx;
        pl[at * heads + hh] = l;
    }
    for (int e = threadIdx.x; e < lora; e += blockDim.x) {
        float c = 0.0f;
        for (int j = 0; j < len; ++j) c = __fmaf_rn(s[j], rows[(size_t)j * w + e], c);
        pc[(at * heads + hh) * lora + e] = c;
    }
}

// `mla_split`'s partials for MLA_HG heads of one query at once (grid: max
// splits × queries × head groups; 256 threads; the host takes it where
// lora + rope ≤ MLA_HW): the split's rows are read once for the group's
// heads instead of once a head. Every value is computed as `mla_split`
// computes it. Scores: 32 rows a pass, eight threads a row, thread l of
// a row's eight summing lane l of dot_lanes (columns ≡ l mod 8 in order)
// for every head, the lanes folded as fold_lanes folds them by shuffles
// between the eight (((0+4)+(2+6))+((1+5)+(3+7)), the sum kept by the
// lower lane of each pair), the tail in order (on every lane alike); the group's
// queries staged in shared memory. Then each head's max and sum in row
// order on a thread of its own, and the weighted rows: each thread two
// latent values for every head, in row order. Scores go through ps.
#define MLA_HG 16
#define MLA_HP (MLA_HG + 4)  // a staged query column's stride (no bank conflicts)
#define MLA_HW 576           // the widest row (lora + rope) the group kernel stages

struct __align__(16) MlaF4 {
    float v[4];
};

// One head group's dot_lanes of row r (n values from column c0 of the
// staged queries qs) on lane l of its eight: acc[h] summed, folded and
// the tail added on every lane (all take part in the shuffles).
__device__ __forceinline__ void mla_group_dots(const float* r, const float* qs, int c0, int n,
                                               int l, float (&acc)[MLA_HG]) {
#pragma unroll
    for (int h = 0; h < MLA_HG; ++h) acc[h] = 0.0f;
    const int body = n / 8 * 8;
    for (int i = l; i < body; i += 8) {
        const float v = r[i];
        const float* q = qs + (c0 + i) * MLA_HP;
#pragma unroll
        for (int h = 0; h < MLA_HG; ++h) acc[h] = __fmaf_rn(v, q[h], acc[h]);
    }
#pragma unroll
    for (int h = 0; h < MLA_HG; ++h) {
        // Lane l takes lane l ^ m's sum; the lower lane of each pair adds
        // its own first, as fold_lanes.
#pragma unroll
        for (int m = 4; m > 0; m >>= 1) {
            const float o = __shfl_xor_sync(0xffffffffu, acc[h], m);
            acc[h] = __fadd_rn(acc[h], o);
        }
        for (int i = body; i < n; ++i) acc[h] = __fmaf_rn(r[i], qs[(c0 + i) * MLA_HP + h], acc[h]);
    }
}

extern "C" __global__ void mla_split_heads(const unsigned long long* __restrict__ blocks,
                                           const int* __restrict__ boff,
                                           const float* __restrict__ q_lat, long long q_qs,
                                           long long q_hs, const float* __restrict__ q_rope,
                                           const int* __restrict__ ns, int heads, int lora,
                                           int rope, float scale, int max_splits, float* ps,
                                           float* pm, float* pl, float* pc) {
    // The group's queries [w][MLA_HP], later the weights [MLA_SPLIT][MLA_HG].
    __shared__ __align__(16) float qs[MLA_HW * MLA_HP];
    __shared__ float mx[MLA_HG];
    const int k = blockIdx.x, qi = blockIdx.y, h0 = blockIdx.z * MLA_HG;
    const int n = ns[qi];
    if (k * MLA_SPLIT >= n) return;  // the whole block leaves together
    const int len = min(MLA_SPLIT, n - k * MLA_SPLIT);
    const int w = lora + rope, tid = (int)threadIdx.x;
    const int hn = min(MLA_HG, heads - h0);
    const float* rows = (const float*)blocks[boff[qi] + k];
    const size_t at = (size_t)qi * max_splits + k;
    for (int e = tid; e < w * MLA_HG; e += blockDim.x) {
        const int i = e / MLA_HG, h = e % MLA_HG, hh = h0 + min(h, hn - 1);
        qs[i * MLA_HP + h] = i < lora ? q_lat[qi * q_qs + hh * q_hs + i]
                                      : q_rope[((size_t)qi * heads + hh) * rope + i - lora];
    }
    __syncthreads();
    const int l = tid & 7;
    for (int j0 = 0; j0 < len; j0 += 32) {
        const int j = j0 + (tid >> 3), jr = min(j, len - 1);
        const float* r = rows + (size_t)jr * w;
        float a[MLA_HG], b[MLA_HG];
        mla_group_dots(r, qs, 0, lora, l, a);
        mla_group_dots(r + lora, qs, lora, rope, l, b);
#pragma unroll
        for (int h = 0; h < MLA_HG; ++h) {
            if ((h & 7) == l && h < hn && j < len)
                ps[(at * heads + h0 + h) * MLA_SPLIT + j] = __fmul_rn(__fadd_rn(a[h], b[h]), scale);
        }
    }
    __syncthreads();
    if (tid < hn) {
        const float* sh = ps + (at * heads + h0 + tid) * MLA_SPLIT;
        float m = __uint_as_float(0xff800000u);  // −∞
        for (int j = 0; j < len; ++j) m = fmaxf(m, sh[j]);
        mx[tid] = m;
    }
    __syncthreads();
    float* wt = qs;  // the weights [MLA_SPLIT][MLA_HG] (the queries are done)
    for (int e = tid; e < len * MLA_HG; e += blockDim.x) {
        const int j = e / MLA_HG, h = e % MLA_HG;
        const float sv = h < hn ? ps[(at * heads + h0 + h) * MLA_SPLIT + j] : 0.0f;
        wt[e] = h < hn ? exp_fixed(__fsub_rn(sv, mx[h])) : 0.0f;
    }
    __syncthreads();
    if (tid < hn) {
        float sum = 0.0f;
        for (int j = 0; j < len; ++j) sum = __fadd_rn(sum, wt[j * MLA_HG + tid]);
        pm[at * heads + h0 + tid] = mx[tid];
        pl[at * heads + h0 + tid] = sum;
    }
    for (int e0 = tid; e0 < lora; e0 += 2 * blockDim.x) {
        const int e1 = e0 + blockDim.x;
        const bool two = e1 < lora;
        float c0[MLA_HG], c1[MLA_HG];
#pragma unroll
        for (int h = 0; h < MLA_HG; ++h) c0[h] = c1[h] = 0.0f;
        for (int j = 0; j < len; ++j) {
            const float v0 = rows[(size_t)j * w + e0];
            const float v1 = two ? rows[(size_t)j * w + e1] : 0.0f;
            const MlaF4* p4 = reinterpret_cast<const MlaF4*>(wt + j * MLA_HG);
#pragma unroll
            for (int g = 0; g < MLA_HG / 4; ++g) {
                const MlaF4 p = p4[g];
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    c0[4 * g + u] = __fmaf_rn(p.v[u], v0, c0[4 * g + u]);
                    c1[4 * g + u] = __fmaf_rn(p.v[u], v1, c1[4 * g + u]);
                }
            }
        }
#pragma unroll
        for (int h = 0; h < MLA_HG; ++h) {
            if (h < hn) {
                pc[(at * heads + h0 + h) * lora + e0] = c0[h];
                if (two) pc[(at * heads + h0 + h) * lora + e1] = c1[h];
            }
        }
    }
}

// Per query and head (grid: queries × heads): the splits merged in order,
// one thread per latent value — the head's L recomputed by each of its
// threads with the same operations. Query qi's head hh goes to out + qi·o_qs
// + hh·o_hs (strides as q_lat's above).
extern "C" __global__ void mla_merge(const int* __restrict__ ns, int heads, int lora,
                                     int max_splits, const float* __restrict__ pm,
                                     const float* __restrict__ pl,
                                     const float* __restrict__ pc, float* __restrict__ out,
                                     long long o_qs, long long o_hs) {
    const int qi = blockIdx.x, hh = blockIdx.y;
    const int splits = (ns[qi] + MLA_SPLIT - 1) / MLA_SPLIT;
    const float ninf = __uint_as_float(0xff800000u);
    for (int e = threadIdx.x; e < lora; e += blockDim.x) {
        float M = ninf, L = 0.0f, C = 0.0f;
        for (int k = 0; k < splits; ++k) {
            const size_t at = (size_t)qi * max_splits + k;
            const float m = pm[at * heads + hh];
            const float mn = fmaxf(M, m);
            const float a = M == ninf ? 0.0f : exp_fixed(__fsub_rn(M, mn));
            const float b = exp_fixed(__fsub_rn(m, mn));
            L = __fadd_rn(__fmul_rn(L, a), __fmul_rn(pl[at * heads + hh], b));
            C = __fadd_rn(__fmul_rn(C, a), __fmul_rn(pc[(at * heads + hh) * lora + e], b));
            M = mn;
        }
        out[qi * o_qs + hh * o_hs + e] = __fmul_rn(C, __fdiv_rn(1.0f, L));
    }
}

// An MLA layer's values [H, T, dv] by position [T, H·dv], each times
// σ(gate) (sigmoid_fixed, as fathom-kernels `backend::mla_out_cpu`) when
// `gated`: the output projection's input.
extern "C" __global__ void mla_gate(const float* __restrict__ vals,
                                    const float* __restrict__ gate, int gated, int heads,
                                    int t, int dv, float* __restrict__ cat) {
    const long long hdv = (long long)heads * dv, n = hdv * t;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long ti = i / hdv, hh = (i % hdv) / dv, c = i % dv;
        const float v = vals[(hh * t + ti) * dv + c];
        cat[i] = gated ? __fmul_rn(v, sigmoid_fixed(gate[i])) : v;
    }
}

// An MLA layer's projections in its attention's call (fathom-kernels
// `backend::mla_proj_cpu`): the RMSNorms of the low-rank queries and of
// the new rows' latent part (`ops::rms_norm`: the sum of squares in
// dot_lanes' order, its eight lanes on eight threads; v · inv · w), the
// rotary step (`backend::rotate_heads`: de-interleaved when `interleaved`,
// then x1·cos − x2·sin and x2·cos + x1·sin, each product rounded).
#define MLA_NORM_MAX 8192

// Stages the d values at x in `row` (shared) and gives every thread of
// the block 1 / sqrt(Σ x² / d + eps).
__device__ __forceinline__ float mla_stage_rms(float* row, const float* x, int d, float eps) {
    __shared__ float lanes[8], inv;
    for (int c = threadIdx.x; c < d; c += blockDim.x) row[c] = x[c];
    __syncthreads();
    const int body = d / 8 * 8;
    if (threadIdx.x < 8) {
        float a = 0.0f;
        for (int i = threadIdx.x; i < body; i += 8) a = __fmaf_rn(row[i], row[i], a);
        lanes[threadIdx.x] = a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        const float ms = __fdiv_rn(fold_lanes(lanes, row, row, body, d), (float)d);
        inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ms, eps)));
    }
    __syncthreads();
    return inv;
}

// Value i of a head's rotated position part, from its raw values r (dr of
// them) and its row's angles cs, sn (dr / 2 each).
__device__ __forceinline__ float mla_rot(const float* r, int dr, int i, const float* cs,
                                         const float* sn, int interleaved) {
    const int half = dr / 2, j = i < half ? i : i - half;
    const float x1 = interleaved ? r[2 * j] : r[j];
    const float x2 = interleaved ? r[2 * j + 1] : r[half + j];
    return i < half ? __fsub_rn(__fmul_rn(x1, cs[j]), __fmul_rn(x2, sn[j]))
                    : __fadd_rn(__fmul_rn(x2, cs[j]), __fmul_rn(x1, sn[j]));
}

// The RMSNorm of each d-wide row of x (a block a row), scaled by nw, in
// place: the low-rank queries between their two products.
extern "C" __global__ void mla_norm_rows(float* __restrict__ x, int d,
                                         const float* __restrict__ nw, float eps) {
    __shared__ float row[MLA_NORM_MAX];
    float* xr = x + (size_t)blockIdx.x * d;
    const float inv = mla_stage_rms(row, xr, d, eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x)
        xr[c] = __fmul_rn(__fmul_rn(row[c], inv), nw[c]);
}

// The queries q [T, H·(dn + dr)] as the attention takes them: q_nope
// [H, T, dn] and q_rope [T, H, dr], the latter rotated with row t's angles
// (cs, sn [T, dr / 2]) when `roped`.
extern "C" __global__ void mla_queries(const float* __restrict__ q, int t, int heads, int dn,
                                       int dr, const float* __restrict__ cs,
                                       const float* __restrict__ sn, int roped,
                                       int interleaved, float* __restrict__ q_nope,
                                       float* __restrict__ q_rope) {
    const long long dq = dn + dr, n = (long long)t * heads * dq;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const long long ti = i / (heads * dq), hh = (i / dq) % heads, e = i % dq;
        const float* src = q + (ti * heads + hh) * dq;
        if (e < dn) {
            q_nope[(hh * t + ti) * dn + e] = src[e];
        } else {
            const int k = (int)(e - dn), half = dr / 2;
            q_rope[(ti * heads + hh) * dr + k] =
                roped ? mla_rot(src + dn, dr, k, cs + ti * half, sn + ti * half, interleaved)
                      : src[e];
        }
    }
}

// The step's new cache rows, a block a row: c [T, lora + dr] (kv_a's
// output) with the latent part RMSNormed (nw, eps) and the position part
// rotated when `roped`, written to rows [T, lora + dr] (they go back to
// the host) and to the row's place among its cache's blocks: query ti's
// row is row ns[ti] − 1 of the cache whose blocks start at table[boff[ti]].
extern "C" __global__ void mla_rows(const float* __restrict__ c, int lora, int dr,
                                    const float* __restrict__ nw, float eps,
                                    const float* __restrict__ cs, const float* __restrict__ sn,
                                    int roped, int interleaved,
                                    const unsigned long long* __restrict__ table,
                                    const int* __restrict__ boff, const int* __restrict__ ns,
                                    float* __restrict__ rows) {
    __shared__ float row[MLA_NORM_MAX];
    const int ti = blockIdx.x, w = lora + dr, half = dr / 2;
    const float* cr = c + (size_t)ti * w;
    const float inv = mla_stage_rms(row, cr, lora, eps);
    const int pos = ns[ti] - 1;
    float* dst = (float*)table[boff[ti] + pos / MLA_SPLIT] + (size_t)(pos % MLA_SPLIT) * w;
    float* out = rows + (size_t)ti * w;
    for (int e = threadIdx.x; e < w; e += blockDim.x) {
        float v;
        if (e < lora)
            v = __fmul_rn(__fmul_rn(row[e], inv), nw[e]);
        else if (roped)
            v = mla_rot(cr + lora, dr, e - lora, cs + (size_t)ti * half, sn + (size_t)ti * half,
                        interleaved);
        else
            v = cr[e];
        out[e] = v;
        dst[e] = v;
    }
}
