// A malloc-level live-bytes counter for the side-by-side benchmarks (bench/flux_vs_diffusers.sh):
// LD_PRELOADed into difftrain's bench and into the Python peer alike, it counts the usable size of
// every block malloc, calloc, realloc and the aligned allocators hand out (LibTorch's and torch's
// CPU allocator: posix_memalign) and keeps the peak, so "peak bytes in use during the timed steps"
// is the same measure on both sides, free of what the allocator keeps cached (which RSS counts).
// Python's own small-object arenas (mmap) are not counted; tensors are.
//
// Exported: alloc_peak_reset() (peak := bytes in use now), alloc_peak_bytes(),
// alloc_live_bytes(). The benches look them up with dlsym and fall back to RSS when absent.
//
//   cc -O2 -shared -fPIC -o build/alloc_peak.so bench/alloc_peak.c
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <stdatomic.h>
#include <stddef.h>

extern void* __libc_malloc(size_t n);
extern void __libc_free(void* p);
extern void* __libc_calloc(size_t n, size_t size);
extern void* __libc_realloc(void* p, size_t n);
extern void* __libc_memalign(size_t alignment, size_t n);
extern void* __libc_valloc(size_t n);
extern void* __libc_pvalloc(size_t n);

static atomic_llong live_bytes;
static atomic_llong peak_bytes;

static void* counted(void* p) {
  if (p == NULL) return p;
  const long long n = (long long)malloc_usable_size(p);
  const long long now = atomic_fetch_add(&live_bytes, n) + n;
  long long peak = atomic_load(&peak_bytes);
  while (now > peak && !atomic_compare_exchange_weak(&peak_bytes, &peak, now)) {
  }
  return p;
}

static void uncount(void* p) {
  if (p != NULL) atomic_fetch_sub(&live_bytes, (long long)malloc_usable_size(p));
}

void alloc_peak_reset(void) { atomic_store(&peak_bytes, atomic_load(&live_bytes)); }
long long alloc_peak_bytes(void) { return atomic_load(&peak_bytes); }
long long alloc_live_bytes(void) { return atomic_load(&live_bytes); }

void* malloc(size_t n) { return counted(__libc_malloc(n)); }
void* calloc(size_t n, size_t size) { return counted(__libc_calloc(n, size)); }
void* memalign(size_t alignment, size_t n) { return counted(__libc_memalign(alignment, n)); }
void* aligned_alloc(size_t alignment, size_t n) { return counted(__libc_memalign(alignment, n)); }
void* valloc(size_t n) { return counted(__libc_valloc(n)); }
void* pvalloc(size_t n) { return counted(__libc_pvalloc(n)); }

void free(void* p) {
  uncount(p);
  __libc_free(p);
}

void* realloc(void* p, size_t n) {
  uncount(p);
  void* q = __libc_realloc(p, n);
  if (q != NULL) return counted(q);
  if (p != NULL && n != 0) counted(p);  // failed: p is still allocated
  return NULL;
}

int posix_memalign(void** out, size_t alignment, size_t n) {
  if (alignment % sizeof(void*) != 0 || (alignment & (alignment - 1)) != 0) return EINVAL;
  void* p = __libc_memalign(alignment, n);
  if (p == NULL && n != 0) return ENOMEM;
  *out = counted(p);
  return 0;
}
