// point_to_voxel: a point cloud [n, features] into voxels, as spconv's PointToVoxel does on the
// CPU (sbnet_cupy/point_to_voxel.py). A point's cell along each axis is floor((p - lower) /
// vsize) in float32 arithmetic (float64 for float64 points); axes run z, y, x (point columns
// ndim - 1 .. 0). Points outside the grid belong to no voxel; voxels are numbered in the order
// of their first point and the first max_voxels are kept; a voxel holds its first max_points
// points in point order.
//
// Every result is deterministic, whatever order the threads run in: each key of a hash table
// of cells keeps its first point (an atomic min) and its point count (an atomic add); the
// voxels' numbers are ranks of their first points (a bitmap and its scan); a voxel's points
// are dropped into a bucket in any order, and its max_points smallest indices are picked.
// Kernels, in order: p2v_clear, p2v_insert, p2v_mark, p2v_rank, p2v_assign, p2v_scatter (then
// the host reads the voxel count), p2v_select, p2v_gather; each is a template on the points'
// type T (half_t, float, double), which only p2v_insert and p2v_gather read.

#define P2V_EMPTY (-1LL)
#define P2V_OUTSIDE (-1e300)  // a coordinate below every grid
#define P2V_RANK_THREADS 1024
#define P2V_SELECT_UNROLL 8

// Every kernel takes P2VArgs, declared in sbnet_cupy/core/records.py (P2V_MAX_DIMS axes at most).

static __device__ __forceinline__ i64 p2v_first() {
    return (i64)blockIdx.x * blockDim.x + threadIdx.x;
}
static __device__ __forceinline__ i64 p2v_step() { return (i64)gridDim.x * blockDim.x; }
static __device__ __forceinline__ int* p2v_table_first(const P2VArgs& a) {
    return reinterpret_cast<int*>(a.table + a.mask + 1);
}
static __device__ __forceinline__ int* p2v_table_count(const P2VArgs& a) {
    return p2v_table_first(a) + a.mask + 1;
}
static __device__ __forceinline__ int* p2v_voxel_count(const P2VArgs& a) {
    return reinterpret_cast<int*>(a.voxel + a.cap);
}
static __device__ __forceinline__ int* p2v_voxel_start(const P2VArgs& a) {
    return p2v_voxel_count(a) + a.cap;
}
static __device__ __forceinline__ int p2v_voxels(const P2VArgs& a) {
    return min(a.total[0], a.max_voxels);
}

// A coordinate's exact value. The GPU's float-to-double conversion flushes subnormal floats to
// zero (CuPy compiles with -ftz=true), spconv's CPU arithmetic does not: the bits decide here.
// Infinities and NaNs lie outside every grid, as they do for spconv.
static __device__ double p2v_exact(float v) {
    const unsigned u = __float_as_uint(v), magnitude = u & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) return P2V_OUTSIDE;
    if (magnitude >= 0x00800000u) return (double)v;
    const double d = (double)(int)magnitude * 0x1p-149;
    return u >> 31 ? -d : d;
}
static __device__ double p2v_exact(half_t v) {
    const int exponent = (v.bits >> 10) & 31, mantissa = v.bits & 1023;
    if (exponent == 31) return P2V_OUTSIDE;
    const double d = exponent ? ldexp((double)(mantissa | 1024), exponent - 25)
                              : (double)mantissa * 0x1p-24;
    return v.bits >> 15 ? -d : d;
}

// x rounded to float32 (to nearest, ties to even, subnormals kept), in double arithmetic, which
// -ftz=true leaves alone. Where x is a double-rounded sum or quotient of two floats, the result
// is still the correctly rounded float one (53 >= 2 * 24 + 2 bits).
static __device__ double p2v_round_float(double x) {
    if (fabs(x) < 0x1p-126) return rint(x * 0x1p149) * 0x1p-149;  // the subnormals' spacing
    int exponent;
    const double m = frexp(x, &exponent);
    return ldexp(rint(ldexp(m, 24)), exponent - 24);
}

// The cell floor((v - lower) / vsize) of a coordinate, as spconv computes it: in float32 for
// float32 points (float16 ones are converted to float32 first), in double for float64 ones.
template <typename T>
static __device__ double p2v_cell(T v, double lower, double vsize) {
    const double offset = p2v_round_float(p2v_exact(v) - lower);
    return floor(p2v_round_float(offset / vsize));
}
template <> __device__ double p2v_cell<double>(double v, double lower, double vsize) {
    return floor((v - lower) / vsize);
}

static __device__ void p2v_atomic_min(int* address, int value) {
    int seen = *(volatile int*)address;  // only ever falls, so a stale value costs a retry
    while (value < seen) {
        const int before = atomicCAS(address, seen, value);
        if (before == seen) return;
        seen = before;
    }
}

// An empty table; no voxels yet.
template <typename T> __global__ void p2v_clear(const P2VArgs a) {
    int* first = p2v_table_first(a);
    int* count = p2v_table_count(a);
    for (i64 s = p2v_first(); s <= a.mask; s += p2v_step()) {
        a.table[s] = P2V_EMPTY;
        first[s] = 0x7fffffff;
        count[s] = 0;
    }
    if (p2v_first() < 2) a.total[p2v_first()] = 0;
}

// Each point's cell, into the table (linear probing: the table has at least 2n slots, so a
// free one is always found).
template <typename T> __global__ void p2v_insert(const P2VArgs a) {
    const T* points = static_cast<const T*>(a.points);
    int* first = p2v_table_first(a);
    int* count = p2v_table_count(a);
    for (i64 i = p2v_first(); i < a.n; i += p2v_step()) {
        const T* point = points + i * a.features;
        i64 key = 0;
        bool inside = true;
        for (int d = 0; d < a.ndim; ++d) {
            const double c = p2v_cell(point[a.ndim - 1 - d], a.lower[d], a.vsize[d]);
            inside = inside && c >= 0 && c < a.grid[d];  // false for NaN
            key = key * a.grid[d] + (inside ? (i64)c : 0);
        }
        int found = -1;
        for (i64 s = hash_slot(key, a.mask); inside; s = (s + 1) & a.mask) {
            const unsigned long long seen =
                atomicCAS((unsigned long long*)(a.table + s), (unsigned long long)P2V_EMPTY,
                          (unsigned long long)key);
            if (seen == (unsigned long long)P2V_EMPTY || (i64)seen == key) {
                p2v_atomic_min(first + s, (int)i);
                atomicAdd(count + s, 1);
                found = (int)s;
                break;
            }
        }
        a.slot[i] = found;
    }
}

// bits: which points come first in their voxel, 32 points a word (a warp's ballot; every lane
// of a warp runs the loop the same number of times), zero past the points up to a multiple of
// 128 (whole uint4s for p2v_rank).
template <typename T> __global__ void p2v_mark(const P2VArgs a) {
    const int lane = threadIdx.x & 31;
    const int* first = p2v_table_first(a);
    for (i64 base = p2v_first() - lane; base < (a.n + 127) / 128 * 128; base += p2v_step()) {
        const i64 i = base + lane;
        bool is_first = false;
        if (i < a.n) {
            const int s = a.slot[i];
            is_first = s >= 0 && first[s] == i;
        }
        const unsigned word = __ballot_sync(0xffffffffu, is_first);
        if (lane == 0) a.bits[base >> 5] = word;
    }
}

// word_rank: the set bits before each word; total[0]: all of them, the voxels found. One CTA
// (n / 32 words is a short scan): each thread counts a run of whole uint4s of words, the CTA
// scans the counts (Hillis-Steele, in shared memory), and each thread ranks its run's words.
template <typename T>
__global__ void __launch_bounds__(P2V_RANK_THREADS) p2v_rank(const P2VArgs a) {
    __shared__ int sums[2][P2V_RANK_THREADS];
    const uint4* bits = reinterpret_cast<const uint4*>(a.bits);
    const int t = threadIdx.x;
    const i64 quads = (a.n + 127) >> 7;
    const i64 per = (quads + P2V_RANK_THREADS - 1) / P2V_RANK_THREADS;
    const i64 begin = min(t * per, quads), end = min(begin + per, quads);
    int count = 0;
    for (i64 q = begin; q < end; ++q) {
        const uint4 b = bits[q];
        count += __popc(b.x) + __popc(b.y) + __popc(b.z) + __popc(b.w);
    }
    int from = 0;
    sums[from][t] = count;
    __syncthreads();
    for (int offset = 1; offset < P2V_RANK_THREADS; offset <<= 1) {
        sums[from ^ 1][t] = sums[from][t] + (t >= offset ? sums[from][t - offset] : 0);
        from ^= 1;
        __syncthreads();
    }
    if (t == P2V_RANK_THREADS - 1) a.total[0] = sums[from][t];
    int run = sums[from][t] - count;
    for (i64 q = begin; q < end; ++q) {
        const uint4 b = bits[q];
        int* rank = a.word_rank + 4 * q;
        rank[0] = run;
        rank[1] = run += __popc(b.x);
        rank[2] = run += __popc(b.y);
        rank[3] = run += __popc(b.z);
        run += __popc(b.w);
    }
}

// A voxel for each first point whose rank is below max_voxels: its key, its point count and a
// bucket of that size (one atomic add a CTA). The table's `first` becomes each key's voxel (-1
// past max_voxels). Every thread of a CTA runs the loop the same number of times.
template <typename T> __global__ void p2v_assign(const P2VArgs a) {
    __shared__ int cta_points, cta_start;
    int* table_voxel = p2v_table_first(a);
    const int* table_count = p2v_table_count(a);
    int* voxel_count = p2v_voxel_count(a);
    int* voxel_start = p2v_voxel_start(a);
    for (i64 base = (i64)blockIdx.x * blockDim.x; base < a.n; base += p2v_step()) {
        const i64 i = base + threadIdx.x;
        int voxel = -1, count = 0, s = -1;
        if (i < a.n) {
            const unsigned word = a.bits[i >> 5], bit = 1u << (i & 31);
            if (word & bit) {
                s = a.slot[i];
                voxel = a.word_rank[i >> 5] + __popc(word & (bit - 1));
                if (voxel < a.max_voxels) {
                    count = table_count[s];
                } else {
                    table_voxel[s] = -1;
                }
            }
        }
        if (threadIdx.x == 0) cta_points = 0;
        __syncthreads();
        const int offset = count ? atomicAdd(&cta_points, count) : 0;
        __syncthreads();
        if (threadIdx.x == 0) cta_start = atomicAdd(a.total + 1, cta_points);
        __syncthreads();
        if (count) {
            table_voxel[s] = voxel;
            a.voxel[voxel] = a.table[s];
            voxel_count[voxel] = count;
            voxel_start[voxel] = cta_start + offset;
        }
        __syncthreads();  // cta_start is read before the next round sets it
    }
}

// Each point's voxel, and the point into its voxel's bucket.
template <typename T> __global__ void p2v_scatter(const P2VArgs a) {
    const int* table_voxel = p2v_table_first(a);
    int* voxel_start = p2v_voxel_start(a);
    for (i64 i = p2v_first(); i < a.n; i += p2v_step()) {
        const int s = a.slot[i];
        const int voxel = s < 0 ? -1 : table_voxel[s];
        a.point_voxel_id[i] = voxel;
        if (voxel >= 0) a.bucket[atomicAdd(voxel_start + voxel, 1)] = (int)i;
    }
}

// A thread a voxel: its max_points smallest point indices, in order (an insertion sort that
// stops at max_points, so a voxel of many points costs a pass and few insertions: its bucket
// is filled in roughly increasing point order), its point count (at most max_points) and its
// coordinates.
template <typename T> __global__ void p2v_select(const P2VArgs a) {
    const int* voxel_count = p2v_voxel_count(a);
    const int* voxel_end = p2v_voxel_start(a);
    const int voxels = p2v_voxels(a);
    for (i64 v = p2v_first(); v < voxels; v += p2v_step()) {
        const int count = voxel_count[v];
        const int* bucket = a.bucket + voxel_end[v] - count;
        int* chosen = a.selected + v * a.max_points;
        int kept = 0, last = 0;  // last: chosen[kept - 1]
        for (int e0 = 0; e0 < count; e0 += P2V_SELECT_UNROLL) {
            int p[P2V_SELECT_UNROLL];
#pragma unroll
            for (int u = 0; u < P2V_SELECT_UNROLL; ++u) {  // loads first, so several are in flight
                p[u] = e0 + u < count ? bucket[e0 + u] : -1;
            }
#pragma unroll
            for (int u = 0; u < P2V_SELECT_UNROLL; ++u) {
                if (p[u] < 0 || (kept == a.max_points && p[u] > last)) continue;
                int k = kept < a.max_points ? kept++ : kept - 1;
                for (; k > 0 && chosen[k - 1] > p[u]; --k) chosen[k] = chosen[k - 1];
                chosen[k] = p[u];
                last = chosen[kept - 1];
            }
        }
        a.num_points[v] = kept;
        i64 key = a.voxel[v];
        for (int d = a.ndim - 1; d >= 0; --d) {
            a.coords[v * a.ndim + d] = (int)(key % a.grid[d]);
            key /= a.grid[d];
        }
    }
}

// A thread a (voxel, feature): the voxel's points' values and, with empty_mean, their mean in
// the places past them (summed in point order in the accumulator type, as spconv's CUDA
// kernel does). Places past the points are otherwise left as they are.
template <typename T> __global__ void p2v_gather(const P2VArgs a) {
    typedef typename acc_type<T>::type Acc;
    const T* points = static_cast<const T*>(a.points);
    T* voxels = static_cast<T*>(a.voxels);
    const i64 items = (i64)p2v_voxels(a) * a.features;
    for (i64 t = p2v_first(); t < items; t += p2v_step()) {
        const i64 v = t / a.features;
        const int f = (int)(t - v * a.features), kept = a.num_points[v];
        const int* chosen = a.selected + v * a.max_points;
        T* out = voxels + v * a.max_points * a.features + f;
        Acc sum = Acc(0);
        for (int k = 0; k < kept; ++k) {
            const T x = points[(i64)chosen[k] * a.features + f];
            out[(i64)k * a.features] = x;
            sum += to_acc(x);
        }
        if (!a.empty_mean) continue;
        const T mean = from_acc<T>(sum / (Acc)kept);
        for (int k = kept; k < a.max_points; ++k) out[(i64)k * a.features] = mean;
    }
}
