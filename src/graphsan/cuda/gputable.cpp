// PyTorch's GPU-trace interpreter made of gputrace.cpp's entries, built into the same library
// (tracebuild.py builds it, gputrace.py installs it).
//
// PyTorch offers no C++ base class with the other entries, so the interpreter's table is built
// here: every slot traps except the trace entries, whose positions come from their member
// pointers (Itanium C++ ABI), and whose signatures are those of the headers it is built against.
// Where those headers do not fit, tracebuild.py builds tracelog.cpp alone: the tracker still
// works, and the reason is kept beside the library.

#include <c10/core/impl/GPUTrace.h>
#include <c10/core/impl/PyInterpreter.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>

namespace graphsan {
void put_error(char* buf, size_t len, const std::string& text); // tracelog.cpp
void trace_alloc(uint64_t addr); // gputrace.cpp, as the rest below
void trace_free(uint64_t addr);
void trace_off();
} // namespace graphsan

namespace {

using graphsan::put_error;
using graphsan::trace_alloc;
using graphsan::trace_free;

using VTable = c10::impl::PyInterpreterVTable;

c10::impl::PyInterpreter* g_interp = nullptr;
bool g_saved_have_state = false; // PyTorch's flag as the install found it
void* g_table[2 + 512];
struct TableObject {
  void* const* vptr;
};
TableObject g_table_object{&g_table[2]};

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
  graphsan::trace_off();
  if (current()) {
    GPUTrace::gpuTraceState.store(nullptr, std::memory_order_release);
    GPUTrace::haveState = g_saved_have_state;
  }
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
