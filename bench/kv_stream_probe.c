// How fast can one thread stream a paged KV cache while doing GQA's arithmetic on it? A probe for RESULTS.md, not
// part of the library. Reads K and V blocks of 16 KiB (16 tokens x 2 KV heads x 128 fp32, the bench's GQA fp32
// layout) in random block order, doing FMAS FMAs on every loaded 8-float vector (8: GQA's 8 query heads per KV head;
// 24: about the arithmetic per byte of the bf16 GQA kernel, 190 cycles per token and KV head on the Zen 4 host of
// bench/RESULTS.md; none with FMAS=0), and prints GB/s of K + V read (median and best of 7 passes over 1 GiB).
//   order: head  = K rows of head 0 for 8 tokens, V the same, then head 1 (the order of the decode kernel's tiles)
//          token = K rows of both heads for 8 tokens, then V (sequential within a block)
//   pf:    none  = hardware prefetchers only
//          next  = software-prefetch every line of the next block, spread over the current one (as the kernel does)
//          warm  = software-prefetch only the first 2 lines of the block after next
//   gcc -O3 -mavx2 -mfma -pthread bench/kv_stream_probe.c -o /tmp/kv_stream_probe
//   /tmp/kv_stream_probe ORDER PF THREADS [FMAS=8: 0, 8, 16, 24 or 32]
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum { kBlock = 16384, kTokens = 16, kHeadFloats = 128, kRowFloats = 2 * kHeadFloats };
static size_t num_blocks;
static char *kcache, *vcache;
static int *order_of_blocks, token_order, prefetch, threads;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// The loop for a constant fmas (inlined into one function per count, so that the accumulators stay in registers).
static inline __attribute__((always_inline)) void *stream(void *arg, const int fmas) {
  const int id = *(int *)arg;
  __m256 acc[8], c[4];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) c[j] = _mm256_set1_ps(1e-3f * j);
  const size_t b0 = num_blocks * id / threads, b1 = num_blocks * (id + 1) / threads;
  for (size_t b = b0; b < b1; ++b) {
    const float *k = (const float *)(kcache + (size_t)order_of_blocks[b] * kBlock);
    const float *v = (const float *)(vcache + (size_t)order_of_blocks[b] * kBlock);
    const char *nk = b + 1 < b1 ? kcache + (size_t)order_of_blocks[b + 1] * kBlock : NULL;
    const char *nv = b + 1 < b1 ? vcache + (size_t)order_of_blocks[b + 1] * kBlock : NULL;
    if (prefetch == 2 && b + 2 < b1)
      for (int line = 0; line < 2; ++line) {
        _mm_prefetch(kcache + (size_t)order_of_blocks[b + 2] * kBlock + 64 * line, _MM_HINT_T0);
        _mm_prefetch(vcache + (size_t)order_of_blocks[b + 2] * kBlock + 64 * line, _MM_HINT_T0);
      }
    size_t next_line = 0;  // "next": one K and one V line of the next block per 4 vectors (both run out together)
    for (int half = 0; half < 2; ++half)
      for (int pass = 0; pass < (token_order ? 2 : 4); ++pass) {  // head: h0 K, h0 V, h1 K, h1 V; token: K, V
        const float *base = ((token_order ? pass : pass & 1) ? v : k) + half * 8 * kRowFloats +
                            (token_order ? 0 : (pass >> 1) * kHeadFloats);
        const int row_floats = token_order ? kRowFloats : kHeadFloats;
        for (int t = 0; t < 8; ++t)
          for (int i = 0; i < row_floats; i += 8) {
            const __m256 x = _mm256_loadu_ps(base + t * kRowFloats + i);
            if (fmas) {
#pragma GCC unroll 32
              for (int j = 0; j < fmas; ++j) acc[j & 7] = _mm256_fmadd_ps(x, c[j & 3], acc[j & 7]);
            } else {
              acc[0] = _mm256_add_ps(acc[0], x);
            }
            if (prefetch == 1 && nk && (i & 31) == 0 && next_line < kBlock) {
              _mm_prefetch(nk + next_line, _MM_HINT_T0);
              _mm_prefetch(nv + next_line, _MM_HINT_T0);
              next_line += 64;
            }
          }
      }
  }
  __m256 s = acc[0];
  for (int j = 1; j < 8; ++j) s = _mm256_add_ps(s, acc[j]);
  volatile float sink = _mm256_cvtss_f32(s);
  (void)sink;
  return NULL;
}

static void *stream0(void *arg) { return stream(arg, 0); }
static void *stream8(void *arg) { return stream(arg, 8); }
static void *stream16(void *arg) { return stream(arg, 16); }
static void *stream24(void *arg) { return stream(arg, 24); }
static void *stream32(void *arg) { return stream(arg, 32); }

static int cmp(const void *a, const void *b) { return (*(double *)a > *(double *)b) - (*(double *)a < *(double *)b); }

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s head|token none|next|warm THREADS [0|8|16|24|32]\n", argv[0]);
    return 2;
  }
  token_order = strcmp(argv[1], "token") == 0;
  prefetch = strcmp(argv[2], "next") == 0 ? 1 : strcmp(argv[2], "warm") == 0 ? 2 : 0;
  threads = atoi(argv[3]);
  const int fmas = argc > 4 ? atoi(argv[4]) : 8;
  void *(*const streams[5])(void *) = {stream0, stream8, stream16, stream24, stream32};
  if ((!token_order && strcmp(argv[1], "head") != 0) || (prefetch == 0 && strcmp(argv[2], "none") != 0) ||
      threads < 1 || threads > 64 || fmas < 0 || fmas > 32 || fmas % 8) {
    fprintf(stderr, "expected ORDER head|token, PF none|next|warm, THREADS 1-64, FMAS 0, 8, 16, 24 or 32; "
            "got %s %s %s %s\n", argv[1], argv[2], argv[3], argc > 4 ? argv[4] : "8");
    return 2;
  }
  const size_t bytes = (size_t)1 << 29;  // per cache: 1 GiB of K + V in all
  num_blocks = bytes / kBlock;
  kcache = mmap(NULL, 2 * bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (kcache == MAP_FAILED) return 1;
  madvise(kcache, 2 * bytes, MADV_HUGEPAGE);
  vcache = kcache + bytes;
  memset(kcache, 1, 2 * bytes);
  order_of_blocks = malloc(num_blocks * sizeof(int));
  for (size_t i = 0; i < num_blocks; ++i) order_of_blocks[i] = (int)i;
  srand(1);
  for (size_t i = num_blocks - 1; i > 0; --i) {
    const size_t j = (size_t)rand() % (i + 1);
    const int t = order_of_blocks[i];
    order_of_blocks[i] = order_of_blocks[j];
    order_of_blocks[j] = t;
  }
  double gbps[7];
  for (int r = 0; r < 7; ++r) {
    pthread_t th[64];
    int ids[64];
    const double t0 = now();
    for (int i = 0; i < threads; ++i) ids[i] = i, pthread_create(&th[i], NULL, streams[fmas / 8], &ids[i]);
    for (int i = 0; i < threads; ++i) pthread_join(th[i], NULL);
    gbps[r] = 2.0 * bytes / (now() - t0) / 1e9;
  }
  qsort(gbps, 7, sizeof(double), cmp);
  printf("order=%s pf=%s threads=%d fmas=%d: median %.1f GB/s, best %.1f GB/s\n", argv[1], argv[2], threads, fmas,
         gbps[3], gbps[6]);
  return 0;
}
