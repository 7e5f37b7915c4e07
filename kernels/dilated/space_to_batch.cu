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
// mul = ceil(2^shift / d) with shift = 31 + ceil(log2(d)) (sbnet_cupy/dilated/reshape_plan.py, _divisor).
// The struct `divisor` (d, mul, shift) and the kernels' arguments nhwc_args and nchw_args are
// declared in sbnet_cupy/core/records.py, which defines them in front of kernels/core/common.cuh.
static __device__ __forceinline__ int divide(const divisor& by, int n) {
    return (int)(((unsigned long long)(unsigned)n * by.mul) >> by.shift);
}

// ---- NHWC ------------------------------------------------------------------------------------
// A pixel is `words` words of Word (1 to 16 bytes, the widest access that the pixel's bytes and
// the pointers' alignment allow). Consecutive threads take consecutive words of an output row,
// so writes are coalesced, and reads are runs of whole pixels. A CTA moves `chunk` words of
// blockDim.y rows (grid.y cuts long rows, so that few rows still make many CTAs).

// Arguments: nhwc_args (sbnet_cupy/core/records.py).

// Grid: (ceil(rows of y / blockDim.y), chunks). The rows run through the sub-lattice columns j
// fastest, ((b * out_h + hq) * block_h + i) * block_w + j, so the block_w rows that read one
// row of x run together and read it whole.
template <typename Word>
__global__ void space_to_batch_nhwc(const nhwc_args a) {
    const Word* __restrict__ x = static_cast<const Word*>(a.x);
    Word* __restrict__ y = static_cast<Word*>(a.y);
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= a.block_h.d * a.block_w.d * a.n * a.out_h.d) return;
    const int r1 = divide(a.block_w, row), j = row - r1 * a.block_w.d;
    const int r2 = divide(a.block_h, r1), i = r1 - r2 * a.block_h.d;
    const int b = divide(a.out_h, r2), hq = r2 - b * a.out_h.d;
    const int h = hq * a.block_h.d + i - a.off_h;
    const bool inside = h >= 0 && h < a.height;
    const i64 image_row = ((i64)b * a.height + h) * a.width;  // first pixel of x's row h
    const int row_words = a.out_w * a.words.d;
    const int end = min(row_words, (int)(blockIdx.y + 1) * a.chunk);
    Word* out = y + ((((i64)(i * a.block_w.d + j) * a.n + b) * a.out_h.d + hq) * row_words);
    for (int k0 = blockIdx.y * a.chunk + threadIdx.x; k0 < end; k0 += UNROLL * blockDim.x) {
        Word v[UNROLL];
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {  // all loads first, so several are in flight
            const int k = k0 + s * blockDim.x;
            v[s] = Word{};
            if (inside && k < end) {
                const int wq = divide(a.words, k), w = wq * a.block_w.d + j - a.off_w;
                if (w >= 0 && w < a.width)
                    v[s] = x[(image_row + w) * a.words.d + k - wq * a.words.d];
            }
        }
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {
            const int k = k0 + s * blockDim.x;
            if (k < end) out[k] = v[s];
        }
    }
}

// Grid: (ceil(rows of x / blockDim.y), chunks); threadIdx.y picks the row (b, h) of x.
template <typename Word>
__global__ void batch_to_space_nhwc(const nhwc_args a) {
    const Word* __restrict__ y = static_cast<const Word*>(a.y);
    Word* __restrict__ x = static_cast<Word*>(a.x);
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= a.n * a.height) return;
    const int b = row / a.height, hp = row - b * a.height + a.off_h;
    const int hq = divide(a.block_h, hp), i = hp - hq * a.block_h.d;
    const int row_words = a.width * a.words.d;
    const int end = min(row_words, (int)(blockIdx.y + 1) * a.chunk);
    Word* out = x + (i64)row * row_words;
    for (int k0 = blockIdx.y * a.chunk + threadIdx.x; k0 < end; k0 += UNROLL * blockDim.x) {
        Word v[UNROLL];
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {  // all loads first, so several are in flight
            const int k = k0 + s * blockDim.x;
            if (k < end) {
                const int w = divide(a.words, k), wp = w + a.off_w;
                const int wq = divide(a.block_w, wp), j = wp - wq * a.block_w.d;
                const i64 pixel =
                    (((i64)(i * a.block_w.d + j) * a.n + b) * a.out_h.d + hq) * a.out_w + wq;
                v[s] = y[pixel * a.words.d + k - w * a.words.d];
            }
        }
#pragma unroll
        for (int s = 0; s < UNROLL; ++s) {
            const int k = k0 + s * blockDim.x;
            if (k < end) out[k] = v[s];
        }
    }
}

// ---- NCHW ------------------------------------------------------------------------------------
// With planes = n * channels, the NCHW forms are, for x the padded image side,
//
//     y[i * block_w + j, plane * out_h + hq, wq] = x[plane, hq * block_h + i, wq * block_w + j]
//
// so for one sub-lattice (i, j), the rows (plane, hq) of y -- "bands", block_h padded rows of x
// each -- are consecutive. A CTA takes a tile of tile_bands bands, tile_rows of the block_h rows
// i of each (all of them unless block_h is large) and tile_cols columns of y (all of them unless
// rows are long), and stages it in shared memory as padded rows of x. One side of the copy reads
// or writes x's rows, V elements a thread; the other reads or writes y, VY elements a thread,
// with the threads of one (i, j) on consecutive vectors of y: for a given (i, j) the tile is
// one run of y (tile_bands * out_w elements when tile_cols = out_w), so a warp's accesses cover
// whole sectors whatever out_w is, and y's vectors may run across its rows (narrow rows of y,
// as a rate-12 dilation's 6 pixels, would otherwise make its vectors narrow). The stride of
// block_w elements lies in the shared-memory accesses. V divides width, off_w and the column
// tiles' first columns (tile_cols, when there are several); VY divides the tile's runs
// (tile_bands * out_w with one column tile, else tile_cols and out_w) and y's sub-lattices
// (bands * out_w); the pointers are aligned to both.
//
// CL = true: y is NHWC, [block_h * block_w * n, out_h, out_w, channels], x still NCHW (the
// channels move last in the same pass, for a convolution in channels_last). The bands run
// through the channels fastest, band = (b * out_h + hq) * channels + c, a tile's bands lie in
// one (b, hq) (tile_bands divides channels), and y's vectors run along the channels: V
// consecutive bands at one column (VY = V). V divides width, off_w, the column tiles' first
// columns, tile_bands and channels.
//
// Shared memory is 32-bit words: tile row (g, ii) starts at word g * band_words + ii * row_words,
// and in a row a pad word follows every 32, so that vectors and every block_w-th element spread
// over the banks; the host picks the pads of row_words and band_words that a warp's accesses
// conflict least on (sbnet_cupy/dilated/reshape_plan.py, _tile_pitches).
// Grid: (ceil(bands / tile_bands), ceil(block_h / tile_rows), ceil(out_w / tile_cols)).

// Arguments: nchw_args (sbnet_cupy/core/records.py).

// Vectors a thread loads before it stores any: 32 to 64 bytes in flight for 4 to 16-byte vectors.
template <int BYTES> struct loads_in_flight {
    static constexpr int value = BYTES >= 16 ? 4 : 8;
};

static __device__ __forceinline__ int skew(int word) { return word + (word >> 5); }

// Byte address in the tile of byte `byte` of the tile row that starts at word `row`.
static __device__ __forceinline__ int tile_at(int row, int byte) {
    return (row + skew(byte >> 2)) * 4 + (byte & 3);
}

// A value of 1 to 16 bytes at a tile address of its own alignment in the row: one access if it
// is smaller than a word, else word by word (the pad words keep it out of alignment, never
// split it, as 32 words hold whole values).
template <typename T>
static __device__ __forceinline__ void tile_store(unsigned char* tile, int at, const T& v) {
    if constexpr (sizeof(T) < 4) {
        *reinterpret_cast<T*>(tile + at) = v;
    } else {
        const unsigned* words = reinterpret_cast<const unsigned*>(&v);
        unsigned* to = reinterpret_cast<unsigned*>(tile + at);
#pragma unroll
        for (int k = 0; k < (int)(sizeof(T) / 4); ++k) to[k] = words[k];
    }
}

template <typename T>
static __device__ __forceinline__ T tile_load(const unsigned char* tile, int at) {
    T v;
    if constexpr (sizeof(T) < 4) {
        v = *reinterpret_cast<const T*>(tile + at);
    } else {
        unsigned* words = reinterpret_cast<unsigned*>(&v);
        const unsigned* from = reinterpret_cast<const unsigned*>(tile + at);
#pragma unroll
        for (int k = 0; k < (int)(sizeof(T) / 4); ++k) words[k] = from[k];
    }
    return v;
}

// The tile's coordinates, shared by both kernels.
struct nchw_tile {
    int band0, bands;  // first band, bands in the tile
    int i0, rows;      // first row i of each band, rows i in the tile
    int q0, w0;        // first column of y; column of x at the tile's first padded column
    __device__ __forceinline__ nchw_tile(const nchw_args& a) {
        band0 = blockIdx.x * a.tile_bands.d;
        bands = min(a.tile_bands.d, a.bands - band0);
        i0 = blockIdx.y * a.tile_rows.d;
        rows = min(a.tile_rows.d, a.block_h - i0);
        q0 = blockIdx.z * a.tile_cols.d;
        w0 = q0 * a.block_w.d - a.off_w;
    }
};

// Vector k of tile row (g, ii) on x's side, for thread t of the tile_bands * tile_rows *
// row_vectors (k fastest): x's offset (valid when `inside`) and the tile address.
struct x_vector {
    i64 offset;
    int at;
    bool inside;
};

template <int V, int SIZE, bool CL>
static __device__ __forceinline__ x_vector locate_x(const nchw_args& a, const nchw_tile& c, int t) {
    const int r = divide(a.row_vectors, t), k = t - r * a.row_vectors.d;
    const int g = divide(a.tile_rows, r), ii = r - g * a.tile_rows.d;
    const int band = c.band0 + g;
    int plane, hq;
    if (CL) {
        const int bq = divide(a.channels, band), b = divide(a.out_h, bq);
        plane = b * a.channels.d + band - bq * a.channels.d;
        hq = bq - b * a.out_h.d;
    } else {
        plane = divide(a.out_h, band);
        hq = band - plane * a.out_h.d;
    }
    const int h = hq * a.block_h + c.i0 + ii - a.off_h;
    const int w = c.w0 + k * V;
    return {((i64)plane * a.height + h) * a.width + w,
            tile_at(g * a.band_words + ii * a.row_words, k * V * SIZE),
            ii < c.rows && h >= 0 && h < a.height && w >= 0 && w < a.width};
}

// A vector on y's side: y's offset (valid when `inside`) and where its elements lie in the tile
// (y_element). CL: element e in tile row `row` + e * band_words, padded column `column`. Else
// element e is element flat + e of the tile's run of sub-lattice column j, tile_cols elements a
// band: band (flat + e) / tile_cols of tile row `row`, padded column ((flat + e) % tile_cols) *
// block_w + j.
struct y_vector {
    i64 offset;
    int row, column, flat;
    bool inside;
};

// Vectors on y's side, for thread t of y_vectors(): NCHW, vector v of the run of (ii, j) (v
// fastest, then j, then ii), VY elements along it; CL, vector gv of the bands at tile column qo
// of row ii, sub-lattice column j (gv fastest, then qo), V bands.
template <bool CL>
static __device__ __forceinline__ int y_vectors(const nchw_args& a, const nchw_tile& c) {
    return c.rows * a.block_w.d * a.col_vectors.d * (CL ? a.tile_cols.d : 1);
}

template <int VY, bool CL>
static __device__ __forceinline__ y_vector locate_y(const nchw_args& a, const nchw_tile& c, int t) {
    const int r = divide(a.col_vectors, t), v = t - r * a.col_vectors.d;
    if (CL) {  // v: vector of channels, o: tile column
        const int ij = divide(a.tile_cols, r), o = r - ij * a.tile_cols.d;
        const int ii = divide(a.block_w, ij), j = ij - ii * a.block_w.d;
        const i64 sub_lattice = (i64)((c.i0 + ii) * a.block_w.d + j) * a.bands * a.out_w;
        const int q = c.q0 + o, bq = divide(a.channels, c.band0);
        const int channel = c.band0 - bq * a.channels.d + v * VY;
        return {sub_lattice + ((i64)bq * a.out_w + q) * a.channels.d + channel,
                v * VY * a.band_words + ii * a.row_words, o * a.block_w.d + j, 0, q < a.out_w};
    }
    const int ii = divide(a.block_w, r), j = r - ii * a.block_w.d;
    const i64 sub_lattice = (i64)((c.i0 + ii) * a.block_w.d + j) * a.bands * a.out_w;
    const int flat = v * VY, o = divide(a.tile_cols, flat), q = c.q0 + flat - o * a.tile_cols.d;
    return {sub_lattice + (i64)(c.band0 + o) * a.out_w + q, ii * a.row_words, j, flat,
            o < c.bands && q < a.out_w};
}

// Tile address of element e of the y vector p.
template <bool CL, int SIZE>
static __device__ __forceinline__ int y_element(const nchw_args& a, const y_vector& p, int e) {
    if (CL) return tile_at(p.row + e * a.band_words, p.column * SIZE);
    const int f = p.flat + e, o = divide(a.tile_cols, f);
    return tile_at(p.row + o * a.band_words,
                   ((f - o * a.tile_cols.d) * a.block_w.d + p.column) * SIZE);
}

template <typename E, int V, int VY, bool CL>
__global__ void __launch_bounds__(THREADS, 4) space_to_batch_nchw(const nchw_args a) {
    static_assert(!CL || V == VY, "channels last: one vector width");
    typedef vec_t<E, V> Vec;
    typedef vec_t<E, VY> VecY;
    constexpr int LOADS = loads_in_flight<sizeof(Vec)>::value;
    extern __shared__ __align__(16) unsigned char tile[];
    const E* __restrict__ x = static_cast<const E*>(a.x);
    E* __restrict__ y = static_cast<E*>(a.y);
    const nchw_tile c(a);

    // x's padded rows into the tile, zeros outside x.
    const int n_in = c.bands * a.tile_rows.d * a.row_vectors.d;
    for (int t0 = threadIdx.x; t0 < n_in; t0 += LOADS * THREADS) {
        Vec v[LOADS];
        int at[LOADS];
#pragma unroll
        for (int s = 0; s < LOADS; ++s) {  // all loads first, so several are in flight
            const x_vector p = locate_x<V, (int)sizeof(E), CL>(a, c, t0 + s * THREADS);
            at[s] = p.at;
            v[s] = Vec{};
            if (t0 + s * THREADS < n_in && p.inside)
                v[s] = *reinterpret_cast<const Vec*>(x + p.offset);
        }
#pragma unroll
        for (int s = 0; s < LOADS; ++s)
            if (t0 + s * THREADS < n_in) tile_store(tile, at[s], v[s]);
    }
    __syncthreads();

    // The tile into y, gathering every block_w-th element of a row (CL: one of each row).
    const int n_out = y_vectors<CL>(a, c);
    for (int t = threadIdx.x; t < n_out; t += THREADS) {
        const y_vector p = locate_y<VY, CL>(a, c, t);
        if (!p.inside) continue;
        VecY v;
#pragma unroll
        for (int e = 0; e < VY; ++e)
            v.v[e] = tile_load<E>(tile, y_element<CL, (int)sizeof(E)>(a, p, e));
        *reinterpret_cast<VecY*>(y + p.offset) = v;
    }
}

template <typename E, int V, int VY, bool CL>
__global__ void __launch_bounds__(THREADS, 4) batch_to_space_nchw(const nchw_args a) {
    static_assert(!CL || V == VY, "channels last: one vector width");
    typedef vec_t<E, V> Vec;
    typedef vec_t<E, VY> VecY;
    constexpr int LOADS = loads_in_flight<sizeof(VecY)>::value;
    extern __shared__ __align__(16) unsigned char tile[];
    const E* __restrict__ y = static_cast<const E*>(a.y);
    E* __restrict__ x = static_cast<E*>(a.x);
    const nchw_tile c(a);

    // y into the tile, spreading every block_w-th element of a row (CL: one to each row).
    const int n_in = y_vectors<CL>(a, c);
    for (int t0 = threadIdx.x; t0 < n_in; t0 += LOADS * THREADS) {
        VecY v[LOADS];
#pragma unroll
        for (int s = 0; s < LOADS; ++s) {  // all loads first, so several are in flight
            const y_vector p = locate_y<VY, CL>(a, c, t0 + s * THREADS);
            if (t0 + s * THREADS < n_in && p.inside)
                v[s] = *reinterpret_cast<const VecY*>(y + p.offset);
        }
#pragma unroll
        for (int s = 0; s < LOADS; ++s) {  // the places again: fewer registers than keeping them
            const y_vector p = locate_y<VY, CL>(a, c, t0 + s * THREADS);
            if (t0 + s * THREADS < n_in && p.inside) {
#pragma unroll
                for (int e = 0; e < VY; ++e)
                    tile_store(tile, y_element<CL, (int)sizeof(E)>(a, p, e), v[s].v[e]);
            }
        }
    }
    __syncthreads();

    // The tile into x's rows; padded rows and columns in the crops are dropped.
    const int n_out = c.bands * a.tile_rows.d * a.row_vectors.d;
    for (int t = threadIdx.x; t < n_out; t += THREADS) {
        const x_vector p = locate_x<V, (int)sizeof(E), CL>(a, c, t);
        if (p.inside) *reinterpret_cast<Vec*>(x + p.offset) = tile_load<Vec>(tile, p.at);
    }
}
