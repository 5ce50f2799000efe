// graphsan's own GPU-trace interpreter, built into the same library as tracelog.cpp (tracebuild.py
// builds both, tracelib.py loads them with ctypes; gputrace.py drives this part).
//
// Once PyTorch's GPU trace is on (graphsan needs to see frees outside the allocator's lock, with
// the freeing thread's Python stack), every allocation, free, event and synchronization calls
// into Python: PyTorch takes the GIL, imports torch.cuda and calls its callback registry, whether
// or not anyone listens. Here graphsan registers its own interpreter for the trace instead. Its
// allocation and free entries run in C++ and call Python only where graphsan must judge: a free
// of a watched block (or in a segment holding freed watched memory), an allocation in such a
// segment, and, while allocation sites are on, the allocating thread's Python frames, read with
// the GIL but without running any Python code. The other trace entries do nothing.
//
// PyTorch offers no C++ base class with the other entries, so the interpreter's table is built
// here: every slot traps except the trace entries, whose positions come from their member
// pointers (Itanium C++ ABI), and whose signatures are those of the headers it is built against.
// Where those headers do not fit, tracebuild.py builds tracelog.cpp alone: the tracker still
// works, and the reason is kept beside the library.

#include <c10/core/impl/GPUTrace.h>
#include <c10/core/impl/PyInterpreter.h>
#include <c10/util/python_stub.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

// The few CPython calls used, declared here so that no Python headers are needed to build; the
// process that loads this library is a Python interpreter (3.11 or newer, for PyFrame_GetLasti).
extern "C" {
int PyGILState_Ensure(void);
void PyGILState_Release(int);
void* PyGILState_GetThisThreadState(void);
int Py_IsInitialized(void);
PyObject* PyThreadState_GetFrame(void*);
void* PyThreadState_Get(void);
PyObject* PyFrame_GetBack(PyObject*);
PyObject* PyFrame_GetCode(PyObject*);
int PyFrame_GetLasti(PyObject*);
void Py_IncRef(PyObject*);
void Py_DecRef(PyObject*);
PyObject* PyLong_FromUnsignedLongLong(unsigned long long);
PyObject* PyObject_CallFunctionObjArgs(PyObject*, ...);
void PyErr_Clear(void);
void PyErr_Fetch(PyObject**, PyObject**, PyObject**);
void PyErr_Restore(PyObject*, PyObject*, PyObject*);
}

namespace graphsan {
void put_error(char* buf, size_t len, const std::string& text); // tracelog.cpp
} // namespace graphsan

namespace {

using graphsan::put_error;

using VTable = c10::impl::PyInterpreterVTable;

struct Trace {
  std::mutex mu;
  std::unordered_set<uint64_t> watched; // a superset of the blocks graphs reference
  std::vector<std::pair<uint64_t, uint64_t>> freed_ranges; // [start, end), sorted, disjoint
  std::unordered_map<uint64_t, uint32_t> site_of; // live block -> site index + 1
  std::vector<std::vector<uintptr_t>> sites; // (code, lasti) pairs, innermost frame first
  std::unordered_map<std::string, uint32_t> site_ids; // a site's bytes -> its index
  PyObject* on_free = nullptr; // graphsan's callbacks, called with the GIL and the address
  PyObject* on_alloc = nullptr;
  int32_t depth = 24;
  bool sites_on = false;
  uint64_t calls = 0; // Python calls made for frees and allocations (a test counts them)
};

Trace* const g_trace = new Trace;
std::atomic<bool> g_trace_on{false};
c10::impl::PyInterpreter* g_interp = nullptr;
bool g_saved_have_state = false; // PyTorch's flag as the install found it
void* g_table[2 + 512];
struct TableObject {
  void* const* vptr;
};
TableObject g_table_object{&g_table[2]};

bool in_freed_range(uint64_t addr) {
  const auto& r = g_trace->freed_ranges;
  auto it = std::upper_bound(
      r.begin(), r.end(), addr, [](uint64_t a, const std::pair<uint64_t, uint64_t>& x) {
        return a < x.first;
      });
  return it != r.begin() && addr < std::prev(it)->second;
}

// Call one of graphsan's callbacks with the address. A free can come from C code while a Python
// exception propagates (a frame's values dropped during unwinding): that exception is kept aside
// and restored, and whatever the callback raises is dropped (it reports its own errors).
void call_python(bool free_callback, uint64_t addr) {
  if (!Py_IsInitialized()) {
    return;
  }
  const int gil = PyGILState_Ensure();
  PyObject* fn = nullptr;
  {
    std::lock_guard<std::mutex> guard(g_trace->mu);
    fn = free_callback ? g_trace->on_free : g_trace->on_alloc;
    Py_IncRef(fn); // the callback may be replaced meanwhile
  }
  if (fn != nullptr) {
    PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
    PyErr_Fetch(&type, &value, &tb);
    PyObject* arg = PyLong_FromUnsignedLongLong(addr);
    if (arg != nullptr) {
      PyObject* out = PyObject_CallFunctionObjArgs(fn, arg, nullptr);
      Py_DecRef(out);
      Py_DecRef(arg);
    }
    PyErr_Clear();
    Py_DecRef(fn); // a destructor it may run must not see the kept exception
    PyErr_Restore(type, value, tb);
  }
  PyGILState_Release(gil);
}

// The calling thread's Python frames as (code, lasti) pairs; the GIL is held. Leaves the error
// indicator as it found it.
void walk_frames(std::vector<uintptr_t>& out, int32_t depth) {
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  PyObject* frame = PyThreadState_GetFrame(PyThreadState_Get());
  for (int32_t i = 0; frame != nullptr && i < depth; ++i) {
    PyObject* code = PyFrame_GetCode(frame);
    out.push_back(reinterpret_cast<uintptr_t>(code));
    out.push_back(static_cast<uintptr_t>(PyFrame_GetLasti(frame)));
    Py_DecRef(code); // the frame holds it; a kept site holds its own reference
    PyObject* back = PyFrame_GetBack(frame);
    Py_DecRef(frame);
    frame = back;
  }
  Py_DecRef(frame);
  PyErr_Clear(); // a frame object that could not be made (out of memory) ends the walk
  PyErr_Restore(type, value, tb);
}

// Not noexcept: a thread stopped by the interpreter's exit while it waits for the GIL is ended
// by a forced unwind, which must pass through.
void trace_alloc(uint64_t addr) {
  if (!g_trace_on.load(std::memory_order_relaxed)) {
    return;
  }
  Trace& t = *g_trace;
  bool judge = false;
  bool sites = false;
  int32_t depth = 1;
  {
    std::lock_guard<std::mutex> guard(t.mu);
    t.site_of.erase(addr);
    judge = !t.freed_ranges.empty() && in_freed_range(addr);
    sites = t.sites_on;
    depth = t.depth;
    if (judge) {
      ++t.calls;
    }
  }
  // A thread without a Python thread state has no Python frames. The autograd engine's worker
  // threads have one (PyTorch makes it), so their allocations take the GIL to find no frames, or
  // those of a Python backward.
  if (sites && Py_IsInitialized() && PyGILState_GetThisThreadState() != nullptr) {
    const int gil = PyGILState_Ensure();
    try {
      std::vector<uintptr_t> path;
      path.reserve(2 * static_cast<size_t>(depth));
      walk_frames(path, depth);
      std::lock_guard<std::mutex> guard(t.mu);
      // the trace may have stopped (and its sites been cleared) during the walk
      if (!path.empty() && g_trace_on.load(std::memory_order_relaxed) && t.sites_on) {
        std::string key(
            reinterpret_cast<const char*>(path.data()), path.size() * sizeof(uintptr_t));
        auto it = t.site_ids.find(key);
        if (it == t.site_ids.end()) {
          for (size_t i = 0; i < path.size(); i += 2) {
            Py_IncRef(reinterpret_cast<PyObject*>(path[i])); // kept with the site
          }
          it = t.site_ids.emplace(std::move(key), static_cast<uint32_t>(t.sites.size())).first;
          t.sites.push_back(std::move(path));
        }
        t.site_of[addr] = it->second + 1;
      }
    } catch (const std::bad_alloc&) { // out of host memory: no site for this block
    }
    PyGILState_Release(gil);
  }
  if (judge) {
    call_python(false, addr);
  }
}

void trace_free(uint64_t addr) {
  if (!g_trace_on.load(std::memory_order_relaxed)) {
    return;
  }
  Trace& t = *g_trace;
  bool judge = false;
  {
    std::lock_guard<std::mutex> guard(t.mu);
    t.site_of.erase(addr);
    // graphsan takes the address out of the set once it has judged the free (gs_trace_unwatch)
    judge = t.watched.count(addr) > 0 || (!t.freed_ranges.empty() && in_freed_range(addr));
    if (judge) {
      ++t.calls;
    }
  }
  if (judge) {
    call_python(true, addr);
  }
}

// One function per trace entry, with the entry's own parameters after the object pointer.
template <typename M>
struct TraceEntryFn;
template <typename... A>
struct TraceEntryFn<void (VTable::*)(A...) const> {
  static void nothing(const void*, A...) {}
  static void alloc(const void*, A... a) {
    trace_alloc(static_cast<uint64_t>(std::get<sizeof...(A) - 1>(std::tuple<A...>(a...))));
  }
  static void free(const void*, A... a) {
    trace_free(static_cast<uint64_t>(std::get<sizeof...(A) - 1>(std::tuple<A...>(a...))));
  }
};

template <typename M>
bool slot_of(M member, size_t* slot) {
  struct Raw {
    uintptr_t ptr;
    ptrdiff_t adj;
  } raw{};
  static_assert(sizeof(M) == sizeof(Raw), "an Itanium C++ ABI member pointer");
  std::memcpy(&raw, &member, sizeof(raw));
#if defined(__arm__) || defined(__aarch64__)
  if ((raw.adj & 1) == 0) {
    return false;
  }
  *slot = raw.ptr / sizeof(void*);
#else
  if ((raw.ptr & 1) == 0) {
    return false;
  }
  *slot = (raw.ptr - 1) / sizeof(void*);
#endif
  return *slot < 512;
}

[[noreturn]] void unexpected_entry() {
  std::fputs("graphsan: PyTorch called its GPU-trace interpreter for something else\n", stderr);
  std::abort();
}

template <typename M>
bool put(M member, void* fn) {
  size_t slot = 0;
  if (!slot_of(member, &slot)) {
    return false;
  }
  g_table[2 + slot] = fn;
  return true;
}

#define GS_ENTRY(name) decltype(&VTable::name)

// An argument of an entry as the allocator would pass it: the device type, else the address.
template <typename T>
T argument(uint64_t addr) {
  if constexpr (std::is_same_v<T, c10::DeviceType>) {
    return c10::kCUDA;
  } else {
    return static_cast<T>(addr);
  }
}

template <typename... A>
void call_entry(void (VTable::*member)(A...) const, const VTable& vt, uint64_t addr) {
  (vt.*member)(argument<A>(addr)...);
}

bool build_table() {
  for (auto& slot : g_table) {
    slot = reinterpret_cast<void*>(&unexpected_entry);
  }
  g_table[0] = nullptr; // offset to top
  g_table[1] = nullptr; // no type information: nothing asks
  bool ok = true;
  ok &= put(
      &VTable::trace_gpu_memory_allocation,
      reinterpret_cast<void*>(&TraceEntryFn<GS_ENTRY(trace_gpu_memory_allocation)>::alloc));
  ok &= put(
      &VTable::trace_gpu_memory_deallocation,
      reinterpret_cast<void*>(&TraceEntryFn<GS_ENTRY(trace_gpu_memory_deallocation)>::free));
#define GS_NOTHING(name) \
  ok &= put(&VTable::name, reinterpret_cast<void*>(&TraceEntryFn<GS_ENTRY(name)>::nothing))
  GS_NOTHING(trace_gpu_event_creation);
  GS_NOTHING(trace_gpu_event_deletion);
  GS_NOTHING(trace_gpu_event_record);
  GS_NOTHING(trace_gpu_event_wait);
  GS_NOTHING(trace_gpu_stream_creation);
  GS_NOTHING(trace_gpu_device_synchronization);
  GS_NOTHING(trace_gpu_stream_synchronization);
  GS_NOTHING(trace_gpu_event_synchronization);
#undef GS_NOTHING
  return ok;
}

bool current() {
  using c10::impl::GPUTrace;
  return g_interp != nullptr && GPUTrace::haveState && GPUTrace::gpuTraceState.load() == g_interp;
}

} // namespace

extern "C" {

// Make this library PyTorch's GPU-trace interpreter. Returns 0; 1 where another interpreter is
// registered (someone turned PyTorch's trace on, now or before: graphsan then listens through
// it); 2 where this library cannot be it. One line in err.
int32_t gs_trace_install(char* err, size_t err_len) {
  using c10::impl::GPUTrace;
  if (current()) {
    return 0;
  }
  const c10::impl::PyInterpreter* other = GPUTrace::gpuTraceState.load();
  if (other != nullptr && other != g_interp) {
    put_error(err, err_len, "PyTorch's GPU trace is already on (another tool listens to it)");
    return 1;
  }
  if (g_interp == nullptr) {
    if (!build_table()) {
      put_error(err, err_len, "cannot place the GPU-trace entries (member pointer layout)");
      return 2;
    }
    g_interp = new c10::impl::PyInterpreter(reinterpret_cast<const VTable*>(&g_table_object));
  }
  g_saved_have_state = GPUTrace::haveState;
  GPUTrace::gpuTraceState.store(g_interp, std::memory_order_release);
  GPUTrace::haveState = true;
  return 0;
}

// Whether this library still is the trace's interpreter (torch._C._activate_gpu_trace() after
// the install replaces it).
int32_t gs_trace_current() {
  return current() ? 1 : 0;
}

// Give the trace back as the install found it (no interpreter registered).
void gs_trace_uninstall() {
  using c10::impl::GPUTrace;
  g_trace_on.store(false);
  if (current()) {
    GPUTrace::gpuTraceState.store(nullptr, std::memory_order_release);
    GPUTrace::haveState = g_saved_have_state;
  }
}

// graphsan's callbacks (called with the GIL held, through ctypes.PyDLL); NULL clears one.
void gs_trace_callbacks(PyObject* on_free, PyObject* on_alloc) {
  Trace& t = *g_trace;
  PyObject* old_free = nullptr;
  PyObject* old_alloc = nullptr;
  Py_IncRef(on_free);
  Py_IncRef(on_alloc);
  {
    std::lock_guard<std::mutex> guard(t.mu);
    old_free = t.on_free;
    old_alloc = t.on_alloc;
    t.on_free = on_free;
    t.on_alloc = on_alloc;
  }
  Py_DecRef(old_free);
  Py_DecRef(old_alloc);
}

// Start listening (what is watched was set before, so that no free slips between), or stop:
// then nothing is watched and no block has a site any more.
void gs_trace_enable(int32_t on, int32_t sites, int32_t depth) {
  Trace& t = *g_trace;
  std::lock_guard<std::mutex> guard(t.mu);
  if (on == 0) {
    t.watched.clear();
    t.freed_ranges.clear();
    t.site_of.clear();
  }
  t.sites_on = sites != 0;
  t.depth = depth > 0 ? depth : 1;
  g_trace_on.store(on != 0);
}

// Forget the interned sites and their code objects (called with the GIL held, through
// ctypes.PyDLL, while the trace is off).
void gs_trace_clear_sites() {
  std::vector<std::vector<uintptr_t>> old;
  {
    std::lock_guard<std::mutex> guard(g_trace->mu);
    old.swap(g_trace->sites);
    g_trace->site_ids.clear();
    g_trace->site_of.clear();
  }
  for (const auto& path : old) {
    for (size_t i = 0; i < path.size(); i += 2) {
      Py_DecRef(reinterpret_cast<PyObject*>(path[i]));
    }
  }
}

void gs_trace_watch(const uint64_t* addrs, int64_t n) {
  std::lock_guard<std::mutex> guard(g_trace->mu);
  for (int64_t i = 0; i < n; ++i) {
    g_trace->watched.insert(addrs[i]);
  }
}

void gs_trace_unwatch(uint64_t addr) {
  std::lock_guard<std::mutex> guard(g_trace->mu);
  g_trace->watched.erase(addr);
}

// The segments holding freed watched memory, as n (start, size) pairs sorted by start.
void gs_trace_freed_ranges(const uint64_t* pairs, int64_t n) {
  std::lock_guard<std::mutex> guard(g_trace->mu);
  auto& r = g_trace->freed_ranges;
  r.clear();
  for (int64_t i = 0; i < n; ++i) {
    r.emplace_back(pairs[2 * i], pairs[2 * i] + pairs[2 * i + 1]);
  }
}

int64_t gs_trace_watched_count() {
  std::lock_guard<std::mutex> guard(g_trace->mu);
  return static_cast<int64_t>(g_trace->watched.size());
}

uint64_t gs_trace_python_calls() {
  std::lock_guard<std::mutex> guard(g_trace->mu);
  return g_trace->calls;
}

// The site of the live block at addr: its index + 1, or 0 where none was recorded.
uint32_t gs_trace_site_of(uint64_t addr) {
  std::lock_guard<std::mutex> guard(g_trace->mu);
  auto it = g_trace->site_of.find(addr);
  return it == g_trace->site_of.end() ? 0 : it->second;
}

// Copy site `index` (from gs_trace_site_of, less one) into out as (code, lasti) pairs; returns
// the number of values (at most cap). The code objects live until gs_trace_clear_sites.
int64_t gs_trace_site(uint32_t index, uintptr_t* out, int64_t cap) {
  std::lock_guard<std::mutex> guard(g_trace->mu);
  if (index >= g_trace->sites.size()) {
    return 0;
  }
  const auto& s = g_trace->sites[index];
  const int64_t n = std::min<int64_t>(cap, static_cast<int64_t>(s.size()));
  std::copy(s.begin(), s.begin() + n, out);
  return n;
}

// Call the trace as the allocator does (tests without a GPU): kind 0 an allocation, 1 a free,
// 2 an event record. Returns 1 where this library is not the trace's interpreter.
int32_t gs_trace_fire(int32_t kind, uint64_t addr) {
  const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
  if (interp == nullptr || interp != g_interp) {
    return 1;
  }
  const VTable& vt = **interp;
  if (kind == 0) {
    call_entry(&VTable::trace_gpu_memory_allocation, vt, addr);
  } else if (kind == 1) {
    call_entry(&VTable::trace_gpu_memory_deallocation, vt, addr);
  } else {
    call_entry(&VTable::trace_gpu_event_record, vt, addr);
  }
  return 0;
}

// Fire n allocations, each followed by its free, from C++ as the allocator does (a benchmark
// without a GPU; the caller releases the GIL as PyTorch's operators do).
int32_t gs_trace_fire_temporaries(uint64_t base, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t addr = base + 512 * static_cast<uint64_t>(i);
    if (gs_trace_fire(0, addr) != 0 || gs_trace_fire(1, addr) != 0) {
      return 1;
    }
  }
  return 0;
}

} // extern "C"
