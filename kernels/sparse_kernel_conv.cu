// sparse_kernel_conv: 2-D convolution (NHWC input, HWIO weights) with a pruned weight, reading
// only its non-zero taps (sbnet_cupy/sparse_kernel_conv.py builds the tap lists).
//
// Every kernel stages a tile of the input (with its halo) in shared memory, converted to the
// accumulation type, channel by channel and column-major: tile[(c * tile_cols + col) * pitch + row],
// so that a thread's run of output rows reads consecutive words. The staged input is X~, the
// input with idil - 1 zeros between pixels (idil = 1 for a plain convolution; the stride of the
// convolution for the gradient with respect to its input) and zeros outside. The thread layout
// is the same everywhere: lane = output column (32 consecutive columns a warp), each thread P
// output rows at a stride of str_h, warps_y warps stacked vertically, warps_q warps side by side
// on different output channels of the same tile.

// The forward kernels' arguments.
struct ConvArgs {
    const void* x;        // [n, in_h, in_w, cin] of T
    void* out;            // [n, out_h, out_w, cout] of T
    const void* bias;     // [cout] of T, or null
    const int* ranges;    // window: columns of (group, ci), [groups * cin + 1];
                          // direct: taps of (co, ci), [cout * cin + 1]
    const int4* columns;  // window: {ci, kw, row0, first tap} per column and one past the end
    const int* taps;      // window: q * R + r; direct: ci << 16 | kh << 8 | kw
    const void* values;   // [taps] of T, in the order of `taps`
    int n, in_h, in_w, cin, out_h, out_w, cout;
    int str_h, str_w, dil_h, dil_w, pad_h, pad_w, idil_h, idil_w;
    int tile_rows, tile_cols, pitch, chunk;  // the staged tile; channels staged at a time
    int warps_y, warps_q, groups, store_rows;  // groups: of Q output channels; rows a store pass
};
static_assert(sizeof(ConvArgs) == 152, "ConvArgs layout changed: update sparse_kernel_conv.py");

// The arguments of the gradient with respect to the non-zero weights.
struct GradValuesArgs {
    const void* x;       // [n, in_h, in_w, cin] of T
    const void* dy;      // [n, out_h, out_w, cout] of T
    const int* ranges;   // taps of (co, ci), [cout * cin + 1]
    const int* taps;     // ci << 16 | kh << 8 | kw
    void* grad;          // [taps] of the accumulation type, added to with atomics
    int n, in_h, in_w, cin, out_h, out_w, cout;
    int str_h, str_w, dil_h, dil_w, pad_h, pad_w;
    int tile_rows, tile_cols, pitch, chunk, co_chunk;
};
static_assert(sizeof(GradValuesArgs) == 112, "GradValuesArgs layout changed: update sparse_kernel_conv.py");

static __device__ __forceinline__ float fma_acc(float a, float b, float c) { return __fmaf_rn(a, b, c); }
static __device__ __forceinline__ double fma_acc(double a, double b, double c) { return __fma_rn(a, b, c); }

// Stages channels [ci0, ci0 + nci) of X~ from the virtual pixel (y0, x0) on (see the top).
// Consecutive threads read consecutive channels, then pixels: coalesced when nci == cin.
template <typename T>
static __device__ __forceinline__ void stage_tile(
    typename acc_type<T>::type* tile, const T* __restrict__ x, int n, int in_h, int in_w, int cin,
    int idil_h, int idil_w, int y0, int x0, int ci0, int nci, int tile_rows, int tile_cols,
    int pitch) {
    typedef typename acc_type<T>::type Acc;
    const int row_elems = tile_cols * nci;
    for (int e = threadIdx.x; e < tile_rows * row_elems; e += blockDim.x) {
        const int row = e / row_elems, j = e - row * row_elems;
        const int col = j / nci, c = j - col * nci;
        const int yv = y0 + row, xv = x0 + col;
        Acc v = Acc(0);
        if (yv >= 0 && xv >= 0 && yv % idil_h == 0 && xv % idil_w == 0) {
            const int yy = yv / idil_h, xx = xv / idil_w;
            if (yy < in_h && xx < in_w) v = to_acc(x[(((i64)n * in_h + yy) * in_w + xx) * cin + ci0 + c]);
        }
        tile[(c * tile_cols + col) * pitch + row] = v;
    }
}

// Writes the CTA's [warps_y * P rows, 32 columns, warps_q * Q channels] outputs (plus the bias)
// through shared memory, store_rows rows a pass, so that each pixel's run of channels is written
// by consecutive threads.
template <typename T, int P, int Q>
static __device__ __forceinline__ void store_output(
    typename acc_type<T>::type (&acc)[Q][P], const ConvArgs& a, typename acc_type<T>::type* stage,
    int n, int oy0, int ox0, int co0, int wy, int wq, int lane) {
    typedef typename acc_type<T>::type Acc;
    T* __restrict__ out = static_cast<T*>(a.out);
    const T* __restrict__ bias = static_cast<const T*>(a.bias);
    const int cta_co = a.warps_q * Q, co_pitch = cta_co | 1;  // odd: no bank conflicts
    const int rows = a.warps_y * P;
    for (int r0 = 0; r0 < rows; r0 += a.store_rows) {
        __syncthreads();  // the tile (or the previous pass) is no longer read
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int r = wy * P + p - r0;
            if (r >= 0 && r < a.store_rows) {
#pragma unroll
                for (int q = 0; q < Q; ++q) stage[(r * 32 + lane) * co_pitch + wq * Q + q] = acc[q][p];
            }
        }
        __syncthreads();
        const int count = min(a.store_rows, rows - r0) * 32 * cta_co;
        for (int e = threadIdx.x; e < count; e += blockDim.x) {
            const int pixel = e / cta_co, c = e - pixel * cta_co;
            const int oy = oy0 + r0 + pixel / 32, ox = ox0 + pixel % 32, co = co0 + c;
            if (oy < a.out_h && ox < a.out_w && co < a.cout) {
                Acc v = stage[pixel * co_pitch + c];
                if (bias != nullptr) v += to_acc(bias[co]);
                out[(((i64)n * a.out_h + oy) * a.out_w + ox) * a.cout + co] = from_acc<T>(v);
            }
        }
    }
}

// acc[p] += v * win[p + RR] for the thread's P output rows.
template <int P, int RR, typename Acc, int W>
static __device__ __forceinline__ void fma_rows(Acc (&acc)[P], const Acc (&win)[W], Acc v) {
#pragma unroll
    for (int p = 0; p < P; ++p) acc[p] = fma_acc(v, win[p + RR], acc[p]);
}

// One tap of the window kernel: code = q * R + r names the accumulator row (output channel q of
// the group) and the window offset r, both of which must be compile-time indices for acc and
// win to stay in registers; the switch (a uniform branch tree: the code is the same for the
// whole warp) turns the run-time code into them.
#define SKC_CASE(k)                                                                   \
    case (k):                                                                          \
        if constexpr ((k) < Q * R) fma_rows<P, (k) % R>(acc[(k) / R], win, v);        \
        break;
#define SKC_CASE8(k)                                                                   \
    SKC_CASE(k) SKC_CASE((k) + 1) SKC_CASE((k) + 2) SKC_CASE((k) + 3) SKC_CASE((k) + 4) \
    SKC_CASE((k) + 5) SKC_CASE((k) + 6) SKC_CASE((k) + 7)
#define SKC_CASE64(k)                                                                  \
    SKC_CASE8(k) SKC_CASE8((k) + 8) SKC_CASE8((k) + 16) SKC_CASE8((k) + 24)            \
    SKC_CASE8((k) + 32) SKC_CASE8((k) + 40) SKC_CASE8((k) + 48) SKC_CASE8((k) + 56)

template <int P, int Q, int R, typename Acc>
static __device__ __forceinline__ void fma_tap(Acc (&acc)[Q][P], const Acc (&win)[P + R], Acc v,
                                               int code) {
    static_assert(Q * R <= 128, "fma_tap has 128 cases");
    switch (code) {
        SKC_CASE64(0)
        SKC_CASE64(64)
    }
}
#undef SKC_CASE64
#undef SKC_CASE8
#undef SKC_CASE

// The window kernel (strategies "taps" and "patches"), for str_h == 1 and idil == 1. A warp
// computes P rows x 32 columns of output for a group of Q output channels. The group's taps are
// sorted by column: (ci, kw, band of R input rows); per column the thread loads the P + R input
// rows it can read (the window) into registers once, with 16-byte loads, and every tap of the
// column (any of the Q channels, any kh whose kh * dil_h falls in the band) is P FMAs from
// registers: a loaded word serves every tap of its column instead of one.
// Grid (ceil(out_w / 32), ceil(out_h / (warps_y * P)), n * ceil(groups / warps_q)); block
// 32 * warps_y * warps_q threads. P % 4 == 0, R % 4 == 0, pitch % 4 == 0.
template <typename T, int P, int Q, int R>
__global__ void sparse_kernel_conv_window(const ConvArgs a) {
    typedef typename acc_type<T>::type Acc;
    constexpr int V = 16 / sizeof(Acc);  // words of a 16-byte load
    static_assert(P % V == 0 && R % V == 0, "window loads are 16 bytes");
    extern __shared__ __align__(16) unsigned char smem[];
    Acc* tile = reinterpret_cast<Acc*>(smem);
    const T* __restrict__ x = static_cast<const T*>(a.x);
    const T* __restrict__ values = static_cast<const T*>(a.values);
    const int* __restrict__ ranges = a.ranges;
    const int4* __restrict__ columns = a.columns;
    const int* __restrict__ taps = a.taps;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wy = warp % a.warps_y, wq = warp / a.warps_y;
    const int group_blocks = (a.groups + a.warps_q - 1) / a.warps_q;
    const int n = blockIdx.z / group_blocks, g0 = (blockIdx.z - n * group_blocks) * a.warps_q;
    const int g = g0 + wq;
    const int oy0 = blockIdx.y * a.warps_y * P, ox0 = blockIdx.x * 32;
    const int lane_base = lane * a.str_w * a.pitch + wy * P;

    Acc acc[Q][P];
#pragma unroll
    for (int q = 0; q < Q; ++q)
#pragma unroll
        for (int p = 0; p < P; ++p) acc[q][p] = Acc(0);

    for (int ci0 = 0; ci0 < a.cin; ci0 += a.chunk) {
        const int nci = min(a.chunk, a.cin - ci0);
        if (ci0 > 0) __syncthreads();  // the previous chunk is no longer read
        stage_tile<T>(tile, x, n, a.in_h, a.in_w, a.cin, 1, 1, oy0 - a.pad_h,
                      ox0 * a.str_w - a.pad_w, ci0, nci, a.tile_rows, a.tile_cols, a.pitch);
        __syncthreads();
        if (g >= a.groups) continue;
        const int last = ranges[g * a.cin + ci0 + nci];
        int c = ranges[g * a.cin + ci0];
        int4 column = columns[c];  // the loads of the next column and tap go out early
        for (; c < last; ++c) {
            const int t_end = columns[c + 1].w;
            const Acc* src = tile + lane_base +
                             ((column.x - ci0) * a.tile_cols + column.y * a.dil_w) * a.pitch + column.z;
            int t = column.w, code = taps[t];
            Acc v = to_acc(values[t]);
            column = columns[c + 1];
            Acc win[P + R];
#pragma unroll
            for (int i = 0; i < (P + R) / V; ++i) {
                const vec_t<Acc, V> w = *reinterpret_cast<const vec_t<Acc, V>*>(src + i * V);
#pragma unroll
                for (int e = 0; e < V; ++e) win[i * V + e] = w.v[e];
            }
            for (++t; t < t_end; ++t) {
                const int next_code = taps[t];
                const Acc next_v = to_acc(values[t]);
                fma_tap<P, Q, R>(acc, win, v, code);
                code = next_code;
                v = next_v;
            }
            fma_tap<P, Q, R>(acc, win, v, code);
        }
    }
    store_output<T, P, Q>(acc, a, tile, n, oy0, ox0, g0 * Q, wy, wq, lane);
}

// The direct kernel (strategy "direct"): any stride, dilation and input dilation. A thread
// computes P output rows for each of the Q output channels of its group, one tap at a time: P
// shared-memory loads and P FMAs a tap. Taps of (co, ci) are in canonical order, so a chunk of
// channels is one run of each output channel's taps. Grid and block as for the window kernel.
template <typename T, int P, int Q>
__global__ void sparse_kernel_conv_direct(const ConvArgs a) {
    typedef typename acc_type<T>::type Acc;
    extern __shared__ __align__(16) unsigned char smem[];
    Acc* tile = reinterpret_cast<Acc*>(smem);
    const T* __restrict__ x = static_cast<const T*>(a.x);
    const T* __restrict__ values = static_cast<const T*>(a.values);
    const int* __restrict__ ranges = a.ranges;
    const int* __restrict__ taps = a.taps;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wy = warp % a.warps_y, wq = warp / a.warps_y;
    const int group_blocks = (a.groups + a.warps_q - 1) / a.warps_q;
    const int n = blockIdx.z / group_blocks, g0 = (blockIdx.z - n * group_blocks) * a.warps_q;
    const int g = g0 + wq;
    const int oy0 = blockIdx.y * a.warps_y * P, ox0 = blockIdx.x * 32;
    const int lane_base = lane * a.str_w * a.pitch + wy * P * a.str_h;

    Acc acc[Q][P];
#pragma unroll
    for (int q = 0; q < Q; ++q)
#pragma unroll
        for (int p = 0; p < P; ++p) acc[q][p] = Acc(0);

    for (int ci0 = 0; ci0 < a.cin; ci0 += a.chunk) {
        const int nci = min(a.chunk, a.cin - ci0);
        if (ci0 > 0) __syncthreads();
        stage_tile<T>(tile, x, n, a.in_h, a.in_w, a.cin, a.idil_h, a.idil_w,
                      oy0 * a.str_h - a.pad_h, ox0 * a.str_w - a.pad_w, ci0, nci, a.tile_rows,
                      a.tile_cols, a.pitch);
        __syncthreads();
        if (g >= a.groups) continue;
#pragma unroll
        for (int q = 0; q < Q; ++q) {
            const int co = g * Q + q;
            if (co >= a.cout) break;
            const int last = ranges[co * a.cin + ci0 + nci];
            for (int t = ranges[co * a.cin + ci0]; t < last; ++t) {
                const int tap = taps[t];
                const Acc v = to_acc(values[t]);
                const Acc* src = tile + lane_base +
                                 (((tap >> 16) - ci0) * a.tile_cols + (tap & 255) * a.dil_w) * a.pitch +
                                 ((tap >> 8) & 255) * a.dil_h;
#pragma unroll
                for (int p = 0; p < P; ++p) acc[q][p] = fma_acc(v, src[p * a.str_h], acc[q][p]);
            }
        }
    }
    store_output<T, P, Q>(acc, a, tile, n, oy0, ox0, g0 * Q, wy, wq, lane);
}

template <typename Acc> static __device__ __forceinline__ Acc warp_sum(Acc s) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
    return s;
}

// Gradient with respect to the non-zero weights: grad[t] += sum over the CTA's output pixels of
// dy[pixel, co_t] * X[pixel * stride + (kh_t, kw_t) * dilation - pad, ci_t]. A CTA takes P rows
// x 32 columns of output and co_chunk output channels: it stages their dy (as [channel][pixel])
// and the input tile; a warp takes an output channel, holds its dy in registers and, for each
// of its taps, multiplies them by the input words the tap reads, sums the warp and adds the sum
// to grad[t] with one atomic. The order of the additions (and so float rounding) varies from run
// to run. Grid (ceil(out_w / 32), ceil(out_h / P), n * ceil(cout / co_chunk)).
template <typename T, int P>
__global__ void sparse_kernel_conv_grad_values(const GradValuesArgs a) {
    typedef typename acc_type<T>::type Acc;
    extern __shared__ __align__(16) unsigned char smem[];
    Acc* tile = reinterpret_cast<Acc*>(smem);
    Acc* dys = tile + a.chunk * a.tile_cols * a.pitch;  // [co_chunk][P * 32]
    const T* __restrict__ x = static_cast<const T*>(a.x);
    const T* __restrict__ dy = static_cast<const T*>(a.dy);
    const int* __restrict__ ranges = a.ranges;
    const int* __restrict__ taps = a.taps;
    Acc* grad = static_cast<Acc*>(a.grad);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int co_blocks = (a.cout + a.co_chunk - 1) / a.co_chunk;
    const int n = blockIdx.z / co_blocks, co0 = (blockIdx.z - n * co_blocks) * a.co_chunk;
    const int nco = min(a.co_chunk, a.cout - co0);
    const int oy0 = blockIdx.y * P, ox0 = blockIdx.x * 32;

    for (int e = threadIdx.x; e < P * 32 * nco; e += blockDim.x) {
        const int pixel = e / nco, c = e - pixel * nco;
        const int oy = oy0 + pixel / 32, ox = ox0 + pixel % 32;
        Acc v = Acc(0);
        if (oy < a.out_h && ox < a.out_w) v = to_acc(dy[(((i64)n * a.out_h + oy) * a.out_w + ox) * a.cout + co0 + c]);
        dys[c * P * 32 + pixel] = v;
    }
    const int lane_base = lane * a.str_w * a.pitch;
    for (int ci0 = 0; ci0 < a.cin; ci0 += a.chunk) {
        const int nci = min(a.chunk, a.cin - ci0);
        if (ci0 > 0) __syncthreads();
        stage_tile<T>(tile, x, n, a.in_h, a.in_w, a.cin, 1, 1, oy0 * a.str_h - a.pad_h,
                      ox0 * a.str_w - a.pad_w, ci0, nci, a.tile_rows, a.tile_cols, a.pitch);
        __syncthreads();
        for (int c = warp; c < nco; c += warps) {
            const int co = co0 + c;
            Acc d[P];
#pragma unroll
            for (int p = 0; p < P; ++p) d[p] = dys[c * P * 32 + p * 32 + lane];
            const int last = ranges[co * a.cin + ci0 + nci];
            for (int t = ranges[co * a.cin + ci0]; t < last; ++t) {
                const int tap = taps[t];
                const Acc* src = tile + lane_base +
                                 (((tap >> 16) - ci0) * a.tile_cols + (tap & 255) * a.dil_w) * a.pitch +
                                 ((tap >> 8) & 255) * a.dil_h;
                Acc s = Acc(0);
#pragma unroll
                for (int p = 0; p < P; ++p) s = fma_acc(d[p], src[p * a.str_h], s);
                s = warp_sum(s);
                if (lane == 0) atomicAdd(grad + t, s);
            }
        }
    }
}
