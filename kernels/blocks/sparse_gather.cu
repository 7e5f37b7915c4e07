// sparse_gather: copy each listed block out of an NHWC tensor into a dense stack.
// Out-of-range pixels read as zero; rows of the stack past the block count are zero.
// Arguments: StackArgs (common.cuh), src = x, dst = the stack.

#define UNROLL 4

// Stack [rows, bh, bw, C]. Each pixel row of a block is contiguous in both tensors, so this is
// a copy of rows of bw * words_per_pixel words, a word being 1 to 16 bytes (the widest access
// that the channel count and the pointers' alignment allow).
// Grid (rows, ceil(bh / blockDim.y)); threadIdx.y picks the block row, threadIdx.x the word.
template <typename Word>
__global__ void sparse_gather(const StackArgs a) {
    const Word* __restrict__ x = static_cast<const Word*>(a.src);
    Word* __restrict__ blocks = static_cast<Word*>(a.dst);
    const int r = blockIdx.y * blockDim.y + threadIdx.y;
    if (r >= a.list.bh) return;
    const block_row row = locate_row(a.list, blockIdx.x, r, a.words_per_pixel);
    for (int c0 = threadIdx.x; c0 < row.length; c0 += UNROLL * blockDim.x) {
        Word v[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {  // all loads first, so several are in flight
            const int c = c0 + k * blockDim.x;
            v[k] = c >= row.first && c < row.last ? x[row.image + c] : Word{};
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const int c = c0 + k * blockDim.x;
            if (c < row.length) blocks[row.stack + c] = v[k];
        }
    }
}

// sparse_gather with an inference BatchNorm (and ReLU) applied on the way: in-image pixels
// become max(x * scale[c] + shift[c], 0) (without RELU, no max); out-of-image pixels and rows
// past the count stay zero. The stack is [rows, bh, bw, C]; vectors of V elements of T, V
// dividing C, words_per_pixel = C / V. Grid and CTA as for sparse_gather.
template <typename T, int V, bool RELU>
__global__ void sparse_gather_affine(const StackArgs a) {
    typedef vec_t<T, V> Vec;
    typedef typename acc_type<T>::type Acc;
    const Vec* __restrict__ x = static_cast<const Vec*>(a.src);
    Vec* __restrict__ blocks = static_cast<Vec*>(a.dst);
    const Acc* __restrict__ scale = static_cast<const Acc*>(a.scale);
    const Acc* __restrict__ shift = static_cast<const Acc*>(a.shift);
    const int r = blockIdx.y * blockDim.y + threadIdx.y;
    if (r >= a.list.bh) return;
    const block_row row = locate_row(a.list, blockIdx.x, r, a.words_per_pixel);
    for (int c0 = threadIdx.x; c0 < row.length; c0 += UNROLL * blockDim.x) {
        Vec v[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {  // all loads first, so several are in flight
            const int c = c0 + k * blockDim.x;
            if (c >= row.first && c < row.last) v[k] = x[row.image + c];
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const int c = c0 + k * blockDim.x;
            if (c >= row.length) continue;
            Vec out = {};
            if (c >= row.first && c < row.last) {
                const int channel = (c % a.words_per_pixel) * V;
#pragma unroll
                for (int e = 0; e < V; ++e) {
                    Acc y = to_acc(v[k].v[e]) * scale[channel + e] + shift[channel + e];
                    out.v[e] = from_acc<T>(RELU && y < Acc(0) ? Acc(0) : y);
                }
            }
            blocks[row.stack + c] = out;
        }
    }
}

// Stack [rows, C, bh, bw]: a transpose through shared memory. A CTA moves a tile of
// tile_rows block rows by 2**log2_tile_c channels: it reads the tile from x in vectors of V
// channels of a pixel, and writes it to the stack in vectors of V pixels of a channel, both
// coalesced. E is a storage type of the element size; words_per_pixel is the channel count. V
// divides the channel count, the tile's pixels and bh * bw, and the pointers are aligned to it;
// pitch (see tile_index) is a multiple of 8 * V. Grid (rows, ceil(C / tile_c), ceil(bh / tile_rows)).
template <typename E, int V>
__global__ void sparse_gather_transposed(const StackArgs a) {
    typedef vec_t<E, V> Vec;
    const E* __restrict__ x = static_cast<const E*>(a.src);
    E* __restrict__ blocks = static_cast<E*>(a.dst);
    const BlockList& list = a.list;
    const int channels = a.words_per_pixel, bh = list.bh, bw = list.bw;
    const int height = list.height, width = list.width;
    extern __shared__ __align__(16) unsigned char smem[];
    E* tile = reinterpret_cast<E*>(smem);
    const int tile_c = 1 << a.log2_tile_c, c_vectors = tile_c / V;
    const int m = blockIdx.x, c0 = blockIdx.y * tile_c, r0 = blockIdx.z * a.tile_rows;
    const int pixels = min(a.tile_rows, bh - r0) * bw;
    const block_origin b = locate_block(list, m);

    // Read: consecutive threads take consecutive channel vectors of a pixel.
    const int n_in = pixels * c_vectors;
    for (int i0 = threadIdx.x; i0 < n_in; i0 += UNROLL * blockDim.x) {
        Vec v[UNROLL];
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {  // all loads first, so several are in flight
            const int i = i0 + k * blockDim.x, p = i / c_vectors, c = (i % c_vectors) * V;
            const int r = p / bw;
            const i64 h = b.h + r0 + r, w = b.w + (p - r * bw);
            v[k] = Vec{};
            if (i < n_in && b.inside && h >= 0 && h < height && w >= 0 && w < width &&
                c0 + c < channels) {
                v[k] = *reinterpret_cast<const Vec*>(
                    x + ((b.n * height + h) * width + w) * channels + c0 + c);
            }
        }
#pragma unroll
        for (int k = 0; k < UNROLL; ++k) {
            const int i = i0 + k * blockDim.x, p = i / c_vectors, c = (i % c_vectors) * V;
            if (i < n_in) {
#pragma unroll
                for (int e = 0; e < V; ++e) tile[tile_index<V>(c + e, p, a.pitch)] = v[k].v[e];
            }
        }
    }
    __syncthreads();

    // Write: consecutive threads take consecutive pixel vectors of a channel.
    const int p_vectors = pixels / V;
    E* out = blocks + ((i64)m * channels + c0) * bh * bw + (i64)r0 * bw;
    for (int i = threadIdx.x; i < p_vectors << a.log2_tile_c; i += blockDim.x) {
        const int c = i / p_vectors, p = (i - c * p_vectors) * V;
        if (c0 + c < channels) {
            *reinterpret_cast<Vec*>(out + (i64)c * bh * bw + p) =
                *reinterpret_cast<const Vec*>(tile + tile_index<V>(c, p, a.pitch));
        }
    }
}
