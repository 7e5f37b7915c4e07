// block_conv's stage loop and sum_groups, closer to the kernel than ldmatrix_after_barrier.cu:
// up to four warp groups of 128 threads in one CTA, dynamic shared memory laid out as
// block_conv<float, 48, 4, *> lays it (per group 3 slots of (64 + 48) rows x 36 words), the
// 3-slot cp.async pipeline with two stages ahead (zero-fill copies, empty commit groups), ONE
// named barrier a stage (`bar.sync group + 1, 128`, both operands in registers), ldmatrix.x4
// reads of the A rows (both m-tiles, 4 k steps) and ldmatrix.x2 reads of the last B n-tile, then
// __syncthreads, group g > 0 storing 24 partial sums a thread over group g - 1's slot 0,
// __syncthreads, group 0 adding them. Every slot read is ordered before the stores by the first
// __syncthreads: a hazard reported here is the tool's.
//   nvcc -arch=sm_90 -o groups4 groups4.cu
//   compute-sanitizer --tool racecheck ./groups4 STAGES [BARRIERS_A_STAGE] [PDL]
// STAGES: each group's stage count, e.g. 4,4,3,3 (block_conv's 3x3 of 48 channels on 4 groups)
// or 7,7; BARRIERS_A_STAGE: 1 (block_conv) or 2 (ldmatrix_after_barrier.cu); PDL: 1 launches
// it as a programmatic dependent of a first kernel and calls griddepcontrol as block_conv does.
#include <cstdio>
#include <cstdlib>
#include <cstring>

constexpr int THREADS = 128, PITCH = 36, BM = 64, BN = 48, SLOT_WORDS = (BM + BN) * PITCH,
              GROUP_WORDS = 3 * SLOT_WORDS, ACC = 24;

__device__ unsigned shared_address(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void group_sync(int group) {
    asm volatile("bar.sync %0, %1;" ::"r"(group + 1), "r"(THREADS) : "memory");
}

__global__ void __launch_bounds__(512) kernel(const unsigned* src, float* out, int4 stages,
                                              int barriers, int pdl) {
    extern __shared__ __align__(16) unsigned smem[];
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    const int group = threadIdx.x / THREADS, tid = threadIdx.x % THREADS, lane = tid & 31;
    const int wm = tid >> 5 & 1, wn = tid >> 6;
    const int mine = group == 0 ? stages.x : group == 1 ? stages.y : group == 2 ? stages.z : stages.w;
    unsigned* const slots = smem + group * GROUP_WORDS;
    const int a_lane = (wm * 32 + (lane & 15)) * PITCH + (lane >> 4) * 4;
    const int b_lane = (wn * (BN / 2) + (lane & 7) + (lane >> 4) * 8) * PITCH + (lane >> 3 & 1) * 4;
    // Each thread copies one 16-byte column (8 a row) of rows tid / 8 + 16 i of a slot.
    const int vec = tid % 8, row0 = tid / 8;
    auto copy = [&](int stage, int slot) {
        for (int r = row0; r < BM + BN; r += 16) {
            const bool valid = (r + stage) % 5 != 0;  // some zero-fill copies, as at the image edge
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                             shared_address(slots + slot * SLOT_WORDS + r * PITCH + vec * 4)),
                         "l"(src + (stage * (BM + BN) + r) * 32 + vec * 4), "r"(valid ? 16 : 0)
                         : "memory");
        }
    };
    float acc[ACC] = {};
    for (int i = 0; i < 2; ++i) {
        if (i < mine) copy(i, i);
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    for (int i = 0, slot = 0; i < mine; ++i, slot = slot == 2 ? 0 : slot + 1) {
        asm volatile("cp.async.wait_group 1;" ::: "memory");
        group_sync(group);
        if (i + 2 < mine) copy(i + 2, slot == 0 ? 2 : slot - 1);
        asm volatile("cp.async.commit_group;" ::: "memory");
        const unsigned* base = slots + slot * SLOT_WORDS;
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
            unsigned r[4], b[2];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                             : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                             : "r"(shared_address(base + a_lane + mt * 16 * PITCH + ks * 8)));
                acc[(mt * 4 + ks) % ACC] += __uint_as_float(r[0] ^ r[1] ^ r[2] ^ r[3]) * 0.f + 1.f;
            }
            asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                         : "=r"(b[0]), "=r"(b[1])
                         : "r"(shared_address(base + BM * PITCH + b_lane + 16 * PITCH + ks * 8)));
            acc[8 + ks] += __uint_as_float(b[0] ^ b[1]) * 0.f + 1.f;
        }
        if (barriers == 2) group_sync(group);
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();  // every group is done with its slots
    float* partial = reinterpret_cast<float*>(smem);
    if (group > 0)
        for (int i = 0; i < ACC; ++i) partial[(group - 1) * GROUP_WORDS + i * THREADS + tid] = acc[i];
    __syncthreads();
    if (group == 0)
        for (int other = 1; other < blockDim.x / THREADS; ++other)
            for (int i = 0; i < ACC; ++i) acc[i] += partial[(other - 1) * GROUP_WORDS + i * THREADS + tid];
    float s = 0;
    for (int i = 0; i < ACC; ++i) s += acc[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

__global__ void first(float* p) { p[threadIdx.x] = 0; }

int main(int argc, char** argv) {
    int st[4] = {0, 0, 0, 0}, groups = 0;
    for (char* t = strtok(argc > 1 ? argv[1] : (char*)"4,4,3,3", ","); t && groups < 4;
         t = strtok(nullptr, ","))
        st[groups++] = atoi(t);
    const int barriers = argc > 2 ? atoi(argv[2]) : 1, pdl = argc > 3 ? atoi(argv[3]) : 0;
    unsigned* src;
    float* out;
    const int max_stages = 64;
    cudaMalloc(&src, (size_t)max_stages * (BM + BN) * 32 * 4);
    cudaMemset(src, 1, (size_t)max_stages * (BM + BN) * 32 * 4);
    cudaMalloc(&out, 512 * 4 * 4);
    const int bytes = groups * GROUP_WORDS * 4;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    cudaStream_t stream;
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
    first<<<1, 32, 0, stream>>>(out);
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(1);
    config.blockDim = dim3(THREADS * groups);
    config.dynamicSmemBytes = bytes;
    config.stream = stream;
    cudaLaunchAttribute attribute;
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = &attribute;
    config.numAttrs = pdl ? 1 : 0;
    cudaError_t e = cudaLaunchKernelEx(&config, kernel, (const unsigned*)src, out,
                                       make_int4(st[0], st[1], st[2], st[3]), barriers, pdl);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    printf("groups=%d stages=%d,%d,%d,%d barriers/stage=%d pdl=%d: %s\n", groups, st[0], st[1],
           st[2], st[3], barriers, pdl, cudaGetErrorString(e));
    return e != cudaSuccess;
}
