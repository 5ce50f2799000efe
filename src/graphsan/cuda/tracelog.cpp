// graphsan's view of PyTorch's CUDA caching allocator: a trace tracker that keeps the allocator's
// events (allocations, frees, segments made, returned, mapped and unmapped) in a buffer that
// Python drains (graphsan/cuda/tracebuild.py builds this file, tracelib.py loads it with ctypes).
//
// The allocator calls the tracker with its per-device lock held, memory history on or off; the
// tracker takes no lock but its own and calls nothing in PyTorch or Python. Trackers cannot be
// detached, so this one is attached once per process and turned on and off by a flag.
//
// gputrace.cpp and gputable.cpp, built into the same library, stand in for PyTorch's GPU-trace
// dispatch.

#include <c10/cuda/CUDACachingAllocator.h>

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <iterator>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>


namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using Entry = cca::TraceEntry;

// One event; tracelib.py reads it with the struct format "<QQQqQQiiii".
struct Record {
  uint64_t addr;
  uint64_t size;
  uint64_t stream;
  int64_t time_us;
  uint64_t pool_a;
  uint64_t pool_b;
  int32_t action; // graphsan's code: an index into tracelib.py's ACTIONS
  int32_t device;
  int32_t tag; // index into the batch's tags; -1: no user metadata
  int32_t unused;
};

struct Log {
  std::mutex mu;
  std::vector<Record> live; // written by the tracker
  std::vector<std::string> tags; // the user metadata strings live's records name
  std::unordered_map<std::string, int32_t> tag_ids;
  bool overflow = false;
  size_t cap = size_t(1) << 18;
  // the batch the last drain took; read by Python until the next drain
  std::vector<Record> out;
  std::vector<std::string> out_tags;
  bool out_overflow = false;
};

// Never destroyed: the allocator may still call the tracker while the process exits.
Log* const g_log = new Log;
std::atomic<bool> g_enabled{false};
std::atomic<bool> g_attached{false};

// The events the view needs, in tracelib.py's ACTIONS order: a record's code is the index here.
constexpr Entry::Action kKeptActions[] = {
    Entry::ALLOC,
    Entry::FREE_COMPLETED,
    Entry::SEGMENT_ALLOC,
    Entry::SEGMENT_FREE,
    Entry::SEGMENT_MAP,
    Entry::SEGMENT_UNMAP,
};

// The action's code; -1 for the events the view does not need.
int32_t action_code(Entry::Action action) {
  for (int32_t code = 0; code < int32_t(std::size(kKeptActions)); ++code) {
    if (kKeptActions[code] == action) {
      return code;
    }
  }
  return -1;
}

void on_trace(const Entry& e) noexcept {
  if (!g_enabled.load(std::memory_order_relaxed)) {
    return;
  }
  const int32_t code = action_code(e.action_);
  if (code < 0) {
    return;
  }
  Record r{};
  r.addr = static_cast<uint64_t>(e.addr_);
  r.size = static_cast<uint64_t>(e.size_);
  r.stream = reinterpret_cast<uint64_t>(e.stream_);
  r.time_us = std::chrono::duration_cast<std::chrono::microseconds>(
                  std::chrono::system_clock::now().time_since_epoch())
                  .count();
  r.pool_a = static_cast<uint64_t>(e.mempool_.first);
  r.pool_b = static_cast<uint64_t>(e.mempool_.second);
  r.action = code;
  r.device = static_cast<int32_t>(e.device_);
  r.tag = -1;
  std::lock_guard<std::mutex> guard(g_log->mu);
  if (g_log->live.size() >= g_log->cap) {
    g_log->overflow = true; // the drain answers with a fresh snapshot
    return;
  }
  try {
    if (!e.user_metadata_.empty()) {
      auto it = g_log->tag_ids.find(e.user_metadata_);
      if (it == g_log->tag_ids.end()) {
        const auto id = static_cast<int32_t>(g_log->tags.size());
        g_log->tags.push_back(e.user_metadata_);
        it = g_log->tag_ids.emplace(e.user_metadata_, id).first;
      }
      r.tag = it->second;
    }
    g_log->live.push_back(r);
  } catch (...) { // out of host memory: an exception must not unwind into the allocator
    g_log->overflow = true;
  }
}

} // namespace

namespace graphsan {

// One line of text into a caller's buffer (gputable.cpp uses it too).
void put_error(char* buf, size_t len, const std::string& text) {
  if (buf == nullptr || len == 0) {
    return;
  }
  const std::string line = text.substr(0, text.find('\n'));
  std::strncpy(buf, line.c_str(), len - 1);
  buf[len - 1] = '\0';
}

} // namespace graphsan

namespace {

using graphsan::put_error;

// The allocator's own spelling of each action, for gs_tracelog_feed.
bool action_named(const char* name, Entry::Action* out) {
  static const std::pair<const char*, Entry::Action> names[] = {
      {"alloc", Entry::ALLOC},
      {"free_requested", Entry::FREE_REQUESTED},
      {"free_completed", Entry::FREE_COMPLETED},
      {"segment_alloc", Entry::SEGMENT_ALLOC},
      {"segment_free", Entry::SEGMENT_FREE},
      {"segment_map", Entry::SEGMENT_MAP},
      {"segment_unmap", Entry::SEGMENT_UNMAP},
      {"snapshot", Entry::SNAPSHOT},
      {"oom", Entry::OOM},
  };
  for (const auto& [n, a] : names) {
    if (std::strcmp(n, name) == 0) {
      *out = a;
      return true;
    }
  }
  return false;
}

} // namespace

extern "C" {

int32_t gs_tracelog_record_size() {
  return static_cast<int32_t>(sizeof(Record));
}

}  // extern "C"

// The CUDA caching allocator of the loaded libc10_cuda (c10::cuda::CUDACachingAllocator::allocator,
// looked up so that this library also loads where libc10_cuda is absent: the CPU tests feed it by
// hand), initialized; nullptr with one line in err and the failure's number in code otherwise.
static cca::CUDAAllocator* caching_allocator(const char* c10_cuda, char* err, size_t err_len,
                                             int32_t* code) {
  void* lib = dlopen(c10_cuda, RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) {
    lib = dlopen("libc10_cuda.so", RTLD_NOW | RTLD_NOLOAD);
  }
  if (lib == nullptr) {
    put_error(err, err_len, "libc10_cuda is not loaded in this process");
    *code = 1;
    return nullptr;
  }
  void* sym = dlsym(lib, "_ZN3c104cuda20CUDACachingAllocator9allocatorE");
  if (sym == nullptr) {
    put_error(err, err_len, "libc10_cuda has no c10::cuda::CUDACachingAllocator::allocator");
    *code = 2;
    return nullptr;
  }
  cca::CUDAAllocator* allocator = static_cast<std::atomic<cca::CUDAAllocator*>*>(sym)->load();
  if (allocator == nullptr || !allocator->initialized()) {
    put_error(err, err_len, "the CUDA caching allocator is not initialized");
    *code = 3;
    return nullptr;
  }
  return allocator;
}

extern "C" {

// Attach the tracker to the allocator of the loaded libc10_cuda (once per process). Returns 0,
// or non-zero with one line in err.
int32_t gs_tracelog_attach(const char* c10_cuda, char* err, size_t err_len) {
  if (g_attached.load()) {
    return 0;
  }
  int32_t code = 0;
  cca::CUDAAllocator* allocator = caching_allocator(c10_cuda, err, err_len, &code);
  if (allocator == nullptr) {
    return code;
  }
  try {
    allocator->attachAllocatorTraceTracker(&on_trace);
  } catch (const std::exception& ex) {
    put_error(err, err_len, std::string("attachAllocatorTraceTracker: ") + ex.what());
    return 4;
  }
  g_attached.store(true);
  return 0;
}

// Give the cached memory of private pool (first, second) back to the driver: a pool that no
// graph and no routing uses any more (the start-up probe's), whose blocks the allocator would
// otherwise keep until an empty_cache() that releases the program's cache too. The allocator
// releases only that pool's blocks for an id other than (0, 0). Returns 0, or non-zero with one
// line in err.
int32_t gs_release_pool(const char* c10_cuda, uint64_t first, uint64_t second, char* err, size_t err_len) {
  if (first == 0 && second == 0) {
    put_error(err, err_len, "(0, 0) names every pool: refused");
    return 1;
  }
  int32_t code = 0;
  cca::CUDAAllocator* allocator = caching_allocator(c10_cuda, err, err_len, &code);
  if (allocator == nullptr) {
    return code + 1;
  }
  try {
    allocator->emptyCache(c10::MempoolId_t{first, second});
  } catch (const std::exception& ex) {
    put_error(err, err_len, std::string("emptyCache: ") + ex.what());
    return 5;
  }
  return 0;
}

// Turn recording on (from an empty buffer) or off (the buffer is emptied).
void gs_tracelog_enable(int32_t on) {
  std::lock_guard<std::mutex> guard(g_log->mu);
  g_log->live.clear();
  g_log->tags.clear();
  g_log->tag_ids.clear();
  g_log->overflow = false;
  g_enabled.store(on != 0);
}

void gs_tracelog_set_cap(uint64_t cap) {
  std::lock_guard<std::mutex> guard(g_log->mu);
  g_log->cap = static_cast<size_t>(cap);
}

// Take everything recorded since the last drain; returns the number of records. The batch
// (gs_tracelog_records, gs_tracelog_tag, gs_tracelog_overflowed) stays valid until the next drain.
int64_t gs_tracelog_drain() {
  std::lock_guard<std::mutex> guard(g_log->mu);
  g_log->out.clear();
  g_log->out.swap(g_log->live);
  g_log->out_tags.clear();
  g_log->out_tags.swap(g_log->tags);
  g_log->tag_ids.clear();
  g_log->out_overflow = g_log->overflow;
  g_log->overflow = false;
  return static_cast<int64_t>(g_log->out.size());
}

const Record* gs_tracelog_records() {
  return g_log->out.data();
}

int32_t gs_tracelog_overflowed() {
  return g_log->out_overflow ? 1 : 0;
}

int32_t gs_tracelog_tag_count() {
  return static_cast<int32_t>(g_log->out_tags.size());
}

const char* gs_tracelog_tag(int32_t i) {
  if (i < 0 || static_cast<size_t>(i) >= g_log->out_tags.size()) {
    return "";
  }
  return g_log->out_tags[static_cast<size_t>(i)].c_str();
}

// Hand the tracker one event as the allocator would (tests without a GPU). Returns 0, or 1 for
// an unknown action name.
int32_t gs_tracelog_feed(
    const char* action,
    int32_t device,
    uint64_t addr,
    uint64_t size,
    uint64_t stream,
    uint64_t pool_a,
    uint64_t pool_b,
    const char* user_metadata) {
  Entry::Action a{};
  if (!action_named(action, &a)) {
    return 1;
  }
  const Entry e(
      a,
      static_cast<c10::DeviceIndex>(device),
      static_cast<size_t>(addr),
      static_cast<size_t>(size),
      reinterpret_cast<cudaStream_t>(stream), // a void* parameter from torch 2.11 on
      decltype(Entry::mempool_){pool_a, pool_b},
      0,
      nullptr,
      "",
      user_metadata == nullptr ? "" : user_metadata);
  on_trace(e);
  return 0;
}

} // extern "C"
