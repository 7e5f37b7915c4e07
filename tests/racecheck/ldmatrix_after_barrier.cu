// A minimal kernel with block_conv's shape of shared-memory use, for compute-sanitizer racecheck:
// two warp groups of 128 threads each stream stages into their own slots (cp.async, wait, named
// barrier of the group, reads), the groups take different numbers of stages, then every thread
// meets at __syncthreads and group 1 stores partial sums over group 0's slots, which group 0
// reads after a second __syncthreads. Every read of a slot is ordered before the stores by the
// first __syncthreads. READ picks the slot reads: 0 ld.shared, 1 ldmatrix.x4; ASYNC picks the
// copies: 0 st.shared, 1 cp.async. A hazard reported here is the tool's, not the kernel's.
//   nvcc -arch=sm_90 -o ldmatrix_after_barrier ldmatrix_after_barrier.cu
//   compute-sanitizer --tool racecheck ./ldmatrix_after_barrier READ ASYNC
#include <cstdio>
#include <cstdlib>

constexpr int GROUP = 128, SLOT_WORDS = 32 * 12;

__device__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

template <int READ, int ASYNC>
__global__ void kernel(const unsigned* src, unsigned* out, int stages0, int stages1) {
    __shared__ __align__(16) unsigned slots[2][2][SLOT_WORDS];  // [group][buffer]
    const int group = threadIdx.x / GROUP, tid = threadIdx.x % GROUP, lane = threadIdx.x % 32;
    const int mine = group == 0 ? stages0 : stages1;
    unsigned acc = 0;
    for (int s = 0; s < mine; ++s) {
        unsigned* slot = slots[group][s & 1];
        if (tid < SLOT_WORDS / 4) {
            if (ASYNC) {
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                             ::"r"(shared_address(slot + tid * 4)), "l"(src + s * SLOT_WORDS + tid * 4));
                asm volatile("cp.async.commit_group;");
                asm volatile("cp.async.wait_group 0;" ::: "memory");
            } else {
                for (int i = 0; i < 4; ++i) slot[tid * 4 + i] = src[s * SLOT_WORDS + tid * 4 + i];
            }
        }
        asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "n"(GROUP) : "memory");
        const unsigned* row = slot + (lane % 32) * 12 / 4 * 4;  // 16-byte aligned rows
        if (READ) {
            unsigned r0, r1, r2, r3;
            asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                         : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(shared_address(row)));
            acc += r0 ^ r1 ^ r2 ^ r3;
        } else {
            acc += row[0] ^ row[1] ^ row[2] ^ row[3];
        }
        asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "n"(GROUP) : "memory");
    }
    __syncthreads();  // every group's reads are done
    unsigned* partial = &slots[0][0][0];
    if (group == 1) partial[tid] = acc;
    __syncthreads();
    if (group == 0) acc += partial[tid];
    out[threadIdx.x] = acc;
}

int main(int argc, char** argv) {
    const int read = argc > 1 ? atoi(argv[1]) : 1, async = argc > 2 ? atoi(argv[2]) : 1;
    unsigned *src, *out;
    cudaMalloc(&src, 8 * SLOT_WORDS * 4);
    cudaMalloc(&out, 2 * GROUP * 4);
    cudaMemset(src, 1, 8 * SLOT_WORDS * 4);
    auto launch = [&](auto k) { k<<<4, 2 * GROUP>>>(src, out, 5, 2); };
    if (read && async) launch(kernel<1, 1>);
    if (read && !async) launch(kernel<1, 0>);
    if (!read && async) launch(kernel<0, 1>);
    if (!read && !async) launch(kernel<0, 0>);
    const cudaError_t e = cudaDeviceSynchronize();
    printf("read=%s async=%s: %s\n", read ? "ldmatrix" : "ld.shared", async ? "cp.async" : "st.shared",
           cudaGetErrorString(e));
    return e != cudaSuccess;
}
