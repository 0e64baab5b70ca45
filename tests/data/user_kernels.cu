// Kernels that are not handoff's: a user's own, compiled to PTX by
//   nvcc -ptx -arch=compute_75 -o tests/data/user_kernels.ptx tests/data/user_kernels.cu
// (the PTX is committed; the tests and examples/user_kernel.rs load it at run time).

__device__ __forceinline__ unsigned long long clock_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// y = a * x.
extern "C" __global__ void user_scale(const float* x, float* y, float a, unsigned long long n) {
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i];
}

// x[i] = base + i.
extern "C" __global__ void user_iota(float* x, unsigned long long n, float base) {
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = base + (float)i;
}

// Waits `ns` nanoseconds, then copies src to dst: a long read of src and a late write of dst.
extern "C" __global__ void user_slow_copy(const float* src, float* dst, unsigned long long n,
                                          unsigned long long ns) {
  unsigned long long start = clock_ns();
  while (clock_ns() - start < ns) {
  }
  unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = src[i];
}
