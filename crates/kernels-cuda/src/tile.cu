// bf16 and MXFP4 products of many positions (the host takes these from
// TILE_T positions, `launch.rs`), in tiles: a block of TILE_THREADS threads makes
// TB_R rows × TB_P positions, its four warps TW_R × TW_P of them each. The
// sums are `rows_product`'s (matmul.cu), bit for bit: lane l of a warp
// accumulates fmaf(x, w, acc) over the columns l, l + 32, l + 64, … in
// order — each full chunk of CHUNK columns, then the columns past the last
// full chunk one a lane at a time — and the 32 lanes' sums fold in halves
// (fold32). What changes is only where the operands come from: a chunk of
// the block's rows (the rearranged layouts of `bf16_lanes` and
// `mxfp4_lanes`: lane l's eight values 16 contiguous bytes, or one word of
// eight codes beside the chunk's eight scale bytes) and of its positions' inputs is copied to
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
#define TILE_BOUNDS __launch_bounds__(TILE_THREADS, TILE_MINB)

// N (4, 8 or 16) bytes from global to shared memory, both N-aligned:
// cp.async where the device has it (compute 8.0 on; 16 bytes past L1,
// fewer through it), else a plain copy (the host emulator too). The copies
// a thread issued since its last `copies_commit` form one group.
template <int N>
__device__ __forceinline__ void copy_async(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    if (N == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d), "l"(src), "n"(N)
                     : "memory");
#else
#pragma unroll
    for (int i = 0; i < N / 4; ++i)
        reinterpret_cast<unsigned*>(dst)[i] = reinterpret_cast<const unsigned*>(src)[i];
#endif
}

__device__ __forceinline__ void copies_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most `N` of this thread's committed groups are in flight.
template <int N>
__device__ __forceinline__ void copies_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// One product's operands as a tile sees them.
struct TileJob {
    const void* __restrict__ w;
    const void* __restrict__ scales;  // MXFP4's bytes, int8's per-row floats; null for bf16
    const float* __restrict__ x;
    float* __restrict__ y;
    int rows, cols, t;
};

// A row of the tile (past the product's: its last, whose sums are never
// written).
__device__ __forceinline__ int tile_row(const TileJob& j, int r) {
    return r < j.rows ? r : j.rows - 1;
}

// bf16 in lane order: a row's chunk is 512 bytes, lane l's eight values
// (columns c + l + 32u, value u at half u) at byte 16l.
struct TileBf16 {
    struct Raw {
        unsigned q[4];
    };
    __device__ static void stage(unsigned char* st, const TileJob& j, int c, int r0) {
        const unsigned short* w = (const unsigned short*)j.w;
#pragma unroll
        for (int i = 0; i < TB_R * 32 / TILE_THREADS; ++i) {
            const int k = (int)threadIdx.x + i * TILE_THREADS, rr = k >> 5, q = k & 31;
            const size_t r = (size_t)tile_row(j, r0 + rr);
            copy_async<16>(st + rr * 512 + q * 16, w + r * j.cols + c + q * 8);
        }
    }
    __device__ static Raw load(const unsigned char* st, int r, int lane) {
        const U32x4 v = reinterpret_cast<const U32x4*>(st)[r * 32 + lane];
        return Raw{{v.x, v.y, v.z, v.w}};
    }
    __device__ static float decode(const Raw& raw, int u) {
        return (u & 1) ? __uint_as_float(raw.q[u >> 1] & 0xFFFF0000u)
                       : __uint_as_float(raw.q[u >> 1] << 16);
    }
    __device__ static float at(const TileJob& j, int r, int i) {
        return bf16f(((const unsigned short*)j.w)[(size_t)r * j.cols + i]);
    }
    __device__ static float finish(const TileJob&, int, float s) { return s; }
};

// MXFP4 in lane order (cols a multiple of 256): a row's chunk is 128 bytes
// of codes, lane l's word holding columns c + l + 32u at nibble u, staged
// at row · 128, and the chunk's eight scale bytes (scale u for value u)
// at TB_R · 128 + row · 8. A value is the E2M1 code's value times its
// scale (e8m0), as `Mxfp4Chunk` makes it.
struct TileMxfp4 {
    struct Raw {
        unsigned word;
        unsigned long long sc;
    };
    __device__ static void stage(unsigned char* st, const TileJob& j, int c, int r0) {
        const unsigned char* p = (const unsigned char*)j.w;
        const int tid = (int)threadIdx.x;
        // TB_R rows × 8 pieces of 16 bytes: one a thread.
        {
            const int rr = tid >> 3, q = tid & 7;
            const size_t r = (size_t)tile_row(j, r0 + rr);
            copy_async<16>(st + rr * 128 + q * 16,
                           p + r * (size_t)(j.cols >> 1) + (c >> 1) + q * 16);
        }
        if (tid < TB_R) {
            const size_t r = (size_t)tile_row(j, r0 + tid);
            const unsigned char* sc = (const unsigned char*)j.scales;
            copy_async<8>(st + TB_R * 128 + tid * 8,
                          sc + r * (size_t)(j.cols >> 5) + (c >> 5));
        }
    }
    __device__ static Raw load(const unsigned char* st, int r, int lane) {
        return Raw{reinterpret_cast<const unsigned*>(st + r * 128)[lane],
                   reinterpret_cast<const unsigned long long*>(st + TB_R * 128)[r]};
    }
    __device__ static float decode(const Raw& raw, int u) {
        const unsigned b = (unsigned)(raw.sc >> (8 * u)) & 0xFFu;
        return e2m1((raw.word >> (4 * u)) & 0x0Fu) * e8m0((unsigned char)b);
    }
    __device__ static float at(const TileJob& j, int r, int i) {
        const size_t e = (size_t)r * j.cols + i;
        const unsigned b = ((const unsigned char*)j.w)[e >> 1];
        const unsigned code = (i & 1) ? (b >> 4) : (b & 0x0Fu);
        return e2m1(code) * e8m0(((const unsigned char*)j.scales)[e >> 5]);
    }
    __device__ static float finish(const TileJob&, int, float s) { return s; }
};

// int8 with a scale a row (cols a multiple of 16), which VRAM keeps in the
// host's layout: each thread loads 16 of a row's bytes and puts column
// c + l + 32u at byte 8l + u of the row's 256 staged bytes, so that lane
// l's eight codes are one 8-byte load (a plain copy: the bytes move).
// The sums finish as `mm_int8`'s, s · scale[r].
struct TileInt8 {
    struct Raw {
        unsigned long long v;
    };
    __device__ static void stage(unsigned char* st, const TileJob& j, int c, int r0) {
        const signed char* q = (const signed char*)j.w;
#pragma unroll
        for (int i = 0; i < TB_R * 16 / TILE_THREADS; ++i) {
            const int k = (int)threadIdx.x + i * TILE_THREADS, rr = k >> 4, piece = k & 15;
            const U32x4 v = *reinterpret_cast<const U32x4*>(
                q + (size_t)tile_row(j, r0 + rr) * j.cols + c + piece * 16);
            const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int b = 0; b < 16; ++b) {
                const int col = piece * 16 + b;  // l + 32u
                st[rr * 256 + (col & 31) * 8 + (col >> 5)] =
                    (unsigned char)(w[b >> 2] >> (8 * (b & 3)));
            }
        }
    }
    __device__ static Raw load(const unsigned char* st, int r, int lane) {
        return Raw{reinterpret_cast<const unsigned long long*>(st + r * 256)[lane]};
    }
    __device__ static float decode(const Raw& raw, int u) {
        return (float)(signed char)(unsigned char)(raw.v >> (8 * u));
    }
    __device__ static float at(const TileJob& j, int r, int i) {
        return (float)((const signed char*)j.w)[(size_t)r * j.cols + i];
    }
    __device__ static float finish(const TileJob& j, int r, float s) {
        return s * ((const float*)j.scales)[r];
    }
};
static_assert(TB_R * 8 == TILE_THREADS, "TileMxfp4::stage: a 16-byte piece a thread");
static_assert(TB_R * 16 % TILE_THREADS == 0, "TileInt8::stage: whole pieces a thread");

// Copies the full chunk at column c of rows r0 .. r0 + TB_R (the format's
// way) and of the inputs of positions p0 .. p0 + TB_P (1,024 bytes each,
// after the weights' TILE_WBYTES) into the stage `st`. Positions past the
// product's repeat its last.
template <typename F>
__device__ __forceinline__ void tile_stage(unsigned char* st, const TileJob& j, int c, int r0,
                                           int p0) {
    F::stage(st, j, c, r0);
    const int tid = (int)threadIdx.x;
#pragma unroll
    for (int i = 0; i < TB_P * 64 / TILE_THREADS; ++i) {
        const int k = tid + i * TILE_THREADS, pp = k >> 6, q = k & 63;
        const int p = p0 + pp < j.t ? p0 + pp : j.t - 1;
        copy_async<16>(st + TILE_WBYTES + pp * 1024 + q * 16,
                       j.x + (size_t)p * j.cols + c + q * 4);
    }
}

// The warp's sums over one staged chunk: its rows wr · TW_R + r and
// positions wp · TW_P + p of the block's, lane `lane`'s columns lane + 32u
// of the chunk for u = 0..7 in order.
template <typename F>
__device__ __forceinline__ void tile_sum(const unsigned char* st, int wr, int wp, int lane,
                                         float (&acc)[TW_R][TW_P]) {
    const float* xs = reinterpret_cast<const float*>(st + TILE_WBYTES) + wp * TW_P * CHUNK + lane;
    typename F::Raw raw[TW_R];
#pragma unroll
    for (int r = 0; r < TW_R; ++r) raw[r] = F::load(st, wr * TW_R + r, lane);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        float wv[TW_R];
#pragma unroll
        for (int r = 0; r < TW_R; ++r) wv[r] = F::decode(raw[r], u);
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
template <typename F>
__device__ __forceinline__ void product_tile(const TileJob& j, int r0, int p0,
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
        tile_stage<F>(sm, j, 0, r0, p0);
        copies_commit();
    }
    for (int k = 0; k < n; ++k) {
        if (k + 1 < n) {
            tile_stage<F>(sm + ((k + 1) & 1) * TILE_STAGE, j, (k + 1) * CHUNK, r0, p0);
            copies_commit();
            copies_wait<1>();
        } else {
            copies_wait<0>();
        }
        __syncthreads();
        tile_sum<F>(sm + (k & 1) * TILE_STAGE, wr, wp, lane, acc);
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
            const float wv = in ? F::at(j, tile_row(j, rw + r), i) : 0.0f;
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
                j.y[(size_t)(pw + p) * j.rows + rw + r] = F::finish(j, rw + r, s);
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

template <typename F>
__device__ __forceinline__ void tile_job(const TileJob& j, int b, unsigned char* sm) {
    const int rt = (j.rows + TB_R - 1) / TB_R, pt = (j.t + TB_P - 1) / TB_P;
    if (b >= rt * pt) return;  // no such block in the host's grids
    int r0, p0;
    tile_place(b, rt, pt, r0, p0);
    product_tile<F>(j, r0, p0, sm);
}

// One product, blockIdx.x its tiles (`tile_place`). x is 16-byte aligned
// and cols a multiple of 8 (the host checks).
extern "C" __global__ void TILE_BOUNDS mm_bf16_tile(const unsigned short* __restrict__ w,
                                                 const float* __restrict__ x,
                                                 float* __restrict__ y, int rows, int cols,
                                                 int t) {
    __shared__ __align__(16) unsigned char sm[2 * TILE_STAGE];
    tile_job<TileBf16>(TileJob{w, nullptr, x, y, rows, cols, t}, (int)blockIdx.x, sm);
}

// Products of one shape (a MoE layer's experts), blockIdx.y picking
// product p at t4[4p .. 4p + 4) (data, scales or 0, x, y) as `mm_bf16_many`
// and `mm_mxfp4_many`.
template <typename F>
__device__ __forceinline__ void tile_many(const unsigned long long* __restrict__ t4, int rows,
                                          int cols, int t, unsigned char* sm) {
    const unsigned long long* e = t4 + 4 * blockIdx.y;
    const TileJob j{(const void*)e[0], (const void*)e[1], (const float*)e[2], (float*)e[3],
                    rows, cols, t};
    tile_job<F>(j, (int)blockIdx.x, sm);
}

extern "C" __global__ void TILE_BOUNDS mm_bf16_tile_many(const unsigned long long* __restrict__ t4,
                                                      int rows, int cols, int t) {
    __shared__ __align__(16) unsigned char sm[2 * TILE_STAGE];
    tile_many<TileBf16>(t4, rows, cols, t, sm);
}

// A set of bf16 products (`Bf16Set`, as `mm_bf16_set`) of one position
// count: entry i's rt_i × pt tiles follow those of the entries before it.
extern "C" __global__ void TILE_BOUNDS mm_bf16_tile_set(int n, int t, Bf16Set s) {
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
    const TileJob j{(const void*)e[0], nullptr, (const float*)e[1], (float*)e[2],
                    (int)(unsigned)e[3], (int)(unsigned)(e[3] >> 32), t};
    tile_job<TileBf16>(j, at, sm);
}

// MXFP4 products (cols a multiple of 256; x 16-byte aligned): one, and of
// one shape through a table (`tile_many`).
extern "C" __global__ void TILE_BOUNDS mm_mxfp4_tile(const unsigned char* __restrict__ packed,
                                                  const unsigned char* __restrict__ scales,
                                                  const float* __restrict__ x,
                                                  float* __restrict__ y, int rows, int cols,
                                                  int t) {
    __shared__ __align__(16) unsigned char sm[2 * TILE_STAGE];
    tile_job<TileMxfp4>(TileJob{packed, scales, x, y, rows, cols, t}, (int)blockIdx.x, sm);
}

extern "C" __global__ void TILE_BOUNDS mm_mxfp4_tile_many(const unsigned long long* __restrict__ t4,
                                                       int rows, int cols, int t) {
    __shared__ __align__(16) unsigned char sm[2 * TILE_STAGE];
    tile_many<TileMxfp4>(t4, rows, cols, t, sm);
}

// int8 products with a scale a row (cols a multiple of 16; x 16-byte
// aligned): the weights' codes, then their scales, as `mm_int8`.
extern "C" __global__ void TILE_BOUNDS mm_int8_tile(const signed char* __restrict__ q,
                                                 const float* __restrict__ scale,
                                                 const float* __restrict__ x,
                                                 float* __restrict__ y, int rows, int cols,
                                                 int t) {
    __shared__ __align__(16) unsigned char sm[2 * TILE_STAGE];
    tile_job<TileInt8>(TileJob{q, scale, x, y, rows, cols, t}, (int)blockIdx.x, sm);
}
