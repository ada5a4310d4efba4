// canonical_ops._unitio: batch unit-file I/O for FileStore, without the GIL.
//
// A plain CPython extension (it links neither torch nor libpython beyond the C API), so
// canonical_ops.units imports it in any Python 3 venv of the same ABI. One call moves a
// whole batch of units (a job's items) with the GIL released; Python keeps the index,
// counters, quarantine and messages, and turns each item's status into a JobOutcome.
//
// Guarantees (the same as the Python code it replaces):
// - Every path component below the store's fan-out directory is opened relative to its
//   parent's descriptor with O_NOFOLLOW; directories are fstat-checked (owner, mode);
//   units are opened O_NONBLOCK and must be regular files of the expected size before a
//   byte is read (a FIFO never blocks).
// - A load hashes (XXH3-128, or the caller's MAC through Python) every byte it reads and
//   compares the header with the bytes the caller expects. Caller memory is written only
//   under the job's claim, from blocks each hashed while in L1 and then streamed
//   (non-temporal stores) into the destination: a unit the page cache holds whole is mapped
//   under a read lease (populated first; one pass: each 2 KiB block hashed from the mapping
//   and streamed on; the lease keeps writers out, and a writer that broke it meanwhile sends
//   the unit to the pieces below; a SIGBUS inside the mapping makes it CORRUPT), any
//   other is read into the batch's aligned buffer first, except pieces RWF_NOWAIT finds in
//   the page cache, read straight into the destination (they never wait for a device, so
//   the claimed window is a bounded copy). An expired job writes nothing.
//   A buffered batch asks the page cache for its next units ahead of reading them (WILLNEED);
//   with direct reads (the default), its O_DIRECT pieces are submitted ahead (Linux AIO) into a
//   ring in that buffer, and every read submitted is waited for before the buffer is given back.
// - A store writes a temp file (hashing each piece as it goes), optionally fdatasyncs it
//   and moves it under its name only under the claim: renameat2(RENAME_NOREPLACE) (or
//   link() where the file system lacks it) never replaces, so the first writer wins, and
//   a crash leaves a temp file, never a partial unit.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <linux/magic.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#define XXH_STATIC_LINKING_ONLY
#define XXH_INLINE_ALL
#include "xxhash.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#include "xxh_x86dispatch.h"  // AVX-512 / AVX2 / SSE2 chosen at run time
#define UNITIO_XXH3_UPDATE XXH3_128bits_update_dispatch
#else
#define UNITIO_XXH3_UPDATE XXH3_128bits_update
#endif

#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008
#endif
#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif
#ifndef O_NOATIME
#define O_NOATIME 0
#endif

namespace {

// ----------------------------------------------------------------- item statuses

enum Status : int {
  OK = 0,           // loaded (verified) / stored (linked by us)
  MISSING = 1,      // key directory or unit not there (a store: it vanished; try again)
  UNSAFE_DIR = 2,   // the key directory is a symlink, not a directory, or not trusted
  UNSAFE_FILE = 3,  // the unit is a symlink or not a regular file (quarantine it)
  CORRUPT = 4,      // size, header or checksum wrong (quarantine it)
  EXPIRED = 5,      // the job's claim was refused: nothing written, the batch stopped
  ERROR = 6,        // an I/O error (errno)
  EXISTS = 7,       // store: a file of that name is there already (Python checks it)
  LOST = 8,         // store: another writer linked it first
  SKIPPED = 9,      // not attempted (an earlier item expired)
};

constexpr int kAlign = 4096;  // O_DIRECT offsets, lengths and buffers
constexpr size_t kMaxHeader = 96 + 1024;
constexpr size_t kStep = 256 << 10;          // bytes copied then hashed at once: they stay in L2
constexpr size_t kMappedBlock = 2048;        // a mapped unit's: hashed, then streamed from L1
constexpr size_t kFaultAround = 64 << 10;    // what a read fault maps of the page cache (Linux)
constexpr size_t kBlock = 4096;              // bytes hashed then streamed at once: they stay in L1
constexpr size_t kPrefetchBytes = 16 << 20;  // a batch's units asked for ahead of their reads
constexpr size_t kOpenAhead = 8;  // of those, kept open for their turn (descriptors per batch)
constexpr size_t kMaxAhead = 8;   // O_DIRECT reads ahead: pieces in flight at most

// ----------------------------------------------------------------- the job state word

// RUNNING -> CLAIMED -> RUNNING ... ; RUNNING -> EXPIRED (watchdog) is final. The worker
// claims before it writes caller memory or publishes; the watchdog expires a job only
// from RUNNING, so the two never both win.
enum : int { RUNNING = 0, CLAIMED = 1, EXPIRED_STATE = 2 };

struct JobState {
  PyObject_HEAD std::atomic<int> word;
};

bool claim(std::atomic<int>* w) {
  int cur = w->load();
  while (true) {
    if (cur == EXPIRED_STATE) return false;
    if (cur == CLAIMED) return true;  // a detached job shared by threads: never expires
    if (w->compare_exchange_weak(cur, CLAIMED)) return true;
  }
}

void release(std::atomic<int>* w) {
  int expected = CLAIMED;
  w->compare_exchange_strong(expected, RUNNING);
}

bool expire(std::atomic<int>* w) {
  int expected = RUNNING;
  return w->compare_exchange_strong(expected, EXPIRED_STATE) || expected == EXPIRED_STATE;
}

PyObject* JobState_new(PyTypeObject* type, PyObject*, PyObject*) {
  auto* self = reinterpret_cast<JobState*>(type->tp_alloc(type, 0));
  if (self != nullptr) new (&self->word) std::atomic<int>(RUNNING);
  return reinterpret_cast<PyObject*>(self);
}

PyObject* JobState_claim(PyObject* self, PyObject*) {
  return PyBool_FromLong(claim(&reinterpret_cast<JobState*>(self)->word));
}

PyObject* JobState_release(PyObject* self, PyObject*) {
  release(&reinterpret_cast<JobState*>(self)->word);
  Py_RETURN_NONE;
}

PyObject* JobState_expire(PyObject* self, PyObject*) {
  return PyBool_FromLong(expire(&reinterpret_cast<JobState*>(self)->word));
}

PyObject* JobState_value(PyObject* self, void*) {
  return PyLong_FromLong(reinterpret_cast<JobState*>(self)->word.load());
}

PyMethodDef JobState_methods[] = {
    {"claim", JobState_claim, METH_NOARGS,
     "False when expired; else True, and the job cannot expire until release()."},
    {"release", JobState_release, METH_NOARGS, "End a claim."},
    {"expire", JobState_expire, METH_NOARGS,
     "The watchdog's move: True when the job is (now) expired, False while claimed."},
    {nullptr, nullptr, 0, nullptr}};

PyGetSetDef JobState_getset[] = {
    {"value", JobState_value, nullptr, "0 running, 1 claimed, 2 expired", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyType_Slot JobState_slots[] = {
    {Py_tp_doc,
     const_cast<char*>("A job's state word, shared by its worker (claims) and the watchdog.")},
    {Py_tp_new, reinterpret_cast<void*>(JobState_new)},
    {Py_tp_methods, JobState_methods},
    {Py_tp_getset, JobState_getset},
    {0, nullptr}};

PyType_Spec JobState_spec = {"canonical_ops._unitio.JobState", sizeof(JobState), 0,
                             Py_TPFLAGS_DEFAULT, JobState_slots};

PyTypeObject* JobStateType = nullptr;

// ----------------------------------------------------------------- the GIL and callbacks

// Python callbacks (the MAC of authenticated units, test hooks) run with the GIL taken back;
// the first exception one raises stops the batch and is raised by the call.
struct Gil {
  PyThreadState* saved = nullptr;
  bool failed = false;
  void drop() { saved = PyEval_SaveThread(); }
  void take() {
    if (saved != nullptr) PyEval_RestoreThread(saved);
    saved = nullptr;
  }
  // Call fn(args...) with the GIL; false (and `failed`) when it raised.
  template <typename F>
  bool with(F fn) {
    if (failed) return false;
    PyEval_RestoreThread(saved);
    bool ok = fn();
    if (!ok) failed = true;  // the exception stays set until the call returns
    saved = PyEval_SaveThread();
    return ok;
  }
};

struct Hook {
  PyObject* fn = nullptr;  // fn(stage, path relative to the namespace directory, bytes)
  Gil* gil = nullptr;
  bool call(const char* stage, const char* dir, const char* name, long long n) {
    if (fn == nullptr) return true;
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return gil->with([&] {
      PyObject* r = PyObject_CallFunction(fn, "ssL", stage, path, n);
      Py_XDECREF(r);
      return r != nullptr;
    });
  }
};

// XXH3-128 in C, or the unit's MAC (an object with update/digest) through Python.
struct Hasher {
  XXH3_state_t state;
  PyObject* mac = nullptr;
  Gil* gil = nullptr;
  void reset() { XXH3_128bits_reset(&state); }
  bool update(const void* data, size_t n) {
    if (n == 0) return true;
    if (mac == nullptr) {
      UNITIO_XXH3_UPDATE(&state, data, n);
      return true;
    }
    return gil->with([&] {
      PyObject* view = PyMemoryView_FromMemory(const_cast<char*>(static_cast<const char*>(data)),
                                               static_cast<Py_ssize_t>(n), PyBUF_READ);
      if (view == nullptr) return false;
      PyObject* r = PyObject_CallMethod(mac, "update", "O", view);
      if (r != nullptr) {  // no view of this memory may outlive the call
        Py_DECREF(r);
        r = PyObject_CallMethod(view, "release", nullptr);
        Py_XDECREF(r);
      }
      Py_DECREF(view);
      return r != nullptr;
    });
  }
  bool digest(unsigned char out[16]) {
    if (mac == nullptr) {
      XXH128_canonical_t canon;
      XXH128_canonicalFromHash(&canon, XXH3_128bits_digest(&state));
      memcpy(out, canon.digest, 16);
      return true;
    }
    return gil->with([&] {
      PyObject* r = PyObject_CallMethod(mac, "digest", nullptr);
      if (r == nullptr) return false;
      bool ok = PyBytes_Check(r) && PyBytes_GET_SIZE(r) == 16;
      if (ok)
        memcpy(out, PyBytes_AS_STRING(r), 16);
      else
        PyErr_SetString(PyExc_ValueError, "mac.digest(): expected 16 bytes");
      Py_DECREF(r);
      return ok;
    });
  }
};

// ----------------------------------------------------------------- safe directories

struct Perms {
  uid_t uid = 0;
  mode_t forbidden = 022;   // bits no one else may have (group_shared: 002)
  std::vector<gid_t> gids;  // trusted groups (group_shared), else empty
  mode_t dir_mode = 0700, file_mode = 0600;
  bool group_shared = false;

  // A directory of ours, or of one of our groups (group_shared); group write only where the
  // group is one of ours (a directory of ours can carry a stranger's group, e.g. from a setgid
  // parent: its members must not plant units).
  bool trusted(const struct stat& st) const {
    if (!S_ISDIR(st.st_mode) || (st.st_mode & forbidden)) return false;
    bool our_group = false;
    for (gid_t g : gids)
      if (st.st_gid == g) our_group = true;
    if ((st.st_mode & 020) && !our_group) return false;
    return st.st_uid == uid || our_group;
  }
};

// The directory `name` of `parent` (no symlink followed), checked; -1 and *status when not.
int open_dir(int parent, const char* name, const Perms& perms, bool create, bool sync, int* status,
             int* err) {
  if (parent < 0) {  // the caller found no (safe) parent directory
    *status = MISSING, *err = ENOENT;
    return -1;
  }
  const int flags = O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
  bool created = false;
  int fd = openat(parent, name, flags);
  if (fd < 0 && errno == ENOENT && create) {
    if (mkdirat(parent, name, perms.dir_mode) == 0)
      created = true;
    else if (errno != EEXIST) {
      *status = ERROR, *err = errno;
      return -1;
    }
    fd = openat(parent, name, flags);
  }
  if (fd < 0) {
    *err = errno;
    *status = errno == ENOENT ? MISSING : (errno == ELOOP || errno == ENOTDIR) ? UNSAFE_DIR : ERROR;
    return -1;
  }
  struct stat st;
  if (created && perms.group_shared) fchmod(fd, perms.dir_mode);  // past the umask
  if (fstat(fd, &st) != 0 || !perms.trusted(st)) {
    *err = errno = EPERM;
    *status = UNSAFE_DIR;
    close(fd);
    return -1;
  }
  if (created && sync) fsync(parent);
  return fd;
}

// ----------------------------------------------------------------- aligned buffers

// Page-aligned buffers (O_DIRECT), kept in a process-wide free list: a batch leases one and
// gives it back, so a buffer is faulted in once, not once per thread or per unit. At most
// kKeptBuffers are kept (the rest freed): memory held is bounded by that, not by threads.
constexpr size_t kKeptBuffers = 16;

struct BufferPool {
  std::mutex lock;
  std::vector<std::pair<unsigned char*, size_t>> free;
};
// Never destroyed: daemon threads may still be inside a batch while the process exits. A
// forked child gets a fresh one (the parent's lock may have been held by another thread).
BufferPool* g_buffers = new BufferPool;

struct Lease {
  unsigned char* data = nullptr;
  size_t size = 0;
  ~Lease() {
    if (data == nullptr) return;
    std::lock_guard<std::mutex> hold(g_buffers->lock);
    if (g_buffers->free.size() < kKeptBuffers)
      g_buffers->free.emplace_back(data, size);
    else
      free(data);
  }
  unsigned char* get(size_t want) {
    if (size >= want) return data;
    {
      std::lock_guard<std::mutex> hold(g_buffers->lock);
      auto& list = g_buffers->free;
      for (auto& entry : list)
        if (entry.second >= want) {
          auto found = entry;
          if (data != nullptr)
            entry = {data, size};  // ours was too small: kept for others
          else
            entry = list.back(), list.pop_back();
          data = found.first, size = found.second;
          return data;
        }
    }
    free(data);
    data = nullptr, size = 0;
    void* p = nullptr;
    // 2 MiB or more: backed by huge pages, so an O_DIRECT read into it pins and maps a few
    // pages instead of 512 per 2 MiB (a cold direct load of 96 MiB: 21-31 -> 8-13 ms of system).
    const size_t huge = size_t(2) << 20;
    if (posix_memalign(&p, want >= huge ? huge : kAlign, want) != 0) return nullptr;
    if (want >= huge) madvise(p, want, MADV_HUGEPAGE);
    data = static_cast<unsigned char*>(p), size = want;
    return data;
  }
};

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// ----------------------------------------------------------------- streaming copies

// Copy n bytes from a block in L1 into caller memory with non-temporal stores: the primary
// row is read next by a DMA engine, not by this CPU, so the stores skip the read-for-
// ownership of each destination line and leave the caches to the source. Callers fence
// (stream_fence) before anyone may look at the destination.
using StreamFn = void (*)(unsigned char*, const unsigned char*, size_t);

#if defined(__x86_64__)
// The destination's first bytes up to a `align` boundary (memcpy), then whole vectors.
size_t stream_head(unsigned char* dst, const unsigned char* src, size_t n, size_t align) {
  size_t head = (align - reinterpret_cast<uintptr_t>(dst) % align) % align;
  head = std::min(head, n);
  memcpy(dst, src, head);
  return head;
}

__attribute__((target("avx512f"))) void stream_avx512(unsigned char* dst, const unsigned char* src,
                                                      size_t n) {
  size_t i = stream_head(dst, src, n, 64);
  for (; i + 256 <= n; i += 256) {
    __m512i a = _mm512_loadu_si512(src + i), b = _mm512_loadu_si512(src + i + 64);
    __m512i c = _mm512_loadu_si512(src + i + 128), d = _mm512_loadu_si512(src + i + 192);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 64), b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 128), c);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i + 192), d);
  }
  memcpy(dst + i, src + i, n - i);
}

__attribute__((target("avx2"))) void stream_avx2(unsigned char* dst, const unsigned char* src,
                                                 size_t n) {
  size_t i = stream_head(dst, src, n, 32);
  for (; i + 128 <= n; i += 128)
    for (size_t k = 0; k < 128; k += 32)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + k),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + k)));
  memcpy(dst + i, src + i, n - i);
}

void stream_sse2(unsigned char* dst, const unsigned char* src, size_t n) {
  size_t i = stream_head(dst, src, n, 16);
  for (; i + 64 <= n; i += 64)
    for (size_t k = 0; k < 64; k += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + k),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + k)));
  memcpy(dst + i, src + i, n - i);
}

StreamFn pick_stream() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return stream_avx512;
  if (__builtin_cpu_supports("avx2")) return stream_avx2;
  return stream_sse2;
}
void stream_fence() { _mm_sfence(); }
#else
void stream_plain(unsigned char* dst, const unsigned char* src, size_t n) { memcpy(dst, src, n); }
StreamFn pick_stream() { return stream_plain; }
void stream_fence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
#endif

const StreamFn g_stream = pick_stream();

// ----------------------------------------------------------------- mapped reads and SIGBUS

// A warm load reads its unit through a mapping of the page cache (one pass: each 2 KiB
// block hashed from the mapping and streamed on). A truncation waits for the reader's lease,
// but the kernel breaks a lease held past its lease-break-time, and a page the kernel evicts
// and cannot read again faults: the next touch raises SIGBUS. The handler turns
// a SIGBUS inside the span this thread is reading into a siglongjmp back to the reader (the
// unit is CORRUPT, a miss); any other SIGBUS goes to the handler that was there before (or
// the default action: the fault repeats and ends the process, as without us).
struct MapGuard {
  sigjmp_buf env;
  const unsigned char* lo = nullptr;
  const unsigned char* hi = nullptr;
};

// initial-exec: the handler reads it without a TLS allocation (a pointer of static TLS).
__attribute__((tls_model("initial-exec"))) thread_local MapGuard* t_guard = nullptr;
std::atomic<const struct sigaction*> g_previous_sigbus{nullptr};
std::mutex g_sigbus_lock;

void on_sigbus(int sig, siginfo_t* info, void* context) {
  MapGuard* guard = t_guard;
  const auto* at = static_cast<const unsigned char*>(info->si_addr);
  if (guard != nullptr && at >= guard->lo && at < guard->hi) siglongjmp(guard->env, 1);
  const struct sigaction* previous = g_previous_sigbus.load();
  if (previous != nullptr && (previous->sa_flags & SA_SIGINFO)) {
    previous->sa_sigaction(sig, info, context);
  } else if (previous != nullptr && previous->sa_handler != SIG_DFL &&
             previous->sa_handler != SIG_IGN) {
    previous->sa_handler(sig);
  } else {  // SIG_DFL (a fault's SIGBUS cannot be ignored): the fault repeats and kills
    signal(SIGBUS, SIG_DFL);
    if (info->si_code <= 0) raise(SIGBUS);  // sent, not a fault: nothing repeats it
  }
}

// Whether on_sigbus handles SIGBUS now (installed when another handler replaced it, that
// one kept as the previous); false when it cannot be: then units are read, not mapped.
bool sigbus_guarded() {
  struct sigaction now;
  if (sigaction(SIGBUS, nullptr, &now) != 0) return false;
  if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus) return true;
  std::lock_guard<std::mutex> hold(g_sigbus_lock);
  auto* previous = new struct sigaction;  // never freed: a handler may be reading the old one
  struct sigaction ours = {};
  ours.sa_sigaction = on_sigbus;
  ours.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&ours.sa_mask);
  if (sigaction(SIGBUS, nullptr, previous) != 0) return false;
  if ((previous->sa_flags & SA_SIGINFO) && previous->sa_sigaction == on_sigbus) return true;
  g_previous_sigbus.store(previous);
  return sigaction(SIGBUS, &ours, nullptr) == 0;
}

// Whether only writers on this host change the unit's pages (a local disk file system or
// tmpfs), whom a read lease keeps out. A network or FUSE file system may change them under a
// lease (another client, its server invalidating the page cache), so a block hashed from the
// mapping could differ when it is read again to be copied: such units are read in pieces.
bool local_pages(int fd) {
  struct statfs where;
  if (fstatfs(fd, &where) != 0) return false;
  switch (static_cast<unsigned long>(where.f_type)) {
    case EXT4_SUPER_MAGIC:  // ext2 / ext3 / ext4
    case XFS_SUPER_MAGIC:
    case BTRFS_SUPER_MAGIC:
    case TMPFS_MAGIC:
      return true;
    default:
      return false;
  }
}

// Read `want` bytes at `offset` into `buf` (room for `want` rounded up to 4096 when
// `direct`); the bytes read: fewer only at the end of the file.
ssize_t read_full(int fd, unsigned char* buf, size_t want, bool direct, off_t offset) {
  size_t got = 0;
  while (got < want) {
    size_t ask = (direct ? round_up(want, kAlign) : want) - got;
    ssize_t n = pread(fd, buf + got, ask, offset + static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    if (n == 0) break;
    got += static_cast<size_t>(n);
    if (direct && got % kAlign != 0) break;  // an O_DIRECT read stops short only at the end
  }
  return static_cast<ssize_t>(got);
}

bool write_full(int fd, const struct iovec* iov_in, int count, off_t offset) {
  struct iovec iov[3];
  memcpy(iov, iov_in, sizeof(struct iovec) * count);
  int first = 0;
  while (first < count) {
    ssize_t n = pwritev(fd, iov + first, count - first, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;
      return false;
    }
    offset += n;
    while (n > 0 && first < count) {
      size_t take =
          static_cast<size_t>(n) < iov[first].iov_len ? static_cast<size_t>(n) : iov[first].iov_len;
      iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + take;
      iov[first].iov_len -= take;
      n -= static_cast<ssize_t>(take);
      if (iov[first].iov_len == 0) ++first;
    }
  }
  return true;
}

// ----------------------------------------------------------------- loads

#ifndef __NR_cachestat
#define __NR_cachestat 451
#endif

// Whether the page cache holds all of [0, size) of fd, asked without side effects
// (cachestat, Linux 6.5); false when the kernel cannot say.
bool fully_cached(int fd, size_t size) {
  struct {
    uint64_t off, len;
  } range = {0, size};
  struct {
    uint64_t cache, dirty, writeback, evicted, recently_evicted;
  } stat = {};
  static const long page = sysconf(_SC_PAGESIZE);
  if (syscall(__NR_cachestat, fd, &range, &stat, 0) != 0) return false;
  return stat.cache >= (size + page - 1) / page;
}

// A batch item: where its unit is, the header it has (to write) or must have (to read:
// position 0, checksum zeroed), its bytes (payload to store, or destination of payload
// bytes [lo, hi)), the MAC of an authenticated unit, and its result.
struct Item {
  int fan = -1;
  const char* kd = nullptr;
  const char* name = nullptr;
  Py_buffer head{};
  Py_buffer data{};
  PyObject* mac = nullptr;
  int status = SKIPPED, err = 0;
  const char* reason = nullptr;
  Item() = default;
  Item(const Item&) = delete;
  ~Item() {  // with the GIL: the batch's items die in the calling function
    if (head.obj != nullptr) PyBuffer_Release(&head);
    if (data.obj != nullptr) PyBuffer_Release(&data);
  }
  uint64_t payload_length() const {  // from the header (bytes 40..48, little endian)
    uint64_t n = 0;
    if (head.len >= 48) memcpy(&n, static_cast<const unsigned char*>(head.buf) + 40, 8);
    return n;
  }
  // Call the hook at `stage` with this unit's path below the namespace directory.
  bool announce(Hook& hook, const char* stage, long long n) const {
    if (hook.fn == nullptr) return true;
    char dir[80];
    snprintf(dir, sizeof dir, "%.2s/%s", kd, kd);
    return hook.call(stage, dir, name, n);
  }
};

struct LoadItem : Item {
  size_t lo = 0, hi = 0;
  char reason_buf[96] = {0};
  unsigned char got[kMaxHeader];
  size_t got_len = 0;  // the header as read, when it did not match
  unsigned long long dev = 0, ino = 0;
  PyObject* result() const {
    PyObject* read = got_len
                         ? PyBytes_FromStringAndSize(reinterpret_cast<const char*>(got), got_len)
                         : Py_NewRef(Py_None);
    if (read == nullptr) return nullptr;
    PyObject* r = Py_BuildValue("(iizOKK)", status, err, reason, read, dev, ino);
    Py_DECREF(read);
    return r;
  }
};

struct LoadOptions {
  Perms perms;
  size_t piece = 0, bounce = 0;
  bool nowait = true, direct = false;
  long long now_ns = 0, granularity_ns = 0;
};

// The header as read vs the one expected: all but position (< 2**63) and checksum.
bool header_matches(const unsigned char* got, const unsigned char* want, size_t hl) {
  return memcmp(got, want, 32) == 0 && got[39] < 0x80 && memcmp(got + 40, want + 40, 40) == 0 &&
         memcmp(got + 96, want + 96, hl - 96) == 0;
}

// A unit to read, opened below its checked key directory without following a symlink and
// without blocking on a FIFO; -1 with *status (MISSING, UNSAFE_DIR, UNSAFE_FILE for a
// symlink, ERROR) and *err otherwise. Callers fstat what they opened.
int open_unit(const Item& item, const Perms& perms, int* status, int* err) {
  int kfd = open_dir(item.fan, item.kd, perms, false, false, status, err);
  if (kfd < 0) return -1;
  const int flags = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
  int fd = openat(kfd, item.name, flags | O_NOATIME);
  if (fd < 0 && errno == EPERM) fd = openat(kfd, item.name, flags);  // O_NOATIME: owner only
  if (fd < 0) {
    *err = errno;
    *status = *err == ENOENT ? MISSING : *err == ELOOP ? UNSAFE_FILE : ERROR;
  }
  close(kfd);
  return fd;
}

// Ask the page cache for a unit the batch reads later (WILLNEED; callers skip units all
// there), so that its device reads run while the units before it are hashed and copied.
bool ask_page_cache(const Item& item, int fd, size_t size, Hook& hook) {
  if (!item.announce(hook, "prefetch", static_cast<long long>(size))) return false;
  posix_fadvise(fd, 0, static_cast<off_t>(size), POSIX_FADV_WILLNEED);
  return true;
}

// The same for a unit too far ahead to keep open: opened, asked for and closed.
void prefetch(const LoadItem& item, const LoadOptions& opt, Hook& hook) {
  int status = OK, err = 0;
  int fd = open_unit(item, opt.perms, &status, &err);
  if (fd < 0) return;
  struct stat st;
  if (fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && !fully_cached(fd, st.st_size))
    ask_page_cache(item, fd, st.st_size, hook);
  close(fd);
}

// A unit opened and checked (a regular file of the expected size) at its turn, or ahead of it.
struct Opened {
  int fd = -1;
  int status = SKIPPED;  // OK: open and checked
  bool whole = false;    // all of it in the page cache
  bool asked = false;    // WILLNEED given ahead of its turn
  bool direct = false;   // read O_DIRECT through the batch's ring (direct reads, not all cached)
  size_t total = 0;
  long long used_ns = 0;  // its last use (atime or mtime)
};

// Reads of fd from here on bypass the page cache (false where the file system refuses).
bool set_direct(int fd) {
  int flags = fcntl(fd, F_GETFL);
  return flags >= 0 && fcntl(fd, F_SETFL, flags | O_DIRECT) == 0;
}

void open_checked(LoadItem& item, const LoadOptions& opt, Opened* u) {
  u->total = item.head.len + item.payload_length();
  if ((u->fd = open_unit(item, opt.perms, &u->status, &item.err)) < 0) {
    if (u->status == UNSAFE_FILE) item.reason = "a symlink";
    return;
  }
  struct stat st;
  if (fstat(u->fd, &st) != 0) {
    item.err = errno, u->status = ERROR;
  } else if (!S_ISREG(st.st_mode)) {
    item.reason = "not a regular file", u->status = UNSAFE_FILE;
  } else if (item.dev = st.st_dev, item.ino = st.st_ino;
             static_cast<uint64_t>(st.st_size) != u->total) {
    snprintf(item.reason_buf, sizeof item.reason_buf, "size %lld != %llu bytes expected",
             static_cast<long long>(st.st_size), static_cast<unsigned long long>(u->total));
    item.reason = item.reason_buf, u->status = CORRUPT;
  } else {
    u->used_ns = std::max<long long>(st.st_atim.tv_sec * 1000000000LL + st.st_atim.tv_nsec,
                                     st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec);
    u->whole = fully_cached(u->fd, u->total);
    u->direct = opt.direct && !(opt.nowait && u->whole) && set_direct(u->fd);
    u->status = OK;
  }
}

// Linux AIO by system call (no libaio): reads submitted now, waited for later. One context per
// thread, kept (io_destroy waits for an RCU grace period: tens of milliseconds), set up again
// in a forked child (contexts are not inherited). A batch never leaves a read in flight.
struct Aio {
  // Events the context is set up for: more than kMaxAhead, as the kernel hands its free
  // slots to CPUs in batches (fewer would refuse submissions while slots are free).
  static constexpr unsigned kAioEvents = 64;
  aio_context_t ctx = 0;
  pid_t owner = 0;
  ~Aio() {
    if (owner == getpid()) syscall(__NR_io_destroy, ctx);
  }
  bool ready() {
    if (owner == getpid()) return true;
    ctx = 0;
    owner = syscall(__NR_io_setup, kAioEvents, &ctx) == 0 ? getpid() : 0;
    return owner != 0;
  }
  // How many of `list` were submitted (0 when none could be).
  size_t submit(struct iocb** list, size_t n) {
    long sent = n > 0 && ready() ? syscall(__NR_io_submit, ctx, static_cast<long>(n), list) : 0;
    return sent > 0 ? static_cast<size_t>(sent) : 0;
  }
  // At least one completion into `events` (at most `max`); their count, or -1 (errno).
  long reap(struct io_event* events, long max) {
    long got;
    do got = syscall(__NR_io_getevents, ctx, 1L, max, events, nullptr);
    while (got < 0 && errno == EINTR);
    return got;
  }
};
thread_local Aio t_aio;

// The mappings of one batch's warm units, side by side in one reserved range that is unmapped
// at once when it is full and when the batch ends: one TLB shootdown for many units instead of
// one per unit (on 2 vCPUs an unmap while another thread of the process runs cost 20 us against
// 4 alone, 7% of a 2 MiB unit's load), and each unit at a 2 MiB boundary, so the page cache's
// huge folios are mapped a PMD at a time (bench/verified_io_candidates.cpp, "arena" rows). A
// unit's mapping is never read after its load (its lease is released then); it only stays
// mapped until the range is let go. Every byte of the range is the batch's (the reservation,
// or a unit mapped over part of it with MAP_FIXED); should a MAP_FIXED fail, the slot's state
// is unknown: the rest is let go, that slot left as it is, and the batch maps units alone.
struct MapArena {
  static constexpr size_t kHuge = 2u << 20, kSize = 64u << 20;
  unsigned char* raw = nullptr;   // the reservation: kSize + kHuge bytes
  unsigned char* base = nullptr;  // its first 2 MiB boundary
  size_t used = 0;
  bool off = false;  // a MAP_FIXED failed, or no range could be reserved: units mapped alone

  ~MapArena() { clear(); }
  void clear() {
    if (raw != nullptr) munmap(raw, kSize + kHuge);
    raw = base = nullptr, used = 0;
  }
  static size_t slot(size_t total) { return round_up(total, kHuge); }

  // The unit's `total` bytes mapped read-only (faulted in as read: see huge_mapped), or
  // nullptr (see errno). Mapped alone (unmap() after use) where the arena is off or the unit
  // larger than it.
  unsigned char* map(int fd, size_t total) {
    const int flags = MAP_SHARED;
    if (off || slot(total) > kSize) {
      void* m = mmap(nullptr, total, PROT_READ, flags, fd, 0);
      return m == MAP_FAILED ? nullptr : static_cast<unsigned char*>(m);
    }
    if (raw != nullptr && used + slot(total) > kSize) clear();  // one shootdown for all of it
    if (raw == nullptr) {
      void* r = mmap(nullptr, kSize + kHuge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
      if (r == MAP_FAILED) return off = true, map(fd, total);
      raw = static_cast<unsigned char*>(r);
      base = reinterpret_cast<unsigned char*>(round_up(reinterpret_cast<size_t>(raw), kHuge));
    }
    unsigned char* at = base + used;
    if (mmap(at, total, PROT_READ, flags | MAP_FIXED, fd, 0) == MAP_FAILED) {
      const int saved = errno;
      if (at > raw) munmap(raw, static_cast<size_t>(at - raw));  // the units before it
      unsigned char* after = at + slot(total);
      munmap(after, static_cast<size_t>(raw + kSize + kHuge - after));
      raw = base = nullptr, used = 0, off = true;
      errno = saved;
      return nullptr;
    }
    used += slot(total);
    return at;
  }
  // After a unit's load: unmapped now only if it was mapped alone.
  void unmap(unsigned char* m, size_t total) {
    if (raw == nullptr || m < base || m >= base + kSize) munmap(m, total);
  }
};

// The loads of one batch: its units opened and checked at their turn or ahead of it, and the
// pieces of those it reads O_DIRECT submitted ahead of their turn (Linux AIO) into a ring (an
// aligned buffer of two bounces), so that the device reads the next units while this one is
// hashed and copied. A piece is a whole unit up to a bounce (one device request: a virtual
// disk pays per request; 1 MiB pieces measured 0.8x of whole units there), a larger unit in
// even pieces of at most a bounce (so the next unit's first fits beside them), placed after the
// pieces in flight and consumed in the order it was submitted; a unit read another way stops
// the submissions until its turn has passed, so the ring is empty then. Never into caller
// memory: a job may expire while a device read is in flight. Without AIO (io_setup refused),
// each piece is read when it is submitted.
struct LoadBatch {
  struct Piece {
    size_t item = 0, pos = 0, n = 0, at = 0;  // unit bytes [pos, pos + n), at ring + at
    long res = 0;                             // bytes read, or -errno
    bool done = false;
  };

  std::vector<LoadItem>& items;
  const LoadOptions& opt;
  std::atomic<int>* state;
  Hook& hook;
  Gil& gil;
  Lease buffer, ring_buffer;
  MapArena maps;
  std::vector<Opened> opened;
  Aio& aio = t_aio;
  unsigned char* ring = nullptr;
  size_t ring_bytes = 0, piece = 0;  // a piece: up to a bounce, the ring two
  Piece flight[kMaxAhead];
  size_t head = 0, count = 0;          // in flight: flight[head], ... (count of them, a ring)
  size_t next_item = 0, next_pos = 0;  // the next piece to submit
  size_t prefetched = 1;               // buffered: items[prefetched:] not asked for yet
  bool open_ahead = true;              // buffered: units asked for are kept open (fds allowing)

  LoadBatch(std::vector<LoadItem>& items_, const LoadOptions& opt_, std::atomic<int>* state_,
            Hook& hook_, Gil& gil_)
      : items(items_), opt(opt_), state(state_), hook(hook_), gil(gil_), opened(items_.size()) {}
  ~LoadBatch() {
    while (count > 0) wait_head(), pop();  // no read may land in a buffer given back
    for (auto& u : opened)
      if (u.fd >= 0) close(u.fd);
  }

  Opened& open(size_t i) {
    if (opened[i].status == SKIPPED) open_checked(items[i], opt, &opened[i]);
    return opened[i];
  }

  // Where in the ring a read of `len` bytes goes, after the pieces in flight; npos: no room
  // until the first of them is consumed.
  static constexpr size_t npos = SIZE_MAX;
  size_t place(size_t len) const {
    if (count == 0) return 0;
    const Piece& last = flight[(head + count - 1) % kMaxAhead];
    size_t first = flight[head].at, end = last.at + round_up(last.n, kAlign);
    if (end > first)  // [first, end) in use: room after it, else at the start
      return ring_bytes - end >= len ? end : first >= len ? 0 : npos;
    return first - end >= len ? end : npos;  // wrapped: [first, ring) and [0, end) in use
  }

  // Submit pieces of the units from `current` on that are read O_DIRECT, until the ring is
  // full or a unit is read another way (or failed its checks). false: the hook raised.
  bool submit_ahead(size_t current) {
    if (next_item < current) next_item = current, next_pos = 0;
    if (ring == nullptr) {
      if (next_item >= items.size() || !open(next_item).direct) return true;
      piece = round_up(opt.bounce, kAlign), ring_bytes = 2 * piece;
      if ((ring = ring_buffer.get(ring_bytes)) == nullptr) return true;  // ENOMEM
    }
    struct iocb cbs[kMaxAhead];
    struct iocb* list[kMaxAhead];
    size_t k = 0;
    bool ok = true;
    while (count < kMaxAhead && next_item < items.size()) {
      Opened& u = open(next_item);
      if (u.status != OK || !u.direct) break;
      if (next_pos >= u.total) {
        ++next_item, next_pos = 0;
        continue;
      }
      size_t parts = (u.total + piece - 1) / piece;  // even pieces: the next unit fits sooner
      size_t even = round_up((u.total + parts - 1) / parts, kAlign);
      size_t n = std::min(even, u.total - next_pos), at = place(round_up(n, kAlign));
      if (at == npos) break;
      if (!(ok = items[next_item].announce(hook, "read", static_cast<long long>(next_pos)))) break;
      size_t s = (head + count++) % kMaxAhead;
      flight[s] = {next_item, next_pos, n, at, 0, false};
      struct iocb& cb = cbs[k];
      memset(&cb, 0, sizeof cb);
      cb.aio_data = s;
      cb.aio_lio_opcode = IOCB_CMD_PREAD;
      cb.aio_fildes = static_cast<uint32_t>(u.fd);
      cb.aio_buf = reinterpret_cast<uintptr_t>(ring + at);
      cb.aio_nbytes = round_up(n, kAlign);
      cb.aio_offset = static_cast<int64_t>(next_pos);
      list[k++] = &cb;
      next_pos += n;
    }
    for (size_t j = aio.submit(list, k); j < k; ++j) {  // not taken: read now
      Piece& p = flight[cbs[j].aio_data];
      ssize_t got = read_full(opened[p.item].fd, ring + p.at, p.n, true, static_cast<off_t>(p.pos));
      p.res = got < 0 ? -errno : got, p.done = true;
    }
    return ok;
  }

  Piece& wait_head() {
    struct io_event events[kMaxAhead];
    while (!flight[head].done) {
      long got = aio.reap(events, static_cast<long>(kMaxAhead));
      if (got < 0) {  // cannot happen with a valid context; never leave a read behind
        flight[head].res = -errno, flight[head].done = true;
        break;
      }
      for (long e = 0; e < got; ++e) {
        Piece& p = flight[events[e].data];
        p.res = static_cast<long>(events[e].res), p.done = true;
      }
    }
    return flight[head];
  }

  void pop() { head = (head + 1) % kMaxAhead, --count; }

  // Item i's pieces in flight waited for and dropped; none of it submitted any more.
  void drop(size_t i) {
    while (count > 0 && flight[head].item == i) wait_head(), pop();
    if (next_item == i) ++next_item, next_pos = 0;
  }

  void prefetch_ahead(size_t i);
  void run();
};

// What a unit's reader or writer works with: its item and the batch's options, the job's
// state word, the hook, the batch's aligned buffer, a hasher and the unit's descriptor.
template <typename ItemT, typename OptionsT>
struct Worker {
  ItemT& item;
  const OptionsT& opt;
  std::atomic<int>* state;
  Hook& hook;
  Lease& buffer;
  Hasher hasher{};
  int fd = -1;
};

struct UnitReader : Worker<LoadItem, LoadOptions> {
  LoadBatch* batch = nullptr;
  size_t index = 0;
  static constexpr int kNotMapped = -1;
  unsigned char sum[16] = {0};
  size_t hl = 0, total = 0;
  bool direct_on = false;
  volatile bool map_claimed = false;  // read after a siglongjmp: volatile

  int fail(int status, const char* reason) {
    item.reason = reason;
    return status;
  }

  // The header (first hl bytes of the unit) is in `got`: check it, start the checksum.
  int begin(const unsigned char* got) {
    const auto* want = static_cast<const unsigned char*>(item.head.buf);
    if (!header_matches(got, want, hl)) {
      memcpy(item.got, got, hl);
      item.got_len = hl;
      return fail(CORRUPT, "header does not match the unit's");
    }
    memcpy(sum, got + 80, 16);
    unsigned char zeroed[kMaxHeader];
    memcpy(zeroed, got, hl);
    memset(zeroed + 80, 0, 16);
    hasher.reset();
    return hasher.update(zeroed, hl) ? OK : ERROR;
  }

  // The wanted part of the payload bytes [p0, p0 + m), which are at `from`, into the
  // destination (streamed: the caller fences before it releases its claim).
  void deliver(size_t p0, const unsigned char* from, size_t m) {
    size_t a = std::max(p0, item.lo), b = std::min(p0 + m, item.hi);
    if (a < b)
      g_stream(static_cast<unsigned char*>(item.data.buf) + (a - item.lo), from + (a - p0), b - a);
  }

  // Whether the page cache holds the unit's first 2 MiB as one huge folio, which the kernel
  // then maps as one PMD: the first read of the mapping faulted it all in (one fault, counted
  // by getrusage). Only then does a mapping pay: the page cache of buffered reads comes in
  // small folios, mapped 64 KiB per fault and unmapped a page at a time (on this VM 140-200 us
  // per 2 MiB, against ~10 with a huge folio and ~50 more for reading it in pieces). The
  // rest of the unit is faulted in now too (a read per fault-around window), so that a
  // claimed stretch is a memory copy.
  bool huge_mapped(const unsigned char* map) {
    struct rusage before, after;
    if (getrusage(RUSAGE_THREAD, &before) != 0) return false;
    unsigned char sink = *static_cast<const volatile unsigned char*>(map);
    sink ^= *static_cast<const volatile unsigned char*>(map + MapArena::kHuge - 1);
    if (getrusage(RUSAGE_THREAD, &after) != 0) return false;
    const long faults = (after.ru_minflt - before.ru_minflt) + (after.ru_majflt - before.ru_majflt);
    if (faults != 1) return false;
    for (size_t at = MapArena::kHuge; at < total; at += kFaultAround)
      sink ^= *static_cast<const volatile unsigned char*>(map + at);
    sink ^= *static_cast<const volatile unsigned char*>(map + total - 1);
    (void)sink;
    return true;
  }

  // One pass over a mapped unit: each 2 KiB block hashed from the mapping (into L1) and
  // streamed on from there. The file is under a read lease meanwhile (mapped_unit), so no
  // writer changes it between the two reads of a block. Claimed one piece at a time: the
  // pages are mapped already (huge_mapped), so a claimed stretch is a memory copy.
  int mapped_blocks(const unsigned char* map) {
    unsigned char header[kMaxHeader];
    memcpy(header, map, hl);
    if (int status = begin(header); status != OK) return status;
    for (size_t pos = hl; pos < total;) {
      const size_t end = std::min(total, pos + opt.piece);
      const bool wanted = end - hl > item.lo && pos - hl < item.hi;
      if (wanted) {
        if (!claim(state)) return EXPIRED;
        map_claimed = true;
      }
      for (; pos < end;) {
        const size_t m = std::min(kMappedBlock, end - pos);
        UNITIO_XXH3_UPDATE(&hasher.state, map + pos, m);
        if (wanted) deliver(pos - hl, map + pos, m);
        pos += m;
      }
      if (wanted) {
        stream_fence();
        map_claimed = false;
        release(state);
      }
    }
    return OK;
  }

  // The whole unit from a mapping of the page cache (the caller saw it all cached), or
  // kNotMapped: to be read in pieces (a MAC unit: its hash runs in Python; smaller than a
  // huge folio, or not held in one (huge_mapped); no SIGBUS guard; a file system whose pages
  // others than local writers change (local_pages); no lease; mmap refused; the lease broken
  // while it was read). A SIGBUS (a page that could
  // not be read again, or a truncation past a broken lease) makes the unit CORRUPT: a miss.
  int mapped_unit() {
    if (item.mac != nullptr || total < MapArena::kHuge || !sigbus_guarded()) return kNotMapped;
    if (!local_pages(fd)) return kNotMapped;
    // A read lease first: refused while any open file may write the unit (then it is read in
    // pieces, as without a mapping); while held, an open for writing or a truncation waits
    // for its release (or the kernel's lease-break-time), and the lease shows it is broken.
    // Its break is signalled to the process: SIGURG (ignored unless the process handles it;
    // SIGIO, the default, would end it), and the owner is cleared at once (no signal at all).
    if (fcntl(fd, F_SETSIG, SIGURG) != 0 || fcntl(fd, F_SETLEASE, F_RDLCK) != 0) return kNotMapped;
    fcntl(fd, F_SETOWN, 0);
    unsigned char* map = batch->maps.map(fd, total);
    if (map == nullptr) {
      fcntl(fd, F_SETLEASE, F_UNLCK);
      return kNotMapped;
    }
    MapGuard guard;
    guard.lo = map, guard.hi = map + total;
    map_claimed = false;
    int status;
    if (sigsetjmp(guard.env, 0) == 0) {  // SA_NODEFER: no signal mask to restore
      t_guard = &guard;
      if (!huge_mapped(map))
        status = kNotMapped;
      else if (!item.announce(hook, "map", static_cast<long long>(total)))  // tests: write now
        status = ERROR;
      else
        status = mapped_blocks(map);
    } else {
      if (map_claimed) {
        stream_fence();
        map_claimed = false;
        release(state);
      }
      status = fail(CORRUPT, "the unit shrank while it was read (SIGBUS)");
    }
    t_guard = nullptr;
    batch->maps.unmap(map, total);
    // Every block was hashed and delivered under the lease, unless a writer broke it (it is
    // breaking, or broken, from the writer's open on): then the blocks delivered may differ
    // from those hashed, and the unit is read again in pieces, each hashed as delivered.
    const bool kept = fcntl(fd, F_GETLEASE) == F_RDLCK;
    fcntl(fd, F_SETLEASE, F_UNLCK);
    if (status == kNotMapped) return status;
    if (status == OK && !kept) {
      if (!item.announce(hook, "lease broken", 0)) return ERROR;
      return kNotMapped;
    }
    return status;
  }

  // Try one piece [pos, pos + n) from the page cache straight into the destination.
  int cached_piece(size_t pos, size_t n, bool* done, bool* tried) {
    *done = *tried = false;
    size_t p0 = pos < hl ? 0 : pos - hl, p1 = pos + n - hl;
    if (p0 < item.lo || p1 > item.hi) return OK;  // not all of it wanted: via the buffer
    *tried = true;
    unsigned char header[kMaxHeader];
    auto* dest = static_cast<unsigned char*>(item.data.buf) + (p0 - item.lo);
    struct iovec iov[2];
    int count = 0;
    if (pos == 0) iov[count++] = {header, hl};
    iov[count++] = {dest, p1 - p0};
    if (!claim(state)) return EXPIRED;
    ssize_t got = preadv2(fd, iov, count, static_cast<off_t>(pos), RWF_NOWAIT);
    int status = OK;
    if (got == static_cast<ssize_t>(n)) {  // hashed while claimed: the bytes we read
      *done = true;
      if (pos == 0) status = begin(header);
      if (status == OK && !hasher.update(dest, p1 - p0)) status = ERROR;
    }
    release(state);
    return status;
  }

  // Bytes [pos, pos + n) of the unit, read into `buf` (never caller memory: the read may
  // have blocked): hashed a block at a time and the wanted part copied under the claim.
  int consume(size_t pos, const unsigned char* buf, size_t n) {
    size_t start = 0;
    if (pos == 0) {
      if (int status = begin(buf); status != OK) return status;
      start = hl;
    }
    // XXH3: one pass, a block at a time (hashed into L1, streamed on from there); a MAC
    // (Python, the GIL per call): a piece at a time.
    const size_t step = item.mac == nullptr ? kBlock : opt.piece;
    bool claimed = false;
    int status = OK;
    for (size_t at = start; at < n && status == OK;) {
      size_t m = std::min(step, n - at);
      if (!hasher.update(buf + at, m)) {
        status = ERROR;
        break;
      }
      size_t p0 = pos + at - hl;  // this block's payload range: [p0, p0 + m)
      if (std::max(p0, item.lo) < std::min(p0 + m, item.hi)) {
        if (!claimed && !(claimed = claim(state))) {
          status = EXPIRED;
          break;
        }
        deliver(p0, buf + at, m);
      }
      at += m;
    }
    if (claimed) {
      stream_fence();
      release(state);
    }
    return status;
  }

  // Read [pos, pos + n) into this thread's buffer and consume it there.
  int buffered_piece(size_t pos, size_t n) {
    if (opt.direct && !direct_on && pos % kAlign == 0) direct_on = set_direct(fd);
    unsigned char* buf = buffer.get(round_up(std::min(opt.bounce, total), kAlign));
    if (buf == nullptr) return item.err = ENOMEM, ERROR;
    if (!item.announce(hook, "read", static_cast<long long>(pos))) return ERROR;
    ssize_t got = read_full(fd, buf, n, direct_on, static_cast<off_t>(pos));
    if (got < 0) return item.err = errno, ERROR;
    if (static_cast<size_t>(got) < n) return fail(CORRUPT, "short read: the file shrank");
    return consume(pos, buf, n);
  }

  // A unit read O_DIRECT: its pieces, submitted ahead (LoadBatch), consumed in order; each
  // wait first tops the ring up, so the device never idles while this CPU hashes.
  int ahead_pieces() {
    for (size_t pos = 0; pos < total;) {
      if (!batch->submit_ahead(index)) return ERROR;  // the hook raised
      if (batch->ring == nullptr) return item.err = ENOMEM, ERROR;
      if (batch->count == 0 || batch->flight[batch->head].item != index)
        return item.err = EIO, ERROR;  // not submitted: cannot happen
      auto& p = batch->wait_head();
      unsigned char* buf = batch->ring + p.at;
      long res = p.res;
      if (res >= 0 && static_cast<size_t>(res) < p.n && res % kAlign == 0) {  // the rest now
        ssize_t more = read_full(fd, buf + res, p.n - res, true, static_cast<off_t>(p.pos + res));
        res = more < 0 ? -errno : res + more;
      }
      if (res < 0) return item.err = static_cast<int>(-res), ERROR;
      if (static_cast<size_t>(res) < p.n) return fail(CORRUPT, "short read: the file shrank");
      int status = consume(p.pos, buf, p.n);
      pos = p.pos + p.n;
      batch->pop();
      if (status != OK) return status;
    }
    return OK;
  }

  int verdict() {
    unsigned char digest[16];
    if (!hasher.digest(digest)) return ERROR;
    unsigned char differ = 0;  // every byte compared: a MAC's time says nothing of it
    for (int i = 0; i < 16; ++i) differ |= digest[i] ^ sum[i];
    if (differ != 0) return fail(CORRUPT, "checksum mismatch");
    return OK;
  }

  // What the page cache holds of the unit (cachestat; unknown counts as not all) decides how
  // it is read. All of it: one pass over a mapping of it under a read lease (XXH3 units it holds
  // in huge folios; else, or the lease refused or broken: RWF_NOWAIT pieces straight into the
  // destination). Not all, with direct reads: O_DIRECT, its pieces read ahead (LoadBatch). Not
  // all, buffered: the kernel is asked for the whole unit at once (WILLNEED: unit-sized device
  // requests, not readahead windows), then each piece comes from the page cache once there,
  // else is waited for alone (read into the buffer); the next piece tries the page cache again.
  int read_unit(const Opened& u) {
    hl = item.head.len;
    total = u.total;
    if (u.direct) {
      if (int status = ahead_pieces(); status != OK) return status;
      return verdict();
    }
    size_t pos = 0;
    if (opt.nowait && u.whole) {  // all in the page cache: one pass over a mapping of it
      int status = mapped_unit();
      if (status != kNotMapped) return status == OK ? verdict() : status;
    }
    bool cached = opt.nowait && (!opt.direct || u.whole);
    if (cached && !u.whole && !u.asked)
      posix_fadvise(fd, 0, static_cast<off_t>(total), POSIX_FADV_WILLNEED);
    while (pos < total) {
      size_t n = std::min(opt.piece, total - pos);
      if (cached) {
        bool done, tried;
        if (int status = cached_piece(pos, n, &done, &tried); status != OK) return status;
        if (done) {
          pos += n;
          continue;
        }
        cached = !tried || !opt.direct;  // not there: with direct reads, the rest O_DIRECT
      }
      if (!cached) n = std::min(opt.bounce, total - pos);
      if (int status = buffered_piece(pos, n); status != OK) return status;
      pos += n;
    }
    return verdict();
  }

  int run() {
    Opened& u = batch->open(index);
    fd = u.fd;
    int status = u.status;
    if (status == OK) {
      status = read_unit(u);
      if (status != OK && u.direct) batch->drop(index);  // its reads in flight
    }
    if (status == OK && opt.now_ns - u.used_ns >= opt.granularity_ns) {
      // recency for other processes: once per recency bucket
      struct timespec times[2] = {{opt.now_ns / 1000000000LL, opt.now_ns % 1000000000LL},
                                  {0, UTIME_OMIT}};
      futimens(fd, times);
    }
    if (fd >= 0) close(fd);
    u.fd = fd = -1;
    return status;
  }
};

// Buffered: before reading items[i], ask for the units of the next kPrefetchBytes (at least
// one) not asked for yet (items[prefetched:]). items[i] and the next kOpenAhead are opened and
// checked now and stay open for their turn (one open per unit); further ones are opened to ask.
void LoadBatch::prefetch_ahead(size_t i) {
  if (!opt.nowait || opt.direct) return;
  open(i);  // before the units ahead take descriptors
  size_t bytes = 0;
  for (size_t k = i + 1; k < prefetched; ++k) bytes += items[k].payload_length();
  for (; prefetched < items.size(); ++prefetched) {
    size_t next = items[prefetched].payload_length();
    if (prefetched > i + 1 && bytes + next > kPrefetchBytes) break;
    bytes += next;
    if (prefetched - i > kOpenAhead || !open_ahead) {
      prefetch(items[prefetched], opt, hook);
      continue;
    }
    Opened& u = open(prefetched);
    if (u.status == ERROR && (items[prefetched].err == EMFILE || items[prefetched].err == ENFILE)) {
      u.status = SKIPPED, items[prefetched].err = 0;  // out of descriptors: opened at its turn,
      open_ahead = false;                             // none other kept open ahead
      continue;
    }
    if (u.status == OK && !u.whole)
      u.asked = ask_page_cache(items[prefetched], u.fd, u.total, hook);
  }
}

void LoadBatch::run() {
  for (size_t i = 0; i < items.size(); ++i) {
    prefetch_ahead(i);
    if (gil.failed) break;
    UnitReader reader{{items[i], opt, state, hook, buffer}, this, i};
    reader.hasher.mac = items[i].mac, reader.hasher.gil = &gil;
    items[i].status = reader.run();
    if (gil.failed || items[i].status == EXPIRED) break;
  }
}

// ----------------------------------------------------------------- stores

struct StoreItem : Item {
  char temp[96] = {0};
  PyObject* result() const { return Py_BuildValue("(iizOii)", status, err, reason, Py_None, 0, 0); }
};

struct StoreOptions {
  Perms perms;
  int tmp = -1;
  const char* prefix = "";
  size_t chunk = 0;
  bool fsync = false, direct = false;
};

struct UnitWriter : Worker<StoreItem, StoreOptions> {
  bool preallocate_blocks = false;  // on ext4 (StoreBatch)

  // The unit as one stream (header with its checksum zeroed, then the payload), hashed and
  // written in chunks from offset 0; the checksum is patched in last. A unit no larger than a
  // chunk (buffered) is hashed whole first and written in ONE call with its checksum in place:
  // its second read comes from the last-level cache, and the page cache can take it in large
  // folios (bench/verified_io_candidates.cpp: 0.93-0.97x of vLLM's unhashed write vs
  // 0.84-0.98x in 1 MiB chunks).
  bool write_stream(size_t* total_out) {
    const auto* head = static_cast<const unsigned char*>(item.head.buf);
    const auto* payload = static_cast<const unsigned char*>(item.data.buf);
    const size_t hl = item.head.len, total = hl + item.data.len;
    const size_t chunk =
        opt.direct ? round_up(std::max(opt.chunk, size_t(kAlign)), kAlign) : opt.chunk;
    unsigned char* buf = nullptr;
    unsigned char first[kAlign], sealed[kMaxHeader];
    const bool whole = !opt.direct && chunk >= total;  // one write, the checksum in place
    if (opt.direct && (buf = buffer.get(chunk)) == nullptr) return errno = ENOMEM, false;
    hasher.reset();
    for (size_t pos = 0; pos < total;) {
      size_t n = std::min(chunk, total - pos);
      struct iovec iov[2];
      int count = 0;
      if (pos < hl)
        iov[count++] = {const_cast<unsigned char*>(head) + pos, std::min(hl, pos + n) - pos};
      if (pos + n > hl) {
        size_t p0 = pos < hl ? 0 : pos - hl;
        iov[count++] = {const_cast<unsigned char*>(payload) + p0, pos + n - hl - p0};
      }
      if (opt.direct) {  // copied into the aligned buffer and hashed there, step by step
        size_t at = 0;
        for (int i = 0; i < count; ++i)
          for (size_t done = 0; done < iov[i].iov_len;) {
            size_t m = std::min(kStep, iov[i].iov_len - done);
            memcpy(buf + at, static_cast<unsigned char*>(iov[i].iov_base) + done, m);
            if (!hasher.update(buf + at, m)) return false;
            at += m, done += m;
          }
        size_t padded = round_up(n, kAlign);
        memset(buf + n, 0, padded - n);
        if (pos == 0) memcpy(first, buf, kAlign);
        struct iovec one = {buf, padded};
        if (!write_full(fd, &one, 1, static_cast<off_t>(pos))) return false;
      } else {  // hashed in the caller's memory (pulling the chunk into cache), then written
        for (int i = 0; i < count; ++i)
          if (!hasher.update(iov[i].iov_base, iov[i].iov_len)) return false;
        if (whole) {  // the header goes out with its checksum
          if (!hasher.digest(sealed + 80)) return false;
          memcpy(sealed, head, 80);
          memcpy(sealed + 96, head + 96, hl - 96);
          iov[0].iov_base = sealed;
        }
        if (!write_full(fd, iov, count, static_cast<off_t>(pos))) return false;
      }
      pos += n;
      if (!hook.call("write", "tmp", item.temp, static_cast<long long>(pos))) return false;
    }
    if (whole) return *total_out = total, true;  // sealed above
    unsigned char digest[16];
    if (!hasher.digest(digest)) return false;
    if (opt.direct) {
      memcpy(first + 80, digest, 16);
      memcpy(buf, first, kAlign);
      struct iovec one = {buf, size_t(kAlign)};
      if (!write_full(fd, &one, 1, 0) || ftruncate(fd, static_cast<off_t>(total)) != 0)
        return false;
    } else {
      struct iovec one = {digest, 16};
      if (!write_full(fd, &one, 1, 80)) return false;
    }
    *total_out = total;
    return true;
  }

  // The temp file's blocks allocated in one call before its bytes are written (RocksDB's
  // allow_fallocate): ext4 then maps the unit as one extent instead of reserving each 4 KiB
  // block on its write path. A file system without fallocate is written as before; no space
  // fails the store before a byte is written.
  bool preallocate() {
    if (!preallocate_blocks) return true;
    size_t total = item.head.len + item.data.len;
    if (opt.direct) total = round_up(total, kAlign);
    if (fallocate(fd, 0, 0, static_cast<off_t>(total)) == 0) return true;
    return errno != ENOSPC && errno != EDQUOT && errno != EFBIG;
  }

  int run() {
    int status = OK;
    int kfd = open_dir(item.fan, item.kd, opt.perms, true, opt.fsync, &status, &item.err);
    if (kfd < 0) return status;
    struct stat st;
    if (fstatat(kfd, item.name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
      close(kfd);
      return EXISTS;
    }
    if (errno != ENOENT) {
      item.err = errno;
      close(kfd);
      return ERROR;
    }
    unsigned char random[8];
    if (getrandom(random, sizeof random, 0) != sizeof random) {
      item.err = errno;
      close(kfd);
      return ERROR;
    }
    unsigned long long r;
    memcpy(&r, random, 8);
    snprintf(item.temp, sizeof item.temp, "%s%016llx.tmp", opt.prefix, r);
    const int flags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
    fd = openat(opt.tmp, item.temp, flags | (opt.direct ? O_DIRECT : 0), opt.perms.file_mode);
    if (fd < 0) {
      item.err = errno;
      item.temp[0] = 0;
      close(kfd);
      return ERROR;
    }
    size_t total = 0;
    bool ok = (!opt.perms.group_shared || fchmod(fd, opt.perms.file_mode) == 0) && preallocate() &&
              write_stream(&total) && (!opt.fsync || fdatasync(fd) == 0);
    int saved = errno;
    close(fd);
    if (ok) ok = hook.call("publish", "tmp", item.temp, static_cast<long long>(total));
    if (!ok) {
      item.err = saved;
      status = ERROR;
    } else if (!claim(state)) {
      status = EXPIRED;
    } else {  // never replaces: the first writer wins
      long moved = syscall(SYS_renameat2, opt.tmp, item.temp, kfd, item.name, RENAME_NOREPLACE);
      if (moved != 0 && (errno == EINVAL || errno == ENOSYS))  // no RENAME_NOREPLACE here
        moved = linkat(opt.tmp, item.temp, kfd, item.name, 0);
      else if (moved == 0)
        item.temp[0] = 0;  // renamed: no temp left
      item.err = moved == 0 ? 0 : errno;
      release(state);
      status = moved == 0 ? OK : item.err == EEXIST ? LOST : item.err == ENOENT ? MISSING : ERROR;
    }
    if (item.temp[0] != 0) unlinkat(opt.tmp, item.temp, 0);
    if (status == OK && opt.fsync && fsync(kfd) != 0) status = (item.err = errno, ERROR);
    close(kfd);
    return status;
  }
};

// The stores of one batch, one unit after the other, sharing the aligned buffer (O_DIRECT).
struct StoreBatch {
  std::vector<StoreItem>& items;
  const StoreOptions& opt;
  std::atomic<int>* state;
  Hook& hook;
  Gil& gil;
  Lease buffer;
  StoreBatch(std::vector<StoreItem>& items_, const StoreOptions& opt_, std::atomic<int>* state_,
             Hook& hook_, Gil& gil_)
      : items(items_), opt(opt_), state(state_), hook(hook_), gil(gil_) {}
  void run() {
    // Preallocated on ext4, where it was measured (bench/verified_io_candidates.cpp,
    // "fallocate, ..." rows): a hashed store 1.07-1.25x of vLLM's plain write against
    // 0.90-0.93x without. Not elsewhere: on XFS (extent-based delayed allocation already)
    // 0.83-0.85x against 0.85-0.86x, on tmpfs fallocate zeroes the pages the write fills.
    struct statfs where;
    const bool preallocate = fstatfs(opt.tmp, &where) == 0 && where.f_type == EXT4_SUPER_MAGIC;
    for (auto& it : items) {
      UnitWriter writer{{it, opt, state, hook, buffer}};
      writer.hasher.mac = it.mac, writer.hasher.gil = &gil;
      writer.preallocate_blocks = preallocate;
      it.status = writer.run();
      if (gil.failed || it.status == EXPIRED) break;
    }
  }
};

// ----------------------------------------------------------------- argument parsing

std::atomic<int>* job_word(PyObject* obj) {
  if (!PyObject_TypeCheck(obj, JobStateType)) {
    PyErr_Format(PyExc_TypeError, "state: expected a JobState, got %s", Py_TYPE(obj)->tp_name);
    return nullptr;
  }
  return &reinterpret_cast<JobState*>(obj)->word;
}

bool parse_perms(PyObject* obj, Perms* perms) {
  PyObject* gids;
  unsigned int uid, forbidden, dir_mode, file_mode;
  int shared;
  if (!PyArg_ParseTuple(
          obj, "IIO!IIp;perms: expected (uid, forbidden, gids, dir_mode, file_mode, group_shared)",
          &uid, &forbidden, &PyTuple_Type, &gids, &dir_mode, &file_mode, &shared))
    return false;
  perms->uid = uid, perms->forbidden = forbidden, perms->dir_mode = dir_mode;
  perms->file_mode = file_mode, perms->group_shared = shared != 0;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(gids); ++i) {
    unsigned long g = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(gids, i));
    if (PyErr_Occurred()) return false;
    perms->gids.push_back(static_cast<gid_t>(g));
  }
  return true;
}

// Run a batch (LoadBatch, StoreBatch) with the GIL released (taken back for hooks and MACs
// only); one result per item, or nullptr with the exception a callback raised.
template <typename Batch, typename Items, typename Options>
PyObject* run_batch(Items& items, const Options& opt, std::atomic<int>* state, PyObject* hook_obj) {
  Gil gil;
  Hook hook{hook_obj == Py_None ? nullptr : hook_obj, &gil};
  gil.drop();
  {
    Batch batch(items, opt, state, hook, gil);
    batch.run();
  }
  gil.take();
  if (gil.failed) return nullptr;
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(items.size()));
  for (size_t i = 0; out != nullptr && i < items.size(); ++i) {
    PyObject* r = items[i].result();
    if (r == nullptr)
      Py_CLEAR(out);
    else
      PyList_SET_ITEM(out, static_cast<Py_ssize_t>(i), r);
  }
  return out;
}

// ----------------------------------------------------------------- load(...)

const char load_doc[] =
    "load(state, items, perms, piece, bounce, nowait, direct, now_ns, granularity_ns, hook)\n"
    "items: [(fan_fd, kd, name, header, dest, lo, hi, mac or None)]; one (status, errno,\n"
    "reason, header read or None, st_dev, st_ino) per item. The GIL is released throughout.";

PyObject* py_load(PyObject*, PyObject* args) {
  PyObject *state_obj, *items_obj, *perms_obj, *hook_obj;
  Py_ssize_t piece, bounce;
  int nowait, direct;
  long long now_ns, granularity_ns;
  if (!PyArg_ParseTuple(args, "OO!OnnppLLO", &state_obj, &PyList_Type, &items_obj, &perms_obj,
                        &piece, &bounce, &nowait, &direct, &now_ns, &granularity_ns, &hook_obj))
    return nullptr;
  std::atomic<int>* state = job_word(state_obj);
  if (state == nullptr) return nullptr;
  LoadOptions opt;
  if (!parse_perms(perms_obj, &opt.perms)) return nullptr;
  if (piece < kAlign || bounce < piece || bounce % kAlign != 0) {
    PyErr_SetString(PyExc_ValueError,
                    "piece, bounce: expected 4096 <= piece <= bounce, bounce a multiple of 4096");
    return nullptr;
  }
  opt.piece = static_cast<size_t>(piece), opt.bounce = static_cast<size_t>(bounce);
  opt.nowait = nowait != 0, opt.direct = direct != 0;
  opt.now_ns = now_ns, opt.granularity_ns = granularity_ns;
  Py_ssize_t count = PyList_GET_SIZE(items_obj);
  std::vector<LoadItem> items(static_cast<size_t>(count));
  for (Py_ssize_t i = 0; i < count; ++i) {
    LoadItem& it = items[static_cast<size_t>(i)];
    Py_ssize_t lo, hi;
    if (!PyArg_ParseTuple(
            PyList_GET_ITEM(items_obj, i),
            "issy*w*nnO;items: expected (fan_fd, kd, name, header, dest, lo, hi, mac)", &it.fan,
            &it.kd, &it.name, &it.head, &it.data, &lo, &hi, &it.mac))
      return nullptr;
    if (it.head.len < 96 || it.head.len > static_cast<Py_ssize_t>(kMaxHeader) || lo < 0 ||
        hi < lo || static_cast<uint64_t>(hi) > it.payload_length() || it.data.len != hi - lo) {
      PyErr_SetString(
          PyExc_ValueError,
          "items: header of 96..1120 bytes, 0 <= lo <= hi <= payload, len(dest) == hi - lo");
      return nullptr;
    }
    it.lo = static_cast<size_t>(lo), it.hi = static_cast<size_t>(hi);
    if (it.mac == Py_None) it.mac = nullptr;
  }
  return run_batch<LoadBatch>(items, opt, state, hook_obj);
}

// ----------------------------------------------------------------- store(...)

const char store_doc[] =
    "store(state, items, perms, tmp_fd, temp_prefix, chunk, fsync, direct, hook)\n"
    "items: [(fan_fd, kd, name, header, payload, mac or None)]; one (status, errno,\n"
    "reason, None, 0, 0) per item. The GIL is released throughout.";

PyObject* py_store(PyObject*, PyObject* args) {
  PyObject *state_obj, *items_obj, *perms_obj, *hook_obj;
  int tmp, fsync_on, direct;
  const char* prefix;
  Py_ssize_t chunk;
  if (!PyArg_ParseTuple(args, "OO!OisnppO", &state_obj, &PyList_Type, &items_obj, &perms_obj, &tmp,
                        &prefix, &chunk, &fsync_on, &direct, &hook_obj))
    return nullptr;
  std::atomic<int>* state = job_word(state_obj);
  if (state == nullptr) return nullptr;
  StoreOptions opt;
  if (!parse_perms(perms_obj, &opt.perms)) return nullptr;
  if (chunk < 1 || strlen(prefix) > 60) {
    PyErr_SetString(PyExc_ValueError, "chunk: expected >= 1; temp_prefix: at most 60 characters");
    return nullptr;
  }
  opt.tmp = tmp, opt.prefix = prefix, opt.chunk = static_cast<size_t>(chunk);
  opt.fsync = fsync_on != 0, opt.direct = direct != 0;
  Py_ssize_t count = PyList_GET_SIZE(items_obj);
  std::vector<StoreItem> items(static_cast<size_t>(count));
  for (Py_ssize_t i = 0; i < count; ++i) {
    StoreItem& it = items[static_cast<size_t>(i)];
    if (!PyArg_ParseTuple(PyList_GET_ITEM(items_obj, i),
                          "issy*y*O;items: expected (fan_fd, kd, name, header, payload, mac)",
                          &it.fan, &it.kd, &it.name, &it.head, &it.data, &it.mac))
      return nullptr;
    if (it.head.len < 96 || it.head.len > static_cast<Py_ssize_t>(kMaxHeader)) {
      PyErr_SetString(PyExc_ValueError, "items: expected a header of 96 to 1120 bytes");
      return nullptr;
    }
    if (it.mac == Py_None) it.mac = nullptr;
  }
  return run_batch<StoreBatch>(items, opt, state, hook_obj);
}

// ----------------------------------------------------------------- xxh3_128(...)

PyObject* py_xxh3_128(PyObject*, PyObject* args) {
  Py_buffer view;
  if (!PyArg_ParseTuple(args, "y*", &view)) return nullptr;
  Hasher hasher;
  hasher.reset();
  Py_BEGIN_ALLOW_THREADS;
  hasher.update(view.buf, static_cast<size_t>(view.len));
  Py_END_ALLOW_THREADS;
  PyBuffer_Release(&view);
  unsigned char digest[16];
  hasher.digest(digest);
  return PyBytes_FromStringAndSize(reinterpret_cast<char*>(digest), 16);
}

PyMethodDef methods[] = {
    {"load", py_load, METH_VARARGS, load_doc},
    {"store", py_store, METH_VARARGS, store_doc},
    {"xxh3_128", py_xxh3_128, METH_VARARGS,
     "XXH3-128 (seed 0) of a buffer, canonical (big-endian) bytes, without the GIL."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_unitio",
                      "Batch unit-file I/O for canonical_ops.units.files, without the GIL.", -1,
                      methods};

}  // namespace

PyMODINIT_FUNC PyInit__unitio(void) {
  pthread_atfork(nullptr, nullptr, [] { g_buffers = new BufferPool; });
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  JobStateType = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&JobState_spec));
  if (JobStateType == nullptr ||
      PyModule_AddObjectRef(m, "JobState", reinterpret_cast<PyObject*>(JobStateType)) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  const struct {
    const char* name;
    int value;
  } constants[] = {{"OK", OK},
                   {"MISSING", MISSING},
                   {"UNSAFE_DIR", UNSAFE_DIR},
                   {"UNSAFE_FILE", UNSAFE_FILE},
                   {"CORRUPT", CORRUPT},
                   {"EXPIRED", EXPIRED},
                   {"ERROR", ERROR},
                   {"EXISTS", EXISTS},
                   {"LOST", LOST},
                   {"SKIPPED", SKIPPED}};
  for (const auto& c : constants)
    if (PyModule_AddIntConstant(m, c.name, c.value) < 0) {
      Py_DECREF(m);
      return nullptr;
    }
  return m;
}
