// sparse_kernel_conv: 2-D convolution (NHWC input, HWIO weights) with a pruned weight, reading
// only its non-zero taps (sbnet_cupy/pruned/weight.py builds the tap lists, program.py
// the Program of the compiled kernel).
//
// Every kernel stages a tile of the input (with its halo) in shared memory, converted to the
// accumulation type, channel by channel and column-major: tile[(c * tile_cols + col) * pitch + row],
// so that a thread's run of output rows reads consecutive words. The staged input is X~, the
// input with idil - 1 zeros between pixels (idil = 1 for a plain convolution; the stride of the
// convolution for the gradient with respect to its input) and zeros outside. The thread layout
// is the same everywhere: lane = output column (32 consecutive columns a warp), each thread P
// output rows at a stride of str_h, warps_y warps stacked vertically, warps_q warps side by side
// on different output channels of the same tile.

// The forward kernels take ConvArgs, the gradient with respect to the non-zero weights
// GradValuesArgs: both declared in sbnet_cupy/core/records.py.

static __device__ __forceinline__ float fma_acc(float a, float b, float c) { return __fmaf_rn(a, b, c); }
static __device__ __forceinline__ double fma_acc(double a, double b, double c) { return __fma_rn(a, b, c); }

// Stages channels [ci0, ci0 + nci) of X~ from the virtual pixel (y0, x0) on (see the top).
// Consecutive threads read consecutive channels, then pixels: coalesced when nci == cin. A
// thread steps through its words (row, col, c) by adding blockDim.x with carries: a division
// per word cost more than the products of a small kernel. It loads LOADS words before it stores
// any, so that their latencies overlap (one at a time, a load's wait was a large share of the
// profiler's stall samples on small kernels; the compiled kernel's first chunk takes 8).
template <typename T, int LOADS = 4>
static __device__ __forceinline__ void stage_tile(
    typename acc_type<T>::type* tile, const T* __restrict__ x, int n, int in_h, int in_w, int cin,
    int idil_h, int idil_w, int y0, int x0, int ci0, int nci, int tile_rows, int tile_cols,
    int pitch) {
    const int row_elems = tile_cols * nci;
    const int step_rows = blockDim.x / row_elems, step_j = blockDim.x - step_rows * row_elems;
    const int step_cols = step_j / nci, step_c = step_j - step_cols * nci;
    int row = threadIdx.x / row_elems, col = threadIdx.x - row * row_elems;
    int c = col % nci;
    col /= nci;
    const bool dilated = idil_h != 1 || idil_w != 1;
    const T* __restrict__ image = x + (i64)n * in_h * in_w * cin + ci0;
    while (row < tile_rows) {
        T word[LOADS];
        int at[LOADS];  // -1: past the tile
#pragma unroll
        for (int s = 0; s < LOADS; ++s) {
            int yy = y0 + row, xx = x0 + col;
            bool inside = row < tile_rows && yy >= 0 && xx >= 0;
            if (dilated) {
                inside = inside && yy % idil_h == 0 && xx % idil_w == 0;
                yy /= idil_h;
                xx /= idil_w;
            }
            word[s] = T{};  // zero bits: 0 in every type
            if (inside && yy < in_h && xx < in_w) word[s] = image[((i64)yy * in_w + xx) * cin + c];
            at[s] = row < tile_rows ? (c * tile_cols + col) * pitch + row : -1;
            row += step_rows;
            c += step_c;
            col += step_cols;
            if (c >= nci) c -= nci, ++col;
            if (col >= tile_cols) col -= tile_cols, ++row;
        }
#pragma unroll
        for (int s = 0; s < LOADS; ++s)
            if (at[s] >= 0) tile[at[s]] = to_acc(word[s]);
    }
}

// Whether Q output channels from co0 go out in stores of V channels: Cout a multiple of V, the
// group whole, `out` aligned to the vector.
template <typename T, int V, int Q>
static __device__ __forceinline__ bool vector_stores_fit(const ConvArgs& a, int co0) {
    return a.cout % V == 0 && co0 + Q <= a.cout &&
           reinterpret_cast<unsigned long long>(a.out) % (V * sizeof(T)) == 0;
}

// Writes the thread's outputs (plus the bias): P rows from (oy, ox) down, Q channels from co0
// on, each pixel's channels in 16-byte stores where cout allows. (A CTA-wide pass through shared
// memory with run-time divisions cost more a word than the products of a small kernel; the
// compiled kernel's wider groups go out through store_output_staged, its indices fixed at
// compile time.)
template <typename T, int P, int Q>
static __device__ __forceinline__ void store_output(
    const typename acc_type<T>::type (&acc)[Q][P], const ConvArgs& a, int n, int oy, int ox,
    int co0) {
    typedef typename acc_type<T>::type Acc;
    constexpr int V = 16 / sizeof(T) < Q ? 16 / sizeof(T) : Q;
    static_assert(Q % V == 0, "Q: a power of two");
    if (ox >= a.out_w || co0 >= a.cout) return;
    T* __restrict__ out = static_cast<T*>(a.out);
    const T* __restrict__ bias = static_cast<const T*>(a.bias);
    Acc b[Q];
#pragma unroll
    for (int q = 0; q < Q; ++q) b[q] = bias != nullptr && co0 + q < a.cout ? to_acc(bias[co0 + q]) : Acc(0);
    const bool vectors = vector_stores_fit<T, V, Q>(a, co0);
#pragma unroll
    for (int p = 0; p < P; ++p) {
        if (oy + p >= a.out_h) break;
        T* dst = out + (((i64)n * a.out_h + oy + p) * a.out_w + ox) * a.cout + co0;
        if (vectors) {
#pragma unroll
            for (int q0 = 0; q0 < Q; q0 += V) {
                vec_t<T, V> v;
#pragma unroll
                for (int i = 0; i < V; ++i) v.v[i] = from_acc<T>(acc[q0 + i][p] + b[q0 + i]);
                *reinterpret_cast<vec_t<T, V>*>(dst + q0) = v;
            }
        } else {
#pragma unroll
            for (int q = 0; q < Q; ++q)
                if (co0 + q < a.cout) dst[q] = from_acc<T>(acc[q][p] + b[q]);
        }
    }
}

// A split's float sums (no bias): P rows from (oy, ox) down, group g's Q channels in one run of
// the partial sums' padded pixel (16-byte stores).
template <int P, int Q, typename Acc>
static __device__ __forceinline__ void store_partial(const Acc (&acc)[Q][P], const ConvArgs& a,
                                                     int split, int n, int oy, int ox, int g) {
    if (ox >= a.out_w || g >= a.groups) return;
    const i64 image = (i64)split * a.n + n;
#pragma unroll
    for (int p = 0; p < P; ++p) {
        if (oy + p >= a.out_h) break;
        vec_t<float, Q> v;
#pragma unroll
        for (int q = 0; q < Q; ++q) v.v[q] = (float)acc[q][p];
        reinterpret_cast<vec_t<float, Q>*>(a.partial)[((image * a.out_h + oy + p) * a.out_w + ox) * a.groups + g] = v;
    }
}

// store_output for the compiled kernel, whose groups hold C = 2 or 4 16-byte chunks of a pixel:
// a thread's own stores hit 32 lines an instruction, a half-written sector each, and backed up
// in the store path at the end of every CTA. Here a warp puts a row of its 32 pixels in shared
// memory (`smem`, 32 * Q words of T a warp, free: the caller synchronised after the last read of
// its tile), and each store instruction then writes 32 / C pixels whole (C lanes a pixel). A
// pixel's chunks are rotated by its place in the 128-byte line (slot) so that the 8 lanes of a
// 16-byte store phase hit distinct banks. Falls back to store_output where 16-byte stores do
// not fit (Cout, the last group, `out`'s alignment).
template <typename T, int P, int Q>
static __device__ __forceinline__ void store_output_staged(
    const float (&acc)[Q][P], const ConvArgs& a, int n, int oy, int ox0, int co0, void* smem) {
    constexpr int V = 16 / sizeof(T), C = Q / V;
    static_assert(C == 2 || C == 4, "store_output_staged: 2 or 4 chunks a pixel");
    const int lane = threadIdx.x & 31;
    T* __restrict__ out = static_cast<T*>(a.out);
    if (co0 >= a.cout) return;
    if (!vector_stores_fit<T, V, Q>(a, co0)) {
        store_output<T, P, Q>(acc, a, n, oy, ox0 + lane, co0);
        return;
    }
    const T* __restrict__ bias = static_cast<const T*>(a.bias);
    float b[Q];
#pragma unroll
    for (int q = 0; q < Q; ++q) b[q] = bias != nullptr ? to_acc(bias[co0 + q]) : 0.0f;
    vec_t<T, V>* chunks = static_cast<vec_t<T, V>*>(smem) + (threadIdx.x >> 5) * 32 * C;
    const auto slot = [](int pixel, int c) { return pixel * C + (c ^ (pixel / (8 / C) % C)); };
#pragma unroll
    for (int p = 0; p < P; ++p) {
        if (oy + p >= a.out_h) break;  // the same for the whole warp
        __syncwarp();
#pragma unroll
        for (int c = 0; c < C; ++c) {
            vec_t<T, V> v;
#pragma unroll
            for (int i = 0; i < V; ++i) v.v[i] = from_acc<T>(acc[c * V + i][p] + b[c * V + i]);
            chunks[slot(lane, c)] = v;
        }
        __syncwarp();
        T* dst = out + (((i64)n * a.out_h + oy + p) * a.out_w + ox0) * a.cout + co0;
#pragma unroll
        for (int i = 0; i < C; ++i) {
            const int pixel = i * (32 / C) + lane / C, c = lane % C;
            if (ox0 + pixel < a.out_w)
                *reinterpret_cast<vec_t<T, V>*>(dst + (i64)pixel * a.cout + c * V) = chunks[slot(pixel, c)];
        }
    }
}

// The direct kernel (strategy "direct"): any stride, dilation and input dilation. A thread
// computes P output rows for each of the Q output channels of its group, one tap at a time: P
// shared-memory loads and P FMAs a tap. Taps of (co, ci) are in canonical order, so a chunk of
// channels is one run of each output channel's taps. Grid (ceil(out_w / 32), ceil(out_h /
// (warps_y * P)), splits * n * ceil(groups / warps_q)); block 32 * warps_y * warps_q threads.
// Where the tiles are fewer than the GPU's SMs, the input channels are split over blockIdx.z
// (split_cin each): every split writes its float sums to partial, and
// split_sum (common.cuh) adds them up in split order (deterministic, no atomics).
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
    const int images = a.n * group_blocks, split = blockIdx.z / images;
    const int z = blockIdx.z - split * images;
    const int n = z / group_blocks, g0 = (z - n * group_blocks) * a.warps_q;
    const int ci_begin = split * a.split_cin, ci_end = min(a.cin, ci_begin + a.split_cin);
    const int g = g0 + wq;
    const int oy0 = blockIdx.y * a.warps_y * P, ox0 = blockIdx.x * 32;
    const int lane_base = lane * a.str_w * a.pitch + wy * P * a.str_h;

    Acc acc[Q][P];
#pragma unroll
    for (int q = 0; q < Q; ++q)
#pragma unroll
        for (int p = 0; p < P; ++p) acc[q][p] = Acc(0);

    for (int ci0 = ci_begin; ci0 < ci_end; ci0 += a.chunk) {
        const int nci = min(a.chunk, ci_end - ci0);
        if (ci0 > ci_begin) __syncthreads();
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
    if (a.partial != nullptr)
        store_partial<P, Q>(acc, a, split, n, oy0 + wy * P, ox0 + lane, g);
    else
        store_output<T, P, Q>(acc, a, n, oy0 + wy * P, ox0 + lane, g * Q);
}

// The compiled kernel (strategy "compiled"), for str_h == 1 and idil == 1: one weight's mask
// compiled in. A warp computes P rows x 32 columns of output for a group of Q output channels.
// sbnet_cupy/pruned/program.py generates a Program for the mask: per group, straight-line
// code over its columns (ci, kw): the thread loads the input rows of the column that its taps
// read (its window) into registers once, with 16-byte loads at immediate offsets, and every
// tap of the column, whatever its kh, is then P FMAs from registers, the tap's accumulators and
// window words named at compile time: no per-tap dispatch, index array or address arithmetic.
// The values (which train) stay in memory in the program's order: a CTA stages its group's run
// of them into shared memory as Acc, and the program reads them with warp-uniform (broadcast)
// 16-byte loads. Program::run(frame, g, acc, s) computes acc for group g, s pointing at the
// thread's window row 0 in the tile's first column; it calls frame.begin (with the first chunk
// of input channels it reads) before its first column, and frame.chunk(ci0) before the first
// column of each later chunk that it reads (chunks without taps are not staged).
// Grid (groups * ceil(out_w / 32), ceil(out_h / (warps_y * P)), n), a tile's groups adjacent:
// the CTAs running at a time write every output channel of their pixels and read the same input
// (group-major, which shared their code, measured slower on batches and only slightly faster
// on some single images); block 32 * warps_y threads (warps_q = 1).
template <typename T>
struct CompiledFrame {
    typedef typename acc_type<T>::type Acc;
    const ConvArgs& a;
    Acc* tile;
    Acc* vals;
    int n, y0, x0;

    // Stages values [first, first + count) (zeros up to a multiple of 4: the program's loads
    // are 16 bytes) and the chunk of input channels from ci0 on.
    __device__ __forceinline__ void begin(int first, int count, int ci0) const {
        const T* __restrict__ values = static_cast<const T*>(a.values);
        for (int i = threadIdx.x; i < ((count + 3) & ~3); i += blockDim.x)
            vals[i] = i < count ? to_acc(values[first + i]) : Acc(0);
        stage<8>(ci0);
    }
    // Stages input channels [ci0, ci0 + chunk) after the previous chunk is no longer read (with
    // the accumulators live: 2 loads in flight, as 4 spilled).
    __device__ __forceinline__ void chunk(int ci0) const {
        __syncthreads();
        stage<2>(ci0);
    }
    template <int LOADS>
    __device__ __forceinline__ void stage(int ci0) const {
        stage_tile<T, LOADS>(tile, static_cast<const T*>(a.x), n, a.in_h, a.in_w, a.cin, 1, 1,
                             y0, x0, ci0, min(a.chunk, a.cin - ci0), a.tile_rows, a.tile_cols,
                             a.pitch);
        __syncthreads();
    }
};

// Four words of 16-byte aligned shared memory.
template <typename Acc>
static __device__ __forceinline__ vec_t<Acc, 4> ld4(const Acc* src) {
    return *reinterpret_cast<const vec_t<Acc, 4>*>(src);
}

template <typename T, class Program>
__global__ void __launch_bounds__(256, 2) sparse_kernel_conv_compiled(const ConvArgs a) {
    typedef typename acc_type<T>::type Acc;
    static_assert(sizeof(Acc) == 4, "the compiled kernel computes in float");
    constexpr int P = Program::P, Q = Program::Q;
    extern __shared__ __align__(16) unsigned char smem[];
    Acc* tile = reinterpret_cast<Acc*>(smem);
    const int lane = threadIdx.x & 31, wy = threadIdx.x >> 5;
    const int g = blockIdx.x % a.groups, n = blockIdx.z;
    const int oy0 = blockIdx.y * a.warps_y * P, ox0 = blockIdx.x / a.groups * 32;
    // The values follow the tile (a multiple of 4 words: pitch % 4 == 0).
    const CompiledFrame<T> frame{a, tile, tile + a.chunk * a.tile_cols * a.pitch, n,
                                 oy0 - a.pad_h, ox0 * a.str_w - a.pad_w};

    Acc acc[Q][P];  // Program::run sets them all
    Program::run(frame, g, acc, tile + lane * a.str_w * a.pitch + wy * P);
    if constexpr (Q * sizeof(T) >= 32) {
        __syncthreads();  // the tile's last reader is done: store_output_staged takes its room
        store_output_staged<T, P, Q>(acc, a, n, oy0 + wy * P, ox0, g * Q, smem);
    } else {
        store_output<T, P, Q>(acc, a, n, oy0 + wy * P, ox0 + lane, g * Q);
    }
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
