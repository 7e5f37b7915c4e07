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
    int* out_map;         // query_map: [taps, n]
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

// Key keys_in[r], value r (DIMS plays no part).
template <int DIMS> __global__ void insert_keys(const RuleArgs a) {
    for (i64 r = subm_first(); r < a.n; r += subm_step()) subm_insert(a, a.keys_in[r], (int)r, true);
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
