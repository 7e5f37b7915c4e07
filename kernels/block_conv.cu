// block_conv: a stride-1 convolution computed on a list of blocks, as an implicit GEMM on tensor
// cores. Each listed block is read straight from its source tensor (with its halo; zeros outside
// the image) and its output pixels are written or added straight into the destination tensor:
// no gathered stack, no scatter pass. Per block, output pixel p = (ph, pw) of an out_h x out_w
// block is
//     dst[block's dst origin + (ph, pw), co] (=, +=) epilogue(sum over dy, dx, ci of
//         prologue(src[block's src origin + (ph + dy, pw + dx), ci]) * weight[co, dy, dx, ci])
// prologue: max(v * scale[ci] + shift[ci], 0) on in-image pixels when scale is given (an
// inference BatchNorm and ReLU); epilogue: + bias[co], then ReLU (relu_out), then zero where the
// source pixel (ph, pw) itself lies outside the image (zero_outside: the dense network's zero
// padding of the next convolution's input).
// Either side is an NHWC image, addressed through the block list, or a stack [rows, height,
// width, C] of per-block intermediates (block m at (m, 0, 0)), so a bottleneck unit is three
// launches: image -> stack (1x1), stack -> stack (3x3), stack -> image (1x1, residual add).

struct BlockSide {
    int height, width;      // the image's, or the stack's block size
    int off_h, off_w;       // image: block (n, hi, wi) starts at (off_h + str_h * hi, ...)
    int str_h, str_w;
    int stack;              // 1: a stack; block m is (m, 0, 0)
};

struct BlockConvArgs {
    const void* src;
    void* dst;
    const void* weight;     // [cout, kh, kw, cin] (OHWI), in T
    const float* bias;      // [cout] or null
    const float* scale;     // [cin] or null: the prologue's affine and ReLU
    const float* shift;
    const int* indices;     // the block list [rows, 3] and its count (see BlockList)
    const int* count;
    int rows, n_batch, cin, cout, kh, kw, out_h, out_w;
    BlockSide in, out;
    int relu_out, zero_outside;
    int paired;             // cout even and dst aligned: two channels written as one access
    int k_groups;           // warp groups of the CTA that split the reduction (blockDim.x / 128)
};
static_assert(sizeof(BlockConvArgs) == 168, "BlockConvArgs must match sbnet_cupy/block_conv.py");

namespace block_conv_tile {
constexpr int THREADS = 128;  // a warp group: 4 warps as 2 x 2, each 32 pixels x BN / 2 channels
constexpr int BM = 64;        // output pixels of one block per tile
constexpr int WORDS = 32;     // 32-bit words of the reduction per pipeline stage
constexpr int PITCH = WORDS + 4;  // padded rows: fragment loads hit 32 different banks
constexpr int SLOTS = 3;      // shared-memory stages of a warp group: loads in flight
}  // namespace block_conv_tile

// Each warp group waits only for its own warps (barrier 0 is __syncthreads).
static __device__ __forceinline__ void group_sync(int group) {
    asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(block_conv_tile::THREADS) : "memory");
}

static __device__ __forceinline__ unsigned to_tf32(float v) {
    unsigned bits;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(v));
    return bits;
}

// V elements of T as they sit in shared memory: TF32 bit patterns for float (one a word), the
// raw 16-bit patterns otherwise (two a word, the lower k in the low half).
template <typename T, int V>
static __device__ __forceinline__ void store_tile(unsigned* row, int k, const vec_t<T, V>& v) {
    if constexpr (sizeof(T) == 4) {
        vec_t<unsigned, V> words;
#pragma unroll
        for (int e = 0; e < V; ++e) words.v[e] = to_tf32(v.v[e]);
        *reinterpret_cast<vec_t<unsigned, V>*>(row + k) = words;
    } else if constexpr (V == 1) {
        reinterpret_cast<unsigned short*>(row)[k] = v.v[0].bits;
    } else {
        vec_t<unsigned, V / 2> words;
#pragma unroll
        for (int e = 0; e < V / 2; ++e)
            words.v[e] = (unsigned)v.v[2 * e].bits | ((unsigned)v.v[2 * e + 1].bits << 16);
        *reinterpret_cast<vec_t<unsigned, V / 2>*>(row + k / 2) = words;
    }
}

// Where a block sits on one side: batch (or stack) index and top-left pixel.
struct side_origin {
    i64 n;
    int h, w;
};

static __device__ __forceinline__ side_origin side_of(const BlockSide& s, int m, const int* row) {
    if (s.stack) return {m, 0, 0};
    return {row[0], s.off_h + s.str_h * row[1], s.off_w + s.str_w * row[2]};
}

// Grid: a few CTAs an SM, each looping over the tiles (block, BM output pixels, BN output
// channels) of the first *count listed blocks, so rows past the count cost nothing. A CTA is
// k_groups warp groups of THREADS threads: group g reduces stages g, g + k_groups, ... of the
// tile into its own accumulators, so that few tiles with a long reduction (deep layers, few
// blocks) still keep many loads in flight; the groups' partial sums meet in shared memory, where
// the whole CTA runs the epilogue and writes the output coalesced.
// With 16-byte vectors (V * sizeof(T) == 16) a group's stages stream through SLOTS shared-memory
// slots with cp.async, SLOTS - 1 stages in flight; the prologue then runs on the landed tile, each
// thread on what it copied. TF32 MMAs read float32 bits as they are (the tensor cores ignore the
// low mantissa bits). Narrower vectors (channel counts that 16 bytes do not divide) go through
// registers into two slots, one stage in flight, rounded to TF32.
// The loops that are not over register arrays stay rolled: a kernel that runs only a few stages
// per tile spends its time fetching instructions otherwise.
// Dynamic shared memory: k_groups * SLOTS * (BM + BN) * PITCH words. T is float (TF32), half_t or
// bfloat16_t; V elements (dividing cin, pointers aligned to them) are read as one access; Op
// (common.cuh) writes or adds the output.
template <typename T, int BN, int V, typename Op>
__global__ void __launch_bounds__(4 * block_conv_tile::THREADS) block_conv(const BlockConvArgs a) {
    using namespace block_conv_tile;
    constexpr int PER_WORD = 4 / sizeof(T);
    constexpr int BK = WORDS * PER_WORD;  // reduction elements a stage
    constexpr int VECTORS = BK / V;       // vectors a tile row
    constexpr int ROWS_PER_PASS = THREADS / VECTORS;
    constexpr int A_PASSES = BM / ROWS_PER_PASS, B_PASSES = BN / ROWS_PER_PASS;
    constexpr int NT = BN / 16;           // n8 tiles of a warp
    constexpr int SLOT_WORDS = (BM + BN) * PITCH;
    constexpr int GROUP_WORDS = SLOTS * SLOT_WORDS;
    constexpr int OUT_PITCH = BN + 4;     // floats a row of a group's output tile
    constexpr bool ASYNC = V * sizeof(T) == 16;  // cp.async moves 16 bytes
    static_assert(THREADS % VECTORS == 0 && BM % ROWS_PER_PASS == 0 && BN % ROWS_PER_PASS == 0,
                  "tile shape");
    static_assert(BM * OUT_PITCH <= GROUP_WORDS, "a group's output tile fits in its slots");
    typedef vec_t<T, V> Vec;
    extern __shared__ __align__(16) unsigned block_conv_smem[];

    const T* __restrict__ src = static_cast<const T*>(a.src);
    const T* __restrict__ weight = static_cast<const T*>(a.weight);
    T* __restrict__ dst = static_cast<T*>(a.dst);
    const int pixels = a.out_h * a.out_w;
    const int n_tiles = (a.cout + BN - 1) / BN;
    const int per_block = (pixels + BM - 1) / BM * n_tiles;
    const int ktotal = a.kh * a.kw * a.cin;
    const int stages = (ktotal + BK - 1) / BK;
    const int tiles = min(max(*a.count, 0), a.rows) * per_block;  // < 2**31: checked at launch
    const int group = threadIdx.x / THREADS, tid = threadIdx.x % THREADS;
    const int lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 1, wn = warp >> 1, g = lane >> 2, t = lane & 3;
    const int vec = tid % VECTORS, row0 = tid / VECTORS;  // this thread's vector and first row
    // Slot i of this group: the A tile [BM][PITCH], then the B tile [BN][PITCH].
    unsigned* const slots = block_conv_smem + group * GROUP_WORDS;
    // This group's stages: group, group + k_groups, ...
    const int mine = stages > group ? (stages - group + a.k_groups - 1) / a.k_groups : 0;

    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int m = tile / per_block, rest = tile % per_block;
        const int p0 = rest / n_tiles * BM, n0 = rest % n_tiles * BN;
        const int* row = a.indices + 3 * (i64)m;
        if (row[0] < 0 || row[0] >= a.n_batch) continue;  // reads zeros, writes nothing
        const side_origin in = side_of(a.in, m, row), out = side_of(a.out, m, row);

        // Reduction index r of this thread's vector in a stage: tap (dy, dx), channel c.
        int r = 0, c = 0, dy = 0, dx = 0;
        auto locate = [&](int stage) {
            r = stage * BK + vec * V;
            const int tap = r / a.cin;
            c = r - tap * a.cin;
            dy = tap / a.kw;
            dx = tap - dy * a.kw;
        };
        // Offset of tile row i's source pixel for the current tap, or -1 outside the image.
        auto source = [&](int i) -> i64 {
            const int p = p0 + row0 + i * ROWS_PER_PASS;
            const int ph = p / a.out_w;
            const int h = in.h + ph + dy, w = in.w + p - ph * a.out_w + dx;
            if (r >= ktotal || p >= pixels || h < 0 || h >= a.in.height || w < 0 ||
                w >= a.in.width)
                return -1;
            return ((in.n * a.in.height + h) * a.in.width + w) * a.cin + c;
        };
        auto weight_offset = [&](int j) -> i64 {
            const int co = n0 + row0 + j * ROWS_PER_PASS;
            return r < ktotal && co < a.cout ? (i64)co * ktotal + r : -1;
        };
        auto a_row = [&](int buffer, int i) {
            return slots + buffer * SLOT_WORDS + (row0 + i * ROWS_PER_PASS) * PITCH;
        };
        auto b_row = [&](int buffer, int j) {
            return slots + buffer * SLOT_WORDS + (BM + row0 + j * ROWS_PER_PASS) * PITCH;
        };

        float acc[2][NT][4] = {};
        auto multiply = [&](int buffer) {  // the MMAs of one stage
            const unsigned* ta = slots + buffer * SLOT_WORDS;
            const unsigned* tb = ta + BM * PITCH;
#pragma unroll
            for (int ks = 0; ks < WORDS / 8; ++ks) {
                unsigned af[2][4], bf[NT][2];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    const unsigned* p = ta + (wm * 32 + mt * 16 + g) * PITCH + ks * 8 + t;
                    af[mt][0] = p[0];
                    af[mt][1] = p[8 * PITCH];
                    af[mt][2] = p[4];
                    af[mt][3] = p[8 * PITCH + 4];
                }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const unsigned* p = tb + (wn * (BN / 2) + nt * 8 + g) * PITCH + ks * 8 + t;
                    bf[nt][0] = p[0];
                    bf[nt][1] = p[4];
                }
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
                        tensor_core_mma<T>::run(acc[mt][nt], af[mt], bf[nt]);
            }
        };
        // The prologue's affine and ReLU on V elements of channels c.. read from the image.
        auto activate = [&](Vec& v) {
#pragma unroll
            for (int e = 0; e < V; ++e)
                v.v[e] = from_acc<T>(
                    fmaxf(to_acc(v.v[e]) * a.scale[c + e] + a.shift[c + e], 0.f));
        };

        if constexpr (ASYNC) {
            constexpr int AHEAD = SLOTS - 1;
            auto copy = [&](int stage, int buffer) {
                locate(stage);
#pragma unroll 1
                for (int i = 0; i < A_PASSES; ++i) {
                    const i64 at = source(i);
                    copy_async16(a_row(buffer, i) + vec * V / PER_WORD, src + max(at, (i64)0),
                                 at >= 0);
                }
#pragma unroll 1
                for (int j = 0; j < B_PASSES; ++j) {
                    const i64 at = weight_offset(j);
                    copy_async16(b_row(buffer, j) + vec * V / PER_WORD, weight + max(at, (i64)0),
                                 at >= 0);
                }
            };
            for (int i = 0; i < AHEAD; ++i) {
                if (i < mine) copy(group + i * a.k_groups, i);
                copy_async_commit();  // empty groups too: the wait below counts groups
            }
            for (int i = 0; i < mine; ++i) {
                copy_async_wait<AHEAD - 1>();  // this thread's copies of its i-th stage landed
                if (a.scale != nullptr) {
                    locate(group + i * a.k_groups);
#pragma unroll 1
                    for (int k = 0; k < A_PASSES; ++k) {
                        if (source(k) < 0) continue;  // zeros stay zeros, as the dense padding
                        Vec* v = reinterpret_cast<Vec*>(a_row(i % SLOTS, k) + vec * V / PER_WORD);
                        Vec x = *v;
                        activate(x);
                        *v = x;
                    }
                }
                group_sync(group);  // everyone's copies landed, and slot (i - 1) % SLOTS is free
                if (i + AHEAD < mine) copy(group + (i + AHEAD) * a.k_groups, (i + AHEAD) % SLOTS);
                copy_async_commit();
                multiply(i % SLOTS);
            }
            copy_async_wait<0>();
        } else {
            Vec va[A_PASSES], vb[B_PASSES];
            unsigned a_loaded = 0;
            auto load = [&](int stage) {
                locate(stage);
                a_loaded = 0;
#pragma unroll
                for (int i = 0; i < A_PASSES; ++i) {
                    const i64 at = source(i);
                    va[i] = at >= 0 ? *reinterpret_cast<const Vec*>(src + at) : Vec{};
                    a_loaded |= (at >= 0 ? 1u : 0u) << i;
                }
#pragma unroll
                for (int j = 0; j < B_PASSES; ++j) {
                    const i64 at = weight_offset(j);
                    vb[j] = at >= 0 ? *reinterpret_cast<const Vec*>(weight + at) : Vec{};
                }
            };
            auto store = [&](int buffer) {
#pragma unroll
                for (int i = 0; i < A_PASSES; ++i) {
                    if (a.scale != nullptr && (a_loaded >> i & 1)) activate(va[i]);
                    store_tile(a_row(buffer, i), vec * V, va[i]);
                }
#pragma unroll
                for (int j = 0; j < B_PASSES; ++j) store_tile(b_row(buffer, j), vec * V, vb[j]);
            };
            if (mine > 0) load(group);
            for (int i = 0; i < mine; ++i) {
                store(i & 1);
                group_sync(group);
                if (i + 1 < mine) load(group + (i + 1) * a.k_groups);  // in flight during the MMAs
                multiply(i & 1);
            }
        }

        // Each group's partial tile [BM][OUT_PITCH] floats, over its own slots; then the whole
        // CTA sums them, applies the epilogue and writes channel pairs, consecutive threads on
        // consecutive channels.
        __syncthreads();
        float* partial = reinterpret_cast<float*>(slots);
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    *reinterpret_cast<vec_t<float, 2>*>(
                        partial + (wm * 32 + mt * 16 + g + 8 * half) * OUT_PITCH + wn * (BN / 2) +
                        nt * 8 + 2 * t) = {{acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]}};
        __syncthreads();
        const float* sums = reinterpret_cast<const float*>(block_conv_smem);
#pragma unroll 1
        for (int e = threadIdx.x; e < BM * BN / 2; e += blockDim.x) {
            const int tile_row = e / (BN / 2), col = e % (BN / 2) * 2;
            const int p = p0 + tile_row, co = n0 + col;
            if (p >= pixels || co >= a.cout) continue;
            const int ph = p / a.out_w, pw = p - ph * a.out_w;
            const int dh = out.h + ph, dw = out.w + pw;
            if (dh < 0 || dh >= a.out.height || dw < 0 || dw >= a.out.width) continue;
            const int sh = in.h + ph, sw = in.w + pw;
            const bool zero = a.zero_outside &&
                              (sh < 0 || sh >= a.in.height || sw < 0 || sw >= a.in.width);
            float v[2] = {0.f, 0.f};
#pragma unroll 1
            for (int k = 0; k < a.k_groups; ++k) {
                const float* s = sums + k * GROUP_WORDS + tile_row * OUT_PITCH + col;
                v[0] += s[0];
                v[1] += s[1];
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                if (a.bias != nullptr && co + i < a.cout) v[i] += a.bias[co + i];
                if (a.relu_out) v[i] = fmaxf(v[i], 0.f);
                if (zero) v[i] = 0.f;
            }
            T* pixel = dst + ((out.n * a.out.height + dh) * a.out.width + dw) * a.cout + co;
            if (a.paired) {
                const vec_t<T, 2> pair = {{from_acc<T>(v[0]), from_acc<T>(v[1])}};
                Op::apply(reinterpret_cast<vec_t<T, 2>*>(pixel), pair);
            } else {
                Op::apply(pixel, from_acc<T>(v[0]));
                if (co + 1 < a.cout) Op::apply(pixel + 1, from_acc<T>(v[1]));
            }
        }
        __syncthreads();  // the next tile's copies reuse the shared memory
    }
}
