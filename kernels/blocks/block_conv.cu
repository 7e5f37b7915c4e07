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

// Arguments: BlockConvArgs, its two sides BlockSide (in: the source, out: the destination),
// declared in sbnet_cupy/core/records.py, which defines them in front of kernels/core/common.cuh.

namespace block_conv_tile {
constexpr int THREADS = 128;  // a warp group: 4 warps as 2 x 2, each 32 pixels x BN / 2 channels
constexpr int BM = 64;        // output pixels of one block per tile
constexpr int WORDS = 32;     // 32-bit words of the reduction per pipeline stage
constexpr int SLOTS = 3;      // shared-memory stages of a warp group: loads in flight
// A warp group's tile of BN output channels (mma_tile, common.cuh).
template <int BN> using shape = mma_tile<BM, BN, WORDS, 2, SLOTS>;
// Elements of T a 32-bit word of shared memory holds, and a 16-byte copy moves.
template <typename T> constexpr int PER_WORD = 4 / sizeof(T);
template <typename T> constexpr int PER_COPY = 16 / sizeof(T);
}  // namespace block_conv_tile

// Whether Op (common.cuh) adds into the destination, which the epilogue then reads first.
template <typename Op> struct reads_destination { static constexpr bool value = false; };
template <> struct reads_destination<Add> { static constexpr bool value = true; };

// Each warp group waits only for its own warps (barrier 0 is __syncthreads).
static __device__ __forceinline__ void group_sync(int group) {
    asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(block_conv_tile::THREADS) : "memory");
}

// A thread's place in a CTA of warp groups: its group and its thread of the group, and its place
// in the group's MMAs (mma_place, common.cuh: warp (wm, wn) of the tile's 2 x 2).
struct fragment_place : mma_place<2> {
    int group, tid;

    __device__ __forceinline__ fragment_place()
        : mma_place<2>(threadIdx.x % block_conv_tile::THREADS),
          group(threadIdx.x / block_conv_tile::THREADS),
          tid(threadIdx.x % block_conv_tile::THREADS) {}
};

// Where a thread's vector sits in the reduction: tap (dy, dx), channel, and r = (dy * kw + dx) *
// cin + channel. From one of its group's stages to the next without dividing (the step's taps
// and channels are the launch's).
struct reduction_cursor {
    int r, dy, dx, channel;

    __device__ reduction_cursor(int r0, int cin, int kw) : r(r0) {
        const int tap = cin > 0 ? r0 / cin : 0;  // no channels: no stages either
        dy = tap / kw;
        dx = tap - dy * kw;
        channel = r0 - tap * cin;
    }
    __device__ __forceinline__ void advance(const BlockConvArgs& a, int step) {
        r += step;
        channel += a.step_channels;
        const int carry = channel >= a.cin;
        if (carry) channel -= a.cin;
        dx += a.step_taps_x + carry;  // < 2 kw: one wrap at most
        dy += a.step_taps_y;
        if (dx >= a.kw) {
            dx -= a.kw;
            ++dy;
        }
    }
};

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

// A launch's tiles: pixels a block, channel tiles of BN, tiles a block, and the tiles of the
// listed blocks up to the count, read once the kernel before is done (launched as a dependent,
// launch_block_conv: the block list, src and dst may all be the previous kernel's).
struct tile_grid {
    int pixels, n_tiles, per_block, tiles;

    template <int BN>
    __device__ __forceinline__ static tile_grid of(const BlockConvArgs& a) {
        tile_grid t;
        t.pixels = a.out_h * a.out_w;
        t.n_tiles = (a.cout + BN - 1) / BN;
        t.per_block = (t.pixels + block_conv_tile::BM - 1) / block_conv_tile::BM * t.n_tiles;
        wait_for_previous_kernel();
        allow_next_kernel();
        t.tiles = min(max(*a.count, 0), a.rows) * t.per_block;  // < 2**31: checked at launch
        return t;
    }
};

// Group 0's ACC accumulators plus the other groups' partial sums, in group order: group g > 0
// leaves its sums at partial + (g - 1) * stride, THREADS words apart. Called by the whole CTA
// once every group is done with its slots.
template <int ACC>
static __device__ __forceinline__ void sum_groups(float* flat, float* partial, int stride,
                                                  int group, int k_groups, int tid) {
    using block_conv_tile::THREADS;
    if (k_groups == 1) return;
    if (group > 0) {
#pragma unroll
        for (int i = 0; i < ACC; ++i) partial[(group - 1) * stride + i * THREADS + tid] = flat[i];
    }
    __syncthreads();
    if (group == 0) {
        for (int other = 1; other < k_groups; ++other) {
#pragma unroll
            for (int i = 0; i < ACC; ++i)
                flat[i] += partial[(other - 1) * stride + i * THREADS + tid];
        }
    }
}

// Where tile `tile` of a launch sits: its block-list row m, first output pixel p0 and channel n0
// (tiles run over rows, then pixel tiles of BM, then channel tiles of BN), and the block's
// origins. False for a row outside the batch, which reads zeros and writes nothing.
struct tile_place {
    int m, p0, n0;
    side_origin in, out;

    __device__ __forceinline__ bool find(const BlockConvArgs& a, int tile, const tile_grid& grid,
                                         int bn) {
        m = tile / grid.per_block;
        const int rest = tile % grid.per_block;
        p0 = rest / grid.n_tiles * block_conv_tile::BM;
        n0 = rest % grid.n_tiles * bn;
        const int* row = a.indices + 3 * (i64)m;
        if (row[0] < 0 || row[0] >= a.n_batch) return false;
        in = side_of(a.in, m, row);
        out = side_of(a.out, m, row);
        return true;
    }
};

// Epilogue of a tile: bias, ReLU, the out-of-image zeros, and the write or add of its output
// pixels. Accumulator (mt, nt, 2 * half + e) of thread th is pixel p0 + acc_row(th, mt, half),
// channel n0 + acc_col(th, nt) + e (mma_tile, common.cuh). The global reads
// (the bias; the old outputs where Op adds, 2 * NT pixel pairs at a time) are issued before the
// writes, which the compiler may not move reads past: one round trip each, not one for each
// write.
template <typename T, int BN, typename Op>
static __device__ __forceinline__ void write_tile(const BlockConvArgs& a,
                                                  const float (&acc)[2][BN / 16][4], int p0,
                                                  int n0, const side_origin& in,
                                                  const side_origin& out, const mma_place<2>& th) {
    using Tile = block_conv_tile::shape<BN>;
    constexpr int NT = Tile::NT;
    T* __restrict__ dst = static_cast<T*>(a.dst);
    const int pixels = a.out_h * a.out_w;
    float bias[NT][2];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int co = n0 + Tile::acc_col(th, nt);
#pragma unroll
        for (int e = 0; e < 2; ++e)
            bias[nt][e] = a.bias != nullptr && co + e < a.cout ? a.bias[co + e] : 0.f;
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
        T* pixel[2];  // null where the pixel is past the block or outside the image
        bool zero[2];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int p = p0 + Tile::acc_row(th, mt, half);
            const int ph = p / a.out_w, pw = p - ph * a.out_w;
            const int dh = out.h + ph, dw = out.w + pw;
            const int sh = in.h + ph, sw = in.w + pw;
            pixel[half] =
                p < pixels && dh >= 0 && dh < a.out.height && dw >= 0 && dw < a.out.width
                    ? dst + ((out.n * a.out.height + dh) * a.out.width + dw) * a.cout
                    : nullptr;
            zero[half] = a.zero_outside &&
                         (sh < 0 || sh >= a.in.height || sw < 0 || sw >= a.in.width);
        }
        vec_t<T, 2> old[2][NT] = {};
        if constexpr (reads_destination<Op>::value) {
#pragma unroll
            for (int half = 0; half < 2; ++half)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const int co = n0 + Tile::acc_col(th, nt);
                    const T* at = pixel[half] + co;
                    if (pixel[half] == nullptr || co >= a.cout) continue;
                    if (a.paired) {
                        old[half][nt] = *reinterpret_cast<const vec_t<T, 2>*>(at);
                    } else {
                        old[half][nt].v[0] = at[0];
                        if (co + 1 < a.cout) old[half][nt].v[1] = at[1];
                    }
                }
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            if (pixel[half] == nullptr) continue;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int co = n0 + Tile::acc_col(th, nt);
                if (co >= a.cout) continue;
                float v[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    v[e] = acc[mt][nt][2 * half + e] + bias[nt][e];
                    if (a.relu_out) v[e] = fmaxf(v[e], 0.f);
                    if (zero[half]) v[e] = 0.f;
                    v[e] += to_acc(old[half][nt].v[e]);
                }
                store_pair(pixel[half] + co, v[0], v[1], a.paired, co + 1 < a.cout);
            }
        }
    }
}

// block_conv's grid: a few CTAs an SM, each looping over the tiles (block, BM output pixels, BN
// output channels) of the first *count listed blocks, so rows past the count cost nothing. A CTA
// is k_groups warp groups of THREADS threads: group g reduces stages g, g + k_groups, ... of the
// tile into its own accumulators, which group 0 sums before the epilogue, so that few tiles with
// a long reduction (deep layers, few blocks) still keep many loads in flight. A group's stages
// stream through SLOTS shared-memory slots with cp.async (16-byte vectors, no prologue: SLOTS - 1
// stages in flight), or through registers into two slots (the prologue's affine and ReLU, or
// narrower vectors: one stage in flight). TF32 MMAs read the float32 bits as they are (the
// tensor cores ignore the low mantissa bits) on the cp.async path and rounded ones on the other.
// Dynamic shared memory: k_groups * SLOTS * (BM + BN) * PITCH words. T is float (TF32), half_t or
// bfloat16_t; V elements (dividing cin, pointers aligned to them) are read as one access. Each
// tile, once group 0 holds its sums, goes to finish(its tile_place, the sums, the thread's
// fragment_place), called by the whole CTA (block_conv writes it; block_conv_pair multiplies it
// on).
template <typename T, int BN, int V, typename Finish>
static __device__ __forceinline__ void stream_tiles(const BlockConvArgs& a, Finish finish) {
    using namespace block_conv_tile;
    using Tile = shape<BN>;
    constexpr int PITCH = Tile::PITCH, SLOT_WORDS = Tile::SLOT_WORDS, NT = Tile::NT;
    constexpr int BK = WORDS * PER_WORD<T>;  // reduction elements a stage
    constexpr int VECTORS = BK / V;  // vectors a tile row
    constexpr int ROWS_PER_PASS = THREADS / VECTORS;
    constexpr int A_PASSES = BM / ROWS_PER_PASS, B_PASSES = BN / ROWS_PER_PASS;
    static_assert(THREADS % VECTORS == 0 && BM % ROWS_PER_PASS == 0 && BN % ROWS_PER_PASS == 0,
                  "tile shape");
    static_assert(A_PASSES <= 32, "the load mask is one word");
    constexpr int GROUP_WORDS = SLOTS * SLOT_WORDS;
    constexpr bool ASYNC = V * sizeof(T) == 16;  // cp.async moves 16 bytes
    constexpr int ACC = 2 * NT * 4;       // accumulators a thread
    static_assert(ACC * THREADS <= GROUP_WORDS, "a group's partial sums fit in its tiles");
    // Each tile row's source offset kept across the stages where registers allow (16-byte
    // vectors: four rows a thread), else computed at each stage.
    constexpr bool KEEP_OFFSETS = A_PASSES <= 4;
    typedef vec_t<T, V> Vec;
    extern __shared__ __align__(16) unsigned block_conv_smem[];

    const T* __restrict__ src = static_cast<const T*>(a.src);
    const T* __restrict__ weight = static_cast<const T*>(a.weight);
    const int ktotal = a.kh * a.kw * a.cin;
    const int stages = (ktotal + BK - 1) / BK;
    const tile_grid grid = tile_grid::of<BN>(a);
    const int pixels = grid.pixels;
    const fragment_place th;
    const int group = th.group, tid = th.tid;
    const int vec = tid % VECTORS, row0 = tid / VECTORS;
    // Slot i of this group: the A tile [BM][PITCH], then the B tile [BN][PITCH].
    unsigned* const slots = block_conv_smem + group * GROUP_WORDS;
    // TF32 MMAs take the float32 bits as they are: store_tile rounds them, cp.async does not.
    const mma_mainloop<T, Tile, false> mainloop(th, slots);
    // Where this thread's cp.async copies land in slot 0 (a shared-memory address).
    const unsigned copy_to = shared_address(slots + row0 * PITCH + vec * V / PER_WORD<T>);
    const reduction_cursor first(group * BK + vec * V, a.cin, a.kw);
    const int step = a.k_groups * BK;

    for (int tile = blockIdx.x; tile < grid.tiles; tile += gridDim.x) {
        tile_place at_tile;
        if (!at_tile.find(a, tile, grid, BN)) continue;
        const int p0 = at_tile.p0, n0 = at_tile.n0;
        const side_origin& in = at_tile.in;

        // For each tile row this thread loads: the source pixel of the top-left tap, and its
        // element offset in src (the taps add (dy * width + dx) * cin).
        int a_h[A_PASSES], a_w[A_PASSES];
        i64 a_at[KEEP_OFFSETS ? A_PASSES : 1];
        unsigned a_rows = 0;
#pragma unroll
        for (int i = 0; i < A_PASSES; ++i) {
            const int p = p0 + row0 + i * ROWS_PER_PASS;
            const int ph = p / a.out_w;
            a_h[i] = in.h + ph;
            a_w[i] = in.w + p - ph * a.out_w;
            if constexpr (KEEP_OFFSETS)
                a_at[i] = ((in.n * a.in.height + a_h[i]) * a.in.width + a_w[i]) * a.cin;
            if (p < pixels) a_rows |= 1u << i;
        }
        reduction_cursor at = first;  // this group's first stage
        // Whether tile row i's source pixel for the cursor's tap lies in the image.
        auto a_valid = [&](int i) {
            const int h = a_h[i] + at.dy, w = a_w[i] + at.dx;
            return (a_rows >> i & 1) && (unsigned)h < (unsigned)a.in.height &&
                   (unsigned)w < (unsigned)a.in.width;
        };
        // The tap's part of the source offset (the same for every tile row: KEEP_OFFSETS), and
        // tile row i's source element.
        auto tap_offset = [&]() {
            return KEEP_OFFSETS ? ((i64)at.dy * a.in.width + at.dx) * a.cin + at.channel : 0;
        };
        auto a_offset = [&](int i, i64 tap) {
            if constexpr (KEEP_OFFSETS) return a_at[i] + tap;
            return ((in.n * a.in.height + a_h[i] + at.dy) * a.in.width + a_w[i] + at.dx) * a.cin +
                   at.channel;
        };

        // This thread's first weight row of the tile, and the step to its next.
        const T* const b_row = weight + (i64)(n0 + row0) * ktotal;
        const i64 b_pass = (i64)ROWS_PER_PASS * ktotal;
        Vec va[A_PASSES], vb[B_PASSES];
        unsigned a_loaded = 0;
        int channel = 0;
        // The register path: the cursor's stage into va, vb; then the next stage.
        auto load = [&]() {
            const bool live = at.r < ktotal;
            const i64 offset = tap_offset();
            channel = at.channel;
            a_loaded = 0;
#pragma unroll
            for (int i = 0; i < A_PASSES; ++i) {
                va[i] = Vec{};
                if (live && a_valid(i)) {
                    va[i] = *reinterpret_cast<const Vec*>(src + a_offset(i, offset));
                    a_loaded |= 1u << i;
                }
            }
#pragma unroll
            for (int j = 0; j < B_PASSES; ++j) {
                const int co = n0 + row0 + j * ROWS_PER_PASS;
                vb[j] = Vec{};
                if (live && co < a.cout)
                    vb[j] = *reinterpret_cast<const Vec*>(b_row + j * b_pass + at.r);
            }
            at.advance(a, step);
        };
        auto store = [&](int buffer) {
            if (a.scale != nullptr) {  // the prologue, on pixels read from the image
                float scale[V], shift[V];
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    scale[e] = a.scale[channel + e];
                    shift[e] = a.shift[channel + e];
                }
#pragma unroll
                for (int i = 0; i < A_PASSES; ++i) {
                    if (!(a_loaded >> i & 1)) continue;
#pragma unroll
                    for (int e = 0; e < V; ++e)
                        va[i].v[e] = from_acc<T>(fmaxf(to_acc(va[i].v[e]) * scale[e] + shift[e],
                                                       0.f));
                }
            }
#pragma unroll
            for (int i = 0; i < A_PASSES; ++i)
                store_tile(slots + buffer * SLOT_WORDS + (row0 + i * ROWS_PER_PASS) * PITCH,
                           vec * V, va[i]);
#pragma unroll
            for (int j = 0; j < B_PASSES; ++j)
                store_tile(slots + buffer * SLOT_WORDS + (BM + row0 + j * ROWS_PER_PASS) * PITCH,
                           vec * V, vb[j]);
        };
        // The cp.async path's load and store in one: the cursor's stage -> slot `buffer`; then
        // the next stage.
        auto copy = [&](int buffer) {
            const bool live = at.r < ktotal;
            const i64 offset = tap_offset();
            const unsigned tile = copy_to + buffer * SLOT_WORDS * 4;
#pragma unroll
            for (int i = 0; i < A_PASSES; ++i) {
                const bool valid = live && a_valid(i);
                copy_async16(tile + i * ROWS_PER_PASS * PITCH * 4,
                             valid ? src + a_offset(i, offset) : src, valid);
            }
#pragma unroll
            for (int j = 0; j < B_PASSES; ++j) {
                const bool valid = live && n0 + row0 + j * ROWS_PER_PASS < a.cout;
                copy_async16(tile + (BM + j * ROWS_PER_PASS) * PITCH * 4,
                             valid ? b_row + j * b_pass + at.r : weight, valid);
            }
            at.advance(a, step);
        };
        float acc[2][NT][4] = {};
        // This group's stages: group, group + k_groups, ...; its warps share its slots.
        const int mine = stages > group ? (stages - group + a.k_groups - 1) / a.k_groups : 0;
        auto sync = [&] { group_sync(group); };
        if (ASYNC && a.scale == nullptr) {
            mainloop.template multistage<mma_schedule::wrapped>(acc, mine, copy, sync);
        } else {
            mainloop.pipelined(acc, mine, load, store, sync);
        }
        // The group's own barrier orders nothing __syncthreads does not; it is there for
        // compute-sanitizer racecheck, which loses track of four groups that passed their
        // barriers unevenly often (tests/racecheck/README.md) and would report the sums' stores.
        group_sync(group);
        __syncthreads();  // every group is done with its tiles: they hold the partial sums now
        sum_groups<ACC>(&acc[0][0][0], reinterpret_cast<float*>(block_conv_smem), GROUP_WORDS,
                        group, a.k_groups, tid);
        finish(at_tile, acc, th);
        __syncthreads();  // the next tile's loads reuse the shared memory
    }
}

// block_conv: stream_tiles, each tile written or added (Op, common.cuh) by group 0.
template <typename T, int BN, int V, typename Op>
__global__ void __launch_bounds__(4 * block_conv_tile::THREADS) block_conv(const BlockConvArgs a) {
    stream_tiles<T, BN, V>(a, [&](const tile_place& at, const float (&acc)[2][BN / 16][4],
                                  const fragment_place& th) {
        if (th.group == 0) write_tile<T, BN, Op>(a, acc, at.p0, at.n0, at.in, at.out, th);
    });
}

// block_conv_halo: block_conv's convolution for kernels wider than 1x1 on 16-byte vectors
// without the prologue, with the reduction staged by channel chunk instead of by 32 words. A
// tile's source pixels (its output rows plus the kernel's halo, whole rows of the block) and
// every tap's weights for a chunk of channels (at most BK: the launch's halo_chunk) are copied
// into shared memory in one batch; each tap's A fragments are then read from the same pixels at
// the tap's shift (ldmatrix takes a row address from each lane, so the shift costs one add a
// tap). One round trip of copies a chunk instead of one a stage: T1 conv-2's 24 channels are one
// chunk where block_conv streams seven stages, and no per-tap address work is left in the loop.
// k_groups warp groups of THREADS threads (warps 2 x 2 as in block_conv) split the chunks: group
// g reduces chunks g, g + k_groups, ... into its own accumulators, summed by group 0 before the
// epilogue, so that a few tiles of a deep layer keep several chunks in flight at once. Each group
// has its own slots, two where it takes several chunks (the next chunk's copies fly during this
// chunk's MMAs); the layout is halo_layout's, which sbnet_cupy/blocks/block_conv.py mirrors.
struct halo_layout {
    int chunk;        // channels a chunk (the launch's; at most BK)
    int pitch;        // words a shared-memory row: the chunk's words + 4 (conflict-free ldmatrix)
    int in_w;         // pixels a halo row
    int pixels;       // halo pixels a tile may need: whole rows of the block, its rows and kh - 1
    int slot_words;   // the halo, then the weights [taps][BN][pitch]
    int group_words;  // a warp group's slots: two where it takes several chunks, else one

    template <typename T, int BN>
    __device__ __forceinline__ static halo_layout of(const BlockConvArgs& a) {
            halo_layout l;
        l.chunk = a.halo_chunk;
        l.pitch = l.chunk / block_conv_tile::PER_WORD<T> + 4;
        l.in_w = a.out_w + a.kw - 1;
        // A tile starts at a multiple of BM: at most out_w - gcd(BM, out_w) pixels into a row.
        int x = block_conv_tile::BM, y = a.out_w;
        while (y) {
            const int r = x % y;
            x = y;
            y = r;
        }
        const int spanned = (a.out_w - x + block_conv_tile::BM - 1) / a.out_w + 1;
        l.pixels = (min(a.out_h, spanned) + a.kh - 1) * l.in_w;
        l.slot_words = (l.pixels + a.kh * a.kw * BN) * l.pitch;
        const int chunks = (a.cin + l.chunk - 1) / l.chunk;
        l.group_words = (chunks > a.k_groups ? 2 : 1) * l.slot_words;
        return l;
    }
};

template <typename T, int BN, typename Op>
__global__ void __launch_bounds__(4 * block_conv_tile::THREADS)
block_conv_halo(const BlockConvArgs a) {
    using namespace block_conv_tile;
    constexpr int V = PER_COPY<T>;
    constexpr int COPIES = WORDS / 4;      // copies a full chunk row; a thread takes one column
    constexpr int ROWS_PER_PASS = THREADS / COPIES;
    constexpr int KSTEP = 8 * PER_WORD<T>;  // elements of one MMA's k
    // The tile's warps and MMAs as block_conv's (its stages are the halo's own: halo_layout).
    using Tile = shape<BN>;
    constexpr int MT = Tile::MT, NT = Tile::NT;
    constexpr int ACC = MT * NT * 4;  // accumulators a thread
    static_assert(MT == 2, "a_lane[1] - a_lane[0]: the step to the second m-tile's A rows");
    extern __shared__ __align__(16) unsigned block_conv_smem[];

    const T* __restrict__ src = static_cast<const T*>(a.src);
    const T* __restrict__ weight = static_cast<const T*>(a.weight);
    const halo_layout l = halo_layout::of<T, BN>(a);
    const int taps = a.kh * a.kw;
    const int chunks = (a.cin + l.chunk - 1) / l.chunk;
    const tile_grid grid = tile_grid::of<BN>(a);
    const int pixels = grid.pixels;
    const fragment_place th;
    const int group = th.group, tid = th.tid;
    // This group's chunks of each tile: group, group + k_groups, ...
    const int mine = chunks > group ? (chunks - group + a.k_groups - 1) / a.k_groups : 0;
    // This thread's copies: column `column` (V elements) of rows row0, row0 + ROWS_PER_PASS, ...
    const int column = tid % COPIES, row0 = tid / COPIES;
    unsigned* const slots = block_conv_smem + group * l.group_words;
    const unsigned smem = shared_address(slots);
    // Each lane's B row of the ldmatrix loads within a tap's weights.
    const int b_lane = th.b_offset(th.wn * Tile::WN, l.pitch);

    for (int tile = blockIdx.x; tile < grid.tiles; tile += gridDim.x) {
        tile_place at_tile;
        if (!at_tile.find(a, tile, grid, BN)) continue;
        const int p0 = at_tile.p0, n0 = at_tile.n0;
        const side_origin &in = at_tile.in, &out = at_tile.out;
        // The block rows of the tile's output pixels, and its halo's pixels.
        const int r0 = p0 / a.out_w;
        const int halo = (min(a.out_h - 1, (p0 + BM - 1) / a.out_w) - r0 + a.kh) * l.in_w;
        // Each lane's A row of the ldmatrix loads at tap (0, 0): the halo pixel of output pixel
        // p0 + wm * WM + mt * 16 + lane % 16 (past the block: the tile's first, read and unused).
        int a_lane[MT];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            int p = p0 + th.wm * Tile::WM + mt * 16 + th.a_row();
            if (p >= pixels) p = p0;
            const int ph = p / a.out_w;
            a_lane[mt] = ((ph - r0) * l.in_w + p - ph * a.out_w) * l.pitch + th.a_word();
        }

        // Chunk c's halo pixels and weights into slot `slot`; columns past cin read as zeros.
        auto copy = [&](int c, int slot) {
            const int channel = c * l.chunk + column * V;
            if (column * V >= l.chunk) return;
            const bool live = channel < a.cin;
            const unsigned base = smem + (slot * l.slot_words + column * 4) * 4;
            int hr = row0 / l.in_w, hc = row0 - hr * l.in_w;
            for (int q = row0; q < halo; q += ROWS_PER_PASS) {
                const int h = in.h + r0 + hr, w = in.w + hc;
                const bool valid = live && (unsigned)h < (unsigned)a.in.height &&
                                   (unsigned)w < (unsigned)a.in.width;
                copy_async16(base + q * l.pitch * 4,
                             valid ? src + ((in.n * a.in.height + h) * a.in.width + w) * a.cin +
                                             channel
                                   : src,
                             valid);
                for (hc += ROWS_PER_PASS; hc >= l.in_w; hc -= l.in_w) ++hr;
            }
            for (int r = row0; r < taps * BN; r += ROWS_PER_PASS) {
                const int tap = r / BN, co = n0 + r % BN;
                const bool valid = live && co < a.cout;
                copy_async16(base + (l.pixels + r) * l.pitch * 4,
                             valid ? weight + ((i64)co * taps + tap) * a.cin + channel : weight,
                             valid);
            }
        };
        float acc[MT][NT][4] = {};
        // Chunk c's MMAs from slot `slot`: every tap, the chunk's k steps (the last chunk's may
        // be fewer).
        auto multiply = [&](int c, int slot) {
            const int ksteps = (min(l.chunk, a.cin - c * l.chunk) + KSTEP - 1) / KSTEP;
            const unsigned* const base = slots + slot * l.slot_words;
            const unsigned* tb = base + l.pixels * l.pitch + b_lane;
            for (int dy = 0; dy < a.kh; ++dy) {
                for (int dx = 0; dx < a.kw; ++dx, tb += BN * l.pitch) {
                    const int shift = (dy * l.in_w + dx) * l.pitch;
                    const unsigned* ta = base + shift;
#pragma unroll
                    for (int ks = 0; ks < WORDS / 8; ++ks) {
                        if (ks >= ksteps) break;
                        warp_mma_step<T, MT, NT>(acc, ta + a_lane[0] + ks * 8,
                                                 a_lane[1] - a_lane[0], tb + ks * 8, l.pitch);
                    }
                }
            }
        };

        // The group's chunks through its two slots (stream_stages: the next chunk's copies fly
        // during this chunk's MMAs).
        stream_stages<mma_schedule::copy_first, 2>(
            mine, [&](int i, int slot) { copy(group + i * a.k_groups, slot); },
            [&] { group_sync(group); },
            [&](int i, int slot) { multiply(group + i * a.k_groups, slot); });
        __syncthreads();  // every group is done with its slots: they hold the partial sums now
        sum_groups<ACC>(&acc[0][0][0], reinterpret_cast<float*>(block_conv_smem), ACC * THREADS,
                        group, a.k_groups, tid);
        if (group == 0) write_tile<T, BN, Op>(a, acc, p0, n0, in, out, th);
        __syncthreads();  // the next tile's copies reuse the shared memory
    }
}

// block_conv_pair: a bottleneck unit's 3x3 and the 1x1 after it in one launch. `conv` is the 3x3
// (stack to stack, as block_conv takes it, with a tile as wide as its output channels: BN >=
// conv.cout, so one tile holds every channel of its pixels). Each tile is streamed as block_conv
// streams it; its epilogue (bias, ReLU) goes into shared memory instead of the stack, as the A
// operand of the 1x1 (K = BN channels, those past conv.cout zero); then the CTA's warp groups
// take the 1x1's tiles of BN2 output channels in turn (group g: tiles g, g + k_groups, ...),
// each copying its weights [BN2][K] into its own slot, and add them into dst2 through the block
// list (no bias, no ReLU: the unit's residual add). This saves the second stack's round trip
// through memory and a launch. Dynamic shared memory: the larger of stream_tiles' and (BM +
// k_groups * BN2) rows of K words + 4.
// Arguments: BlockConvPairArgs (sbnet_cupy/core/records.py): the 3x3's BlockConvArgs `conv`, then
// the 1x1's dst2, weight2, cout2, its side out2 and paired2.

template <typename T, int BN, int BN2>
__global__ void __launch_bounds__(4 * block_conv_tile::THREADS)
block_conv_pair(const BlockConvPairArgs p) {
    using namespace block_conv_tile;
    constexpr int V = PER_COPY<T>;
    constexpr int K_WORDS = BN / PER_WORD<T>;  // words of a row of the 1x1's operands
    // The 1x1's tile: its whole reduction one stage, A (z) and B (a group's weights) apart.
    using Second = mma_tile<BM, BN2, K_WORDS, 2, 1>;
    constexpr int PITCH2 = Second::PITCH;
    constexpr int COPIES = K_WORDS / 4;  // copies a weight row
    constexpr int NT = BN / 16;
    extern __shared__ __align__(16) unsigned block_conv_smem[];
    const BlockConvArgs& a = p.conv;
    // The 1x1 as block_conv's arguments, for its epilogue: added into dst2, nothing else.
    BlockConvArgs second = a;
    second.dst = p.dst2;
    second.bias = nullptr;
    second.cout = p.cout2;
    second.out = p.out2;
    second.relu_out = second.zero_outside = 0;
    second.paired = p.paired2;
    const T* __restrict__ weight2 = static_cast<const T*>(p.weight2);
    unsigned* const z = block_conv_smem;  // [BM][PITCH2]: the 3x3's tile, the 1x1's A
    const int n2_tiles = (p.cout2 + BN2 - 1) / BN2;

    stream_tiles<T, BN, V>(a, [&](const tile_place& at, const float (&acc)[2][NT][4],
                                  const fragment_place& th) {
        __syncthreads();  // group 0's sums are read: z may take their place
        if (th.group == 0) {  // bias and ReLU, then the tile into z as the 1x1's A operand
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int co = shape<BN>::acc_col(th, nt);
                float bias[2];
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    bias[e] = a.bias != nullptr && co + e < a.cout ? a.bias[co + e] : 0.f;
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int half = 0; half < 2; ++half) {
                        vec_t<T, 2> v;
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float x = acc[mt][nt][2 * half + e] + bias[e];
                            if (a.relu_out) x = fmaxf(x, 0.f);
                            v.v[e] = from_acc<T>(x);
                        }
                        const int row = shape<BN>::acc_row(th, mt, half);
                        store_tile<T, 2>(z + row * PITCH2, co, v);
                    }
            }
        }
        __syncthreads();  // z is whole
        const side_origin out2 = side_of(second.out, at.m, a.indices + 3 * (i64)at.m);
        unsigned* const w = z + BM * PITCH2 + th.group * BN2 * PITCH2;  // this group's weights
        const unsigned copy_base = shared_address(w);
        const mma_mainloop<T, Second, false> second_mma(th, z);
        for (int n2 = th.group; n2 < n2_tiles; n2 += a.k_groups) {
            // The 1x1's one stage, copied and waited for (a group has a tile or two: nothing to
            // overlap): weight rows n2 * BN2 ..., K columns, zeros past cout2 and conv.cout.
            for (int c = th.tid; c < BN2 * COPIES; c += THREADS) {
                const int r = c / COPIES, column = c % COPIES;
                const int co = n2 * BN2 + r, k = column * V;
                const bool valid = co < p.cout2 && k < a.cout;
                copy_async16(copy_base + (r * PITCH2 + column * 4) * 4,
                             valid ? weight2 + (i64)co * a.cout + k : weight2, valid);
            }
            copy_async_commit();
            copy_async_wait<0>();
            group_sync(th.group);
            float acc2[Second::MT][Second::NT][4] = {};
            second_mma.multiply(acc2, z, w);
            write_tile<T, BN2, Add>(second, acc2, at.p0, n2 * BN2, at.in, out2, th);
            group_sync(th.group);  // the group's slot takes its next tile's weights
        }
    });
}
