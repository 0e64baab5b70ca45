// The article's kernels, compiled to PTX by build.rs and loaded at run time by src/kernels.rs.
// Every kernel uses a grid-stride loop, so any grid size covers any length.

// %globaltimer is a nanosecond clock shared by all multiprocessors (PTX ISA, special registers).
__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void spin_for(unsigned long long ns) {
  if (ns == 0) return;
  unsigned long long start = now_ns();
  while (now_ns() - start < ns) {
  }
}

// Kernel A: produce x. x[i] = ((i + round) mod 2^24) + 1, exact in f32, so round 0 of a
// four-element buffer is [1, 2, 3, 4] and successive rounds differ.
extern "C" __global__ void handoff_produce(float* x, unsigned long long n, unsigned int round) {
  unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    x[i] = (float)(((i + round) & 0xFFFFFFull) + 1ull);
  }
}

// Kernel B: y = 2x.
extern "C" __global__ void handoff_twice(const float* x, float* y, unsigned long long n) {
  unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    y[i] = 2.0f * x[i];
  }
}

// Kernel C: independent work of a tunable duration. One thread spins for `ns` nanoseconds and
// touches no memory, so it can overlap a transfer.
extern "C" __global__ void handoff_busy(unsigned long long ns) {
  spin_for(ns);
}

// A long read: each thread waits `ns` nanoseconds, then copies its elements of src to dst.
// Used to widen the window in which another stream could overwrite src or free it.
extern "C" __global__ void handoff_delayed_copy(const float* src, float* dst, unsigned long long n,
                                                unsigned long long ns) {
  spin_for(ns);
  unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    dst[i] = src[i];
  }
}

// Fill: every element of dst (n elements of `size` bytes) gets the pattern in lo (and hi, for
// elements over 8 bytes). `typed` says the elements are aligned to their size (1, 2, 4 or 8),
// so one store writes one element; otherwise the bytes are written one by one.
extern "C" __global__ void handoff_fill(unsigned char* dst, unsigned long long n, unsigned int size,
                                        unsigned int typed, unsigned long long lo,
                                        unsigned long long hi) {
  unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    unsigned char* p = dst + i * size;
    if (typed && size == 1) {
      *p = (unsigned char)lo;
    } else if (typed && size == 2) {
      *(unsigned short*)p = (unsigned short)lo;
    } else if (typed && size == 4) {
      *(unsigned int*)p = (unsigned int)lo;
    } else if (typed && size == 8) {
      *(unsigned long long*)p = lo;
    } else {
      for (unsigned int b = 0; b < size; b++) {
        p[b] = (unsigned char)(((b < 8) ? (lo >> (8 * b)) : (hi >> (8 * (b - 8)))) & 0xffull);
      }
    }
  }
}
