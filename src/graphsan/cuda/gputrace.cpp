// graphsan's own GPU-trace interpreter, built into the same library as tracelog.cpp (tracebuild.py
// builds both, tracelib.py loads them with ctypes; gputrace.py drives this part). This file keeps
// the trace's state and its allocation and free entries; gputable.cpp makes them PyTorch's
// interpreter.
//
// Once PyTorch's GPU trace is on (graphsan needs to see frees outside the allocator's lock, with
// the freeing thread's Python stack), every allocation, free, event and synchronization calls
// into Python: PyTorch takes the GIL, imports torch.cuda and calls its callback registry, whether
// or not anyone listens. Here graphsan registers its own interpreter for the trace instead. Its
// allocation and free entries run in C++ and call Python only where graphsan must judge: a free
// of a watched block (or in a segment holding freed watched memory), an allocation in such a
// segment, and, while allocation sites are on, the allocating thread's Python frames, read with
// the GIL but without running any Python code. The other trace entries do nothing.

#include <c10/util/python_stub.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <new>
#include <string>
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
PyObject* PyTuple_New(long);
int PyTuple_SetItem(PyObject*, long, PyObject*);
PyObject* PyObject_CallFunctionObjArgs(PyObject*, ...);
void PyErr_Clear(void);
void PyErr_Fetch(PyObject**, PyObject**, PyObject**);
void PyErr_Restore(PyObject*, PyObject*, PyObject*);
}

namespace {

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

} // namespace

namespace graphsan {

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

// Stop listening without forgetting what is watched (gputable.cpp's uninstall).
void trace_off() {
  g_trace_on.store(false);
}

} // namespace graphsan

extern "C" {

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

// Site `index` (from gs_trace_site_of, less one) as a new tuple (code, lasti, code, lasti, ...)
// that holds its own references to the code objects; empty where there is no such site; NULL
// with the error set where Python is out of memory. Called with the GIL held (ctypes.PyDLL), so
// no gs_trace_clear_sites can drop a code object between the copy and the new references. No
// Python object is made while the trace's lock is held: a collection could run code that takes
// it.
PyObject* gs_trace_site_tuple(uint32_t index) {
  std::vector<uintptr_t> path;
  try {
    std::lock_guard<std::mutex> guard(g_trace->mu);
    if (index < g_trace->sites.size()) {
      path = g_trace->sites[index];
      for (size_t i = 0; i < path.size(); i += 2) {
        Py_IncRef(reinterpret_cast<PyObject*>(path[i]));
      }
    }
  } catch (const std::bad_alloc&) { // the copy failed before any reference was taken
    path.clear();
  }
  PyObject* tuple = PyTuple_New(static_cast<long>(path.size()));
  for (size_t i = 0; i < path.size(); ++i) {
    PyObject* item = nullptr;
    if (tuple != nullptr) {
      item = i % 2 == 0 ? reinterpret_cast<PyObject*>(path[i])
                        : PyLong_FromUnsignedLongLong(static_cast<unsigned long long>(path[i]));
    }
    if (item == nullptr) { // give back the references not yet placed in the tuple
      for (size_t j = i + (i % 2); j < path.size(); j += 2) {
        Py_DecRef(reinterpret_cast<PyObject*>(path[j]));
      }
      Py_DecRef(tuple);
      return nullptr;
    }
    PyTuple_SetItem(tuple, static_cast<long>(i), item); // takes the reference
  }
  return tuple;
}

} // extern "C"
