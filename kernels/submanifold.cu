// Rulebooks (kernel maps) of sparse convolutions, and the gather that feeds their matrix
// product (sbnet_cupy/submanifold.py). Active sites live in an open-addressing hash table of
// linearised int64 keys ((b * S0 + c0) * S1 + c1 ...): linear probing from a 64-bit mix of the
// key, at most `capacity` probes, so a full table raises a flag instead of looping forever.

#define SUBM_EMPTY (-1LL)
#define SUBM_MAX_DIMS 4
// Flags the inserts raise (sbnet_cupy/submanifold.py reads them back).
#define SUBM_DUPLICATE 1
#define SUBM_FULL 2
#define SUBM_OUTSIDE 4

// Arguments of every rulebook kernel; each reads the fields it needs.
struct RuleArgs {
    const int* coords;    // sites [n, 1 + DIMS]: batch index, then coordinates
    const i64* keys_in;   // insert_keys: keys [n]
    i64* table_keys;      // [mask + 1], SUBM_EMPTY where free
    int* table_vals;      // [mask + 1], the row each key came from
    int* flags;           // [1], OR of the SUBM_* flags
    int* out_map;         // query_map: [taps, n]; decode_keys: coords [n, 1 + DIMS]
    i64* out_keys;        // compact_table: the occupied slots' keys, in no particular order
    int* counter;         // compact_table: how many
    i64 mask, n;          // capacity - 1 (a power of two minus one); sites
    int batch, taps, transposed;
    int shape[SUBM_MAX_DIMS];        // grid of `coords`
    int query_shape[SUBM_MAX_DIMS];  // grid of the table's keys
    int kernel[SUBM_MAX_DIMS], stride[SUBM_MAX_DIMS], padding[SUBM_MAX_DIMS],
        dilation[SUBM_MAX_DIMS];
};
static_assert(sizeof(RuleArgs) == 192, "RuleArgs must match sbnet_cupy/submanifold.py");

// splitmix64's finaliser: neighbouring coordinates land far apart.
static __device__ __forceinline__ i64 subm_slot(i64 key, i64 mask) {
    unsigned long long x = (unsigned long long)key;
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return (i64)(x & (unsigned long long)mask);
}

static __device__ void subm_insert(const RuleArgs& a, i64 key, int value, bool unique) {
    i64 slot = subm_slot(key, a.mask);
    for (i64 probe = 0; probe <= a.mask; ++probe) {
        const unsigned long long seen =
            atomicCAS((unsigned long long*)(a.table_keys + slot), (unsigned long long)SUBM_EMPTY,
                      (unsigned long long)key);
        if (seen == (unsigned long long)SUBM_EMPTY) {
            if (a.table_vals) a.table_vals[slot] = value;
            return;
        }
        if ((i64)seen == key) {
            if (unique) atomicOr(a.flags, SUBM_DUPLICATE);
            return;
        }
        slot = (slot + 1) & a.mask;
    }
    atomicOr(a.flags, SUBM_FULL);
}

static __device__ int subm_lookup(const RuleArgs& a, i64 key) {
    i64 slot = subm_slot(key, a.mask);
    for (i64 probe = 0; probe <= a.mask; ++probe) {
        const i64 seen = a.table_keys[slot];
        if (seen == key) return a.table_vals[slot];
        if (seen == SUBM_EMPTY) return -1;
        slot = (slot + 1) & a.mask;
    }
    return -1;
}

// Key (in query_shape) of the site that tap k connects site `row` of `coords` to, or -1:
// forward, the input o * stride - padding + k * dilation of output o; transposed, the output
// (i + padding - k * dilation) / stride that input i feeds, where it divides.
template <int DIMS> static __device__ i64 subm_connect(const RuleArgs& a, i64 row, int k) {
    const int* site = a.coords + row * (1 + DIMS);
    if (site[0] < 0 || site[0] >= a.batch) return -1;  // unchecked coords: never a bad key
    int tap[DIMS];
#pragma unroll
    for (int d = DIMS - 1; d >= 0; --d) {
        tap[d] = k % a.kernel[d];
        k /= a.kernel[d];
    }
    i64 key = site[0];
#pragma unroll
    for (int d = 0; d < DIMS; ++d) {
        i64 q;
        if (a.transposed) {
            const i64 num = (i64)site[1 + d] + a.padding[d] - (i64)tap[d] * a.dilation[d];
            if (num < 0 || num % a.stride[d] != 0) return -1;
            q = num / a.stride[d];
        } else {
            q = (i64)site[1 + d] * a.stride[d] - a.padding[d] + (i64)tap[d] * a.dilation[d];
        }
        if (q < 0 || q >= a.query_shape[d]) return -1;
        key = key * a.query_shape[d] + q;
    }
    return key;
}

static __device__ __forceinline__ i64 subm_first() {
    return (i64)blockIdx.x * blockDim.x + threadIdx.x;
}
static __device__ __forceinline__ i64 subm_step() { return (i64)gridDim.x * blockDim.x; }

// An empty table (every key SUBM_EMPTY), flags and counter zero (DIMS plays no part).
template <int DIMS> __global__ void clear_table(const RuleArgs a) {
    for (i64 s = subm_first(); s <= a.mask; s += subm_step()) a.table_keys[s] = SUBM_EMPTY;
    if (subm_first() == 0) {
        *a.flags = 0;
        *a.counter = 0;
    }
}

// Row r of coords, value r; rows outside batch x shape raise SUBM_OUTSIDE and are left out.
template <int DIMS> __global__ void insert_coords(const RuleArgs a) {
    for (i64 r = subm_first(); r < a.n; r += subm_step()) {
        const int* site = a.coords + r * (1 + DIMS);
        bool inside = site[0] >= 0 && site[0] < a.batch;
        i64 key = site[0];
#pragma unroll
        for (int d = 0; d < DIMS; ++d) {
            inside = inside && site[1 + d] >= 0 && site[1 + d] < a.shape[d];
            key = key * a.shape[d] + site[1 + d];
        }
        if (inside) {
            subm_insert(a, key, (int)r, true);
        } else {
            atomicOr(a.flags, SUBM_OUTSIDE);
        }
    }
}

// Key keys_in[r], value r (DIMS plays no part); negative keys raise SUBM_OUTSIDE.
template <int DIMS> __global__ void insert_keys(const RuleArgs a) {
    for (i64 r = subm_first(); r < a.n; r += subm_step()) {
        const i64 key = a.keys_in[r];
        if (key >= 0) {
            subm_insert(a, key, (int)r, true);
        } else {
            atomicOr(a.flags, SUBM_OUTSIDE);
        }
    }
}

// Every output site that (input r, tap k) feeds, for all r < n, k < taps (repeats expected).
template <int DIMS> __global__ void insert_targets(const RuleArgs a) {
    for (i64 t = subm_first(); t < a.n * a.taps; t += subm_step()) {
        const i64 key = subm_connect<DIMS>(a, t % a.n, (int)(t / a.n));
        if (key >= 0) subm_insert(a, key, 0, false);
    }
}

// The keys of the occupied slots, appended in whatever order the atomics give (the caller
// sorts them; DIMS plays no part).
template <int DIMS> __global__ void compact_table(const RuleArgs a) {
    for (i64 s = subm_first(); s <= a.mask; s += subm_step()) {
        const i64 key = a.table_keys[s];
        if (key != SUBM_EMPTY) a.out_keys[atomicAdd(a.counter, 1)] = key;
    }
}

// Coordinates [n, 1 + DIMS] (in out_map) of the keys keys_in [n] of a grid of query_shape.
template <int DIMS> __global__ void decode_keys(const RuleArgs a) {
    for (i64 r = subm_first(); r < a.n; r += subm_step()) {
        i64 key = a.keys_in[r];
        int* site = a.out_map + r * (1 + DIMS);
#pragma unroll
        for (int d = DIMS - 1; d >= 0; --d) {
            site[1 + d] = (int)(key % a.query_shape[d]);
            key /= a.query_shape[d];
        }
        site[0] = (int)key;
    }
}

// out_map[k, r] = row (in the table) of the site tap k connects site r of coords to, or -1.
template <int DIMS> __global__ void query_map(const RuleArgs a) {
    for (i64 t = subm_first(); t < a.n * a.taps; t += subm_step()) {
        const i64 key = subm_connect<DIMS>(a, t % a.n, (int)(t / a.n));
        a.out_map[t] = key < 0 ? -1 : subm_lookup(a, key);
    }
}

struct GatherArgs {
    const void* src;  // features [N_in, words] (Word units)
    void* dst;        // [n_out, taps, words]
    const int* map;   // [taps, n_out]: row of src, or -1 for zeros
    i64 n_out;
    int taps, words;
};
static_assert(sizeof(GatherArgs) == 40, "GatherArgs must match sbnet_cupy/submanifold.py");

// dst[o, k, :] = src[map[k, o], :], zeros where map is -1. Consecutive threads write
// consecutive words of dst.
template <typename Word> __global__ void submanifold_gather(const GatherArgs a) {
    const i64 total = a.n_out * a.taps * a.words;
    const Word* src = (const Word*)a.src;
    Word* dst = (Word*)a.dst;
    for (i64 t = subm_first(); t < total; t += subm_step()) {
        const i64 r = t / a.words;
        const int k = (int)(r % a.taps);
        const int i = a.map[k * a.n_out + r / a.taps];
        Word v = Word();
        if (i >= 0) v = src[(i64)i * a.words + t % a.words];
        dst[t] = v;
    }
}

// --- the fused convolution: gather and tensor-core matrix product in one kernel -------------
//
// out[o, :] = bias + sum over taps k and input channels of features[map[k, o], ci] *
// weight[:, k, ci], for a tile of FUSED_BM output sites x FUSED_BN output channels a CTA (4
// warps of 32 x 32). Per tap, the rows' neighbours are read once; a tap no row of the tile has
// is skipped. Per chunk of 32 bytes of input channels, the rows (zeros for absent neighbours)
// and the weight's slice [FUSED_BN, chunk] are staged in shared memory and multiplied with
// mma.sync (tensor_core_mma, common.cuh): m16n8k16 for half and bfloat16, m16n8k8 TF32 for float;
// float32 accumulation.

#define FUSED_BM 64
#define FUSED_BN 64
#define FUSED_THREADS 128
#define FUSED_PITCH 12  // 32-bit words a staged row: 8 of data, 4 of padding (no bank conflicts)

struct FusedArgs {
    const void* features;  // [N_in, cin]
    const void* weight;    // [cout, taps, cin]
    const void* bias;      // [cout], or null
    const int* map;        // [taps, n_out]: the input row tap k of output o reads, or -1
    void* out;             // [n_out, cout]
    i64 n_out;
    int cin, cout, taps;
};
static_assert(sizeof(FusedArgs) == 64, "FusedArgs must match sbnet_cupy/submanifold.py");

// A staged word as the MMA takes it: 16-bit pairs as they are, float rounded to TF32.
template <typename T> static __device__ __forceinline__ unsigned fused_operand(unsigned w) {
    return w;
}
template <> __device__ __forceinline__ unsigned fused_operand<float>(unsigned w) {
    unsigned t;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(t) : "f"(__uint_as_float(w)));
    return t;
}

// Stage rows [FUSED_BM or FUSED_BN][32 bytes] of a matrix of `cols` columns: row r is row
// src(r) of `base` (absent: -1, zeros), columns col0.. (zeros past cols). VEC: cols is a whole
// number of 32-byte chunks and rows are 16-byte aligned, so a thread moves one 16-byte half-row.
template <typename T, bool VEC, typename Src>
static __device__ __forceinline__ void fused_stage(unsigned* tile, const T* base, i64 stride,
                                                   int cols, int col0, Src src) {
    constexpr int BK = 32 / sizeof(T);
    if (VEC) {
        const int r = threadIdx.x >> 1, part = threadIdx.x & 1;
        const i64 row = src(r);
        uint4 v = {0, 0, 0, 0};
        if (row >= 0) v = *(const uint4*)(base + row * stride + col0 + part * (BK / 2));
        *(uint4*)(tile + r * FUSED_PITCH + part * 4) = v;
    } else {
        T* t = (T*)tile;
        for (int e = threadIdx.x; e < FUSED_BM * BK; e += FUSED_THREADS) {
            const int r = e / BK, c = e % BK;
            const i64 row = src(r);
            T v = T();
            if (row >= 0 && col0 + c < cols) v = base[row * stride + col0 + c];
            t[r * (FUSED_PITCH * 4 / (int)sizeof(T)) + c] = v;
        }
    }
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(FUSED_THREADS) submanifold_fused(const FusedArgs a) {
    constexpr int BK = 32 / sizeof(T);
    static_assert(FUSED_BM == FUSED_BN && FUSED_THREADS == 2 * FUSED_BM, "one half-row a thread");
    __shared__ __align__(16) unsigned as[FUSED_BM * FUSED_PITCH];
    __shared__ __align__(16) unsigned bs[FUSED_BN * FUSED_PITCH];
    __shared__ int rows[FUSED_BM];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tig = lane & 3;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
    const i64 m0 = (i64)blockIdx.x * FUSED_BM;
    const int n0 = blockIdx.y * FUSED_BN;
    const T* features = (const T*)a.features;
    const T* weight = (const T*)a.weight;
    float acc[2][4][4] = {};
    for (int k = 0; k < a.taps; ++k) {
        int src = -1;
        if (threadIdx.x < FUSED_BM) {
            if (m0 + threadIdx.x < a.n_out) src = a.map[(i64)k * a.n_out + m0 + threadIdx.x];
            rows[threadIdx.x] = src;
        }
        if (!__syncthreads_or(src >= 0)) continue;  // no row of the tile has this neighbour
        for (int c0 = 0; c0 < a.cin; c0 += BK) {
            fused_stage<T, VEC>(as, features, a.cin, a.cin, c0,
                                [&](int r) { return (i64)rows[r]; });
            fused_stage<T, VEC>(bs, weight + (i64)k * a.cin, (i64)a.taps * a.cin, a.cin, c0,
                                [&](int r) { return n0 + r < a.cout ? (i64)(n0 + r) : (i64)-1; });
            __syncthreads();
            unsigned b[4][2];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) {
                const unsigned* col = bs + (wn + nt * 8 + gid) * FUSED_PITCH + tig;
                b[nt][0] = fused_operand<T>(col[0]);
                b[nt][1] = fused_operand<T>(col[4]);
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                const unsigned* row = as + (wm + mt * 16 + gid) * FUSED_PITCH + tig;
                const unsigned frag[4] = {
                    fused_operand<T>(row[0]), fused_operand<T>(row[8 * FUSED_PITCH]),
                    fused_operand<T>(row[4]), fused_operand<T>(row[8 * FUSED_PITCH + 4])};
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) tensor_core_mma<T>::run(acc[mt][nt], frag, b[nt]);
            }
            __syncthreads();
        }
    }
    T* out = (T*)a.out;
    const T* bias = (const T*)a.bias;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const i64 o = m0 + wm + mt * 16 + gid + (i >> 1) * 8;
                const int co = n0 + wn + nt * 8 + tig * 2 + (i & 1);
                if (o < a.n_out && co < a.cout) {
                    const float b = bias ? to_acc(bias[co]) : 0.0f;
                    out[o * a.cout + co] = from_acc<T>(acc[mt][nt][i] + b);
                }
            }
        }
    }
}
