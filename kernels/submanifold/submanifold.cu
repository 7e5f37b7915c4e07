// Rulebooks (kernel maps) of sparse convolutions, and the gather that feeds their matrix
// product (sbnet_cupy/submanifold/). Active sites live in an open-addressing hash table of
// linearised int64 keys ((b * S0 + c0) * S1 + c1 ...): linear probing from a 64-bit mix of the
// key, at most `capacity` probes, so a full table raises a flag instead of looping forever.

#define SUBM_EMPTY (-1LL)
#define SUBM_MAX_DIMS 4
// Flags the inserts raise (sbnet_cupy/submanifold/cuda_rulebook.py reads them back).
#define SUBM_DUPLICATE 1
#define SUBM_FULL 2
#define SUBM_OUTSIDE 4

// The kernels' argument records (RuleArgs, GatherArgs, MaskArgs, FusedArgs) are declared in
// sbnet_cupy/core/records.py, which puts their definitions in front of this file.
static_assert(sizeof(((RuleArgs*)0)->shape) == SUBM_MAX_DIMS * sizeof(int),
              "RuleArgs' grids hold SUBM_MAX_DIMS axes (sbnet_cupy/core/records.py)");

// rank_words: a CTA of RANK_THREADS threads ranks RANK_WORDS consecutive words of a bitmap.
#define RANK_THREADS 256
#define RANK_PER_THREAD 4
#define RANK_WORDS (RANK_THREADS * RANK_PER_THREAD)

static __device__ void subm_insert(const RuleArgs& a, i64 key, int value, bool unique) {
    i64 slot = hash_slot(key, a.mask);
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
    i64 slot = hash_slot(key, a.mask);
    for (i64 probe = 0; probe <= a.mask; ++probe) {
        const i64 seen = a.table_keys[slot];
        if (seen == key) return a.table_vals[slot];
        if (seen == SUBM_EMPTY) return -1;
        slot = (slot + 1) & a.mask;
    }
    return -1;
}

// Row of `key` in the table (hash table or bitmap), or -1 (also for key -1: no site). A
// bitmap's sites have rows below n_out: those a bounded build had no room for (see emit_sites)
// are absent. The bit's word and its rank are read together: one latency, where most lookups
// find a site.
static __device__ int subm_find(const RuleArgs& a, i64 key) {
    if (key < 0) return -1;
    if (!a.bits) return subm_lookup(a, key);
    const unsigned word = a.bits[key >> 5], below = (1u << (key & 31)) - 1u;
    const int rank = a.ranks[key >> 5];
    if (!((word >> (key & 31)) & 1u)) return -1;
    const int row = rank + __popc(word & below);
    return row < a.n_out ? row : -1;
}

// What tap t of axis d adds to a coordinate: forward, t * dilation - padding (to o * stride);
// transposed, padding - t * dilation (to i, before the division by stride).
static __device__ __forceinline__ i64 subm_offset(const RuleArgs& a, int d, int t,
                                                  bool transposed) {
    const i64 shift = (i64)t * a.dilation[d];
    return transposed ? a.padding[d] - shift : shift - a.padding[d];
}

// The coordinate along axis d of query_shape that `offset` takes coordinate c to, or -1:
// forward, c * stride + offset; transposed, (c + offset) / stride, where it divides. The
// division is 32-bit: a numerator below query_shape x stride is below 2^32 (coordinates and
// padding are int32).
static __device__ __forceinline__ i64 subm_axis(const RuleArgs& a, int d, int c, i64 offset,
                                                bool transposed) {
    if (transposed) {
        const i64 num = c + offset;
        if (num < 0 || num >= (i64)a.query_shape[d] * a.stride[d]) return -1;
        const unsigned stride = a.stride[d], q = (unsigned)num / stride;
        return q * stride == (unsigned)num ? (i64)q : -1;
    }
    const i64 q = (i64)c * a.stride[d] + offset;
    return q >= 0 && q < a.query_shape[d] ? q : -1;
}

// site[0 .. DIMS] = the batch index and coordinates of `key` in a grid of query_shape; Key:
// unsigned for a bitmap's keys (below 2^31), whose divisions then take 32 bits.
template <int DIMS, typename Key>
static __device__ __forceinline__ void subm_decode(const RuleArgs& a, Key key, int* site) {
#pragma unroll
    for (int d = DIMS - 1; d >= 0; --d) {
        const Key rest = key / (Key)a.query_shape[d];
        site[1 + d] = (int)(key - rest * (Key)a.query_shape[d]);
        key = rest;
    }
    site[0] = (int)key;
}

static __device__ __forceinline__ i64 subm_first() {
    return (i64)blockIdx.x * blockDim.x + threadIdx.x;
}
static __device__ __forceinline__ i64 subm_step() { return (i64)gridDim.x * blockDim.x; }

// f(r, k, key) for every site r < n of coords and tap k < taps, key (in query_shape) that of the
// site tap k connects r to, or -1: forward, the input o * stride - padding + k * dilation of
// output o; transposed, the output (i + padding - k * dilation) / stride that input i feeds,
// where it divides. A thread takes a site and a row of taps (those along the last axis, whose
// keys are consecutive: one bitmap word), with the site read and its other axes worked out once;
// rows along blockIdx.y (site_tap_grid, cuda_rulebook.py), sites along x, both grid-stride.
// HALF: the taps up to the centre alone (k <= taps / 2, an odd kernel along every axis).
template <int DIMS, bool HALF = false, typename F>
static __device__ __forceinline__ void for_each_site_tap(const RuleArgs& a, bool transposed,
                                                         F f) {
    constexpr int last = DIMS - 1;
    const int row_taps = a.kernel[last], rows = a.taps / row_taps;
    for (int g = blockIdx.y; g < (HALF ? rows / 2 + 1 : rows); g += gridDim.y) {
        const int row_end = HALF && g == rows / 2 ? row_taps / 2 + 1 : row_taps;
        i64 offset[DIMS];  // the row's offsets along the other axes
        int rest = g;
#pragma unroll
        for (int d = last - 1; d >= 0; --d) {
            const int above = rest / a.kernel[d];
            offset[d] = subm_offset(a, d, rest - above * a.kernel[d], transposed);
            rest = above;
        }
        for (i64 r = subm_first(); r < a.n; r += subm_step()) {
            const int* site = a.coords + r * (1 + DIMS);
            // unchecked coords: never a bad key
            i64 outer = site[0] >= 0 && site[0] < a.batch ? site[0] : -1;
#pragma unroll
            for (int d = 0; d < last; ++d) {
                const i64 q = outer < 0 ? -1 : subm_axis(a, d, site[1 + d], offset[d], transposed);
                outer = q < 0 ? -1 : outer * a.query_shape[d] + q;
            }
            const int c = site[1 + last];
            for (int t = 0; t < row_end; ++t) {
                const i64 q = outer < 0 ? -1 : subm_axis(a, last, c, subm_offset(a, last, t,
                                                                                 transposed),
                                                         transposed);
                f(r, g * row_taps + t, q < 0 ? -1 : outer * a.query_shape[last] + q);
            }
        }
    }
}

// An empty table (every key SUBM_EMPTY), flags and counter zero (DIMS plays no part).
template <int DIMS> __global__ void clear_table(const RuleArgs a) {
    for (i64 s = subm_first(); s <= a.mask; s += subm_step()) a.table_keys[s] = SUBM_EMPTY;
    if (subm_first() == 0) {
        *a.flags = 0;
        *a.counter = 0;
    }
}

// Whether a coords row `site` lies inside batch x shape, and its linear key there.
template <int DIMS>
static __device__ __forceinline__ bool subm_site_key(const RuleArgs& a, const int* site, i64& key) {
    bool inside = site[0] >= 0 && site[0] < a.batch;
    key = site[0];
#pragma unroll
    for (int d = 0; d < DIMS; ++d) {
        inside = inside && site[1 + d] >= 0 && site[1 + d] < a.shape[d];
        key = key * a.shape[d] + site[1 + d];
    }
    return inside;
}

// Row r of coords, value r; rows outside batch x shape raise SUBM_OUTSIDE and are left out.
template <int DIMS> __global__ void insert_coords(const RuleArgs a) {
    for (i64 r = subm_first(); r < a.n; r += subm_step()) {
        i64 key;
        if (subm_site_key<DIMS>(a, a.coords + r * (1 + DIMS), key)) {
            subm_insert(a, key, (int)r, true);
        } else {
            atomicOr(a.flags, SUBM_OUTSIDE);
        }
    }
}

// SparseGraphs' check of its input, rows r < n of coords: as insert_coords (into a table that may
// keep no values), but rows of -1 alone (the graph's padding) are counted in *counter instead of
// raising SUBM_OUTSIDE; the caller compares the count with the padding it wrote, so that a real
// row of -1 is found too.
// Whole warps a step (lanes past n idle), so that a warp counts its padding rows in one atomic.
template <int DIMS> __global__ void check_sites(const RuleArgs a) {
    const int lane = threadIdx.x % 32;
    for (i64 first = subm_first() - lane; first < a.n; first += subm_step()) {
        const i64 r = first + lane;
        bool inside = false, padding = false;
        i64 key = 0;
        if (r < a.n) {
            const int* site = a.coords + r * (1 + DIMS);
            inside = subm_site_key<DIMS>(a, site, key);
            padding = true;
#pragma unroll
            for (int d = 0; d <= DIMS; ++d) padding = padding && site[d] == -1;
        }
        const unsigned pads = __ballot_sync(0xffffffffu, padding);
        if (inside) {
            subm_insert(a, key, (int)r, true);
        } else if (r < a.n && !padding) {
            atomicOr(a.flags, SUBM_OUTSIDE);
        }
        if (lane == 0 && pads) atomicAdd(a.counter, __popc(pads));
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
    for_each_site_tap<DIMS>(a, a.transposed, [&](i64, int, i64 key) {
        if (key >= 0) subm_insert(a, key, 0, false);
    });
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
        subm_decode<DIMS>(a, a.keys_in[r], a.out_map + r * (1 + DIMS));
    }
}

// out_map[k, r] = row (in the table) of the site tap k connects site r of coords to, or -1.
template <int DIMS> __global__ void query_map(const RuleArgs a) {
    for_each_site_tap<DIMS>(a, a.transposed, [&](i64 r, int k, i64 key) {
        a.out_map[k * a.n + r] = subm_find(a, key);
    });
}

// Both maps of a submanifold rulebook on the table's own sites, in one pass: out_map[k, r] =
// the row tap k of site r reads, out_map_t[k, r] = the row site r feeds through tap k. With an
// odd kernel along every axis (symmetric) the two are the same lookups with the taps reversed,
// and site r reading row s through tap k is row s reading r through the mirrored tap: the taps
// up to the centre are looked up, each pair found written for both sites, and the rest of the
// maps (out_map's taps past the centre, out_map_t's before it) were set to -1 (build_raw).
// Otherwise a second pass finds the sites r feeds (the transposed connection, stride 1).
template <int DIMS> __global__ void query_subm(const RuleArgs a) {
    if (a.symmetric) {
        for_each_site_tap<DIMS, true>(a, false, [&](i64 r, int k, i64 key) {
            const int row = subm_find(a, key);
            const i64 mirrored = a.taps - 1 - k;
            a.out_map[k * a.n + r] = row;
            a.out_map_t[mirrored * a.n + r] = row;
            if (row >= 0 && mirrored != k) {
                a.out_map[mirrored * a.n + row] = (int)r;
                a.out_map_t[k * a.n + row] = (int)r;
            }
        });
        return;
    }
    for_each_site_tap<DIMS>(a, false, [&](i64 r, int k, i64 key) {
        a.out_map[k * a.n + r] = subm_find(a, key);
    });
    for_each_site_tap<DIMS>(a, true, [&](i64 r, int k, i64 key) {
        a.out_map_t[k * a.n + r] = subm_find(a, key);
    });
}

// --- a strided convolution's output sites through a bitmap of the output grid ----------------
// mark_targets sets the bit of every output site an input feeds; rank_words counts set bits
// (one sync reads the total); emit_sites writes the sites in key order, that is sorted by
// (batch, coordinates), with no sort; scatter_strided writes both maps from the inputs' side.

// bits |= every output site that (input r, tap k) feeds, for all r < n, k < taps. A row of
// taps feeds consecutive keys: a thread ORs its bits of one word together, one atomic a word.
template <int DIMS> __global__ void mark_targets(const RuleArgs a) {
    i64 word = -1;
    unsigned bits = 0;
    for_each_site_tap<DIMS>(a, true, [&](i64, int, i64 key) {
        if (key < 0) return;
        if (key >> 5 != word) {
            if (bits) atomicOr(a.bits + word, bits);
            word = key >> 5;
            bits = 0;
        }
        bits |= 1u << (key & 31);
    });
    if (bits) atomicOr(a.bits + word, bits);
}

// Exclusive prefix sum of v over the CTA (RANK_THREADS threads, all of them calling); the
// CTA's total in *total. Each warp scans by shuffles and `warp_sums` (RANK_THREADS / 32 ints of
// shared memory) carries the warps' totals: one barrier where a scan through shared memory took
// two a step.
static __device__ int rank_scan(int v, int* warp_sums, int* total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int inclusive = v;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const int before = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += before;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    int before = 0, all = 0;
#pragma unroll
    for (int w = 0; w < RANK_THREADS / 32; ++w) {
        const int sum = warp_sums[w];
        before += w < warp ? sum : 0;
        all += sum;
    }
    *total = all;
    __syncthreads();  // warp_sums is free again
    return before + inclusive - v;
}

// CTA g (of groups = gridDim.x) writes ranks[w] = set bits of its words before w (for the words
// with a set bit: no lookup or emit_sites uses another's) and group[g] = its total; the last CTA
// to finish (counter, zero at launch) turns group into exclusive offsets with the grand total in
// group[groups]. Deterministic: no order of atomics enters a result. DIMS plays no part.
template <int DIMS> __global__ void __launch_bounds__(RANK_THREADS) rank_words(const RuleArgs a) {
    __shared__ int warp_sums[RANK_THREADS / 32];
    __shared__ bool last;
    const i64 first = (i64)blockIdx.x * RANK_WORDS + threadIdx.x * RANK_PER_THREAD;
    int counts[RANK_PER_THREAD], mine = 0;
#pragma unroll
    for (int j = 0; j < RANK_PER_THREAD; ++j) {
        counts[j] = first + j < a.words ? __popc(a.bits[first + j]) : 0;
        mine += counts[j];
    }
    int total;
    int rank = rank_scan(mine, warp_sums, &total);
#pragma unroll
    for (int j = 0; j < RANK_PER_THREAD; ++j) {
        if (counts[j]) a.ranks[first + j] = rank;
        rank += counts[j];
    }
    if (threadIdx.x == 0) {
        a.group[blockIdx.x] = total;
        __threadfence();  // group[g] visible before this CTA counts as done
        last = atomicAdd(a.counter, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    int carry = 0;
    for (int base = 0; base < (int)gridDim.x; base += RANK_THREADS) {
        const int g = base + threadIdx.x;
        const int v = g < (int)gridDim.x ? ((volatile int*)a.group)[g] : 0;
        const int before = rank_scan(v, warp_sums, &total);
        if (g < (int)gridDim.x) a.group[g] = carry + before;
        carry += total;
    }
    if (threadIdx.x == 0) a.group[gridDim.x] = carry;
}

// Coordinates (out_map, [n_out, 1 + DIMS]) of every set bit, at its rank: key order. Turns the
// ranks of the words with a set bit into global ones (group's offsets added), for subm_find;
// the others, most words of a sparse grid, are neither read nor written. A warp takes 32 words
// and then each of those with a set bit in turn, lane l its bit l: a word's sites are decoded
// side by side, where one thread's chain of them was the kernel's time, and their rows written
// by consecutive lanes. Sites ranked n_out or later are left out: a build bounded by a capacity
// (a CUDA graph's) had no room for them, which its count (group[groups]) above n_out tells.
template <int DIMS> __global__ void emit_sites(const RuleArgs a) {
    const int lane = threadIdx.x % 32;
    for (i64 first = subm_first() - lane; first < a.words; first += subm_step()) {
        const i64 mine = first + lane;
        const unsigned word = mine < a.words ? a.bits[mine] : 0u;
        int rank = 0;
        if (word) {
            rank = a.ranks[mine] + a.group[mine / RANK_WORDS];
            a.ranks[mine] = rank;
        }
        for (unsigned left = __ballot_sync(0xffffffffu, word != 0); left; left &= left - 1u) {
            const int j = __ffs(left) - 1;
            const unsigned bits = __shfl_sync(0xffffffffu, word, j);
            const int below = __popc(bits & ((1u << lane) - 1u));
            const int row = __shfl_sync(0xffffffffu, rank, j) + below;
            if ((bits >> lane) & 1u && row < a.n_out) {
                subm_decode<DIMS>(a, (unsigned)((first + j) * 32 + lane),
                                  a.out_map + (i64)row * (1 + DIMS));
            }
        }
    }
}

// out_map_t[k, r] = row of the output site input r feeds through tap k (or -1), and
// out_map[k, that row] = r (out_map [taps, n_out] filled with -1 beforehand): the output side
// of each pair is unique, so the scatter has no conflicts for distinct inputs. subm_find
// leaves out the sites emit_sites had no room for.
template <int DIMS> __global__ void scatter_strided(const RuleArgs a) {
    for_each_site_tap<DIMS>(a, true, [&](i64 r, int k, i64 key) {
        const int row = subm_find(a, key);
        a.out_map_t[k * a.n + r] = row;
        if (row >= 0) a.out_map[(i64)k * a.n_out + row] = (int)r;
    });
}

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

// The neighbour mask of every row of a map: sorted by it, rows that have the same taps share
// tiles of the fused kernel, which then skips the taps none of a tile's rows has.
template <typename Mask> __global__ void tap_masks(const MaskArgs a) {
    constexpr int BITS = 8 * sizeof(Mask);
    const int taps = min(a.taps, BITS);
    for (i64 r = subm_first(); r < a.n; r += subm_step()) {
        unsigned long long mask = 0;
        for (int k = 0; k < taps; ++k) mask |= (unsigned long long)(a.map[k * a.n + r] >= 0) << k;
        ((Mask*)a.masks)[r] = (Mask)mask;
    }
}

// Rulebook.fused_order's rows from an argsort of the masks: rows[0, j] = order[j] and rows[1 + k,
// j] = map[k, order[j]]. A thread reads its row's index once and copies that row's column of the
// map tap by tap: scattered reads, coalesced writes, no cast of the order between them.
template <typename Index> __global__ void ordered_map(const MaskArgs a) {
    const Index* order = (const Index*)a.order;
    for (i64 j = subm_first(); j < a.n; j += subm_step()) {
        const i64 i = order[j];
        a.rows[j] = (int)i;
        for (int k = 0; k < a.taps; ++k) a.rows[(k + 1) * a.n + j] = a.map[k * a.n + i];
    }
}

// The sites that have each tap, in order: pairs[k, i] is the i-th output site o whose map[k, o]
// is a row (not -1), totals[k] how many there are. grad_weight's kernel then multiplies only the
// sites a tap has, where the map's rows are mostly -1 (LiDAR sites fill a third or so of their
// neighbourhoods). Two passes, so that the order is the sites' (a deterministic sum): each CTA of
// PAIR_SITES sites counts its own, then places them after the counts of the CTAs before it, a
// round of THREADS sites at a time.
#define PAIR_SITES 1024

template <int THREADS> __global__ void tap_pair_counts(const PairArgs a) {
    __shared__ int count;
    const int k = blockIdx.y;
    const i64 base = (i64)blockIdx.x * PAIR_SITES;
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    int mine = 0;
    for (int j = 0; j < PAIR_SITES / THREADS; ++j) {
        const i64 o = base + j * THREADS + threadIdx.x;
        mine += o < a.n_out && a.map[k * a.n_out + o] >= 0;
    }
    atomicAdd(&count, mine);
    __syncthreads();
    if (threadIdx.x == 0) a.counts[k * a.blocks + blockIdx.x] = count;
}

template <int THREADS> __global__ void tap_pairs(const PairArgs a) {
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps");
    __shared__ int before;
    __shared__ int warp_counts[THREADS / 32];
    const int k = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const i64 base = (i64)blockIdx.x * PAIR_SITES;
    if (threadIdx.x == 0) before = 0;
    __syncthreads();
    int mine = 0;
    for (int b = threadIdx.x; b < (int)blockIdx.x; b += THREADS) mine += a.counts[k * a.blocks + b];
    atomicAdd(&before, mine);
    __syncthreads();
    int placed = before;  // sites of this tap before the round
    for (int j = 0; j < PAIR_SITES / THREADS; ++j) {
        const i64 o = base + j * THREADS + threadIdx.x;
        const bool has = o < a.n_out && a.map[k * a.n_out + o] >= 0;
        const unsigned votes = __ballot_sync(0xffffffffu, has);
        if (lane == 0) warp_counts[warp] = __popc(votes);
        __syncthreads();
        int offset = placed, round = 0;
        for (int w = 0; w < THREADS / 32; ++w) {
            offset += w < warp ? warp_counts[w] : 0;
            round += warp_counts[w];
        }
        if (has) a.pairs[k * a.n_out + offset + __popc(votes & ((1u << lane) - 1u))] = (int)o;
        placed += round;
        __syncthreads();  // warp_counts is the next round's
    }
    if (blockIdx.x == gridDim.x - 1 && threadIdx.x == 0) a.totals[k] = placed;
}

// --- the fused convolution: gather and tensor-core matrix product in one kernel -------------
//
// out[o, :] = bias + sum over taps k and input channels of features[map[k, o], ci] * weight[:, k,
// ci] (then max(0, .) where a.relu: an eval model's ReLU, BatchNorm folded into weight and bias,
// torch_bridge.submanifold.fuse_bn_relu), for a tile of BM output sites x BN output channels a CTA
// (4 warps; BN 16, 32, 64, 96 or 128, the launch's choice by cout: narrow layers (and segmentation
// U-Nets' 96 channels) do no MMA work on padding, wide ones gather each neighbour row once; BM 64,
// or 128 where the sites fill the GPU (fused_tall): a weight slice then serves twice the rows, and
// each warp does twice the MMAs for its fragment loads; 128 x 128 tiles, four warps of 64 x 64,
// where 128 x 64 ones would leave a last round of CTAs nearly empty: fused_tall_wide). The
// reduction runs in stages of STAGE bytes a row: the tile's rows (zeros for absent neighbours) and
// the weight's slice [BN, STAGE bytes] staged in shared memory and multiplied with mma.sync
// (tensor_core_mma, common.cuh): m16n8k16 for half and bfloat16, m16n8k8 TF32 for float; float32
// accumulation. A stage holds `width` channels of each of `per_stage` taps side by side: rows
// narrower than a stage (16 or 32 channels) pack several taps into it, so every barrier has whole
// k-steps of work; wider rows take ceil(cin / width) stages a tap. All but one of the stages in
// shared memory are in flight (cp.async where rows are whole 16-byte vectors): with few sites the
// grid is small and each CTA's chain of loads is what takes the time. The neighbour rows of up to
// FUSED_TAPS taps are read once, together; taps no row of the tile has are skipped, and where the
// launch gives an order of the output rows sorted by their neighbour masks (tap_masks), with the
// map's columns in that order (so that tiles read the map coalesced), a tile's rows have much the
// same taps. Where tiles are fewer than the GPU has SMs, the taps are split over blockIdx.z: each
// split writes its float sums to partial[z], and split_sum (common.cuh) adds them up in split order
// (deterministic, no atomics). Both are programmatic dependent launches (common.cuh).

#define FUSED_BM 64  // sites of a tile in static shared memory (BM 128 takes dynamic slots)
#define FUSED_THREADS 128
#define FUSED_TAPS 32  // taps whose neighbour rows a CTA holds at once (bits of one word)
#define FUSED_SLOT_BYTES 37888  // static shared memory for stages, beside the neighbour rows

// Words a staged row of STAGE bytes takes (mma_pitch, common.cuh).
template <int STAGE> constexpr int fused_pitch = mma_pitch<STAGE / 4>;

// Stages of FUSED_BM sites and BN channels, rows of STAGE bytes, that fit in FUSED_SLOT_BYTES
// (six at most).
template <int STAGE, int BN>
constexpr int fused_slots = FUSED_SLOT_BYTES / ((FUSED_BM + BN) * fused_pitch<STAGE> * 4) < 6
                                ? FUSED_SLOT_BYTES / ((FUSED_BM + BN) * fused_pitch<STAGE> * 4)
                                : 6;

// A tile of BM sites x BN channels in stages of STAGE bytes a row (32: one k-step of the MMA; 64
// or 128: two or four, for fewer barriers and copy rounds) and SLOTS of them in shared memory
// (mma_tile, common.cuh): the stages that fit in FUSED_SLOT_BYTES, or as many as the launch gives
// dynamic shared memory for. Four warps of WM x WN: 2 x 2 for BN 128, 96, 64 and 32, 4 x 1 for 16.
template <int STAGE, int BN, int SLOTS = fused_slots<STAGE, BN>, int BM = FUSED_BM>
struct fused_tile : mma_tile<BM, BN, STAGE / 4, BN == 16 ? 4 : 2, SLOTS> {
    static_assert(STAGE == 32 || STAGE == 64 || STAGE == 128, "a stage is 1, 2 or 4 k-steps");
    static_assert(BN == 16 || BN == 32 || BN == 64 || BN == 96 || BN == 128,
                  "a tile is 16, 32, 64, 96 or 128 channels wide");
    static_assert(fused_tile::SLOTS >= 2 && fused_tile::NT % 2 == 0,
                  "a stage in flight; B fragments in pairs");
};

// Element e of a staged row, in the VEC layout: each thread stages one 16-byte part of rows
// (threadIdx.x % PARTS), so it needs that part's tap slot g = e / width and column c once.
template <typename T, int STAGE> struct fused_part {
    static constexpr int PARTS = STAGE / 16;
    int g, c;
    __device__ __forceinline__ explicit fused_part(int width) {
        const int e = threadIdx.x % PARTS * (16 / (int)sizeof(T));
        g = e / width;
        c = e - g * width;
    }
};

// The VEC copies of ROWS rows of STAGE bytes for a stage of tap `tap` (this thread's part's;
// -1: zeros): the thread's part of its i-th row r = threadIdx.x / PARTS + i * STRIDE, copied
// from source row source(i, r) (-1: zeros) of base, columns from col0 + part.c; through L1 where
// L1 (copy_async16_unless_negative): the features' rows, which a tile's sites share across taps.
template <typename T, int STAGE, int ROWS, bool L1, typename Source>
static __device__ __forceinline__ void fused_copy_rows(unsigned* tile, const T* base, int stride,
                                                       int col0, fused_part<T, STAGE> part,
                                                       int tap, Source source) {
    constexpr int PARTS = fused_part<T, STAGE>::PARTS, PITCH = fused_pitch<STAGE>;
    static_assert(FUSED_THREADS % PARTS == 0, "a thread's parts are one column of parts");
    constexpr int STRIDE = FUSED_THREADS / PARTS;
    // In bytes, so that a row's address is one wide multiply-add: at + row * row_bytes.
    const char* at = (const char*)(base + col0 + part.c);
    const unsigned row_bytes = (unsigned)stride * (unsigned)sizeof(T);
    const unsigned dst =
        shared_address(tile + threadIdx.x / PARTS * PITCH + threadIdx.x % PARTS * 4);
#pragma unroll
    for (int i = 0; i < (ROWS + STRIDE - 1) / STRIDE; ++i) {
        const int r = threadIdx.x / PARTS + i * STRIDE;
        if (ROWS % STRIDE != 0 && r >= ROWS) break;
        const int row = source(i, r);
        // An unsigned 32 x 32 -> 64-bit product (max(row, 0)): one instruction, where a
        // signed or 64-bit one takes three or four. Negative row | tap: zeros.
        copy_async16_unless_negative<L1>(
            dst + i * STRIDE * PITCH * 4,
            at + (unsigned long long)(unsigned)max(row, 0) * row_bytes, row | tap);
    }
}

// Stage ROWS rows of STAGE bytes: element e of row r is base[row_of(tap, r) * stride + col0 +
// e % width] for tap = tap_of(e / width); zero where row_of gives -1, where tap is -1 or
// e / width >= per_stage, and past `cols`. VEC: width and cols are whole 16-byte vectors and
// rows 16-byte aligned, so each 16-byte part of a row is one thread's cp.async (landed after
// the caller's wait), and a thread's parts (`part`) are of one tap, looked up once; otherwise
// the stores are the thread's own. Selects, not branches: the stage loop is latency-bound. L1:
// as fused_copy_rows.
template <typename T, bool VEC, int STAGE, int ROWS, bool L1, typename TapOf, typename RowOf>
static __device__ __forceinline__ void fused_stage(unsigned* tile, const T* base, int stride,
                                                   int width, int per_stage, int cols, int col0,
                                                   fused_part<T, STAGE> part, TapOf tap_of,
                                                   RowOf row_of) {
    constexpr int BK = STAGE / sizeof(T), PITCH = fused_pitch<STAGE>;
    if (VEC) {
        const int tap = part.g < per_stage && col0 + part.c < cols ? tap_of(part.g) : -1;
        fused_copy_rows<T, STAGE, ROWS, L1>(tile, base, stride, col0, part, tap,
                                            [&](int, int r) { return row_of(max(tap, 0), r); });
    } else {
        T* t = (T*)tile;
        for (int e = threadIdx.x; e < ROWS * BK; e += FUSED_THREADS) {
            const int r = e / BK, k = e % BK, g = k / width, c = k - g * width;
            const int tap = g < per_stage && col0 + c < cols ? tap_of(g) : -1;
            const int row = tap < 0 ? -1 : row_of(tap, r);
            t[r * (PITCH * 4 / (int)sizeof(T)) + k] =
                row >= 0 ? base[(i64)row * stride + col0 + c] : T();
        }
    }
}

// The rows of a tile of BM sites a thread stages in the VEC layout: threadIdx.x / PARTS + i *
// STRIDE.
template <int STAGE, int BM> constexpr int fused_held = BM * (STAGE / 16) / FUSED_THREADS;

// fused_stage's VEC copies of the tile's BM feature rows for a stage of tap `tap` (this thread's
// part's; -1: zeros), from the source rows held[i] of the thread's rows, which the kernel read
// from shared memory a stage ahead, so that no copy waits on that read. L1: as fused_copy_rows.
template <typename T, int STAGE, int BM, bool L1>
static __device__ __forceinline__ void fused_stage_held(
    unsigned* tile, const T* base, int stride, int col0, fused_part<T, STAGE> part, int tap,
    const int (&held)[fused_held<STAGE, BM>]) {
    fused_copy_rows<T, STAGE, BM, L1>(tile, base, stride, col0, part, tap,
                                      [&](int i, int) { return held[i]; });
}

// DYNAMIC_SLOTS: 0, the slots that fit in static shared memory (tiles of FUSED_BM sites); else
// that many slots in the launch's dynamic shared memory (DYNAMIC_SLOTS x SLOT_WORDS words: past
// 48 KiB, where a 128-wide tile's 128-byte stages, or a 128-site tile's, fit only once in static
// memory). BM: the sites of a tile.
template <typename T, bool VEC, int STAGE, int BN, int DYNAMIC_SLOTS = 0, int BM = FUSED_BM>
__global__ void __launch_bounds__(FUSED_THREADS) submanifold_fused(const FusedArgs a) {
    static_assert(BM == FUSED_BM || DYNAMIC_SLOTS, "128-site tiles take dynamic slots");
    using tile_t =
        fused_tile<STAGE, BN, DYNAMIC_SLOTS ? DYNAMIC_SLOTS : fused_slots<STAGE, BN>, BM>;
    constexpr int BK = STAGE / sizeof(T), PITCH = tile_t::PITCH, SLOTS = tile_t::SLOTS;
    constexpr int SLOT_WORDS = tile_t::SLOT_WORDS, MT = tile_t::MT, NT = tile_t::NT;
    static_assert(FUSED_TAPS <= 32, "the taps of a group are the bits of one word");
    // The features' rows through L1 in 16-bit tiles of 32 channels or more, where nearby sites'
    // rows come back across taps; 16-wide tiles (a backbone's first level, its sites in the
    // voxeliser's order) and TF32 ones measured no faster that way (bench/README).
    constexpr bool FEATURES_L1 = sizeof(T) == 2 && BN >= 32;
    __shared__ __align__(16) unsigned static_slots[DYNAMIC_SLOTS ? 4 : SLOTS * SLOT_WORDS];
    extern __shared__ __align__(16) unsigned submanifold_smem[];
    unsigned* const slots = DYNAMIC_SLOTS ? submanifold_smem : static_slots;
    __shared__ int rows[FUSED_TAPS][BM];  // neighbour rows of the group's taps
    __shared__ int out_rows[BM];          // the tile's output rows, -1 past n_out
    // The group's taps some row has, in tap order: a copy a warp, so that each warp writes and
    // reads its own with no barrier of the CTA.
    // Bytes, not ints: the four copies then take no more shared memory than one did, which
    // would cost the widest tiles a CTA an SM.
    __shared__ unsigned char active[FUSED_THREADS / 32][FUSED_TAPS];
    __shared__ unsigned warp_taps[FUSED_THREADS / 32];  // bit t: a row of the warp's has tap t
    static_assert(FUSED_THREADS % BM == 0, "a thread reads the map of one output row");
    // A thread reads the neighbour rows of output row `mine` for taps t0, t0 + TAP_STRIDE, ...
    constexpr int TAP_STRIDE = FUSED_THREADS / BM, PER_THREAD = FUSED_TAPS / TAP_STRIDE;
    const int mine = threadIdx.x % BM, t0 = threadIdx.x / BM;
    const mma_place<tile_t::WARPS_M> th(threadIdx.x);
    const int lane = th.lane, warp = threadIdx.x >> 5;
    const int wm = th.wm * tile_t::WM, wn = th.wn * tile_t::WN;  // the warp's first row, column
    // Float words rounded to TF32 by the MMA, as the staging stores them as they are.
    const mma_mainloop<T, tile_t, true> mainloop(th, slots);
    const i64 m0 = (i64)blockIdx.x * BM;
    const int n0 = blockIdx.y * BN;
    // A stage: `width` channels of `per_stage` taps; a tap's channels in `chunks` stages.
    const int width = max(1, min(a.cin, BK)), per_stage = BK / width;  // cin 0: no stages
    const int chunks = (a.cin + width - 1) / width;
    const fused_part<T, STAGE> part(width);
    const T* features = (const T*)a.features;
    const T* weight = (const T*)a.weight;
    const int tap_begin = (int)blockIdx.z * a.split_taps;
    const int tap_end = min(a.taps, tap_begin + a.split_taps);
    // Launched as a dependent (launch_fused): features may be the previous kernel's output.
    wait_for_previous_kernel();
    allow_next_kernel();
    // The map's columns come in the tiles' order (the launch permuted them with the rows), so
    // a tile reads them at its positions, coalesced; only the epilogue needs the output rows.
    const int position = m0 + mine < a.n_out ? (int)(m0 + mine) : -1;
    if (t0 == 0) out_rows[mine] = position >= 0 && a.order ? a.order[position] : position;
    __syncthreads();  // for the epilogue, where the CTA has no taps
    float acc[MT][NT][4] = {};
    for (int k0 = tap_begin; k0 < tap_end; k0 += FUSED_TAPS) {
        const int group = min(FUSED_TAPS, tap_end - k0);
        // All of a thread's map reads in flight at once: the tile's prologue is one load's
        // latency, not PER_THREAD of them. The reads walk the row's column of the map by a
        // pointer: a 64-bit add a tap, where a 64-bit product and its address cost several.
        int found[PER_THREAD];
        const int* column = a.map + (i64)(k0 + t0) * a.n_out + max(position, 0);
        const i64 tap_step = (i64)TAP_STRIDE * a.n_out;
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            found[i] = t0 + i * TAP_STRIDE < group && position >= 0 ? *column : -1;
            column += tap_step;
        }
        unsigned has = 0;  // bit t: this thread's row has tap t
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i)
            has |= (unsigned)(found[i] >= 0) << (t0 + i * TAP_STRIDE);
        has = __reduce_or_sync(0xffffffffu, has);
        // The previous group's last stage is read; its slots and rows may be overwritten.
        __syncthreads();
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) rows[t0 + i * TAP_STRIDE][mine] = found[i];
        if (lane == 0) warp_taps[warp] = has;
        __syncthreads();
        unsigned group_taps = 0;
#pragma unroll
        for (int w = 0; w < FUSED_THREADS / 32; ++w) group_taps |= warp_taps[w];
        const int n_active = __popc(group_taps);
        if (group_taps >> lane & 1u) active[warp][__popc(group_taps & ((1u << lane) - 1u))] = lane;
        __syncwarp();
        const int stages = (n_active + per_stage - 1) / per_stage * chunks;
        // load(slot) stages s = 0, 1, 2, ... in turn: taps [first, first + per_stage) of the
        // active ones, channels [chunk * width, + width).
        int first = 0, chunk = 0;
        // HOLD: the next stage's tap of this thread's part and its rows' sources, read from
        // shared memory while the MMAs of a stage run (fetch), used by the copies after them.
        // 16-bit types only: in TF32 the registers they take cost as much as the waits they
        // save (bench: 0.92-0.97x the time in float16, 0.95-1.04x in TF32).
        constexpr bool HOLD = VEC && sizeof(T) == 2;
        int held_tap = -1, held[fused_held<STAGE, BM>];
        auto fetch = [&] {
            held_tap = part.g < per_stage && chunk * width + part.c < a.cin &&
                               first + part.g < n_active
                           ? active[warp][first + part.g]
                           : -1;
#pragma unroll
            for (int i = 0; i < fused_held<STAGE, BM>; ++i)
                held[i] = rows[max(held_tap, 0)][threadIdx.x / fused_part<T, STAGE>::PARTS +
                                                 i * (FUSED_THREADS / fused_part<T, STAGE>::PARTS)];
        };
        if (HOLD) fetch();
        auto load = [&](int s) {
            unsigned* slot = slots + s * SLOT_WORDS;
            const int col0 = chunk * width;
            // The stage's g-th tap (of the group), or -1 past the active ones.
            auto tap_of = [&](int g) {
                return HOLD ? held_tap : first + g < n_active ? active[warp][first + g] : -1;
            };
            // Rows in units of cin: neighbour rows of the features, a tap's weights.
            if constexpr (HOLD) {
                fused_stage_held<T, STAGE, BM, FEATURES_L1>(slot, features, a.cin, col0, part,
                                                            held_tap, held);
            } else {
                fused_stage<T, VEC, STAGE, BM, FEATURES_L1>(
                    slot, features, a.cin, width, per_stage, a.cin, col0, part, tap_of,
                    [&](int tap, int r) { return rows[tap][r]; });
            }
            fused_stage<T, VEC, STAGE, BN, false>(
                slot + BM * PITCH, weight, a.cin, width, per_stage, a.cin, col0, part,
                tap_of, [&](int tap, int r) {
                    return n0 + r < a.cout ? (n0 + r) * a.taps + k0 + tap : -1;
                });
            if (++chunk == chunks) {
                chunk = 0;
                first += per_stage;
            }
            if (HOLD) fetch();
        };
        mainloop.template multistage<mma_schedule::modulo>(acc, stages, load,
                                                           [] { __syncthreads(); });
    }
    T* out = (T*)a.out;
    const T* bias = (const T*)a.bias;
    float* partial = a.partial ? a.partial + (i64)blockIdx.z * a.n_out * a.cout : nullptr;
    // Each thread's accumulators are column pairs (co, co + 1) of rows; a pair is one vector
    // store where cout is even (and the output aligned to it). The bias is read once, before
    // any store: a load after a store to out waits its whole latency, as they may alias.
    const bool paired = a.cout % 2 == 0 && (partial || (size_t)out % (2 * sizeof(T)) == 0);
    float bias_of[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int co = n0 + wn + nt * 8 + th.t * 2;
#pragma unroll
        for (int e = 0; e < 2; ++e)
            bias_of[nt][e] = bias && !partial && co + e < a.cout ? to_acc(bias[co + e]) : 0.0f;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const i64 o = out_rows[wm + mt * 16 + th.g + half * 8];
            if (o < 0) continue;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int co = n0 + wn + nt * 8 + th.t * 2;
                if (co >= a.cout) continue;
                float v[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    v[e] = acc[mt][nt][2 * half + e] + bias_of[nt][e];
                    if (!partial && a.relu) v[e] = fmaxf(v[e], 0.0f);
                }
                if (partial) {
                    store_pair(partial + o * a.cout + co, v[0], v[1], paired, co + 1 < a.cout);
                } else {
                    store_pair(out + o * a.cout + co, v[0], v[1], paired, co + 1 < a.cout);
                }
            }
        }
    }
}

// --- the weight's gradient: gather and tensor-core matrix product in one kernel --------------
//
// dw[co, k, ci] = sum over output sites o of dy[o, co] * features[map[k, o], ci] (zero where the
// map is -1): for each tap a product over the sites, which the gemm route makes of the gathered
// rows [n_out, taps x cin], written whole and read again. Here the gathered rows never leave shared
// memory. A CTA takes BM columns (k, ci) of the taps x cin (the MMA's rows) x BN output channels
// (its columns) over the sites of its split (blockIdx.z), whose map it reads a chunk at a time (all
// of a thread's loads in flight at once): every site (64-column tiles), or, in 128 x 128 tiles,
// given the sites that have each tap (a.pairs, tap_pairs), those of its tap alone (then a tile's
// columns are of one tap, a.tiles_per_tap of them a tap), and reduces over the sites in stages of
// 4096 / BM bytes of rows, one row a site (two k-steps of the MMA in 64-column tiles, one in
// 128-column ones): the features' rows through the map, dy's as they lie (or through the pairs).
// Wide layers take 128 x 128 tiles, which read each pair's two rows once where 64 x 64 tiles read
// them twice or more: by pairs, the rows are gathered from all over memory and their bytes are the
// time. Both tiles stay site-major in shared memory ([site][column], as cp.async copies them), so
// the fragments come through transposing ldmatrix (16-bit types) or word loads rounded to TF32
// (float). Each split writes float sums, in out itself or in its part of a partial buffer that
// split_sum adds up in split order (deterministic, no atomics). Rows are whole 16-byte vectors
// (cin and cout x the item size, 16-byte aligned arrays: grad_weight_fits).

#define GRAD_THREADS 128
#define GRAD_SLOT_BYTES 36864  // static shared memory for stages, beside the chunk's map
#define GRAD_MAP_ENTRIES 2304  // map entries a CTA holds at once (a chunk of sites of its taps)

// Sites a stage of a BM x BN tile holds: 4096 / BM bytes of a column, twice that in tiles of 16
// channels, whose stage would otherwise be 4 MMAs a warp for a stage's fixed work.
template <typename T, int BM, int BN>
constexpr int grad_stage_sites = 4096 / BM / sizeof(T) * (BN == 16 ? 2 : 1);
// Taps a tile's BM columns may touch: rows of at least 16 bytes, not aligned to the tile.
template <typename T, int BM> constexpr int grad_tile_taps = BM / (16 / sizeof(T)) + 1;
// Elements a staged row of `cols` columns takes: 8 of padding, so that the 8 rows of an ldmatrix
// (or the 4 x 8 words of a TF32 fragment's loads) fall in distinct banks.
constexpr int grad_pitch(int cols) { return cols + 8; }

template <typename T, int BM, int BN>
__global__ void __launch_bounds__(GRAD_THREADS) submanifold_grad_weight(const GradWeightArgs a) {
    static_assert((BM == 64 && (BN == 16 || BN == 32 || BN == 64)) || (BM == 128 && BN == 128),
                  "tiles of 64 columns x 16, 32 or 64 channels, or 128 x 128");
    constexpr int BK = grad_stage_sites<T, BM, BN>, ENTRIES = GRAD_MAP_ENTRIES;
    constexpr int TILE_TAPS = grad_tile_taps<T, BM>, E = 16 / sizeof(T);  // a 16-byte part
    static_assert(ENTRIES % (2 * GRAD_THREADS) == 0 && ENTRIES / 2 % BK == 0 &&
                  ENTRIES >= TILE_TAPS * BK, "whole loads a thread, whole stages a chunk");
    constexpr int A_PITCH = grad_pitch(BM), B_PITCH = grad_pitch(BN);
    constexpr int SLOT_BYTES = BK * (A_PITCH + B_PITCH) * sizeof(T);
    constexpr int SLOTS = GRAD_SLOT_BYTES / SLOT_BYTES < 4 ? GRAD_SLOT_BYTES / SLOT_BYTES : 4;
    static_assert(SLOTS >= 2 && SLOT_BYTES % 16 == 0, "a stage in flight, slots of whole vectors");
    // Four warps of WM x WN, as mma_tile: 2 x 2 but for BN 16 (4 x 1).
    using tile_t = mma_tile<BM, BN, 8, BN == 16 ? 4 : 2, SLOTS>;
    constexpr int MT = tile_t::MT, NT = tile_t::NT;
    static_assert(NT % 2 == 0, "B fragments in pairs");
    __shared__ __align__(16) unsigned char slots[SLOTS * SLOT_BYTES];
    // The chunk's input rows of the tile's taps, [tile_taps][chunk]: the fewer taps a tile has,
    // the longer its chunks, and the fewer times the pipeline drains. By pairs: the input rows
    // [chunk], then the output sites [chunk].
    __shared__ int rows[ENTRIES];

    const mma_place<tile_t::WARPS_M> th(threadIdx.x);
    const int lane = th.lane, wm = th.wm * tile_t::WM, wn = th.wn * tile_t::WN;
    const int cols = a.taps * a.cin;  // dw's columns after its output channel
    // 128 x 128 tiles multiply by pairs (a.pairs), 64-column ones every site (grad_weight_config):
    // compile-time, so that a 64-column tile's stage has no pairs' branches and reads.
    constexpr bool by_pairs = BM == 128;
    const int n0 = blockIdx.y * BN;
    // The tile's first column, its first tap and how many, the end of its columns.
    int m0, tap_lo, tile_taps, col_end;
    if constexpr (by_pairs) {
        tap_lo = blockIdx.x / a.tiles_per_tap;
        m0 = tap_lo * a.cin + blockIdx.x % a.tiles_per_tap * BM;
        tile_taps = 1;
        col_end = (tap_lo + 1) * a.cin;
    } else {
        m0 = blockIdx.x * BM;
        tap_lo = m0 / a.cin;
        tile_taps = min(a.taps - 1, (m0 + BM - 1) / a.cin) - tap_lo + 1;
        col_end = cols;
    }
    const int chunk = by_pairs ? ENTRIES / 2 : ENTRIES / tile_taps / BK * BK;
    const i64 site_begin = (i64)blockIdx.z * a.split_sites;
    const T* features = (const T*)a.features;
    const T* dy = (const T*)a.dy;

    // The 16-byte part of the tile's columns this thread stages (its tap, the tap's channel),
    // the same in every stage; and its first row, then every A_ROWS.
    constexpr int A_PARTS = BM / E, A_ROWS = GRAD_THREADS / A_PARTS;
    static_assert(GRAD_THREADS % A_PARTS == 0 && BK % A_ROWS == 0, "whole rows of parts a pass");
    const int a_col = m0 + threadIdx.x % A_PARTS * E;
    const int a_tap = a_col < col_end ? a_col / a.cin - tap_lo : -1;
    const char* a_src = (const char*)(features + (a_col < col_end ? a_col % a.cin : 0));
    const unsigned row_bytes = (unsigned)a.cin * (unsigned)sizeof(T);
    constexpr int B_PARTS = BN / E;
    // dy's copies a thread makes a stage, and dy's rows from the tile's first output channel.
    constexpr int B_COPIES = (BK * B_PARTS + GRAD_THREADS - 1) / GRAD_THREADS;
    const char* const dy_cols = (const char*)(dy + n0);
    const unsigned dy_row_bytes = (unsigned)a.cout * (unsigned)sizeof(T);

    // dy (and the map) may be the previous kernel's output: launched as its dependent.
    wait_for_previous_kernel();
    allow_next_kernel();
    const i64 site_end =
        min(by_pairs ? (i64)a.totals[tap_lo] : a.n_out, site_begin + a.split_sites);
    const int* tap_map = a.map + (i64)tap_lo * a.n_out;
    float acc[MT][NT][4] = {};
    for (i64 c0 = site_begin; c0 < site_end; c0 += chunk) {
        const int n_sites = (int)min((i64)chunk, site_end - c0);
        int found[ENTRIES / GRAD_THREADS];
        if constexpr (by_pairs) {  // found: the input rows, then the sites (read first)
            constexpr int HALF = ENTRIES / 2 / GRAD_THREADS;
#pragma unroll
            for (int j = 0; j < HALF; ++j) {
                const int s = threadIdx.x + j * GRAD_THREADS;
                found[HALF + j] = s < n_sites ? a.pairs[(i64)tap_lo * a.n_out + c0 + s] : -1;
            }
#pragma unroll
            for (int j = 0; j < HALF; ++j)
                found[j] = found[HALF + j] >= 0 ? tap_map[found[HALF + j]] : -1;
        } else {
#pragma unroll
            for (int j = 0; j < ENTRIES / GRAD_THREADS; ++j) {
                const int e = threadIdx.x + j * GRAD_THREADS, t = e / chunk, s = e - t * chunk;
                found[j] = t < tile_taps && s < n_sites ? tap_map[(i64)t * a.n_out + c0 + s] : -1;
            }
        }
        __syncthreads();  // the previous chunk's last stage is read: rows and slots are free
#pragma unroll
        for (int j = 0; j < ENTRIES / GRAD_THREADS; ++j)
            rows[threadIdx.x + j * GRAD_THREADS] = found[j];
        __syncthreads();
        const int stages = (n_sites + BK - 1) / BK;
        auto copy = [&](int i, int slot) {
            unsigned char* base = slots + slot * SLOT_BYTES;
            const unsigned a_dst = shared_address(base) +
                                   (threadIdx.x / A_PARTS * A_PITCH + threadIdx.x % A_PARTS * E) *
                                       (unsigned)sizeof(T);
#pragma unroll
            for (int p = 0; p < BK / A_ROWS; ++p) {
                const int s = i * BK + threadIdx.x / A_PARTS + p * A_ROWS;  // < chunk
                const int row = a_tap < 0 ? -1 : rows[a_tap * chunk + s];  // -1 past n_sites
                copy_async16_unless_negative(
                    a_dst + p * A_ROWS * A_PITCH * (unsigned)sizeof(T),
                    a_src + (unsigned long long)(unsigned)max(row, 0) * row_bytes, row);
            }
            const unsigned b_base = shared_address(base) + BK * A_PITCH * (unsigned)sizeof(T);
            // Unrolled (a loop from threadIdx.x is not), with a row's address one unsigned
            // 32 x 32 -> 64-bit product, as the features' rows: sites are below 2^31.
#pragma unroll
            for (int j = 0; j < B_COPIES; ++j) {
                const int e = threadIdx.x + j * GRAD_THREADS;
                if (BK * B_PARTS % GRAD_THREADS != 0 && e >= BK * B_PARTS) break;
                const int r = e / B_PARTS, col = e % B_PARTS * E, s = i * BK + r;
                const bool valid = s < n_sites && n0 + col < a.cout;
                const int o = by_pairs ? rows[chunk + s] : (int)(c0 + s);  // -1 past n_sites
                copy_async16(b_base + (r * B_PITCH + col) * (unsigned)sizeof(T),
                             dy_cols + (valid ? (unsigned long long)(unsigned)o * dy_row_bytes +
                                                    col * sizeof(T)
                                              : 0),
                             valid);
            }
        };
        auto consume = [&](int, int slot) {
            const T* at = (const T*)(slots + slot * SLOT_BYTES);
            const T* bt = at + BK * A_PITCH;
            if constexpr (sizeof(T) == 2) {
#pragma unroll
                for (int ks = 0; ks < BK / 16; ++ks) {
                    unsigned af[MT][4], bf[NT][2];
                    // A: matrices (sites +0, +8) x (rows +0, +8) of the warp's m16 tile.
                    const int k = ks * 16 + (lane >> 4) * 8 + (lane & 7);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
                        load_matrices_transposed(
                            af[mt], at + k * A_PITCH + wm + mt * 16 + (lane >> 3 & 1) * 8);
                    // B: matrices (sites +0, +8) of n8 tiles nt and nt + 1.
                    const int kb = ks * 16 + (lane >> 3 & 1) * 8 + (lane & 7);
#pragma unroll
                    for (int nt = 0; nt < NT; nt += 2) {
                        unsigned pair[4];
                        load_matrices_transposed(pair,
                                                 bt + kb * B_PITCH + wn + nt * 8 + (lane >> 4) * 8);
                        bf[nt][0] = pair[0], bf[nt][1] = pair[1];
                        bf[nt + 1][0] = pair[2], bf[nt + 1][1] = pair[3];
                    }
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt)
                            tensor_core_mma<T>::run(acc[mt][nt], af[mt], bf[nt]);
                }
            } else {
                const float* af32 = (const float*)at;
                const float* bf32 = (const float*)bt;
#pragma unroll
                for (int ks = 0; ks < BK / 8; ++ks) {
                    unsigned af[MT][4], bf[NT][2];
                    const int k = ks * 8 + th.t;  // fragment word (row g, k t) and (g, t + 4)
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        const float* r = af32 + k * A_PITCH + wm + mt * 16 + th.g;
                        af[mt][0] = to_tf32(r[0]);
                        af[mt][1] = to_tf32(r[8]);
                        af[mt][2] = to_tf32(r[4 * A_PITCH]);
                        af[mt][3] = to_tf32(r[4 * A_PITCH + 8]);
                    }
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) {
                        const float* r = bf32 + k * B_PITCH + wn + nt * 8 + th.g;
                        bf[nt][0] = to_tf32(r[0]);
                        bf[nt][1] = to_tf32(r[4 * B_PITCH]);
                    }
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int nt = 0; nt < NT; ++nt)
                            tensor_core_mma<T>::run(acc[mt][nt], af[mt], bf[nt]);
                }
            }
        };
        stream_stages<mma_schedule::modulo, SLOTS>(stages, copy, [] { __syncthreads(); }, consume);
    }
    float* out = a.out + (i64)blockIdx.z * a.cout * cols;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int col = m0 + tile_t::acc_row(th, mt, i >> 1);
                const int co = n0 + tile_t::acc_col(th, nt) + (i & 1);
                if (col < col_end && co < a.cout) out[(i64)co * cols + col] = acc[mt][nt][i];
            }
}
