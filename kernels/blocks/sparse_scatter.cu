// sparse_scatter: write (Assign) or add (Add, AtomicAdd) each block of a dense stack into an
// NHWC tensor, in place. Out-of-range pixels and rows past the block count write nothing.
// Arguments: StackArgs (common.cuh), src = the stack, dst = y.

#define UNROLL 4

// Stack [rows, bh, bw, C]: each pixel row of a block is contiguous in both tensors. Word is a
// storage type of 1 to 16 bytes for Assign, or vec_t<T, V> (V elements of the data type) for the
// adds. Grid (rows, ceil(bh / blockDim.y)); threadIdx.y picks the block row, threadIdx.x the word.
template <typename Word, typename Op>
__global__ void sparse_scatter(const StackArgs a) {
    const Word* __restrict__ blocks = static_cast<const Word*>(a.src);
    Word* __restrict__ y = static_cast<Word*>(a.dst);
    const int r = blockIdx.y * blockDim.y + threadIdx.y;
    if (r >= a.list.bh) return;
    const block_row row = locate_row(a.list, blockIdx.x, r, a.words_per_pixel);
    for (int c0 = row.first + threadIdx.x; c0 < row.last; c0 += UNROLL * blockDim.x) {
        Word v[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {  // all loads first, so several are in flight
            const int c = c0 + k * blockDim.x;
            if (c < row.last) v[k] = blocks[row.stack + c];
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const int c = c0 + k * blockDim.x;
            if (c < row.last) Op::apply(y + row.image + c, v[k]);
        }
    }
}

// Stack [rows, C, bh, bw]: a transpose through shared memory, the mirror of
// sparse_gather_transposed. A CTA reads a tile of tile_rows block rows by 2**log2_tile_c
// channels from the stack in vectors of V pixels of a channel, and applies it to y in vectors of
// V channels of a pixel, both coalesced. E is a storage type for Assign, the data type for the
// adds; words_per_pixel is the channel count. V divides the channel count, the tile's pixels and
// bh * bw, and the pointers are aligned to it; pitch (see tile_index) is a multiple of 8 * V.
// Grid (rows, ceil(C / tile_c), ceil(bh / tile_rows)).
template <typename E, int V, typename Op>
__global__ void sparse_scatter_transposed(const StackArgs a) {
    typedef vec_t<E, V> Vec;
    const E* __restrict__ blocks = static_cast<const E*>(a.src);
    E* __restrict__ y = static_cast<E*>(a.dst);
    const BlockList& list = a.list;
    const int channels = a.words_per_pixel, bh = list.bh, bw = list.bw;
    const int height = list.height, width = list.width;
    extern __shared__ __align__(16) unsigned char smem[];
    E* tile = reinterpret_cast<E*>(smem);
    const int tile_c = 1 << a.log2_tile_c, c_vectors = tile_c / V;
    const int m = blockIdx.x, c0 = blockIdx.y * tile_c, r0 = blockIdx.z * a.tile_rows;
    const int pixels = min(a.tile_rows, bh - r0) * bw;
    const block_origin b = locate_block(list, m);
    if (!b.inside) return;  // uniform across the CTA, so no thread misses the barrier

    // Read: consecutive threads take consecutive pixel vectors of a channel.
    const int p_vectors = pixels / V, n_in = p_vectors << a.log2_tile_c;
    const E* in = blocks + ((i64)m * channels + c0) * bh * bw + (i64)r0 * bw;
    for (int i0 = threadIdx.x; i0 < n_in; i0 += UNROLL * blockDim.x) {
        Vec v[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {  // all loads first, so several are in flight
            const int i = i0 + k * blockDim.x, c = i / p_vectors, p = (i - c * p_vectors) * V;
            if (i < n_in && c0 + c < channels) {
                v[k] = *reinterpret_cast<const Vec*>(in + (i64)c * bh * bw + p);
            }
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const int i = i0 + k * blockDim.x, c = i / p_vectors, p = (i - c * p_vectors) * V;
            if (i < n_in && c0 + c < channels) {
                *reinterpret_cast<Vec*>(tile + tile_index<V>(c, p, a.pitch)) = v[k];
            }
        }
    }
    __syncthreads();

    // Write: consecutive threads take consecutive channel vectors of a pixel.
    for (int i = threadIdx.x; i < pixels * c_vectors; i += blockDim.x) {
        const int p = i / c_vectors, c = (i % c_vectors) * V;
        const int r = p / bw;
        const i64 h = b.h + r0 + r, w = b.w + (p - r * bw);
        if (h >= 0 && h < height && w >= 0 && w < width && c0 + c < channels) {
            Vec v;
#pragma unroll
            for (int e = 0; e < V; ++e) v.v[e] = tile[tile_index<V>(c + e, p, a.pitch)];
            Op::apply(reinterpret_cast<Vec*>(y + ((b.n * height + h) * width + w) * channels + c0 + c), v);
        }
    }
}
