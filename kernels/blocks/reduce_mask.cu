// reduce_mask: pool every block of a mask and list the active ones, in raster order.
//
// One warp pools one block; the 32 warps of a CTA pool 32 consecutive blocks and store their
// flags as one 32-bit word. The last CTA to finish (a ticket counter) turns the words into the
// index list with a prefix sum over their popcounts. So the op is a single launch, needs no host
// round trip, and its order does not depend on scheduling.

#define WARPS 32

// Inclusive prefix sum over the 1024 threads of a CTA; `total` receives the sum of all threads.
static __device__ __forceinline__ int cta_inclusive_scan(int value, int* warp_sums, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int d = 1; d < 32; d <<= 1) {
        const int other = __shfl_up_sync(~0u, value, d);
        if (lane >= d) value += other;
    }
    if (lane == 31) warp_sums[warp] = value;
    __syncthreads();
    if (warp == 0) {
        int sum = warp_sums[lane];
        for (int d = 1; d < 32; d <<= 1) {
            const int other = __shfl_up_sync(~0u, sum, d);
            if (lane >= d) sum += other;
        }
        warp_sums[lane] = sum;
        if (lane == 31) *total = sum;
    }
    __syncthreads();
    const int before = warp == 0 ? 0 : warp_sums[warp - 1];
    __syncthreads();  // warp_sums is reused by the next call
    return before + value;
}

// Arguments: ReduceMaskArgs (sbnet_cupy/core/records.py). tickets: one counter, zero before the
// launch; the last CTA sets it back to zero. capacity: rows of `indices`; rows past the count
// up to fill_rows are set to -1.

// BH, BW: block size, or 0 to read it from the arguments at run time.
template <typename T, bool AVG, int BH, int BW>
__global__ void __launch_bounds__(WARPS * 32) reduce_mask(const ReduceMaskArgs a) {
    typedef typename acc_type<T>::type Acc;
    const T* __restrict__ mask = static_cast<const T*>(a.mask);
    unsigned* __restrict__ words = a.words;
    int* __restrict__ indices = a.indices;
    const int height = a.height, width = a.width, bcount_w = a.bcount_w;
    const int off_h = a.off_h, off_w = a.off_w, str_h = a.str_h, str_w = a.str_w;
    const int capacity = a.capacity;
    const int bh = BH ? BH : a.bh;
    const int bw = BW ? BW : a.bw;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per_image = a.bcount_h * bcount_w;
    const int total = per_image * a.n_batch;

    __shared__ int flags[WARPS];
    __shared__ int warp_sums[WARPS];
    __shared__ int chunk_total;
    __shared__ bool last_cta;

    const int block = blockIdx.x * WARPS + warp;
    bool active = false;
    if (block < total) {  // uniform across the warp, as the shuffles below need
        const int n = block / per_image, bhi = (block % per_image) / bcount_w;
        const int bwi = block % bcount_w;
        const i64 h0 = off_h + (i64)str_h * bhi, w0 = off_w + (i64)str_w * bwi;
        const T* image = mask + (i64)n * height * width;
        Acc acc = AVG ? Acc(0) : Acc(__int_as_float(0xff800000));  // -inf
#pragma unroll 8
        for (int p = lane; p < bh * bw; p += 32) {
            const int r = p / bw;
            const i64 h = h0 + r, w = w0 + (p - r * bw);
            if (h >= 0 && h < height && w >= 0 && w < width) {
                const Acc v = to_acc(image[h * width + w]);
                acc = AVG ? acc + v : (v > acc ? v : acc);
            }
        }
        for (int d = 16; d; d >>= 1) {
            const Acc other = __shfl_xor_sync(~0u, acc, d);
            acc = AVG ? acc + other : (other > acc ? other : acc);
        }
        // Average over the whole block area, out-of-range pixels counting as zero, as SBNet does.
        active = (AVG ? acc / Acc(bh * bw) : acc) > Acc(a.tol);
    }
    if (lane == 0) flags[warp] = active;
    __syncthreads();
    if (warp == 0) {
        const unsigned word = __ballot_sync(~0u, flags[lane]);
        if (lane == 0) {
            words[blockIdx.x] = word;
            __threadfence();  // publish the word before taking a ticket
            last_cta = atomicAdd(a.tickets, 1u) == gridDim.x - 1;
        }
    }
    __syncthreads();
    if (!last_cta) return;
    __threadfence();

    // The last CTA: every word is written. Compact them 1024 words at a time: a prefix sum over
    // the words' popcounts gives each word its first row, then each warp expands words, one
    // lane per bit.
    const volatile unsigned* all_words = words;
    __shared__ unsigned chunk_words[WARPS * 32];
    __shared__ int chunk_rows[WARPS * 32];
    int written = 0;
    for (int w0 = 0; w0 < (int)gridDim.x; w0 += WARPS * 32) {
        const int w = w0 + threadIdx.x;
        const unsigned bits = w < (int)gridDim.x ? all_words[w] : 0u;
        const int n_set = __popc(bits);
        chunk_words[threadIdx.x] = bits;
        chunk_rows[threadIdx.x] = written + cta_inclusive_scan(n_set, warp_sums, &chunk_total) - n_set;
        __syncthreads();
        const int chunk = min(WARPS * 32, (int)gridDim.x - w0);
        for (int j = warp; j < chunk; j += WARPS) {
            const unsigned word = chunk_words[j];
            if (!(word >> lane & 1u)) continue;
            const int pos = chunk_rows[j] + __popc(word & ((1u << lane) - 1u));
            if (pos < capacity) {
                const int block_id = (w0 + j) * 32 + lane;
                int* row = indices + 3 * (i64)pos;
                row[0] = block_id / per_image;
                row[1] = (block_id % per_image) / bcount_w;
                row[2] = block_id % bcount_w;
            }
        }
        written += chunk_total;
        __syncthreads();  // chunk_words and chunk_rows are rewritten next round
    }
    if (threadIdx.x == 0) {
        *a.count = written;
        *a.tickets = 0;
    }
    for (i64 i = written + threadIdx.x; i < a.fill_rows; i += blockDim.x) {
        indices[3 * i] = indices[3 * i + 1] = indices[3 * i + 2] = -1;
    }
}
