// Helpers shared by every kernel in this folder. sbnet_cupy/core/kernels.py puts this file in front
// of each kernel source, so the kernels need no include path and no CUDA header (NVRTC compiles
// them wherever CuPy finds it), and CuPy's disk-cache key covers this file too.

typedef long long i64;

// The slot of a key in an open-addressing hash table of mask + 1 slots (a power of two):
// splitmix64's finaliser, so that neighbouring sites or cells land far apart.
static __device__ __forceinline__ i64 hash_slot(i64 key, i64 mask) {
    unsigned long long x = (unsigned long long)key;
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return (i64)(x & (unsigned long long)mask);
}

// Storage of the 16-bit floats, converted with PTX instead of cuda_fp16.h / cuda_bf16.h.
struct half_t { unsigned short bits; };
struct bfloat16_t { unsigned short bits; };
template <typename T> struct is_bfloat16 { static constexpr bool value = false; };
template <> struct is_bfloat16<bfloat16_t> { static constexpr bool value = true; };

// Sums and comparisons run in float, or in double for double data.
template <typename T> struct acc_type { typedef float type; };
template <> struct acc_type<double> { typedef double type; };

template <typename T> static __device__ __forceinline__ float to_acc(T v) { return (float)v; }
static __device__ __forceinline__ double to_acc(double v) { return v; }
static __device__ __forceinline__ float to_acc(half_t v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
}
static __device__ __forceinline__ float to_acc(bfloat16_t v) {
    return __uint_as_float((unsigned)v.bits << 16);
}

template <typename T> static __device__ __forceinline__ T from_acc(typename acc_type<T>::type v) {
    return (T)v;
}
template <> __device__ __forceinline__ half_t from_acc<half_t>(float v) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
    return h;
}
template <> __device__ __forceinline__ bfloat16_t from_acc<bfloat16_t>(float v) {
    bfloat16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
    return h;
}

// Programmatic dependent launch (sm_90 and later): a kernel launched with it
// (sbnet_cupy/core/launch.py's launch(..., dependent=True)) may be scheduled while the kernel before it
// on the stream is still running, so its prologue and launch overlap that kernel's tail. It must
// call wait_for_previous_kernel before it touches memory that kernel may read or write; it calls
// allow_next_kernel to let the next such kernel be scheduled. Both do nothing on older GPUs and
// in a kernel launched without the attribute.
static __device__ __forceinline__ void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
static __device__ __forceinline__ void allow_next_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

static __device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
static __device__ __forceinline__ void atomic_add(double* p, double v) { atomicAdd(p, v); }
static __device__ __forceinline__ void atomic_add(half_t* p, half_t v) {
    asm volatile("red.global.add.noftz.f16 [%0], %1;" ::"l"(p), "h"(v.bits) : "memory");
}
static __device__ __forceinline__ void atomic_add(bfloat16_t* p, bfloat16_t v) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.noftz.bf16 [%0], %1;" ::"l"(p), "h"(v.bits) : "memory");
#else
    unsigned short* bits = &p->bits;
    unsigned short seen = *bits, expected;
    do {
        expected = seen;
        bfloat16_t old = {expected};
        seen = atomicCAS(bits, expected, from_acc<bfloat16_t>(to_acc(old) + to_acc(v)).bits);
    } while (seen != expected);
#endif
}

// V elements moved as one aligned access.
template <typename T, int V> struct alignas(sizeof(T) * V) vec_t { T v[V]; };

// An accumulator's column pair (v0, v1) stored as T at at[0] and at[1] (the MMA epilogues): one
// vector store where `paired` (an even row length, the array aligned to it), else one element at
// a time, at[1] only where `second` (the pair's second column lies inside the row).
template <typename T>
static __device__ __forceinline__ void store_pair(T* at, float v0, float v1, bool paired,
                                                  bool second) {
    if (paired) {
        *reinterpret_cast<vec_t<T, 2>*>(at) = {{from_acc<T>(v0), from_acc<T>(v1)}};
    } else {
        at[0] = from_acc<T>(v0);
        if (second) at[1] = from_acc<T>(v1);
    }
}

// How a scatter combines a value with what is already in the output.
struct Assign {
    template <typename T> static __device__ __forceinline__ void apply(T* dst, const T& v) { *dst = v; }
};
struct Add {
    template <typename T> static __device__ __forceinline__ void apply(T* dst, const T& v) {
        *dst = from_acc<T>(to_acc(*dst) + to_acc(v));
    }
    template <typename T, int V>
    static __device__ __forceinline__ void apply(vec_t<T, V>* dst, const vec_t<T, V>& v) {
        vec_t<T, V> y = *dst;
#pragma unroll
        for (int i = 0; i < V; ++i) y.v[i] = from_acc<T>(to_acc(y.v[i]) + to_acc(v.v[i]));
        *dst = y;
    }
};
// Hopper adds vector reductions: one instruction for up to 16 bytes of float, half or bfloat16.
template <typename T, int V>
static __device__ __forceinline__ void atomic_add_vec(vec_t<T, V>* dst, const vec_t<T, V>& v) {
#pragma unroll
    for (int i = 0; i < V; ++i) atomic_add(&dst->v[i], v.v[i]);
}
#if __CUDA_ARCH__ >= 900
static __device__ __forceinline__ void atomic_add_vec(vec_t<float, 2>* p, const vec_t<float, 2>& v) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(v.v[0]), "f"(v.v[1])
                 : "memory");
}
static __device__ __forceinline__ void atomic_add_vec(vec_t<float, 4>* p, const vec_t<float, 4>& v) {
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.v[0]),
                 "f"(v.v[1]), "f"(v.v[2]), "f"(v.v[3])
                 : "memory");
}
#define SBNET_RED_16BIT(T, PTX_TYPE)                                                              \
    static __device__ __forceinline__ void atomic_add_vec(vec_t<T, 2>* p, const vec_t<T, 2>& v) { \
        asm volatile("red.global.add.noftz.v2." PTX_TYPE " [%0], {%1, %2};" ::"l"(p),             \
                     "h"(v.v[0].bits), "h"(v.v[1].bits)                                           \
                     : "memory");                                                                 \
    }                                                                                             \
    static __device__ __forceinline__ void atomic_add_vec(vec_t<T, 4>* p, const vec_t<T, 4>& v) { \
        asm volatile("red.global.add.noftz.v4." PTX_TYPE " [%0], {%1, %2, %3, %4};" ::"l"(p),     \
                     "h"(v.v[0].bits), "h"(v.v[1].bits), "h"(v.v[2].bits), "h"(v.v[3].bits)       \
                     : "memory");                                                                 \
    }                                                                                             \
    static __device__ __forceinline__ void atomic_add_vec(vec_t<T, 8>* p, const vec_t<T, 8>& v) { \
        asm volatile("red.global.add.noftz.v8." PTX_TYPE                                          \
                     " [%0], {%1, %2, %3, %4, %5, %6, %7, %8};" ::"l"(p),                         \
                     "h"(v.v[0].bits), "h"(v.v[1].bits), "h"(v.v[2].bits), "h"(v.v[3].bits),      \
                     "h"(v.v[4].bits), "h"(v.v[5].bits), "h"(v.v[6].bits), "h"(v.v[7].bits)       \
                     : "memory");                                                                 \
    }
SBNET_RED_16BIT(half_t, "f16")
SBNET_RED_16BIT(bfloat16_t, "bf16")
#undef SBNET_RED_16BIT
#endif

struct AtomicAdd {
    template <typename T> static __device__ __forceinline__ void apply(T* dst, const T& v) {
        atomic_add(dst, v);
    }
    template <typename T, int V>
    static __device__ __forceinline__ void apply(vec_t<T, V>* dst, const vec_t<T, V>& v) {
        atomic_add_vec(dst, v);
    }
};

// Every kernel takes its arguments as one struct passed by value, packed on the host into the
// launch's argument buffer. The structs (BlockList, the gather's and scatter's StackArgs,
// split_sum's SplitSumArgs and each kernel file's) are declared once, in
// sbnet_cupy/core/records.py, which writes their definitions (with static_asserts of every
// field's offset) in front of this file and packs them in Python from the same declaration.
// A BlockList is a list of blocks in an NHWC tensor [n_batch, height, width, ...]: rows
// (n, hi, wi) of `indices`, the first *count of `rows` valid (capacity mode reports the true
// count, which may exceed the rows); block (n, hi, wi) is bh x bw pixels from
// (off_h + str_h*hi, off_w + str_w*wi).

static __device__ __forceinline__ int valid_rows(const BlockList& list) {
    return min(max(*list.count, 0), list.rows);
}

// Where block m of the list sits in the image. `inside` is false for rows past the count and for
// indices that point outside the batch: such blocks read as zeros and write nothing.
struct block_origin {
    i64 n, h, w;  // batch index and top-left pixel (h, w may be negative or past the image)
    bool inside;
};

static __device__ __forceinline__ block_origin locate_block(const BlockList& list, int m) {
    block_origin b = {0, 0, 0, false};
    if (m >= valid_rows(list)) return b;
    const int* row = list.indices + 3 * (i64)m;
    b.n = row[0];
    b.h = list.off_h + (i64)list.str_h * row[1];
    b.w = list.off_w + (i64)list.str_w * row[2];
    b.inside = b.n >= 0 && b.n < list.n_batch;
    return b;
}

// Row r of stack row m, counted in words (words_per_pixel a pixel): `length` words starting at
// word `stack` of the stack [rows, bh, bw, ...]; of them, words [first, last) lie inside the
// image, word c at word `image + c` of the NHWC tensor. Rows past the count, of blocks outside
// the batch or outside the image have first == last.
struct block_row {
    i64 image, stack;
    int first, last, length;
};

static __device__ __forceinline__ block_row locate_row(const BlockList& list, int m, int r,
                                                       int words_per_pixel) {
    const block_origin b = locate_block(list, m);
    block_row row = {0, 0, 0, 0, list.bw * words_per_pixel};
    row.stack = ((i64)m * list.bh + r) * row.length;
    const i64 h = b.h + r;
    if (!b.inside || h < 0 || h >= list.height) return row;
    row.first = (int)min(max(-b.w, (i64)0), (i64)list.bw) * words_per_pixel;
    row.last = (int)min(max(list.width - b.w, (i64)0), (i64)list.bw) * words_per_pixel;
    row.image = ((b.n * list.height + h) * list.width + b.w) * words_per_pixel;
    return row;
}

// The second kernel of a reduction split over CTAs (the fused submanifold convolution's taps,
// the pruned-kernel convolution's input channels): out [rows, cols] = bias [cols] (or none) +
// each split's float sums, partial [splits, rows, pitch], added in split order (deterministic,
// no atomics), then max(0, .) where a.relu. sbnet_cupy/core/plan.py's split_sum_plan launches it.
// Its arguments: SplitSumArgs (sbnet_cupy/core/records.py).

template <typename T> __global__ void split_sum(const SplitSumArgs a) {
    const i64 total = a.rows * a.cols;
    const T* __restrict__ bias = static_cast<const T*>(a.bias);
    T* __restrict__ out = static_cast<T*>(a.out);
    wait_for_previous_kernel();  // where launched as a dependent of the splits' kernel
    allow_next_kernel();
    for (i64 t = blockIdx.x * (i64)blockDim.x + threadIdx.x; t < total;
         t += (i64)gridDim.x * blockDim.x) {
        const i64 row = t / a.cols;
        const int col = (int)(t - row * a.cols);
        float sum = bias != nullptr ? to_acc(bias[col]) : 0.0f;
        for (int s = 0; s < a.splits; ++s) sum += a.partial[(s * a.rows + row) * a.pitch + col];
        out[t] = from_acc<T>(a.relu ? fmaxf(sum, 0.0f) : sum);
    }
}

// Index of element (c, p) in the shared-memory tile [tile_c][pitch] of the transposing kernels.
// Vectors of V pixels are XOR-swizzled by the channel's vector index, so that a warp's accesses
// spread over the banks both when it walks the channels of a few pixels and when it walks the
// pixels of one channel; pitch is a multiple of 8 * V, so the swizzle stays inside the row.
template <int V> static __device__ __forceinline__ int tile_index(int c, int p, int pitch) {
    return c * pitch + (((p / V) ^ ((c / V) & 7)) * V) + p % V;
}

// float32 rounded to TF32 (nearest, ties away), as its bit pattern: an MMA operand.
static __device__ __forceinline__ unsigned to_tf32(float v) {
    unsigned bits;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(v));
    return bits;
}

// One m16n8k8 (TF32) or m16n8k16 (fp16, bf16) tensor-core MMA with fp32 accumulation: d += a b,
// a and b the fragments of PTX's mma.sync layouts, which take the same 32-bit words of a
// [row][k] tile for all three types (8 words of k a step). Declared apart from its definition,
// which tests/cuda_emulation.h replaces.
template <typename T> struct tensor_core_mma;
template <typename T> struct tensor_core_mma {
    static __device__ __forceinline__ void run(float (&d)[4], const unsigned (&a)[4],
                                               const unsigned (&b)[2]) {
#define SBNET_MMA_SYNC(SHAPE_AND_TYPES)                                                            \
    asm volatile("mma.sync.aligned." SHAPE_AND_TYPES " {%0, %1, %2, %3}, {%4, %5, %6, %7}, "       \
                 "{%8, %9}, {%0, %1, %2, %3};"                                                     \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                  \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))
        if constexpr (sizeof(T) == 4) {
            SBNET_MMA_SYNC("m16n8k8.row.col.f32.tf32.tf32.f32");
        } else if constexpr (is_bfloat16<T>::value) {
            SBNET_MMA_SYNC("m16n8k16.row.col.f32.bf16.bf16.f32");
        } else {
            SBNET_MMA_SYNC("m16n8k16.row.col.f32.f16.f16.f32");
        }
#undef SBNET_MMA_SYNC
    }
};

// 16 bytes from global to shared memory without passing through registers; zeros (and no read)
// when !valid.
// dst as a shared-memory address (shared_address), which a loop can keep and step.
static __device__ __forceinline__ void copy_async16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
static __device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
static __device__ __forceinline__ void copy_async16(unsigned* dst, const void* src, bool valid) {
    copy_async16(shared_address(dst), src, valid);
}
// copy_async16 with zeros where `flag` is negative: the copy's predicate is the sign test itself
// (cp.async's ignore-src form), one instruction where turning a bool into a source size takes
// three, in loops that issue little else. L1: through the L1 cache (cp.async.ca), for rows the
// CTA reads again soon (a tile's neighbour rows, which nearby sites share across taps); else
// L2 only.
template <bool L1 = false>
static __device__ __forceinline__ void copy_async16_unless_negative(unsigned dst, const void* src,
                                                                    int flag) {
    // The two differ in the cache operator alone, which asm takes as a literal.
#define SBNET_COPY_UNLESS_NEGATIVE(CACHE)                                                         \
    asm volatile("{\n .reg .pred ignore;\n setp.lt.s32 ignore, %2, 0;\n"                        \
                 " cp.async." CACHE ".shared.global [%0], [%1], 16, ignore;\n}" ::"r"(dst),      \
                 "l"(src), "r"(flag)                                                              \
                 : "memory")
    if constexpr (L1) {
        SBNET_COPY_UNLESS_NEGATIVE("ca");
    } else {
        SBNET_COPY_UNLESS_NEGATIVE("cg");
    }
#undef SBNET_COPY_UNLESS_NEGATIVE
}

// Four (x4) or two (x2) 8 x 4-word matrices of shared memory into registers: lane l gives the
// address of row l % 8 of matrix l / 8 and receives word l % 4 of row l / 4 of each matrix, the
// mma.sync fragment layout of a [row][k] tile for TF32 and 16-bit types alike. One instruction a
// fragment instead of one a word.
static __device__ __forceinline__ void load_matrices(unsigned (&r)[4], const unsigned* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}
static __device__ __forceinline__ void load_matrices(unsigned (&r)[2], const unsigned* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(shared_address(row)));
}
// Four 8 x 8 matrices of 16-bit elements, each transposed on the way (ldmatrix .trans): lane l
// gives the address of row l % 8 of matrix l / 8 and receives, of each matrix, the elements of rows
// 2 (l % 4) and 2 (l % 4) + 1 in column l / 4, as one word: the mma.sync fragments of a tile stored
// [k][row] (k-major), where load_matrices takes one stored [row][k].
static __device__ __forceinline__ void load_matrices_transposed(unsigned (&r)[4],
                                                                const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
}
// A thread's place in the MMAs of a tile split among warps, WARPS_M of them down its rows (warp w
// at row w % WARPS_M, column w / WARPS_M of the warps): its lane, its warp's (wm, wn), and the
// lane's row g and column pair t of each m16n8 accumulator tile (accumulator 2 * half + e is row
// g + 8 * half, column 2 * t + e). The lane's rows of the ldmatrix loads (load_matrices) from a
// [row][k] tile of `pitch` words: A rows lane % 16 of an m16 tile at word lane / 16 * 4 (a0..a3);
// B rows lane % 8 of a pair of n8 tiles (+ 8 from lane 16: the pair's second) at word
// lane / 8 % 2 * 4 (b0, b1).
template <int WARPS_M> struct mma_place {
    int lane, wm, wn, g, t;

    __device__ __forceinline__ explicit mma_place(int thread)
        : lane(thread & 31), wm((unsigned)thread / 32 % WARPS_M),
          wn((unsigned)thread / 32 / WARPS_M), g(lane >> 2), t(lane & 3) {}
    __device__ __forceinline__ int a_row() const { return lane & 15; }
    __device__ __forceinline__ int a_word() const { return (lane >> 4) * 4; }
    // Offsets in words of this lane's A row of the m16 tile from row `first`, and its B row of
    // the n8 tile pair from row `first`.
    __device__ __forceinline__ int a_offset(int first, int pitch) const {
        return (first + a_row()) * pitch + a_word();
    }
    __device__ __forceinline__ int b_offset(int first, int pitch) const {
        return (first + (lane & 7) + (lane >> 4) * 8) * pitch + (lane >> 3 & 1) * 4;
    }
};

// A staged word as the MMA takes it: 16-bit pairs as they are; float words as they are (the tensor
// cores ignore the low mantissa bits) or, where ROUND, rounded to TF32.
template <typename T, bool ROUND>
static __device__ __forceinline__ unsigned mma_operand(unsigned w) {
    if constexpr (ROUND && sizeof(T) == 4) return to_tf32(__uint_as_float(w));
    return w;
}

// One k step (8 words) of a warp's MMAs, acc[mt][nt] += A tile mt x B tile nt: the A fragments
// of m-tile mt from this lane's ldmatrix row a + mt * a_step (mma_place::a_offset), the B
// fragments of the NT n-tiles from its row b of the first pair (mma_place::b_offset; pairs 16
// rows of `pitch` words apart, an odd last n-tile through an x2 load). ROUND: as mma_operand.
template <typename T, int MT, int NT, bool ROUND = false>
static __device__ __forceinline__ void warp_mma_step(float (&acc)[MT][NT][4], const unsigned* a,
                                                     int a_step, const unsigned* b, int pitch) {
    unsigned af[MT][4], bf[NT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        load_matrices(af[mt], a + mt * a_step);
#pragma unroll
        for (int i = 0; i < 4; ++i) af[mt][i] = mma_operand<T, ROUND>(af[mt][i]);
    }
#pragma unroll
    for (int nt = 0; nt + 1 < NT; nt += 2) {
        unsigned pair[4];
        load_matrices(pair, b + nt * 8 * pitch);
        bf[nt][0] = mma_operand<T, ROUND>(pair[0]);
        bf[nt][1] = mma_operand<T, ROUND>(pair[1]);
        bf[nt + 1][0] = mma_operand<T, ROUND>(pair[2]);
        bf[nt + 1][1] = mma_operand<T, ROUND>(pair[3]);
    }
    if constexpr (NT % 2 == 1) {
        load_matrices(bf[NT - 1], b + (NT - 1) * 8 * pitch);
#pragma unroll
        for (int i = 0; i < 2; ++i) bf[NT - 1][i] = mma_operand<T, ROUND>(bf[NT - 1][i]);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) tensor_core_mma<T>::run(acc[mt][nt], af[mt], bf[nt]);
}

static __device__ __forceinline__ void copy_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int PENDING> static __device__ __forceinline__ void copy_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// --- The tensor-core main loop ----------------------------------------------------------------
// A tensor-core kernel is three parts that change independently, as in CUTLASS: a loader that
// brings one stage of a tile's reduction from global into shared memory (block_conv: through the
// block list, the taps and channels flattened; block_conv_halo: a chunk of channels of the halo
// and of every tap's weights; submanifold_fused: through the rulebook, skipping the taps no row of
// the tile has; block_conv_pair's 1x1: its weights, against the 3x3's tile already in shared
// memory), the main loop below (slots, cp.async groups, barriers, the warp MMA step), and an
// epilogue, the kernel's own. A new tile shape is a new mma_tile.

// Words a staged row of WORDS words takes: 4 of padding, so that ldmatrix's 8 rows fall in
// distinct banks.
template <int WORDS> constexpr int mma_pitch = WORDS + 4;

// A tile of BM rows (output pixels or sites) x BN columns (output channels), a reduction stage
// of WORDS 32-bit words a row (WORDS / 8 MMA k-steps), SLOTS stages in shared memory. Four warps,
// WARPS_M of them down the rows (mma_place), each WM x WN: MT m16 by NT n8 MMA tiles. A slot is
// the A rows [BM][PITCH], then the B rows [BN][PITCH].
template <int BM_, int BN_, int WORDS_, int WARPS_M_, int SLOTS_> struct mma_tile {
    static constexpr int BM = BM_, BN = BN_, WORDS = WORDS_, SLOTS = SLOTS_;
    static constexpr int WARPS_M = WARPS_M_, WARPS_N = 4 / WARPS_M;
    static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
    static constexpr int MT = WM / 16, NT = WN / 8;
    static constexpr int KSTEPS = WORDS / 8;
    static constexpr int PITCH = mma_pitch<WORDS>;
    static constexpr int SLOT_WORDS = (BM + BN) * PITCH;
    static_assert(WARPS_M * WARPS_N == 4 && WM % 16 == 0 && WN % 8 == 0 && WORDS % 8 == 0,
                  "four warps of whole m16n8 tiles, whole k-steps a stage");

    // Where a thread's accumulator [mt][nt][2 * half + e] lies in the tile (for an epilogue):
    // row acc_row(th, mt, half), column acc_col(th, nt) + e.
    static __device__ __forceinline__ int acc_row(const mma_place<WARPS_M>& th, int mt, int half) {
        return th.wm * WM + mt * 16 + th.g + 8 * half;
    }
    static __device__ __forceinline__ int acc_col(const mma_place<WARPS_M>& th, int nt) {
        return th.wn * WN + nt * 8 + 2 * th.t;
    }
};

// How stream_stages runs a pipeline of cp.async copies through SLOTS shared-memory slots.
// wrapped and modulo are the same schedule, SLOTS - 1 stages in flight: at each stage, wait for
// its copies, one barrier (which also frees the slot the stage before it left), the copies of the
// stage SLOTS - 1 ahead into that slot, the MMAs. nvcc (13, sm_90) makes different code of the
// two, each the better for its kernel in registers, spills and the loop's instructions (checked
// instantiation by instantiation): wrapped, the first stages' copies unrolled and the slot a
// counter that wraps (block_conv: three slots, straight-line copies); modulo, the first copies in
// a loop and the slot the stage modulo SLOTS (submanifold_fused: up to six slots, copies that may
// be loops of their own). copy_first, two slots: the next stage's copies go out before the wait
// for this stage's, and a second barrier frees the slot once its MMAs are done, so two stages'
// copies are in flight at each wait (block_conv_halo, whose stage is a whole chunk of every tap:
// few stages, each a long round of copies).
enum class mma_schedule { wrapped, modulo, copy_first };

// `stages` stages through SLOTS slots (mma_schedule): copy(i, slot) issues stage i's cp.async
// copies (or plain stores) into slot `slot`, for i = 0, 1, ... in turn; sync() is the barrier of
// the threads that share the slots; consume(i, slot) does the MMAs of stage i, in slot `slot`
// (i % SLOTS). Whatever a stage's layout: mma_mainloop::multistage for mma_tile's slots,
// block_conv_halo for its chunks.
template <mma_schedule SCHEDULE, int SLOTS, typename Copy, typename Sync, typename Consume>
static __device__ __forceinline__ void stream_stages(int stages, const Copy& copy, const Sync& sync,
                                                     const Consume& consume) {
    constexpr int AHEAD = SLOTS - 1;
    static_assert(AHEAD >= 1, "a stage in flight");
    if constexpr (SCHEDULE == mma_schedule::wrapped) {
#pragma unroll
        for (int i = 0; i < AHEAD; ++i) {
            if (i < stages) copy(i, i);
            copy_async_commit();  // empty groups too: the wait below counts groups
        }
        for (int i = 0, slot = 0; i < stages; ++i, slot = slot == AHEAD ? 0 : slot + 1) {
            copy_async_wait<AHEAD - 1>();  // this thread's copies of stage i have landed
            sync();                        // everyone's, and slot (i - 1) is free again
            if (i + AHEAD < stages) copy(i + AHEAD, slot == 0 ? AHEAD : slot - 1);
            copy_async_commit();
            consume(i, slot);
        }
    } else if constexpr (SCHEDULE == mma_schedule::modulo) {
        for (int i = 0; i < AHEAD; ++i) {
            if (i < stages) copy(i, i);
            copy_async_commit();
        }
        for (int i = 0; i < stages; ++i) {
            copy_async_wait<AHEAD - 1>();
            sync();
            if (i + AHEAD < stages) copy(i + AHEAD, (i + AHEAD) % SLOTS);
            copy_async_commit();
            consume(i, i % SLOTS);
        }
    } else {
        static_assert(SLOTS == 2, "copy_first: two slots");
        if (stages > 0) copy(0, 0);
        copy_async_commit();
        for (int i = 0; i < stages; ++i) {
            if (i + 1 < stages) copy(i + 1, (i + 1) & 1);
            copy_async_commit();
            copy_async_wait<1>();  // this thread's copies of stage i have landed
            sync();                // everyone's
            consume(i, i & 1);
            sync();                // slot i & 1 may take stage i + 2
        }
    }
    copy_async_wait<0>();
}

// The main loop of a thread's warp in a Tile whose slots start at `slots`: the MMAs of a staged
// stage, and the pipelines that stream a tile's stages through the slots. ROUND: the MMA rounds
// float words to TF32 (mma_operand), for loaders that stage them as they are.
template <typename T, typename Tile, bool ROUND> struct mma_mainloop {
    typedef float accumulators[Tile::MT][Tile::NT][4];
    const unsigned* slots;
    // The lane's ldmatrix rows (mma_place) of its warp's A rows and of its B rows (from the
    // slot's B tile).
    int a_lane, b_lane;

    __device__ __forceinline__ mma_mainloop(const mma_place<Tile::WARPS_M>& th,
                                            const unsigned* slots_)
        : slots(slots_), a_lane(th.a_offset(th.wm * Tile::WM, Tile::PITCH)),
          b_lane(th.b_offset(th.wn * Tile::WN, Tile::PITCH)) {}

    // acc += the MMAs of a stage whose A rows [BM][PITCH] start at `a_rows` and B rows [BN][PITCH]
    // at `b_rows`.
    __device__ __forceinline__ void multiply(accumulators& acc, const unsigned* a_rows,
                                             const unsigned* b_rows) const {
        const unsigned* const a = a_rows + a_lane;
        const unsigned* const b = b_rows + b_lane;
#pragma unroll
        for (int ks = 0; ks < Tile::KSTEPS; ++ks)
            warp_mma_step<T, Tile::MT, Tile::NT, ROUND>(acc, a + ks * 8, 16 * Tile::PITCH,
                                                         b + ks * 8, Tile::PITCH);
    }
    // acc += the MMAs of the stage in slot `slot`.
    __device__ __forceinline__ void multiply(accumulators& acc, int slot) const {
        const unsigned* const a = slots + slot * Tile::SLOT_WORDS;
        multiply(acc, a, a + Tile::BM * Tile::PITCH);
    }

    // acc += the MMAs of `stages` stages streamed through the tile's slots (stream_stages: copy
    // (slot) and sync(), in the order SCHEDULE gives).
    template <mma_schedule SCHEDULE, typename Copy, typename Sync>
    __device__ __forceinline__ void multistage(accumulators& acc, int stages, const Copy& copy,
                                               const Sync& sync) const {
        stream_stages<SCHEDULE, Tile::SLOTS>(
            stages, [&](int, int slot) { copy(slot); }, sync,
            [&](int, int slot) { multiply(acc, slot); });
    }

    // acc += the MMAs of `stages` stages through registers and two slots, one stage in flight:
    // fetch() loads the next stage into the thread's registers, store(slot) puts them into slot
    // `slot` (a loader that transforms what it reads, or reads narrower than cp.async's 16 bytes).
    template <typename Fetch, typename Store, typename Sync>
    __device__ __forceinline__ void pipelined(accumulators& acc, int stages, const Fetch& fetch,
                                              const Store& store, const Sync& sync) const {
        static_assert(Tile::SLOTS >= 2, "a slot to store into while the other is read");
        if (stages > 0) fetch();
        for (int i = 0; i < stages; ++i) {
            store(i & 1);
            sync();
            if (i + 1 < stages) fetch();  // in flight during the MMAs
            multiply(acc, i & 1);
        }
    }
};
