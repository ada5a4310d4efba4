// The ceiling of a verified warm load on this machine, with no canonical-kv code: T threads
// read 96 units of 2 MiB from the page cache (a) plainly at file offset 0 (what vLLM's fs tier
// does), (b) plainly at offset 136 (the unit format's payload offset with an unpadded 36-byte
// vLLM key), (c) at offset 136 in 256 KiB RWF_NOWAIT pieces, each XXH3-128-hashed from the
// destination right after its read (what canonical_fs does).
//
//   g++ -O2 -std=c++17 -pthread -Ikernels/third_party/xxhash bench/verified_read_ceiling.cpp \
//       kernels/third_party/xxhash/xxh_x86dispatch.c -o /tmp/ceiling
//   /tmp/ceiling [THREADS=2] [REPEATS=7] [DIR=/tmp]
#define XXH_STATIC_LINKING_ONLY
#define XXH_INLINE_ALL
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "xxh_x86dispatch.h"
#include "xxhash.h"

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  const size_t kUnits = 96, kUnit = 2 << 20, kPiece = 256 << 10, kOffset = 136;
  const int threads = argc > 1 ? atoi(argv[1]) : 2, repeats = argc > 2 ? atoi(argv[2]) : 7;
  std::string dir = std::string(argc > 3 ? argv[3] : "/tmp") + "/ceiling.XXXXXX";
  if (!mkdtemp(dir.data())) return perror("mkdtemp"), 1;
  std::vector<std::string> paths;
  std::vector<unsigned char> src(kUnit + 4096);
  for (auto& c : src) c = static_cast<unsigned char>(rand());
  for (size_t i = 0; i < kUnits; ++i) {
    paths.push_back(dir + "/u" + std::to_string(i));
    int fd = open(paths.back().c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || write(fd, src.data(), src.size()) != static_cast<ssize_t>(src.size()))
      return perror("write"), 1;
    close(fd);
  }
  auto* dest = static_cast<unsigned char*>(
      mmap(nullptr, kUnits * kUnit, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  for (size_t i = 0; i < kUnits * kUnit; i += 4096) dest[i] = 1;  // fault the destination in
  auto run = [&](int mode) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t)
      pool.emplace_back([&, t] {
        alignas(64) XXH3_state_t state;
        for (size_t i = t; i < kUnits; i += threads) {
          int fd = open(paths[i].c_str(), O_RDONLY);
          unsigned char* d = dest + i * kUnit;
          if (mode == 0) {
            (void)pread(fd, d, kUnit, 0);
          } else if (mode == 1) {
            (void)pread(fd, d, kUnit, kOffset);
          } else {
            XXH3_128bits_reset(&state);
            for (size_t o = 0; o < kUnit; o += kPiece) {
              iovec v = {d + o, kPiece};
              (void)preadv2(fd, &v, 1, kOffset + o, RWF_NOWAIT);
              XXH3_128bits_update_dispatch(&state, d + o, kPiece);
            }
          }
          close(fd);
        }
      });
    for (auto& t : pool) t.join();
  };
  std::vector<double> times[3];
  for (int r = 0; r < repeats; ++r)
    for (int m = 0; m < 3; ++m) {
      double start = now();
      run(m);
      times[m].push_back(now() - start);
    }
  const char* names[] = {"plain pread @0 (vLLM fs)", "plain pread @136", "NOWAIT 256K @136 + XXH3"};
  double best0 = *std::min_element(times[0].begin(), times[0].end());
  for (int m = 0; m < 3; ++m) {
    std::sort(times[m].begin(), times[m].end());
    printf("%d threads  %-26s best %.2f GB/s  median %.2f  (%.2fx of plain @0, best)\n", threads,
           names[m], kUnits * kUnit / times[m][0] / 1e9,
           kUnits * kUnit / times[m][repeats / 2] / 1e9, best0 / times[m][0]);
  }
  for (auto& p : paths) unlink(p.c_str());
  rmdir(dir.c_str());
}
