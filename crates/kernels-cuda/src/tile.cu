// bf16 products of many positions (the host takes these from TILE_T
// positions, `launch.rs`), in tiles: a block of TILE_THREADS threads makes
// TB_R rows × TB_P positions, its four warps TW_R × TW_P of them each. The
// sums are `rows_product`'s (matmul.cu), bit for bit: lane l of a warp
// accumulates fmaf(x, w, acc) over the columns l, l + 32, l + 64, … in
// order — each full chunk of CHUNK columns, then the columns past the last
// full chunk one a lane at a time — and the 32 lanes' sums fold in halves
// (fold32). What changes is only where the operands come from: a chunk of
// the block's rows (the rearranged layout of `bf16_lanes`, lane l's eight
// values 16 contiguous bytes) and of its positions' inputs is copied to
// shared memory once for the whole block, the next chunk's copy in flight
// (cp.async) while this one is summed; each weight then serves TW_P
// positions and each input TW_R rows from registers. The multi-position
// kernels of matmul.cu read a row's weights again for every eight positions.
// Follows grouped.cu in the kernels' source (it uses Bf16Set).

#define TW_R 8
#define TW_P 8
#define TB_R (2 * TW_R)
#define TB_P (2 * TW_P)
#define TILE_THREADS 128
#define TILE_WBYTES (TB_R * CHUNK * 2)
#define TILE_XBYTES (TB_P * CHUNK * 4)
#define TILE_STAGE (TILE_WBYTES + TILE_XBYTES)
// Row tiles a group of the grid's raster takes before moving to the next
// position tile, so that the blocks running at once share their rows' and
// positions' chunks in L2.
#define TILE_GROUP 16
// Blocks an SM is asked to hold at once (their registers capped to fit).
#ifndef TILE_MINB
#define TILE_MINB 4
#endif

// 16 bytes from global to shared memory: cp.async where the device has it
// (compute 8.0 on), else a plain copy (the host emulator too). The copies
// a thread issued since its last `copies_commit` form one group.
__device__ __forceinline__ void copy16(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
#else
    *reinterpret_cast<U32x4*>(dst) = *reinterpret_cast<const U32x4*>(src);
#endif
}

__device__ __forceinline__ void copies_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most `N` of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void copies_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// One product's operands as a tile sees them.
struct TileJob {
    const unsigned short* __restrict__ w;
    const float* __restrict__ x;
    float* __restrict__ y;
    int rows, cols, t;
};

// Copies the full chunk at column c of rows r0 .. r0 + TB_R and of the
// inputs of positions p0 .. p0 + TB_P into the stage `st`: the rows' 512
// bytes each as VRAM holds them (lane order), then the positions' 1,024
// bytes each. Rows and positions past the product's repeat its last (their
// sums are never written).
__device__ __forceinline__ void tile_stage(unsigned char* st, const TileJob& j, int c, int r0,
                                           int p0) {
    const int tid = (int)threadIdx.x;
#pragma unroll
    for (int i = 0; i < TB_R * 32 / TILE_THREADS; ++i) {
        const int k = tid + i * TILE_THREADS, rr = k >> 5, q = k & 31;
        const int r = r0 + rr < j.rows ? r0 + rr : j.rows - 1;
        copy16(st + rr * 512 + q * 16, j.w + (size_t)r * j.cols + c + q * 8);
    }
#pragma unroll
    for (int i = 0; i < TB_P * 64 / TILE_THREADS; ++i) {
        const int k = tid + i * TILE_THREADS, pp = k >> 6, q = k & 63;
        const int p = p0 + pp < j.t ? p0 + pp : j.t - 1;
        copy16(st + TILE_WBYTES + pp * 1024 + q * 16, j.x + (size_t)p * j.cols + c + q * 4);
    }
}

// The warp's sums over one staged chunk: its rows wr · TW_R + r and
// positions wp · TW_P + p of the block's, lane `lane`'s columns lane + 32u
// of the chunk for u = 0..7 in order.
__device__ __forceinline__ void tile_sum(const unsigned char* st, int wr, int wp, int lane,
                                         float (&acc)[TW_R][TW_P]) {
    const U32x4* ws = reinterpret_cast<const U32x4*>(st) + wr * TW_R * 32 + lane;
    const float* xs = reinterpret_cast<const float*>(st + TILE_WBYTES) + wp * TW_P * CHUNK + lane;
    unsigned q[TW_R][4];
#pragma unroll
    for (int r = 0; r < TW_R; ++r) {
        const U32x4 v = ws[r * 32];
        q[r][0] = v.x;
        q[r][1] = v.y;
        q[r][2] = v.z;
        q[r][3] = v.w;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        float wv[TW_R];
#pragma unroll
        for (int r = 0; r < TW_R; ++r)
            wv[r] = (u & 1) ? __uint_as_float(q[r][u >> 1] & 0xFFFF0000u)
                            : __uint_as_float(q[r][u >> 1] << 16);
#pragma unroll
        for (int p = 0; p < TW_P; ++p) {
            const float xv = xs[p * CHUNK + 32 * u];
#pragma unroll
            for (int r = 0; r < TW_R; ++r) acc[r][p] = fmaf(xv, wv[r], acc[r][p]);
        }
    }
}

// The tile of rows r0 .. r0 + TB_R and positions p0 .. p0 + TB_P of `j`,
// staged through `sm` (two stages of TILE_STAGE bytes); y is [t, rows].
__device__ __forceinline__ void bf16_tile(const TileJob& j, int r0, int p0,
                                          unsigned char* sm) {
    const int warp = (int)(threadIdx.x >> 5), lane = (int)(threadIdx.x & 31);
    const int wr = warp & 1, wp = warp >> 1;
    float acc[TW_R][TW_P];
#pragma unroll
    for (int r = 0; r < TW_R; ++r)
#pragma unroll
        for (int p = 0; p < TW_P; ++p) acc[r][p] = 0.0f;
    const int full = j.cols - j.cols % CHUNK, n = full / CHUNK;
    if (n > 0) {
        tile_stage(sm, j, 0, r0, p0);
        copies_commit();
    }
    for (int k = 0; k < n; ++k) {
        if (k + 1 < n) {
            tile_stage(sm + ((k + 1) & 1) * TILE_STAGE, j, (k + 1) * CHUNK, r0, p0);
            copies_commit();
            copies_wait<1>();
        } else {
            copies_wait<0>();
        }
        __syncthreads();
        tile_sum(sm + (k & 1) * TILE_STAGE, wr, wp, lane, acc);
        // The stage is copied over again two chunks on.
        __syncthreads();
    }
    const int rw = r0 + wr * TW_R, pw = p0 + wp * TW_P;
    // Columns past the last full chunk, in the host's layout, a lane's
    // column at a time as `finish_pair` takes them.
    for (int c = full; c < j.cols; c += 32) {
        const int i = c + lane;
        const bool in = i < j.cols;
#pragma unroll
        for (int r = 0; r < TW_R; ++r) {
            const int rr = rw + r < j.rows ? rw + r : j.rows - 1;
            const float wv = in ? bf16f(j.w[(size_t)rr * j.cols + i]) : 0.0f;
#pragma unroll
            for (int p = 0; p < TW_P; ++p) {
                const int pp = pw + p < j.t ? pw + p : j.t - 1;
                const float xv = in ? j.x[(size_t)pp * j.cols + i] : 0.0f;
                acc[r][p] = fmaf(xv, wv, acc[r][p]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < TW_R; ++r) {
#pragma unroll
        for (int p = 0; p < TW_P; ++p) {
            const float s = fold32(acc[r][p]);
            if (lane == 0 && rw + r < j.rows && pw + p < j.t)
                j.y[(size_t)(pw + p) * j.rows + rw + r] = s;
        }
    }
}

// Block b of a product's rt × pt tiles (row tiles × position tiles) in
// grouped raster order: TILE_GROUP row tiles across every position tile,
// then the next TILE_GROUP.
__device__ __forceinline__ void tile_place(int b, int rt, int pt, int& r0, int& p0) {
    const int per = TILE_GROUP * pt, first = (b / per) * TILE_GROUP;
    const int gm = rt - first < TILE_GROUP ? rt - first : TILE_GROUP;
    const int in = b % per;
    r0 = (first + in % gm) * TB_R;
    p0 = (in / gm) * TB_P;
}

__device__ __forceinline__ void tile_job(const TileJob& j, int b, unsigned char* sm) {
    const int rt = (j.rows + TB_R - 1) / TB_R, pt = (j.t + TB_P - 1) / TB_P;
    if (b >= rt * pt) return;  // no such block in the host's grids
    int r0, p0;
    tile_place(b, rt, pt, r0, p0);
    bf16_tile(j, r0, p0, sm);
}

// One product, blockIdx.x its tiles (`tile_place`). x is 16-byte aligned
// and cols a multiple of 8 (the host checks).
extern "C" __global__ void __launch_bounds__(TILE_THREADS, TILE_MINB)
    mm_bf16_tile(const unsigned short* __restrict__ w, const float* __restrict__ x,
                 float* __restrict__ y, int rows, int cols, int t) {
    __shared__ __align__(16) unsigned char sm[2 * TILE_STAGE];
    tile_job(TileJob{w, x, y, rows, cols, t}, (int)blockIdx.x, sm);
}

// Products of one shape (a MoE layer's experts), blockIdx.y picking
// product p at tab[4p .. 4p + 4) (data, 0, x, y) as `mm_bf16_many`.
extern "C" __global__ void __launch_bounds__(TILE_THREADS, TILE_MINB)
    mm_bf16_tile_many(const unsigned long long* __restrict__ tab, int rows, int cols, int t) {
    __shared__ __align__(16) unsigned char sm[2 * TILE_STAGE];
    const unsigned long long* e = tab + 4 * blockIdx.y;
    const TileJob j{(const unsigned short*)e[0], (const float*)e[2], (float*)e[3], rows, cols, t};
    tile_job(j, (int)blockIdx.x, sm);
}

// A set of bf16 products (`Bf16Set`, as `mm_bf16_set`) of one position
// count: entry i's rt_i × pt tiles follow those of the entries before it.
extern "C" __global__ void __launch_bounds__(TILE_THREADS, TILE_MINB)
    mm_bf16_tile_set(int n, int t, Bf16Set s) {
    __shared__ __align__(16) unsigned char sm[2 * TILE_STAGE];
    const int pt = (t + TB_P - 1) / TB_P;
    int first = 0, b = (int)blockIdx.x, at = -1;
    unsigned long long e[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < SET_MAX; ++i) {
        const int tiles = ((int)(unsigned)s.e[i][3] + TB_R - 1) / TB_R * pt;
        if (i < n && at < 0 && b < first + tiles) {
            at = b - first;
#pragma unroll
            for (int f = 0; f < 4; ++f) e[f] = s.e[i][f];
        }
        first += tiles;
    }
    if (at < 0) return;  // no such block in the host's grids
    const TileJob j{(const unsigned short*)e[0], (const float*)e[1], (float*)e[2],
                    (int)(unsigned)e[3], (int)(unsigned)(e[3] >> 32), t};
    tile_job(j, at, sm);
}
