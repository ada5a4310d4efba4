// What a TP rank's access pattern costs on this CPU, with no canonical-kv code
// involved: the same 64-byte streaming-store copy loop the CPU kernel uses,
// over (a) one contiguous buffer and (b) fragments scattered one per random
// slot of a large area (a TP rank's 1/TP slice of canonical pages in random
// page order), in both directions, on OpenMP threads, with 4 KiB or 2 MiB
// pages. bench_transfer.py's "limit" is the best contiguous copy torch or
// numpy gives a user; this shows how far below a contiguous copy the scattered
// pattern itself lands whatever the kernel.
//
//   gcc -O2 -fopenmp bench/pattern_limit.c -o /tmp/pattern_limit
//   OMP_NUM_THREADS=2 /tmp/pattern_limit FRAGMENT_BYTES SLOT_BYTES [HUGE=0|1]
//   e.g. 4096 32768 (split HND TP=8: 4 KiB of every 32 KiB), 256 2048 (split NHD TP=8)
#define _GNU_SOURCE
#include <emmintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// 2 MiB-aligned, touched, with or without transparent huge pages.
static char* area(size_t bytes, int huge) {
  const size_t align = 2u << 20;
  char* raw = mmap(NULL, bytes + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    perror("mmap");
    exit(1);
  }
  char* p = (char*)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
  madvise(p, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  memset(p, 1, bytes);
  return p;
}

static inline void copy_stream(char* dst, const char* src, size_t size) {
  for (size_t i = 0; i < size; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i*)(src + i));
    __m128i b = _mm_loadu_si128((const __m128i*)(src + i + 16));
    __m128i c = _mm_loadu_si128((const __m128i*)(src + i + 32));
    __m128i d = _mm_loadu_si128((const __m128i*)(src + i + 48));
    _mm_stream_si128((__m128i*)(dst + i), a);
    _mm_stream_si128((__m128i*)(dst + i + 16), b);
    _mm_stream_si128((__m128i*)(dst + i + 32), c);
    _mm_stream_si128((__m128i*)(dst + i + 48), d);
  }
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s FRAGMENT_BYTES SLOT_BYTES [HUGE]\n", argv[0]);
    return 2;
  }
  const size_t fragment = strtoull(argv[1], NULL, 10), slot = strtoull(argv[2], NULL, 10);
  const int huge = argc > 3 ? atoi(argv[3]) : 0;
  if (fragment == 0 || fragment % 64 || slot < fragment) {
    fprintf(stderr, "FRAGMENT_BYTES: a multiple of 64 <= SLOT_BYTES\n");
    return 2;
  }
  const size_t bytes = 128u << 20, n = bytes / fragment;
  char* dense = area(bytes, huge);
  char* other = area(bytes, huge);
  char* scattered = area(n * slot, huge);
  uint32_t* order = malloc(n * sizeof *order);
  for (size_t i = 0; i < n; ++i) order[i] = (uint32_t)i;
  srand(1);
  for (size_t i = n - 1; i > 0; --i) {
    size_t j = (size_t)rand() % (i + 1);
    uint32_t t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  double contiguous = 1e9, store = 1e9, load = 1e9;
  for (int rep = 0; rep < 21; ++rep) {
    double t = now();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; ++i)
      copy_stream(other + i * fragment, dense + i * fragment, fragment);
    _mm_sfence();
    t = now() - t;
    if (t < contiguous) contiguous = t;
    t = now();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; ++i)
      copy_stream(scattered + (size_t)order[i] * slot, dense + i * fragment, fragment);
    _mm_sfence();
    t = now() - t;
    if (t < store) store = t;
    t = now();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; ++i)
      copy_stream(dense + i * fragment, scattered + (size_t)order[i] * slot, fragment);
    _mm_sfence();
    t = now() - t;
    if (t < load) load = t;
  }
  printf(
      "%zu B fragments, one per random %zu B slot, %d threads, %s pages: contiguous %.2f GB/s | "
      "scattered store %.2f GB/s (%.2fx) | scattered load %.2f GB/s (%.2fx)\n",
      fragment, slot, omp_get_max_threads(), huge ? "2 MiB" : "4 KiB", bytes / contiguous / 1e9,
      bytes / store / 1e9, contiguous / store, bytes / load / 1e9, contiguous / load);
  return 0;
}
