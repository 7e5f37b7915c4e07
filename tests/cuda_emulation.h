// The CUDA features that kernels/blocks/block_conv.cu and kernels/submanifold/submanifold.cu
// use, emulated on the CPU so that CI (no GPU) runs the kernels' own code: one std::thread a
// CUDA thread, the CTAs of a grid one after another; __syncthreads, __syncwarp and bar.sync as
// barriers; ldmatrix, mma.sync, __ballot_sync, __reduce_or_sync and the shuffles by exchanging
// the lanes' registers within a warp, in PTX's fragment layouts; cp.async copies made at their
// wait_group; a misaligned cp.async or ldmatrix address reported as the GPU's fault would be.
// tests/cuda_emulation.py builds kernels/core/common.cuh and the kernel file without their inline
// PTX: this file's first part goes before common.cuh, its second part (what needs common.cuh's
// types) after it. It checks what a kernel computes, never how fast or how it schedules: races
// between warps are the GPU's compute-sanitizer's to find.
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>
#include <algorithm>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
// The CTAs of a grid run one after another, so a static local is what one CTA's threads share.
#define __shared__ static
using std::min;
using std::max;

struct dim3_ { unsigned x = 0, y = 0, z = 0; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
thread_local dim3_ threadIdx, blockIdx;
thread_local dim3_ blockDim, gridDim;

struct Warp {
    std::barrier<> bar{32};
    const void* addr[32];
    unsigned a[32][4], b[32][2];
};
// Dynamic shared memory, in the library's static storage like the kernels' static __shared__
// arrays: a 32-bit shared-space address is then an offset from it (a signed one: the static
// arrays may lie below it).
alignas(16) static unsigned char dynamic_shared[256 * 1024];
struct Cta {
    std::unique_ptr<std::barrier<>> all;
    std::vector<std::unique_ptr<std::barrier<>>> groups;  // bar.sync 1.. of 128 threads
    std::vector<std::unique_ptr<Warp>> warps;
};
thread_local Cta* cta;
struct PendingCopy { unsigned dst; const void* src; bool valid; };
thread_local std::vector<std::vector<PendingCopy>> copy_groups;  // committed groups, oldest first
thread_local std::vector<PendingCopy> open_group;

static inline void __syncthreads() { cta->all->arrive_and_wait(); }
// bar.sync group + 1 of 128 threads: a warp group of block_conv.
static inline void group_sync(int group) { cta->groups[group]->arrive_and_wait(); }
static inline Warp& my_warp() { return *cta->warps[threadIdx.x / 32]; }
static inline int my_lane() { return threadIdx.x % 32; }

static inline unsigned __ballot_sync(unsigned, int predicate) {
    Warp& w = my_warp();
    const int lane = my_lane();
    w.a[lane][0] = predicate != 0;
    w.bar.arrive_and_wait();
    unsigned ballot = 0;
    for (int l = 0; l < 32; ++l) ballot |= w.a[l][0] << l;
    w.bar.arrive_and_wait();
    return ballot;
}
static inline unsigned __reduce_or_sync(unsigned, unsigned value) {
    Warp& w = my_warp();
    w.a[my_lane()][0] = value;
    w.bar.arrive_and_wait();
    unsigned all = 0;
    for (int l = 0; l < 32; ++l) all |= w.a[l][0];
    w.bar.arrive_and_wait();
    return all;
}
// The 32-bit value of lane `source` (__shfl_sync), or of lane - delta (the caller's own below
// delta: __shfl_up_sync).
template <typename T> static inline T shuffle_from(T value, int source) {
    static_assert(sizeof(T) == 4, "32-bit values");
    Warp& w = my_warp();
    std::memcpy(&w.a[my_lane()][0], &value, 4);
    w.bar.arrive_and_wait();
    T got;
    std::memcpy(&got, &w.a[source][0], 4);
    w.bar.arrive_and_wait();
    return got;
}
template <typename T> static inline T __shfl_sync(unsigned, T value, int source) {
    return shuffle_from(value, source % 32);
}
template <typename T> static inline T __shfl_up_sync(unsigned, T value, unsigned delta) {
    return shuffle_from(value, my_lane() >= (int)delta ? my_lane() - (int)delta : my_lane());
}
static inline void __syncwarp() { my_warp().bar.arrive_and_wait(); }
static inline int __popc(unsigned v) { return __builtin_popcount(v); }
static inline int __ffs(int v) { return __builtin_ffs(v); }
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
template <typename T> static inline T atomicAdd(T* p, T v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
template <typename T> static inline T atomicOr(T* p, T v) {
    return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST);
}
template <typename T> static inline T atomicCAS(T* p, T expected, T desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
template <typename T> static inline T atomic_add_float(T* p, T v) {  // float, double
    T seen, sum;
    __atomic_load(p, &seen, __ATOMIC_SEQ_CST);
    do {
        sum = seen + v;
    } while (!__atomic_compare_exchange(p, &seen, &sum, false, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST));
    return seen;
}
static inline float atomicAdd(float* p, float v) { return atomic_add_float(p, v); }
static inline double atomicAdd(double* p, double v) { return atomic_add_float(p, v); }

static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }

static inline void wait_for_previous_kernel() {}
static inline void allow_next_kernel() {}

// A shared-space address: the offset from the dynamic shared memory. The static __shared__
// arrays are other objects, so the offset and its way back go through integers: pointer
// arithmetic across objects is undefined, and _FORTIFY_SOURCE (on by default in Ubuntu's g++)
// aborts a copy to a pointer it sees leave dynamic_shared.
static inline unsigned __cvta_generic_to_shared(const void* p) {
    return (unsigned)(int)((std::intptr_t)p - (std::intptr_t)dynamic_shared);
}
static inline unsigned char* shared_pointer(unsigned address) {
    return (unsigned char*)((std::intptr_t)dynamic_shared + (int)address);
}
// The first misaligned access of a launch, which the GPU would fault on: emu_run returns it.
static std::atomic<const char*> emu_fault{nullptr};
static inline void check_aligned(const void* p, const char* what) {
    const char* none = nullptr;
    if ((std::uintptr_t)p % 16) emu_fault.compare_exchange_strong(none, what);
}

static inline void copy_async16(unsigned dst, const void* src, bool valid) {
    check_aligned(shared_pointer(dst), "cp.async: shared address not 16-byte aligned");
    if (valid) check_aligned(src, "cp.async: global address not 16-byte aligned");
    open_group.push_back({dst, src, valid});
}
template <bool L1 = false>
static inline void copy_async16_unless_negative(unsigned dst, const void* src, int flag) {
    copy_async16(dst, src, flag >= 0);
}
static inline void copy_async_commit() {
    copy_groups.push_back(std::move(open_group));
    open_group.clear();
}
template <int PENDING> static inline void copy_async_wait() {
    while ((int)copy_groups.size() > PENDING) {
        for (const PendingCopy& c : copy_groups.front()) {
            unsigned char* to = shared_pointer(c.dst);
            if (c.valid) std::memcpy(to, c.src, 16);
            else std::memset(to, 0, 16);
        }
        copy_groups.erase(copy_groups.begin());
    }
}

// ldmatrix .x4 / .x2: lane l gives the address of row l % 8 of matrix l / 8 and receives word
// l % 4 of row l / 4 of each matrix.
template <int N> static inline void load_matrices(unsigned (&r)[N], const unsigned* row) {
    check_aligned(row, "ldmatrix: row address not 16-byte aligned");
    Warp& w = my_warp();
    const int lane = my_lane();
    w.addr[lane] = row;
    w.bar.arrive_and_wait();
    for (int j = 0; j < N; ++j) r[j] = ((const unsigned*)w.addr[j * 8 + lane / 4])[lane % 4];
    w.bar.arrive_and_wait();
}

// ldmatrix .x4 .trans: lane l gives the address of row l % 8 of matrix l / 8 and receives, of
// each matrix, the 16-bit elements of rows 2 (l % 4) and 2 (l % 4) + 1 in column l / 4.
static inline void load_matrices_transposed(unsigned (&r)[4], const void* row) {
    check_aligned(row, "ldmatrix: row address not 16-byte aligned");
    Warp& w = my_warp();
    const int lane = my_lane();
    w.addr[lane] = row;
    w.bar.arrive_and_wait();
    for (int j = 0; j < 4; ++j) {
        std::uint16_t lo, hi;
        std::memcpy(&lo, (const std::uint16_t*)w.addr[j * 8 + lane % 4 * 2] + lane / 4, 2);
        std::memcpy(&hi, (const std::uint16_t*)w.addr[j * 8 + lane % 4 * 2 + 1] + lane / 4, 2);
        r[j] = lo | (unsigned)hi << 16;
    }
    w.bar.arrive_and_wait();
}

// Run `kernel` on a grid of gx x gy x gz CTAs of `block` threads with `smem` bytes of dynamic
// shared memory (filled with 0xff bytes: NaN where a kernel reads what no one wrote); returns
// the first fault, or null.
static const char* emu_run(int gx, int gy, int gz, int block, int smem,
                           const std::function<void()>& kernel) {
    if (smem > (int)sizeof dynamic_shared) return "more dynamic shared memory than emulated";
    emu_fault = nullptr;
    for (int b = 0; b < gx * gy * gz; ++b) {
        Cta c;
        std::memset(dynamic_shared, 0xff, smem);
        c.all = std::make_unique<std::barrier<>>(block);
        for (int g = 0; g < block / 128; ++g) c.groups.push_back(std::make_unique<std::barrier<>>(128));
        for (int w = 0; w < block / 32; ++w) c.warps.push_back(std::make_unique<Warp>());
        std::vector<std::thread> threads;
        for (int t = 0; t < block; ++t) {
            threads.emplace_back([&, t] {
                cta = &c;
                threadIdx.x = t;
                blockDim.x = block;
                blockIdx.x = b % gx, blockIdx.y = b / gx % gy, blockIdx.z = b / (gx * gy);
                gridDim.x = gx, gridDim.y = gy, gridDim.z = gz;
                copy_groups.clear(); open_group.clear();
                kernel();
            });
        }
        for (auto& th : threads) th.join();
    }
    return emu_fault.load();
}

// float32 rounded to TF32, before common.cuh: its templates (mma_operand) call it.
static inline unsigned to_tf32(float v) {
    unsigned u = __float_as_uint(v);
    return (u + 0x1000u) & ~0x1fffu;  // nearest, ties away (finite values)
}

// ---- after kernels/common.cuh ----
// What needs common.cuh's types: its conversions and MMAs that are inline PTX there.
static inline float half_to_float(unsigned short h) {
    const unsigned sign = (h >> 15) & 1, exp = (h >> 10) & 31, man = h & 1023;
    float v;
    if (exp == 0) v = std::ldexp((float)man, -24);
    else if (exp == 31) v = man ? NAN : INFINITY;
    else v = std::ldexp((float)(man | 1024), (int)exp - 25);
    return sign ? -v : v;
}
static inline unsigned short float_to_half(float f) {  // nearest, ties to even
    if (std::isnan(f)) return 0x7e00;
    const unsigned sign = std::signbit(f) ? 0x8000 : 0;
    float a = std::fabs(f);
    if (a >= 65520.f) return sign | 0x7c00;
    if (a < std::ldexp(1.f, -14)) {  // subnormal
        const unsigned m = (unsigned)std::nearbyint(a * std::ldexp(1.f, 24));
        return sign | m;
    }
    int e;
    std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    const float scaled = std::ldexp(a, 11 - e);  // in [1024, 2048)
    unsigned m = (unsigned)std::nearbyint(scaled);
    if (m == 2048) { m = 1024; ++e; }
    return sign | ((unsigned)(e + 14) << 10) | (m & 1023);
}

static inline float to_acc(half_t v) { return half_to_float(v.bits); }
template <> inline half_t from_acc<half_t>(float v) { return {float_to_half(v)}; }
template <> inline bfloat16_t from_acc<bfloat16_t>(float v) {  // nearest, ties to even
    unsigned u = __float_as_uint(v);
    u += 0x7fff + ((u >> 16) & 1);
    return {(unsigned short)(u >> 16)};
}

// The tensor cores' products: one warp's m16n8k(8 * PER) product, PER elements a 32-bit word (1
// for TF32, 2 for fp16 and bf16, the lower k in the low half). The lanes' fragment words are
// gathered into A [16][K] and B [K][8] by PTX's layouts (lane 4 g + t holds A rows g and g + 8,
// k = PER t.. and K / 2 + PER t..; B column g, the same k), and each lane's four accumulators
// (rows g, g + 8; columns 2 t, 2 t + 1) take the sums, in double, stored as float.
template <int PER, typename Element>
static void warp_mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2],
                     Element element) {
    constexpr int K = 8 * PER;
    Warp& w = my_warp();
    const int lane = my_lane();
    for (int i = 0; i < 4; ++i) w.a[lane][i] = a[i];
    for (int i = 0; i < 2; ++i) w.b[lane][i] = b[i];
    w.bar.arrive_and_wait();
    double A[16][K], B[K][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        for (int e = 0; e < PER; ++e) {
            const int k = PER * t + e;
            A[g][k] = element(w.a[l][0], e);
            A[g + 8][k] = element(w.a[l][1], e);
            A[g][k + K / 2] = element(w.a[l][2], e);
            A[g + 8][k + K / 2] = element(w.a[l][3], e);
            B[k][g] = element(w.b[l][0], e);
            B[k + K / 2][g] = element(w.b[l][1], e);
        }
    }
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i / 2), c = 2 * t + (i % 2);
        double s = d[i];
        for (int k = 0; k < K; ++k) s += A[r][k] * B[k][c];
        d[i] = (float)s;
    }
    w.bar.arrive_and_wait();
}

template <> struct tensor_core_mma<float> {  // TF32: the hardware ignores the low 13 bits
    static void run(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
        warp_mma<1>(d, a, b, [](unsigned w, int) { return (double)__uint_as_float(w & ~0x1fffu); });
    }
};
template <> struct tensor_core_mma<half_t> {
    static void run(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
        warp_mma<2>(d, a, b, [](unsigned w, int e) {
            return (double)half_to_float(e ? w >> 16 : w & 0xffff);
        });
    }
};
template <> struct tensor_core_mma<bfloat16_t> {
    static void run(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
        warp_mma<2>(d, a, b, [](unsigned w, int e) {
            return (double)__uint_as_float(e ? w & 0xffff0000u : w << 16);
        });
    }
};
