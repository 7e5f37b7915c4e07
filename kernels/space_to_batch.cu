// space_to_batch / batch_to_space: move the block_h x block_w sub-lattices of an image into the
// batch dimension and back, as TensorFlow's ops do. With x the image side and y the batch side:
//
//     y[(i * block_w + j) * n + b, hq, wq] =
//         x[b, hq * block_h + i - off_h, wq * block_w + j - off_w]
//
// (zero where x's index falls outside it). off_h, off_w are the top and left paddings of
// space_to_batch and the top and left crops of batch_to_space. Each kernel reads every element
// once and writes every element once, in one launch.

#define UNROLL 4
#define THREADS 256

// Division by a positive int known at launch, for dividends in [0, 2^31): the host picks
// mul = ceil(2^shift / d) with shift = 31 + ceil(log2(d)) (sbnet_cupy/space_to_batch.py, _divisor).
struct divisor {
    int d;
    unsigned mul, shift;
    __device__ __forceinline__ int div(int n) const {
        return (int)(((unsigned long long)(unsigned)n * mul) >> shift);
    }
};

// ---- NHWC ------------------------------------------------------------------------------------
// A pixel is `words` words of Word (1 to 16 bytes, the widest access that the pixel's bytes and
// the pointers' alignment allow). Consecutive threads take consecutive words of an output row,
// so writes are coalesced, and reads are runs of whole pixels.

struct nhwc_args {
    void* x;
    void* y;
    int n, height, width;            // x: [n, height, width, words]
    int out_h, out_w;                // y: [block_h * block_w * n, out_h, out_w, words]
    int block_h, off_h, off_w;
    divisor words, block_w;
};
static_assert(sizeof(nhwc_args) == 72, "nhwc_args: sbnet_cupy/space_to_batch.py, _NHWC_ARGS");

// Grid: ceil(rows of y / blockDim.y); threadIdx.y picks y's row (b', hq), threadIdx.x the word.
template <typename Word>
__global__ void space_to_batch_nhwc(const nhwc_args a) {
    const Word* __restrict__ x = static_cast<const Word*>(a.x);
    Word* __restrict__ y = static_cast<Word*>(a.y);
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= a.block_h * a.block_w.d * a.n * a.out_h) return;
    const int hq = row % a.out_h, batch = row / a.out_h;
    const int b = batch % a.n, ij = batch / a.n;
    const int i = ij / a.block_w.d, j = ij - i * a.block_w.d;
    const int h = hq * a.block_h + i - a.off_h;
    const bool inside = h >= 0 && h < a.height;
    const i64 image_row = ((i64)b * a.height + h) * a.width;  // first pixel of x's row h
    const int row_words = a.out_w * a.words.d;
    Word* out = y + (i64)row * row_words;
    for (int k0 = threadIdx.x; k0 < row_words; k0 += UNROLL * blockDim.x) {
        Word v[UNROLL];
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {  // all loads first, so several are in flight
            const int k = k0 + s * blockDim.x;
            v[s] = Word{};
            if (inside && k < row_words) {
                const int wq = a.words.div(k), w = wq * a.block_w.d + j - a.off_w;
                if (w >= 0 && w < a.width)
                    v[s] = x[(image_row + w) * a.words.d + k - wq * a.words.d];
            }
        }
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {
            const int k = k0 + s * blockDim.x;
            if (k < row_words) out[k] = v[s];
        }
    }
}

// Grid: ceil(rows of x / blockDim.y); threadIdx.y picks the row (b, h) of x, threadIdx.x the word.
template <typename Word>
__global__ void batch_to_space_nhwc(const nhwc_args a) {
    const Word* __restrict__ y = static_cast<const Word*>(a.y);
    Word* __restrict__ x = static_cast<Word*>(a.x);
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= a.n * a.height) return;
    const int b = row / a.height, hp = row - b * a.height + a.off_h;
    const int hq = hp / a.block_h, i = hp - hq * a.block_h;
    const int row_words = a.width * a.words.d;
    Word* out = x + (i64)row * row_words;
    for (int k0 = threadIdx.x; k0 < row_words; k0 += UNROLL * blockDim.x) {
        Word v[UNROLL];
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {  // all loads first, so several are in flight
            const int k = k0 + s * blockDim.x;
            if (k < row_words) {
                const int w = a.words.div(k), wp = w + a.off_w;
                const int wq = a.block_w.div(wp), j = wp - wq * a.block_w.d;
                const i64 pixel =
                    (((i64)(i * a.block_w.d + j) * a.n + b) * a.out_h + hq) * a.out_w + wq;
                v[s] = y[pixel * a.words.d + k - w * a.words.d];
            }
        }
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {
            const int k = k0 + s * blockDim.x;
            if (k < row_words) out[k] = v[s];
        }
    }
}

// ---- NCHW ------------------------------------------------------------------------------------
// Along a row, the sub-lattice column j of y interleaves with the others in x, so one side of
// the copy has a stride of block_w elements. A CTA stages a tile of rows in shared memory: it
// reads x's rows (space_to_batch) or y's rows (batch_to_space) in vectors of V elements, and
// writes the other side in vectors of V elements, both coalesced; the stride lies in the
// shared-memory accesses, where a pad of `skew` elements after every 2^skew_log2 elements spreads
// it over the banks. V divides width, out_w and off_w, and the pointers are aligned to it.
//
// A tile is tile_units units by tile_vectors * V columns of y (tile_vectors * V * block_w padded
// columns of x). A unit is a padded row of x (space_to_batch: units = n * channels * padded
// height, unit_rows = padded height) or a row of x (batch_to_space: units = n * channels *
// height, unit_rows = height). Grid: (ceil(units / tile_units), column tiles).

struct nchw_args {
    void* x;
    void* y;
    int n, height, width;          // x: [n, channels, height, width]
    int out_h, out_w;              // y: [block_h * block_w * n, channels, out_h, out_w]
    int off_h, off_w;
    int units, tile_units, pitch;  // pitch: elements of shared memory a unit takes
    int skew_log2, skew;
    divisor channels, block_h, block_w, unit_rows;
    divisor tile_vectors, row_vectors;  // row_vectors = tile_vectors * block_w
};
static_assert(sizeof(nchw_args) == 136, "nchw_args: sbnet_cupy/space_to_batch.py, _NCHW_ARGS");

static __device__ __forceinline__ int skewed(const nchw_args& a, int k) {
    return k + (k >> a.skew_log2) * a.skew;
}

template <typename E, int V>
__global__ void __launch_bounds__(THREADS) space_to_batch_nchw(const nchw_args a) {
    typedef vec_t<E, V> Vec;
    extern __shared__ __align__(16) unsigned char smem[];
    E* tile = reinterpret_cast<E*>(smem);
    const E* __restrict__ x = static_cast<const E*>(a.x);
    E* __restrict__ y = static_cast<E*>(a.y);
    const int bw = a.block_w.d, tv = a.tile_vectors.d;
    const int u0 = blockIdx.x * a.tile_units, units = min(a.tile_units, a.units - u0);
    const int q0 = blockIdx.y * tv * V;  // first column of y in the tile
    const int w0 = q0 * bw - a.off_w;    // column of x at the tile's first padded column

    // Read x's padded rows: thread t takes vector k of unit u (zeros in the padding).
    const int n_in = units * a.row_vectors.d;
    for (int t0 = threadIdx.x; t0 < n_in; t0 += UNROLL * THREADS) {
        Vec v[UNROLL];
        int at[UNROLL];
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {  // all loads first, so several are in flight
            const int t = t0 + s * THREADS;
            const int u = a.row_vectors.div(t), k = t - u * a.row_vectors.d;
            const int plane = a.unit_rows.div(u0 + u), h = u0 + u - plane * a.unit_rows.d - a.off_h;
            const int w = w0 + k * V;
            at[s] = u * a.pitch + skewed(a, k * V);  // a chunk of the skew holds whole vectors
            v[s] = Vec{};
            if (t < n_in && h >= 0 && h < a.height && w >= 0 && w < a.width)
                v[s] = *reinterpret_cast<const Vec*>(x + ((i64)plane * a.height + h) * a.width + w);
        }
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {
            if (t0 + s * THREADS < n_in) {
#pragma unroll
                for (int e = 0; e < V; ++e) tile[at[s] + e] = v[s].v[e];
            }
        }
    }
    __syncthreads();

    // Write y's rows: thread t takes vector qv of row j of unit u, gathering every bw-th element.
    const int n_out = units * bw * tv;
    for (int t = threadIdx.x; t < n_out; t += THREADS) {
        const int pair = a.tile_vectors.div(t), qv = t - pair * tv, q = q0 + qv * V;
        if (q >= a.out_w) continue;
        const int u = a.block_w.div(pair), j = pair - u * bw;
        const int plane = a.unit_rows.div(u0 + u), hp = u0 + u - plane * a.unit_rows.d;
        const int b = a.channels.div(plane), c = plane - b * a.channels.d;
        const int hq = a.block_h.div(hp), i = hp - hq * a.block_h.d;
        const int base = u * a.pitch, column = qv * V * bw + j;
        Vec v;
#pragma unroll
        for (int e = 0; e < V; ++e) v.v[e] = tile[base + skewed(a, column + e * bw)];
        const i64 y_row = (((i64)(i * bw + j) * a.n + b) * a.channels.d + c) * a.out_h + hq;
        *reinterpret_cast<Vec*>(y + y_row * a.out_w + q) = v;
    }
}

template <typename E, int V>
__global__ void __launch_bounds__(THREADS) batch_to_space_nchw(const nchw_args a) {
    typedef vec_t<E, V> Vec;
    extern __shared__ __align__(16) unsigned char smem[];
    E* tile = reinterpret_cast<E*>(smem);
    const E* __restrict__ y = static_cast<const E*>(a.y);
    E* __restrict__ x = static_cast<E*>(a.x);
    const int bw = a.block_w.d, tv = a.tile_vectors.d;
    const int u0 = blockIdx.x * a.tile_units, units = min(a.tile_units, a.units - u0);
    const int q0 = blockIdx.y * tv * V;  // first column of y in the tile
    const int w0 = q0 * bw - a.off_w;    // column of x at the tile's first padded column

    // Read y's rows: thread t takes vector qv of row j of unit u, spreading it every bw-th element.
    const int n_in = units * bw * tv;
    for (int t0 = threadIdx.x; t0 < n_in; t0 += UNROLL * THREADS) {
        Vec v[UNROLL];
        int base[UNROLL], column[UNROLL];
        bool load[UNROLL];
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {  // all loads first, so several are in flight
            const int t = t0 + s * THREADS;
            const int pair = a.tile_vectors.div(t), qv = t - pair * tv, q = q0 + qv * V;
            const int u = a.block_w.div(pair), j = pair - u * bw;
            const int plane = a.unit_rows.div(u0 + u);
            const int hp = u0 + u - plane * a.unit_rows.d + a.off_h;
            const int b = a.channels.div(plane), c = plane - b * a.channels.d;
            const int hq = a.block_h.div(hp), i = hp - hq * a.block_h.d;
            base[s] = u * a.pitch;
            column[s] = qv * V * bw + j;
            load[s] = t < n_in && q < a.out_w;
            if (load[s]) {
                const i64 y_row = (((i64)(i * bw + j) * a.n + b) * a.channels.d + c) * a.out_h + hq;
                v[s] = *reinterpret_cast<const Vec*>(y + y_row * a.out_w + q);
            }
        }
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {
            if (load[s]) {
#pragma unroll
                for (int e = 0; e < V; ++e)
                    tile[base[s] + skewed(a, column[s] + e * bw)] = v[s].v[e];
            }
        }
    }
    __syncthreads();

    // Write x's rows: thread t takes vector k of unit u; padded columns in the crops are dropped.
    const int n_out = units * a.row_vectors.d;
    for (int t = threadIdx.x; t < n_out; t += THREADS) {
        const int u = a.row_vectors.div(t), k = t - u * a.row_vectors.d, w = w0 + k * V;
        if (w < 0 || w >= a.width) continue;
        const int base = u * a.pitch + skewed(a, k * V);
        Vec v;
#pragma unroll
        for (int e = 0; e < V; ++e) v.v[e] = tile[base + e];
        *reinterpret_cast<Vec*>(x + (i64)(u0 + u) * a.width + w) = v;
    }
}
