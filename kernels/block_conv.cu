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
    // A group's step from one of its stages to the next, k_groups stages of the reduction, as
    // taps (step_taps_y rows and step_taps_x columns of the kernel) and channels.
    int step_taps_y, step_taps_x, step_channels;
};
static_assert(sizeof(BlockConvArgs) == 184, "BlockConvArgs must match sbnet_cupy/block_conv.py");

namespace block_conv_tile {
constexpr int THREADS = 128;  // a warp group: 4 warps as 2 x 2, each 32 pixels x BN / 2 channels
constexpr int BM = 64;        // output pixels of one block per tile
constexpr int WORDS = 32;     // 32-bit words of the reduction per pipeline stage
constexpr int PITCH = WORDS + 4;  // padded rows: fragment loads hit 32 different banks
constexpr int SLOTS = 3;      // shared-memory stages of a warp group: loads in flight
}  // namespace block_conv_tile

// Whether Op (common.cuh) adds into the destination, which the epilogue then reads first.
template <typename Op> struct reads_destination { static constexpr bool value = false; };
template <> struct reads_destination<Add> { static constexpr bool value = true; };

// Each warp group waits only for its own warps (barrier 0 is __syncthreads).
static __device__ __forceinline__ void group_sync(int group) {
    asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(block_conv_tile::THREADS) : "memory");
}

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

// Grid: a few CTAs an SM, each looping over the tiles (block, BM output pixels, BN output
// channels) of the first *count listed blocks, so rows past the count cost nothing. A CTA is
// k_groups warp groups of THREADS threads: group g reduces stages g, g + k_groups, ... of the
// tile into its own accumulators, which group 0 sums before the epilogue, so that few tiles with
// a long reduction (deep layers, few blocks) still keep many loads in flight. A group's stages
// stream through SLOTS shared-memory slots with cp.async (16-byte vectors, no prologue: SLOTS - 1
// stages in flight), or through registers into two slots (the prologue's affine and ReLU, or
// narrower vectors: one stage in flight). TF32 MMAs read the float32 bits as they are (the
// tensor cores ignore the low mantissa bits) on the cp.async path and rounded ones on the other.
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
    static_assert(THREADS % VECTORS == 0 && BM % ROWS_PER_PASS == 0 && BN % ROWS_PER_PASS == 0,
                  "tile shape");
    static_assert(A_PASSES <= 32, "the load mask is one word");
    constexpr int SLOT_WORDS = (BM + BN) * PITCH;
    constexpr int GROUP_WORDS = block_conv_tile::SLOTS * SLOT_WORDS;
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
    T* __restrict__ dst = static_cast<T*>(a.dst);
    const int pixels = a.out_h * a.out_w;
    const int n_tiles = (a.cout + BN - 1) / BN;
    const int per_block = (pixels + BM - 1) / BM * n_tiles;
    const int ktotal = a.kh * a.kw * a.cin;
    const int stages = (ktotal + BK - 1) / BK;
    // Launched as a dependent (launch_block_conv): the block list, src and dst may all be the
    // previous kernel's.
    wait_for_previous_kernel();
    allow_next_kernel();
    const int tiles = min(max(*a.count, 0), a.rows) * per_block;  // < 2**31: checked at launch
    const int group = threadIdx.x / THREADS, tid = threadIdx.x % THREADS;
    const int lane = tid & 31, warp = tid >> 5;
    const int wm = warp & 1, wn = warp >> 1, g = lane >> 2, t = lane & 3;
    const int vec = tid % VECTORS, row0 = tid / VECTORS;
    // Slot i of this group: the A tile [BM][PITCH], then the B tile [BN][PITCH].
    unsigned* const slots = block_conv_smem + group * GROUP_WORDS;
    // Each lane's row of the ldmatrix loads (load_matrices): A rows wm * 32 + lane % 16, words
    // lane / 16 * 4 (fragment registers a0..a3); B rows wn * BN / 2 + lane % 8 (+ 8 for the
    // second n-tile of a pair), words lane / 8 % 2 * 4 (b0, b1).
    const int a_lane = (wm * 32 + (lane & 15)) * PITCH + (lane >> 4) * 4;
    const int b_lane = (wn * (BN / 2) + (lane & 7) + (lane >> 4) * 8) * PITCH + (lane >> 3 & 1) * 4;
    // Where this thread's cp.async copies land in slot 0 (a shared-memory address).
    const unsigned copy_to = shared_address(slots + row0 * PITCH + vec * V / PER_WORD);
    const reduction_cursor first(group * BK + vec * V, a.cin, a.kw);
    const int step = a.k_groups * BK;

    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int m = tile / per_block, rest = tile % per_block;
        const int p0 = rest / n_tiles * BM, n0 = rest % n_tiles * BN;
        const int* row = a.indices + 3 * (i64)m;
        if (row[0] < 0 || row[0] >= a.n_batch) continue;  // reads zeros, writes nothing
        const side_origin in = side_of(a.in, m, row), out = side_of(a.out, m, row);

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
        // The MMAs of one stage, from slot `buffer`: fragments through ldmatrix (load_matrices).
        auto multiply = [&](int buffer) {
            const unsigned* ta = slots + buffer * SLOT_WORDS + a_lane;
            const unsigned* tb = slots + buffer * SLOT_WORDS + BM * PITCH + b_lane;
#pragma unroll
            for (int ks = 0; ks < WORDS / 8; ++ks) {
                unsigned af[2][4], bf[NT][2];
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) load_matrices(af[mt], ta + mt * 16 * PITCH + ks * 8);
#pragma unroll
                for (int nt = 0; nt + 1 < NT; nt += 2) {
                    unsigned pair[4];
                    load_matrices(pair, tb + nt * 8 * PITCH + ks * 8);
                    bf[nt][0] = pair[0];
                    bf[nt][1] = pair[1];
                    bf[nt + 1][0] = pair[2];
                    bf[nt + 1][1] = pair[3];
                }
                if constexpr (NT % 2 == 1)
                    load_matrices(bf[NT - 1], tb + (NT - 1) * 8 * PITCH + ks * 8);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
                        tensor_core_mma<T>::run(acc[mt][nt], af[mt], bf[nt]);
            }
        };

        // This group's stages: group, group + k_groups, ...
        const int mine = stages > group ? (stages - group + a.k_groups - 1) / a.k_groups : 0;
        if (ASYNC && a.scale == nullptr) {
            constexpr int AHEAD = block_conv_tile::SLOTS - 1;
#pragma unroll
            for (int i = 0; i < AHEAD; ++i) {
                if (i < mine) copy(i);
                copy_async_commit();  // empty groups too: the wait below counts groups
            }
            // Stage i sits in slot i % SLOTS; the copy of stage i + AHEAD takes slot
            // (i - 1) % SLOTS, which stage i - 1 left.
            for (int i = 0, slot = 0; i < mine; ++i, slot = slot == AHEAD ? 0 : slot + 1) {
                copy_async_wait<AHEAD - 1>();  // this thread's copies of stage i have landed
                group_sync(group);             // everyone's, and slot (i - 1) is free again
                if (i + AHEAD < mine) copy(slot == 0 ? AHEAD : slot - 1);
                copy_async_commit();
                multiply(slot);
            }
            copy_async_wait<0>();
        } else {
            if (mine > 0) load();
            for (int i = 0; i < mine; ++i) {
                store(i & 1);
                group_sync(group);
                if (i + 1 < mine) load();  // in flight during the MMAs
                multiply(i & 1);
            }
        }
        __syncthreads();  // every group is done with its tiles: they hold the partial sums now
        if (a.k_groups > 1) {
            float* partial = reinterpret_cast<float*>(block_conv_smem);
            float* flat = &acc[0][0][0];
            if (group > 0) {
#pragma unroll
                for (int i = 0; i < ACC; ++i)
                    partial[(group - 1) * GROUP_WORDS + i * THREADS + tid] = flat[i];
            }
            __syncthreads();
            if (group == 0) {
                for (int other = 1; other < a.k_groups; ++other) {
#pragma unroll
                    for (int i = 0; i < ACC; ++i)
                        flat[i] += partial[(other - 1) * GROUP_WORDS + i * THREADS + tid];
                }
            }
        }
        if (group == 0) {
            // Epilogue: accumulator (mt, nt, 2 * half + e) is pixel p0 + wm * 32 + mt * 16 + g +
            // 8 * half, channel n0 + wn * BN / 2 + nt * 8 + 2 * t + e. The global reads (the
            // bias; the old outputs where Op adds, 2 * NT pixel pairs at a time) are issued before
            // the writes, which the compiler may not move reads past: one round trip each, not
            // one for each write.
            float bias[NT][2];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int co = n0 + wn * (BN / 2) + nt * 8 + 2 * t;
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
                    const int p = p0 + wm * 32 + mt * 16 + g + 8 * half;
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
                            const int co = n0 + wn * (BN / 2) + nt * 8 + 2 * t;
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
                        const int co = n0 + wn * (BN / 2) + nt * 8 + 2 * t;
                        if (co >= a.cout) continue;
                        float v[2];
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            v[e] = acc[mt][nt][2 * half + e] + bias[nt][e];
                            if (a.relu_out) v[e] = fmaxf(v[e], 0.f);
                            if (zero[half]) v[e] = 0.f;
                            v[e] += to_acc(old[half][nt].v[e]);
                        }
                        T* at = pixel[half] + co;
                        if (a.paired) {
                            *reinterpret_cast<vec_t<T, 2>*>(at) = {{from_acc<T>(v[0]), from_acc<T>(v[1])}};
                        } else {
                            at[0] = from_acc<T>(v[0]);
                            if (co + 1 < a.cout) at[1] = from_acc<T>(v[1]);
                        }
                    }
                }
            }
        }
        __syncthreads();  // the next tile's loads reuse the shared memory
    }
}
