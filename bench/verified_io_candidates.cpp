// Candidates for one pass over the bytes of a verified unit load / store (issue 30), on this
// CPU, with no canonical-kv code. T threads move U units of a vLLM chunk's size (a 192-byte
// header then the payload, as canonical_fs writes them) between files and a page-aligned
// destination region, each method in a shuffled order per round; best and median of R rounds.
//
//   warm loads (page cache), cold loads (fdatasync + posix_fadvise(DONTNEED) first), stores
//   (fresh files, written back and unlinked untimed between rounds); checksums alone ("sum":
//   from L2 and from memory, against reading the same bytes).
//
//   g++ -O2 -std=c++17 -pthread -mavx2 -msse4.2 -mpclmul -mvpclmulqdq \
//       -Ikernels/third_party/xxhash bench/verified_io_candidates.cpp \
//       kernels/third_party/xxhash/xxh_x86dispatch.c -o /tmp/candidates
//   /tmp/candidates [THREADS=2] [ROUNDS=7] [PAYLOAD_BYTES=2097152] [DIR=/tmp] [MiB=192]
//   (environment: ONLY=warm|cold|store|sum, PICK=a,b to run some; AHEAD_MIB=8, the reads ahead)
#define XXH_STATIC_LINKING_ONLY
#define XXH_INLINE_ALL
#include <fcntl.h>
#include <immintrin.h>
#include <linux/aio_abi.h>
#include <nmmintrin.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "xxh_x86dispatch.h"
#include "xxhash.h"

namespace {

constexpr size_t kHeader = 192, kAlign = 4096;

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// CRC32C with the SSE4.2 instruction, three interleaved streams over the block's thirds,
// combined by a short serial pass (the shift-by-table is left out: a ceiling, not a codec).
uint32_t crc32c_3way(uint32_t crc, const unsigned char* p, size_t n) {
  size_t third = n / 24 * 8;
  uint64_t a = crc, b = 0, c = 0;
  const unsigned char *pa = p, *pb = p + third, *pc = p + 2 * third;
  for (size_t i = 0; i < third; i += 8) {
    uint64_t x, y, z;
    memcpy(&x, pa + i, 8), memcpy(&y, pb + i, 8), memcpy(&z, pc + i, 8);
    a = _mm_crc32_u64(a, x), b = _mm_crc32_u64(b, y), c = _mm_crc32_u64(c, z);
  }
  a = _mm_crc32_u64(a, b ^ c);
  for (size_t i = 3 * third; i < n; ++i) a = _mm_crc32_u8(static_cast<uint32_t>(a), p[i]);
  return static_cast<uint32_t>(a);
}

// Copy n bytes (dst 64-byte aligned) with non-temporal stores: the row is not read back soon.
// 256-bit vectors throughout (AVX2, VPCLMULQDQ): the same loops on CPUs with and without
// AVX-512 (XXH3 picks its widest loop at run time).
void copy_nt(unsigned char* dst, const unsigned char* src, size_t n) {
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
  memcpy(dst + i, src + i, n - i);
}

constexpr int kAcc = 8;  // 256-bit accumulators: 256 bytes a step

// The folding loop of a CRC computed with carry-less multiplies (VPCLMULQDQ, eight 256-bit
// accumulators, 256 bytes a step), the way a 64-bit CRC (CRC-64/NVME) would be computed: its
// throughput, the fold constant and the final reduction left out (a ceiling, not a codec).
void crc_fold(__m256i acc[kAcc], const unsigned char* p, size_t n) {
  const __m256i k = _mm256_set1_epi64x(0x21e9761e252621acLL);
  for (size_t i = 0; i + 256 <= n; i += 256)
    for (int j = 0; j < kAcc; ++j)
      acc[j] =
          _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(acc[j], k, 0x00),
                                            _mm256_clmulepi64_epi128(acc[j], k, 0x11)),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32 * j)));
}

// Every byte loaded once and folded by XOR: how fast this core reads, the bound of any checksum.
void read_only(__m256i acc[kAcc], const unsigned char* p, size_t n) {
  for (size_t i = 0; i + 256 <= n; i += 256)
    for (int j = 0; j < kAcc; ++j)
      acc[j] = _mm256_xor_si256(
          acc[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32 * j)));
}

enum class Sum { XXH128, XXH64, CRC32C, CRC_FOLD, READ, NONE };

struct Checksum {
  Sum kind;
  alignas(64) XXH3_state_t state;
  uint32_t crc = 0;
  __m256i acc[kAcc];
  void reset() {
    if (kind == Sum::XXH128) XXH3_128bits_reset(&state);
    if (kind == Sum::XXH64) XXH3_64bits_reset(&state);
    crc = 0;
    for (auto& a : acc) a = _mm256_setzero_si256();
  }
  void update(const void* p, size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    if (kind == Sum::XXH128) XXH3_128bits_update_dispatch(&state, p, n);
    if (kind == Sum::XXH64) XXH3_64bits_update_dispatch(&state, p, n);
    if (kind == Sum::CRC32C) crc = crc32c_3way(crc, b, n);
    if (kind == Sum::CRC_FOLD) crc_fold(acc, b, n);
    if (kind == Sum::READ) read_only(acc, b, n);
  }
  uint64_t digest() {
    if (kind == Sum::XXH128) return XXH3_128bits_digest(&state).low64;
    if (kind == Sum::XXH64) return XXH3_64bits_digest(&state);
    if (kind == Sum::CRC_FOLD || kind == Sum::READ) {
      __m256i x = acc[0];
      for (int j = 1; j < kAcc; ++j) x = _mm256_xor_si256(x, acc[j]);
      return static_cast<uint64_t>(_mm256_extract_epi64(x, 0));
    }
    return crc;
  }
};

struct Setup {
  int threads;
  size_t payload, unit, units;
  std::string dir;
  std::vector<std::string> paths;
  unsigned char* rows;  // units x round_up(payload, 4096)
  size_t row;
};

// One unit load into dest: fd open, the payload's bytes at file offset kHeader.
using LoadFn = std::function<void(Setup&, int fd, unsigned char* dest, Checksum&, unsigned char*)>;

void load_plain_at0(Setup& s, int fd, unsigned char* d, Checksum&, unsigned char*) {
  (void)pread(fd, d, s.payload, 0);  // vLLM fs: the row is the file
}

// Today's: RWF_NOWAIT pieces straight into the row, each hashed from there after its read.
LoadFn load_pieces(size_t piece) {
  return [piece](Setup& s, int fd, unsigned char* d, Checksum& c, unsigned char*) {
    unsigned char head[kHeader];
    c.reset();
    (void)pread(fd, head, kHeader, 0);
    c.update(head, kHeader);
    for (size_t o = 0; o < s.payload; o += piece) {
      size_t n = std::min(piece, s.payload - o);
      iovec v = {d + o, n};
      (void)preadv2(fd, &v, 1, kHeader + o, RWF_NOWAIT);
      c.update(d + o, n);
    }
    (void)c.digest();
  };
}

// pread into a small L1/L2 bounce, hash it there, copy to the row (nt: streaming stores).
LoadFn load_bounce(size_t piece, bool nt) {
  return [piece, nt](Setup& s, int fd, unsigned char* d, Checksum& c, unsigned char* buf) {
    c.reset();
    for (size_t o = 0; o < s.unit; o += piece) {
      size_t n = std::min(piece, s.unit - o);
      (void)pread(fd, buf, n, o);
      c.update(buf, n);
      size_t skip = o == 0 ? kHeader : 0;
      unsigned char* to = d + o + skip - kHeader;
      if (nt)
        copy_nt(to, buf + skip, n - skip);
      else
        memcpy(to, buf + skip, n - skip);
    }
    (void)c.digest();
  };
}

// One loop over a mapped unit m: hash a block from the mapping (into L1), copy it from L1
// (nt: streaming stores; snap: through an L1 copy, so the row gets exactly what was hashed).
void fused(Setup& s, const unsigned char* m, unsigned char* d, Checksum& c, unsigned char* buf,
           size_t block, bool nt, bool snap, bool hash_row = false) {
  c.reset();
  c.update(m, kHeader);
  for (size_t o = 0; o < s.payload; o += block) {
    size_t n = std::min(block, s.payload - o);
    const unsigned char* from = m + kHeader + o;
    if (hash_row) {  // copied (cached stores), then the row's block hashed from L1
      memcpy(d + o, from, n);
      c.update(d + o, n);
      continue;
    }
    if (snap) memcpy(buf, from, n), from = buf;
    c.update(from, n);
    if (nt)
      copy_nt(d + o, from, n);
    else
      memcpy(d + o, from, n);
  }
  (void)c.digest();
}

// mmap the unit, then one loop: hash a block from the mapping (into L1), copy it from L1.
// snap: each block is first copied into an L1 bounce, hashed and copied on from there, so the
// row gets exactly the bytes hashed even while another process writes the file; hash_row:
// each block copied into the row, then hashed there from L1 (the same guarantee, no bounce).
LoadFn load_mmap(size_t block, bool populate, bool nt, bool snap = false, bool hash_row = false) {
  return [block, populate, nt, snap, hash_row](Setup& s, int fd, unsigned char* d, Checksum& c,
                                               unsigned char* buf) {
    int flags = MAP_SHARED | (populate ? MAP_POPULATE : 0);
    auto* m = static_cast<unsigned char*>(mmap(nullptr, s.unit, PROT_READ, flags, fd, 0));
    if (m == MAP_FAILED) return perror("mmap"), exit(1);
    fused(s, m, d, c, buf, block, nt, snap, hash_row);
    munmap(m, s.unit);
  };
}

// A cold unit read through a mapping marked MADV_HUGEPAGE: each fault reads ahead a PMD-sized
// folio (one device request per 2 MiB), which the page cache then keeps in huge folios (so
// later warm loads of it map a PMD at a time); one pass: hashed and streamed from the mapping.
LoadFn load_mmap_huge(size_t block) {
  return [block](Setup& s, int fd, unsigned char* d, Checksum& c, unsigned char* buf) {
    auto* m = static_cast<unsigned char*>(mmap(nullptr, s.unit, PROT_READ, MAP_SHARED, fd, 0));
    if (m == MAP_FAILED) return perror("mmap"), exit(1);
    madvise(m, s.unit, MADV_HUGEPAGE);
    fused(s, m, d, c, buf, block, true, false);
    munmap(m, s.unit);
  };
}

// A mapping kept from an earlier load (what a cache of mappings would give: the ceiling of
// one pass when mapping costs nothing), one loop: hash in L1 + NT stream (snap: via an L1 copy).
std::vector<unsigned char*> g_maps;
LoadFn load_kept(size_t block, bool snap) {
  return [block, snap](Setup& s, int fd, unsigned char* d, Checksum& c, unsigned char* buf) {
    unsigned char*& m = g_maps[(d - s.rows) / s.row];  // sized by main: one per unit
    if (m == nullptr)
      m = static_cast<unsigned char*>(
          mmap(nullptr, s.unit, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0));
    fused(s, m, d, c, buf, block, true, snap);
  };
}

// A per-thread arena: units mapped MAP_FIXED one after another into a reserved PROT_NONE range,
// the whole arena reset with one mmap when full (one TLB flush for many units).
LoadFn load_arena(size_t block, bool populate, bool snap = true) {
  return [block, populate, snap](Setup& s, int fd, unsigned char* d, Checksum& c,
                                 unsigned char* buf) {
    thread_local unsigned char* arena = nullptr;
    thread_local size_t used = 0;
    // 2 MiB slots in a 2 MiB-aligned arena: a unit the page cache holds in huge folios is
    // then mapped a PMD at a time (4 KiB slots map it a page at a time: much dearer)
    const size_t huge = 2u << 20, size = 64u << 20, span = round_up(s.unit, huge);
    if (arena == nullptr) {
      auto* raw = static_cast<unsigned char*>(mmap(
          nullptr, size + huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
      arena = reinterpret_cast<unsigned char*>(round_up(reinterpret_cast<size_t>(raw), huge));
    }
    if (used + span > size) {
      mmap(arena, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
      used = 0;
    }
    auto* m = static_cast<unsigned char*>(
        mmap(arena + used, s.unit, PROT_READ,
             MAP_SHARED | MAP_FIXED | (populate ? MAP_POPULATE : 0), fd, 0));
    if (m == MAP_FAILED) return perror("mmap"), exit(1);
    used += span;
    fused(s, m, d, c, buf, block, true, snap);
  };
}

double time_loads(Setup& s, const LoadFn& fn, Sum sum, int oflags, size_t bounce) {
  std::vector<std::thread> pool;
  double start = now();
  for (int t = 0; t < s.threads; ++t)
    pool.emplace_back([&, t] {
      Checksum c{sum};
      void* buf = nullptr;
      if (posix_memalign(&buf, kAlign, bounce) != 0) exit(1);
      memset(buf, 0, bounce);
      for (size_t i = t; i < s.units; i += s.threads) {
        int fd = open(s.paths[i].c_str(), O_RDONLY | oflags);
        if (fd < 0) perror("open"), exit(1);
        fn(s, fd, s.rows + i * s.row, c, static_cast<unsigned char*>(buf));
        close(fd);
      }
      free(buf);
    });
  for (auto& t : pool) t.join();
  return now() - start;
}

// O_DIRECT whole unit into the row's bounce then hash+copy (cold candidate (c)).
LoadFn load_direct(size_t piece, bool hash, bool nt) {
  return [piece, hash, nt](Setup& s, int fd, unsigned char* d, Checksum& c, unsigned char* buf) {
    c.reset();
    size_t padded = round_up(s.unit, kAlign);
    for (size_t o = 0; o < padded; o += piece) {
      size_t n = std::min(piece, padded - o);
      ssize_t got = pread(fd, buf, n, o);
      if (got <= 0) break;
      size_t have = std::min(static_cast<size_t>(got), s.unit - o);
      size_t skip = o == 0 ? kHeader : 0;
      if (hash) c.update(buf, have);
      unsigned char* to = d + o + skip - kHeader;
      if (nt)
        copy_nt(to, buf + skip, have - skip);
      else
        memcpy(to, buf + skip, have - skip);
    }
    (void)c.digest();
  };
}

// Cold, a thread's units read O_DIRECT ahead (Linux AIO: whole units, as many as fit 8 MiB,
// at least two) while the one before is hashed and streamed into its row a 4 KiB block at a
// time (`fused`): what unitio's direct_io loads do, without the checks.
double time_ahead(Setup& s) {
  std::vector<std::thread> pool;
  double start = now();
  for (int t = 0; t < s.threads; ++t)
    pool.emplace_back([&, t] {
      const size_t slot = round_up(s.unit, kAlign);
      const size_t ahead = getenv("AHEAD_MIB") ? atol(getenv("AHEAD_MIB")) << 20 : 8u << 20;
      const size_t slots = std::max<size_t>(2, ahead / slot);
      void* ring = nullptr;
      unsigned char block[4096];
      if (posix_memalign(&ring, kAlign, slot * slots) != 0) exit(1);
      memset(ring, 0, slot * slots);
      aio_context_t ctx = 0;
      if (syscall(__NR_io_setup, 64, &ctx) != 0) perror("io_setup"), exit(1);
      std::vector<size_t> ids;
      for (size_t i = t; i < s.units; i += s.threads) ids.push_back(i);
      std::vector<int> fds(ids.size(), -1);
      std::vector<char> done(ids.size(), 0);
      auto at = [&](size_t k) { return static_cast<unsigned char*>(ring) + (k % slots) * slot; };
      size_t submitted = 0;
      auto submit = [&] {
        size_t k = submitted++;
        if ((fds[k] = open(s.paths[ids[k]].c_str(), O_RDONLY | O_DIRECT)) < 0)
          perror("open"), exit(1);
        struct iocb cb = {};
        cb.aio_data = k, cb.aio_lio_opcode = IOCB_CMD_PREAD;
        cb.aio_fildes = static_cast<uint32_t>(fds[k]);
        cb.aio_buf = reinterpret_cast<uintptr_t>(at(k)), cb.aio_nbytes = slot;
        struct iocb* list[1] = {&cb};
        if (syscall(__NR_io_submit, ctx, 1L, list) != 1) perror("io_submit"), exit(1);
      };
      while (submitted < std::min(slots, ids.size())) submit();
      Checksum c{Sum::XXH128};
      for (size_t k = 0; k < ids.size(); ++k) {
        while (!done[k]) {
          struct io_event events[8];
          long got = syscall(__NR_io_getevents, ctx, 1L, 8L, events, nullptr);
          for (long e = 0; e < got; ++e) done[events[e].data] = 1;
        }
        fused(s, at(k), s.rows + ids[k] * s.row, c, block, 4096, true, false);
        close(fds[k]);
        if (submitted < ids.size()) submit();
      }
      syscall(__NR_io_destroy, ctx);
      free(ring);
    });
  for (auto& t : pool) t.join();
  return now() - start;
}

void load_direct_plain(Setup& s, int fd, unsigned char* d, Checksum&, unsigned char*) {
  (void)pread(fd, d, round_up(s.payload, kAlign), 0);  // vLLM fs O_DIRECT: into the row
}

void drop_cache(Setup& s) {
  for (auto& p : s.paths) {
    int fd = open(p.c_str(), O_RDONLY);
    fdatasync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
  }
}

void warm_cache(Setup& s) {
  std::vector<unsigned char> buf(s.unit);
  for (auto& p : s.paths) {
    int fd = open(p.c_str(), O_RDONLY);
    (void)pread(fd, buf.data(), s.unit, 0);
    close(fd);
  }
}

// ---- stores: src row -> a fresh file (header + payload), checksum patched at 80.
using StoreFn = std::function<void(Setup&, int fd, const unsigned char* src, Checksum&)>;

void store_plain(Setup& s, int fd, const unsigned char* src, Checksum&) {
  (void)pwrite(fd, src, s.payload, 0);  // vLLM fs
}

// Today's: header + payload in 256 KiB pwritev pieces, each hashed after its write.
StoreFn store_pieces(size_t piece, bool hash_first) {
  return [piece, hash_first](Setup& s, int fd, const unsigned char* src, Checksum& c) {
    unsigned char head[kHeader] = {1};
    c.reset();
    c.update(head, kHeader);
    (void)pwrite(fd, head, kHeader, 0);
    for (size_t o = 0; o < s.payload; o += piece) {
      size_t n = std::min(piece, s.payload - o);
      if (hash_first) c.update(src + o, n);
      (void)pwrite(fd, src + o, n, kHeader + o);
      if (!hash_first) c.update(src + o, n);
    }
    uint64_t sum = c.digest();
    (void)pwrite(fd, &sum, 8, 80);
  };
}

// The whole unit hashed first (its second read, by the write, comes from L3), then header
// (checksum in place) and payload in ONE pwritev: the page cache may take it in large folios.
void store_whole(Setup& s, int fd, const unsigned char* src, Checksum& c) {
  unsigned char head[kHeader] = {1};
  c.reset();
  c.update(head, kHeader);
  c.update(src, s.payload);
  uint64_t sum = c.digest();
  memcpy(head + 80, &sum, 8);
  iovec v[2] = {{head, kHeader}, {const_cast<unsigned char*>(src), s.payload}};
  (void)pwritev(fd, v, 2, 0);
}

// The same after fallocate of the whole file (RocksDB's allow_fallocate): ext4 maps the unit
// as one extent up front instead of reserving each 4 KiB block on the write path.
void store_plain_fallocated(Setup& s, int fd, const unsigned char* src, Checksum& c) {
  (void)fallocate(fd, 0, 0, static_cast<off_t>(s.payload));
  store_plain(s, fd, src, c);
}

void store_whole_fallocated(Setup& s, int fd, const unsigned char* src, Checksum& c) {
  (void)fallocate(fd, 0, 0, static_cast<off_t>(kHeader + s.payload));
  store_whole(s, fd, src, c);
}

// ftruncate + shared mapping: one loop hashes a block of the row and copies it in (nt).
StoreFn store_mmap(size_t block, bool nt) {
  return [block, nt](Setup& s, int fd, const unsigned char* src, Checksum& c) {
    if (ftruncate(fd, static_cast<off_t>(s.unit)) != 0) return perror("ftruncate"), exit(1);
    auto* m = static_cast<unsigned char*>(
        mmap(nullptr, s.unit, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0));
    if (m == MAP_FAILED) return perror("mmap"), exit(1);
    c.reset();
    memset(m, 1, kHeader);
    c.update(m, kHeader);
    for (size_t o = 0; o < s.payload; o += block) {
      size_t n = std::min(block, s.payload - o);
      c.update(src + o, n);
      if (nt)
        copy_nt(m + kHeader + o, src + o, n);
      else
        memcpy(m + kHeader + o, src + o, n);
    }
    uint64_t sum = c.digest();
    memcpy(m + 80, &sum, 8);
    munmap(m, s.unit);
  };
}

double time_stores(Setup& s, const StoreFn& fn, Sum sum) {
  std::vector<std::thread> pool;
  double start = now();
  for (int t = 0; t < s.threads; ++t)
    pool.emplace_back([&, t] {
      Checksum c{sum};
      for (size_t i = t; i < s.units; i += s.threads) {
        std::string p = s.paths[i] + ".w";
        int fd = open(p.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
        if (fd < 0) perror("open"), exit(1);
        fn(s, fd, s.rows + i * s.row, c);
        close(fd);
      }
    });
  for (auto& t : pool) t.join();
  double took = now() - start;
  for (auto& p : s.paths) {  // written back and removed, untimed
    std::string w = p + ".w";
    int fd = open(w.c_str(), O_RDONLY);
    fdatasync(fd);
    close(fd);
    unlink(w.c_str());
  }
  return took;
}

// Checksums alone, T threads each over its share of the units' bytes: `resident` from a
// 256 KiB buffer of its own (L2: where a verified load hashes a piece it has just read) or
// from the rows (memory: where a store hashes the caller's row), in 256 KiB updates.
volatile uint64_t g_sink;
double time_sums(Setup& s, Sum sum, bool resident) {
  std::vector<std::thread> pool;
  double start = now();
  for (int t = 0; t < s.threads; ++t)
    pool.emplace_back([&, t] {
      constexpr size_t kPiece = 256 << 10;
      std::vector<unsigned char> own(kPiece, static_cast<unsigned char>(t + 1));
      Checksum c{sum};
      for (size_t i = t; i < s.units; i += s.threads) {
        const unsigned char* unit = s.rows + i * s.row;
        c.reset();
        for (size_t o = 0; o < s.payload; o += kPiece)
          c.update(resident ? own.data() : unit + o, std::min(kPiece, s.payload - o));
        g_sink = g_sink + c.digest();
      }
    });
  for (auto& th : pool) th.join();
  return now() - start;
}

struct Method {
  const char* group;  // warm, cold, store, sum
  const char* name;
  std::function<double(Setup&)> run;
  std::vector<double> times;
};

}  // namespace

int main(int argc, char** argv) {
  Setup s;
  s.threads = argc > 1 ? atoi(argv[1]) : 2;
  int rounds = argc > 2 ? atoi(argv[2]) : 7;
  s.payload = argc > 3 ? strtoull(argv[3], nullptr, 10) : (2 << 20);
  s.dir = std::string(argc > 4 ? argv[4] : "/tmp") + "/candidates.XXXXXX";
  size_t mib = argc > 5 ? strtoull(argv[5], nullptr, 10) : 192;
  s.unit = kHeader + s.payload;
  s.units = std::max<size_t>(8, (mib << 20) / s.payload);
  s.row = round_up(s.payload, kAlign);
  g_maps.assign(s.units, nullptr);
  if (!mkdtemp(s.dir.data())) return perror("mkdtemp"), 1;
  std::vector<unsigned char> src(s.unit);
  std::mt19937_64 rng(1);
  for (auto& c : src) c = static_cast<unsigned char>(rng());
  for (size_t i = 0; i < s.units; ++i) {
    s.paths.push_back(s.dir + "/u" + std::to_string(i));
    int fd = open(s.paths.back().c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || write(fd, src.data(), s.unit) != static_cast<ssize_t>(s.unit))
      return perror("write"), 1;
    close(fd);
  }
  s.rows = static_cast<unsigned char*>(
      mmap(nullptr, s.units * s.row, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  for (size_t i = 0; i < s.units * s.row; i += 4096) s.rows[i] = static_cast<unsigned char>(i);

  const size_t K = 1024;
  auto warm = [](LoadFn fn, Sum sum, size_t bounce = 256 << 10) {
    return [fn, sum, bounce](Setup& st) {
      warm_cache(st);
      return time_loads(st, fn, sum, 0, bounce);
    };
  };
  auto cold = [](LoadFn fn, Sum sum, int oflags, size_t bounce = 4 << 20) {
    return [fn, sum, oflags, bounce](Setup& st) {
      drop_cache(st);
      return time_loads(st, fn, sum, oflags, bounce);
    };
  };
  auto store = [](StoreFn fn, Sum sum) {
    return [fn, sum](Setup& st) { return time_stores(st, fn, sum); };
  };
  auto sums = [](Sum sum, bool resident) {
    return [sum, resident](Setup& st) { return time_sums(st, sum, resident); };
  };
  std::vector<Method> methods = {
      {"warm", "plain pread @0 (vLLM fs)", warm(load_plain_at0, Sum::NONE)},
      {"warm", "NOWAIT 256K + XXH3-128 (today)", warm(load_pieces(256 * K), Sum::XXH128)},
      {"warm", "kept map fused 16K NT", warm(load_kept(16 * K, false), Sum::XXH128)},
      {"warm", "kept map snap 4K NT", warm(load_kept(4 * K, true), Sum::XXH128)},
      {"warm", "arena snap 4K NT populate", warm(load_arena(4 * K, true), Sum::XXH128)},
      {"warm", "arena snap 4K NT faultaround", warm(load_arena(4 * K, false), Sum::XXH128)},
      {"warm", "arena fused 2K NT populate", warm(load_arena(2 * K, true, false), Sum::XXH128)},
      {"warm", "arena fused 2K NT faults (unitio)",
       warm(load_arena(2 * K, false, false), Sum::XXH128)},
      {"warm", "NOWAIT 64K + XXH3-128", warm(load_pieces(64 * K), Sum::XXH128)},
      {"warm", "NOWAIT 128K + XXH3-128", warm(load_pieces(128 * K), Sum::XXH128)},
      {"warm", "NOWAIT 512K + XXH3-128", warm(load_pieces(512 * K), Sum::XXH128)},
      {"warm", "NOWAIT 1M + XXH3-128", warm(load_pieces(1024 * K), Sum::XXH128)},
      {"warm", "NOWAIT whole + XXH3-128", warm(load_pieces(64 * 1024 * K), Sum::XXH128)},
      {"warm", "NOWAIT 256K, no hash", warm(load_pieces(256 * K), Sum::NONE)},
      {"warm", "bounce 32K + XXH3-128 + memcpy", warm(load_bounce(32 * K, false), Sum::XXH128)},
      {"warm", "bounce 32K + XXH3-128 + NT copy", warm(load_bounce(32 * K, true), Sum::XXH128)},
      {"warm", "bounce 128K + XXH3-128 + NT copy", warm(load_bounce(128 * K, true), Sum::XXH128)},
      {"warm", "mmap+POPULATE fused 16K XXH3-128",
       warm(load_mmap(16 * K, true, false), Sum::XXH128)},
      {"warm", "mmap+POPULATE fused 16K XXH3-128 NT",
       warm(load_mmap(16 * K, true, true), Sum::XXH128)},
      {"warm", "mmap+POPULATE fused 4K XXH3-128 NT",
       warm(load_mmap(4 * K, true, true), Sum::XXH128)},
      {"warm", "mmap+POPULATE 4K L1 snapshot XXH3-128 NT",
       warm(load_mmap(4 * K, true, true, true), Sum::XXH128)},
      {"warm", "mmap+POPULATE 2K L1 snapshot XXH3-128 NT",
       warm(load_mmap(2 * K, true, true, true), Sum::XXH128)},
      {"warm", "mmap+POPULATE 8K L1 snapshot XXH3-128 NT",
       warm(load_mmap(8 * K, true, true, true), Sum::XXH128)},
      {"warm", "mmap+POPULATE fused 2K XXH3-128 NT",
       warm(load_mmap(2 * K, true, true), Sum::XXH128)},
      {"warm", "mmap+POPULATE fused 64K XXH3-128 NT",
       warm(load_mmap(64 * K, true, true), Sum::XXH128)},
      {"warm", "mmap+POPULATE copy 2K, XXH3-128 of the row",
       warm(load_mmap(2 * K, true, false, false, true), Sum::XXH128)},
      {"warm", "mmap+POPULATE copy 8K, XXH3-128 of the row",
       warm(load_mmap(8 * K, true, false, false, true), Sum::XXH128)},
      {"warm", "mmap fault-around fused 16K NT", warm(load_mmap(16 * K, false, true), Sum::XXH128)},
      {"warm", "mmap+POPULATE fused 16K XXH3-64 NT",
       warm(load_mmap(16 * K, true, true), Sum::XXH64)},
      {"warm", "mmap+POPULATE fused 16K CRC32C NT",
       warm(load_mmap(16 * K, true, true), Sum::CRC32C)},
      {"warm", "mmap+POPULATE copy only NT", warm(load_mmap(16 * K, true, true), Sum::NONE)},
      {"cold", "plain pread @0 (vLLM fs buffered)", cold(load_plain_at0, Sum::NONE, 0)},
      {"cold", "O_DIRECT whole into row (vLLM fs)", cold(load_direct_plain, Sum::NONE, O_DIRECT)},
      {"cold", "buffered 4M bounce + XXH3 + memcpy (today)",
       cold(load_direct(4 << 20, true, false), Sum::XXH128, 0)},
      {"cold", "O_DIRECT 4M bounce + XXH3 + memcpy (today)",
       cold(load_direct(4 << 20, true, false), Sum::XXH128, O_DIRECT)},
      {"cold", "O_DIRECT 4M bounce, fused 16K NT",
       cold(load_direct(4 << 20, true, true), Sum::XXH128, O_DIRECT)},
      {"cold", "O_DIRECT AIO ahead, whole units, fused 4K NT",
       [](Setup& st) { return drop_cache(st), time_ahead(st); }},
      {"cold", "O_DIRECT 512K pieces + XXH3 + NT",
       cold(load_direct(512 * K, true, true), Sum::XXH128, O_DIRECT, 512 * K)},
      {"cold", "mmap+POPULATE fused 16K NT", cold(load_mmap(16 * K, true, true), Sum::XXH128, 0)},
      {"cold", "mmap MADV_HUGEPAGE fused 2K NT", cold(load_mmap_huge(2 * K), Sum::XXH128, 0)},
      {"store", "pwrite whole @0 (vLLM fs)", store(store_plain, Sum::NONE)},
      {"store", "pwrite 256K then XXH3 (today)", store(store_pieces(256 * K, false), Sum::XXH128)},
      {"store", "XXH3 256K then pwrite", store(store_pieces(256 * K, true), Sum::XXH128)},
      {"store", "XXH3 32K then pwrite", store(store_pieces(32 * K, true), Sum::XXH128)},
      {"store", "XXH3 512K then pwrite", store(store_pieces(512 * K, true), Sum::XXH128)},
      {"store", "XXH3 1M then pwrite", store(store_pieces(1024 * K, true), Sum::XXH128)},
      {"store", "XXH3 whole, then ONE pwritev", store(store_whole, Sum::XXH128)},
      {"store", "fallocate, XXH3 whole, ONE pwritev", store(store_whole_fallocated, Sum::XXH128)},
      {"store", "fallocate, pwrite whole @0", store(store_plain_fallocated, Sum::NONE)},
      {"store", "pwrite 256K, no hash", store(store_pieces(256 * K, false), Sum::NONE)},
      {"store", "ftruncate+mmap fused 16K NT", store(store_mmap(16 * K, true), Sum::XXH128)},
      {"store", "ftruncate+mmap fused 16K memcpy", store(store_mmap(16 * K, false), Sum::XXH128)},
      {"sum", "read only, from L2 (any checksum's bound)", sums(Sum::READ, true)},
      {"sum", "XXH3-128 from L2", sums(Sum::XXH128, true)},
      {"sum", "XXH3-64 from L2", sums(Sum::XXH64, true)},
      {"sum", "CRC32C 3 streams (SSE4.2) from L2", sums(Sum::CRC32C, true)},
      {"sum", "CRC fold VPCLMULQDQ x4 from L2", sums(Sum::CRC_FOLD, true)},
      {"sum", "read only, from memory", sums(Sum::READ, false)},
      {"sum", "XXH3-128 from memory", sums(Sum::XXH128, false)},
      {"sum", "CRC fold VPCLMULQDQ x4 from memory", sums(Sum::CRC_FOLD, false)},
  };
  // ONLY=warm (a group), PICK=a,b (names containing one of these, and each group's first)
  const char *only = getenv("ONLY"), *pick = getenv("PICK");
  std::vector<size_t> order;
  for (size_t i = 0; i < methods.size(); ++i) {
    bool first = i == 0 || strcmp(methods[i - 1].group, methods[i].group) != 0, picked = !pick;
    for (std::string rest = pick ? pick : ""; !picked && !rest.empty();) {
      size_t comma = rest.find(',');
      picked = strstr(methods[i].name, rest.substr(0, comma).c_str()) != nullptr;
      rest = comma == std::string::npos ? "" : rest.substr(comma + 1);
    }
    if ((only == nullptr || strcmp(only, methods[i].group) == 0) && (first || picked))
      order.push_back(i);
  }
  std::mt19937 shuffle(42);
  for (int r = 0; r < rounds; ++r) {
    std::shuffle(order.begin(), order.end(), shuffle);
    for (size_t i : order) methods[i].times.push_back(methods[i].run(s));
  }
  double base[4] = {0, 0, 0, 0};
  const char* groups[] = {"warm", "cold", "store", "sum"};
  printf("%d threads, %zu units of %zu payload bytes (+%zu header), %d rounds, shuffled\n",
         s.threads, s.units, s.payload, kHeader, rounds);
  for (int g = 0; g < 4; ++g)
    for (auto& m : methods) {
      if (strcmp(m.group, groups[g]) != 0 || m.times.empty()) continue;
      std::sort(m.times.begin(), m.times.end());
      if (base[g] == 0) base[g] = m.times[0];
      double bytes = static_cast<double>(s.units * s.payload);
      printf("%-5s %-44s best %5.2f GB/s  median %5.2f  %.2fx of the first (best)\n", m.group,
             m.name, bytes / m.times[0] / 1e9, bytes / m.times[m.times.size() / 2] / 1e9,
             base[g] / m.times[0]);
    }
  for (auto& p : s.paths) unlink(p.c_str());
  rmdir(s.dir.c_str());
}
