// graphsan's walk of a CUDA graph being captured, in C++: every kernel, memcpy and memset node
// (child graphs and conditional bodies included) with its argument bytes, as one packed buffer
// that graphsan/cuda/graphwalk.py reads. It stands in for cuda/driver.py's walk through
// cuda-bindings, which builds Python objects for every driver call and every node.
//
// The driver's functions come from libcuda's cuGetProcAddress, asked for the version of the
// cuda.h this file is compiled against, so the structures below are the ones the driver fills;
// tests hand in a table of their own (gs_walk_set_driver). Nothing here calls PyTorch or Python.
//
// The buffer, per node, in walk order (little-endian): a 16-byte head
//   uint32 kind (KIND_*), uint32 payload bytes, uint64 a kernel's function handle
// then, for the kernel kinds, the launch shape: uint32 grid x, y, z and block x (16 bytes, not
// counted in the payload bytes), then the payload, padded to 8 bytes:
//   KIND_KERNEL_FUNC / KIND_KERNEL_KERN: the parameter block (`gather`'s layout: each
//       parameter at its offset, zeros in padding and for null pointers); the handle is a
//       CUfunction or a CUkernel
//   KIND_KERNEL_EXTRA_FUNC / _KERN: the packed `extra` launch buffer, as it is
//   KIND_KERNEL_NONE_FUNC / _KERN: no parameters (empty payload)
//   KIND_MEMCPY: uint32 count, uint32 0, then count x (uint32 side: 0 src, 1 dst; uint32 host;
//       uint64 address)
//   KIND_MEMSET: uint64 destination
//   KIND_MEM_ALLOC: uint64 address, uint64 bytes (memory the graph allocates: cudaMallocAsync)
// A node that cannot be read is counted in the stats and left out.

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#if __has_include(<cuda.h>)
#include <cuda.h>
#define GS_HAVE_CUDA_H 1
#endif

namespace {

enum : uint32_t {
  KIND_KERNEL_FUNC = 0,
  KIND_KERNEL_KERN = 1,
  KIND_KERNEL_EXTRA_FUNC = 2,
  KIND_KERNEL_EXTRA_KERN = 3,
  KIND_KERNEL_NONE_FUNC = 4,
  KIND_KERNEL_NONE_KERN = 5,
  KIND_MEMCPY = 6,
  KIND_MEMSET = 7,
  KIND_MEM_ALLOC = 8,
};

// nodes, kernels, copies, unreadable, child_graphs: WalkStats' fields in order
enum { ST_NODES, ST_KERNELS, ST_COPIES, ST_UNREADABLE, ST_CHILD_GRAPHS, ST_COUNT };

constexpr size_t kMaxParams = 4096; // no kernel takes more; a guard against runaway loops
constexpr int kMaxDepth = 64; // child graphs inside child graphs

void put_error(char* buf, size_t len, const std::string& text) {
  if (buf != nullptr && len > 0) {
    std::strncpy(buf, text.c_str(), len - 1);
    buf[len - 1] = '\0';
  }
}

#ifdef GS_HAVE_CUDA_H

// The driver functions the walk calls, in the order gs_walk_set_driver takes them.
struct Driver {
  CUresult (*graph_get_nodes)(CUgraph, CUgraphNode*, size_t*);
  CUresult (*node_get_type)(CUgraphNode, CUgraphNodeType*);
  CUresult (*kernel_node_get_params)(CUgraphNode, CUDA_KERNEL_NODE_PARAMS*);
  CUresult (*memcpy_node_get_params)(CUgraphNode, CUDA_MEMCPY3D*);
  CUresult (*memset_node_get_params)(CUgraphNode, CUDA_MEMSET_NODE_PARAMS*);
  CUresult (*child_graph_node_get_graph)(CUgraphNode, CUgraph*);
  CUresult (*node_get_params)(CUgraphNode, void*); // CUgraphNodeParams*; may be null
  CUresult (*func_get_param_info)(CUfunction, size_t, size_t*, size_t*);
  CUresult (*kernel_get_param_info)(CUkernel, size_t, size_t*, size_t*); // may be null
  CUresult (*mem_alloc_node_get_params)(CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS*); // may be null
};
constexpr int kDriverSlots = sizeof(Driver) / sizeof(void*);

std::mutex g_mu; // the driver table, the layouts and the output buffer
bool g_ready = false;
Driver g_driver{};
// (handle, is a CUkernel) -> (offset, size) of each parameter, looked up once per function
std::unordered_map<uint64_t, std::vector<std::pair<size_t, size_t>>> g_layouts[2];
std::vector<uint8_t> g_out;
int64_t g_stats[ST_COUNT];

bool load_driver(std::string& why) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (lib == nullptr) {
    why = "libcuda.so.1 cannot be loaded";
    return false;
  }
  using GetProc2 = CUresult (*)(const char*, void**, int, cuuint64_t, void*);
  auto get_proc = reinterpret_cast<GetProc2>(dlsym(lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr) {
    why = "libcuda.so.1 has no cuGetProcAddress_v2";
    return false;
  }
  const char* names[kDriverSlots] = {
      "cuGraphGetNodes",
      "cuGraphNodeGetType",
      "cuGraphKernelNodeGetParams",
      "cuGraphMemcpyNodeGetParams",
      "cuGraphMemsetNodeGetParams",
      "cuGraphChildGraphNodeGetGraph",
      "cuGraphNodeGetParams",
      "cuFuncGetParamInfo",
      "cuKernelGetParamInfo",
      "cuGraphMemAllocNodeGetParams",
  };
  void* slots[kDriverSlots] = {};
  for (int i = 0; i < kDriverSlots; ++i) {
    int status = 0;
    if (get_proc(names[i], &slots[i], CUDA_VERSION, CU_GET_PROC_ADDRESS_DEFAULT, &status) !=
            CUDA_SUCCESS ||
        slots[i] == nullptr) {
      slots[i] = nullptr;
      if (i != 6 && i != 8 && i != 9) { // conditional bodies, CUkernel layouts, memory nodes
        why = std::string("the driver has no ") + names[i];
        return false;
      }
    }
  }
  std::memcpy(&g_driver, slots, sizeof(g_driver));
  return true;
}

void put(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  g_out.insert(g_out.end(), p, p + n);
}

void put_head(uint32_t kind, uint32_t bytes, uint64_t handle) {
  put(&kind, 4);
  put(&bytes, 4);
  put(&handle, 8);
}

// The launch shape a kernel record carries after its head: the grid says which entries of a
// by-value argument struct the launch fills (PyTorch's multi-tensor metadata: one per block).
void put_shape(const CUDA_KERNEL_NODE_PARAMS& p) {
  const uint32_t shape[4] = {p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX};
  put(shape, sizeof(shape));
}

void pad8() {
  g_out.resize((g_out.size() + 7) & ~size_t(7), 0);
}

// A node's parameters, zeroed, then filled by the driver's getter; false where the getter is
// missing (an older driver) or fails.
template <typename Getter, typename Params>
bool get_params(Getter getter, CUgraphNode node, Params& p) {
  std::memset(&p, 0, sizeof(p));
  return getter != nullptr && getter(node, &p) == CUDA_SUCCESS;
}

const std::vector<std::pair<size_t, size_t>>* layout_of(uint64_t handle, bool is_kernel) {
  auto& cache = g_layouts[is_kernel ? 1 : 0];
  auto it = cache.find(handle);
  if (it != cache.end()) return &it->second;
  if (is_kernel && g_driver.kernel_get_param_info == nullptr) return nullptr;
  std::vector<std::pair<size_t, size_t>> layout;
  for (size_t i = 0; i < kMaxParams; ++i) {
    size_t off = 0, size = 0;
    CUresult rc = is_kernel ? g_driver.kernel_get_param_info(
                                  reinterpret_cast<CUkernel>(handle), i, &off, &size)
                            : g_driver.func_get_param_info(
                                  reinterpret_cast<CUfunction>(handle), i, &off, &size);
    if (rc != CUDA_SUCCESS) break;
    layout.emplace_back(off, size);
  }
  return &cache.emplace(handle, std::move(layout)).first->second;
}

// The packed `extra` launch buffer (CU_LAUNCH_PARAM_BUFFER_POINTER / _SIZE), as cuBLASLt
// passes its arguments; false where the array holds none.
bool put_extra(void** extra, uint32_t kind, uint64_t handle, const CUDA_KERNEL_NODE_PARAMS& p) {
  void* ptr = nullptr;
  size_t size = 0;
  for (int i = 0; i < 16; i += 2) {
    if (extra[i] == CU_LAUNCH_PARAM_END) break;
    if (extra[i] == CU_LAUNCH_PARAM_BUFFER_POINTER) ptr = extra[i + 1];
    if (extra[i] == CU_LAUNCH_PARAM_BUFFER_SIZE) size = *static_cast<size_t*>(extra[i + 1]);
  }
  if (ptr == nullptr || size == 0 || size > UINT32_MAX) return false;
  put_head(kind, static_cast<uint32_t>(size), handle);
  put_shape(p);
  put(ptr, size);
  pad8();
  return true;
}

bool read_kernel(CUgraphNode node) {
  CUDA_KERNEL_NODE_PARAMS p;
  if (!get_params(g_driver.kernel_node_get_params, node, p)) return false;
  uint64_t handle = reinterpret_cast<uint64_t>(p.func);
  bool is_kernel = false;
  if (handle == 0) {
    handle = reinterpret_cast<uint64_t>(p.kern);
    is_kernel = handle != 0;
  }
  uint32_t k = is_kernel ? 1 : 0;
  if (p.kernelParams != nullptr) {
    const auto* layout = handle ? layout_of(handle, is_kernel) : nullptr;
    if (layout == nullptr || layout->empty()) return false; // "no parameter layout"
    size_t size = 0;
    for (const auto& [off, sz] : *layout) size = std::max(size, off + sz);
    put_head(KIND_KERNEL_FUNC + k, static_cast<uint32_t>(size), handle);
    put_shape(p);
    size_t at = g_out.size();
    g_out.resize(at + size, 0);
    for (size_t i = 0; i < layout->size(); ++i) {
      const auto& [off, sz] = (*layout)[i];
      if (p.kernelParams[i] != nullptr && sz != 0) {
        std::memcpy(g_out.data() + at + off, p.kernelParams[i], sz);
      }
    }
    pad8();
    return true;
  }
  if (p.extra != nullptr) return put_extra(p.extra, KIND_KERNEL_EXTRA_FUNC + k, handle, p);
  put_head(KIND_KERNEL_NONE_FUNC + k, 0, handle);
  put_shape(p);
  return true;
}

void put_side(uint32_t side, CUmemorytype type, CUdeviceptr device, const void* host,
              size_t x, uint32_t& count) {
  uint64_t address = 0;
  uint32_t is_host = 0;
  if (type == CU_MEMORYTYPE_DEVICE || type == CU_MEMORYTYPE_UNIFIED) {
    address = static_cast<uint64_t>(device) + x;
  } else if (type == CU_MEMORYTYPE_HOST && host != nullptr) { // pinned host memory
    address = reinterpret_cast<uint64_t>(host) + x;
    is_host = 1;
  } else {
    return; // an array, or no host pointer
  }
  put(&side, 4);
  put(&is_host, 4);
  put(&address, 8);
  ++count;
}

bool read_memcpy(CUgraphNode node) {
  CUDA_MEMCPY3D p;
  if (!get_params(g_driver.memcpy_node_get_params, node, p)) return false;
  size_t head = g_out.size();
  put_head(KIND_MEMCPY, 0, 0);
  uint32_t count = 0, zero = 0;
  size_t count_at = g_out.size();
  put(&count, 4);
  put(&zero, 4);
  put_side(0, p.srcMemoryType, p.srcDevice, p.srcHost, p.srcXInBytes, count);
  put_side(1, p.dstMemoryType, p.dstDevice, p.dstHost, p.dstXInBytes, count);
  uint32_t bytes = static_cast<uint32_t>(g_out.size() - count_at);
  std::memcpy(g_out.data() + head + 4, &bytes, 4);
  std::memcpy(g_out.data() + count_at, &count, 4);
  return true;
}

bool read_memset(CUgraphNode node) {
  CUDA_MEMSET_NODE_PARAMS p;
  if (!get_params(g_driver.memset_node_get_params, node, p)) return false;
  uint64_t dst = static_cast<uint64_t>(p.dst);
  put_head(KIND_MEMSET, 8, 0);
  put(&dst, 8);
  return true;
}

bool read_mem_alloc(CUgraphNode node) {
  CUDA_MEM_ALLOC_NODE_PARAMS p;
  if (!get_params(g_driver.mem_alloc_node_get_params, node, p)) return false;
  const uint64_t range[2] = {static_cast<uint64_t>(p.dptr), static_cast<uint64_t>(p.bytesize)};
  put_head(KIND_MEM_ALLOC, sizeof(range), 0);
  put(range, sizeof(range));
  return true;
}

bool walk_graph(CUgraph graph, int depth, std::string& why) {
  if (depth > kMaxDepth) {
    why = "child graphs nested past 64 levels";
    return false;
  }
  size_t count = 0;
  if (g_driver.graph_get_nodes(graph, nullptr, &count) != CUDA_SUCCESS) {
    why = "cuGraphGetNodes failed";
    return false;
  }
  std::vector<CUgraphNode> nodes(count);
  if (count != 0 && g_driver.graph_get_nodes(graph, nodes.data(), &count) != CUDA_SUCCESS) {
    why = "cuGraphGetNodes failed";
    return false;
  }
  nodes.resize(count);
  for (CUgraphNode node : nodes) {
    ++g_stats[ST_NODES];
    CUgraphNodeType type;
    if (g_driver.node_get_type(node, &type) != CUDA_SUCCESS) {
      why = "cuGraphNodeGetType failed";
      return false;
    }
    bool ok = true;
    switch (type) {
      case CU_GRAPH_NODE_TYPE_KERNEL:
        ++g_stats[ST_KERNELS];
        ok = read_kernel(node);
        break;
      case CU_GRAPH_NODE_TYPE_MEMCPY:
        ++g_stats[ST_COPIES];
        ok = read_memcpy(node);
        break;
      case CU_GRAPH_NODE_TYPE_MEMSET:
        ++g_stats[ST_COPIES];
        ok = read_memset(node);
        break;
      case CU_GRAPH_NODE_TYPE_MEM_ALLOC:
        ok = read_mem_alloc(node);
        break;
      case CU_GRAPH_NODE_TYPE_GRAPH: {
        ++g_stats[ST_CHILD_GRAPHS];
        CUgraph child = nullptr;
        if (g_driver.child_graph_node_get_graph(node, &child) != CUDA_SUCCESS) {
          why = "cuGraphChildGraphNodeGetGraph failed";
          return false;
        }
        if (!walk_graph(child, depth + 1, why)) return false;
        break;
      }
#if CUDA_VERSION >= 12030
      case CU_GRAPH_NODE_TYPE_CONDITIONAL: {
        CUgraphNodeParams params;
        if (!get_params(g_driver.node_get_params, node, params)) {
          ++g_stats[ST_UNREADABLE];
          break;
        }
        for (unsigned i = 0; i < params.conditional.size; ++i) {
          ++g_stats[ST_CHILD_GRAPHS];
          if (!walk_graph(params.conditional.phGraph_out[i], depth + 1, why)) return false;
        }
        break;
      }
#endif
      default:
        break; // events, host nodes, empty nodes, memory nodes: no arguments to read
    }
    if (!ok) ++g_stats[ST_UNREADABLE];
  }
  return true;
}

#endif // GS_HAVE_CUDA_H

} // namespace

extern "C" {

// 0 where the walk can run (the driver's functions were found), else -1 and why.
int32_t gs_walk_init(char* err, size_t err_len) {
#ifdef GS_HAVE_CUDA_H
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_ready) return 0;
  std::string why;
  if (!load_driver(why)) {
    put_error(err, err_len, why);
    return -1;
  }
  g_ready = true;
  return 0;
#else
  put_error(err, err_len, "built without cuda.h");
  return -1;
#endif
}

// Tests: the driver functions as an array of Driver's slots in order (null where optional).
int32_t gs_walk_set_driver(void* const* fns, int32_t n) {
#ifdef GS_HAVE_CUDA_H
  std::lock_guard<std::mutex> lock(g_mu);
  if (n != kDriverSlots) return -1;
  std::memcpy(&g_driver, fns, sizeof(g_driver));
  g_layouts[0].clear();
  g_layouts[1].clear();
  g_ready = true;
  return 0;
#else
  (void)fns;
  (void)n;
  return -1;
#endif
}

int32_t gs_walk_driver_slots() {
#ifdef GS_HAVE_CUDA_H
  return kDriverSlots;
#else
  return 0;
#endif
}

// Walk `graph` (a CUgraph) into the library's buffer; returns its bytes, or -1 with why. The
// buffer and the stats (int64[5], WalkStats' order) stay valid until the next walk; callers
// hold graphwalk.py's lock around both.
int64_t gs_walk(uint64_t graph, int64_t* stats, char* err, size_t err_len) {
#ifdef GS_HAVE_CUDA_H
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_ready) {
    put_error(err, err_len, "gs_walk_init was not called");
    return -1;
  }
  g_out.clear();
  std::memset(g_stats, 0, sizeof(g_stats));
  std::string why;
  bool ok = false;
  try {
    ok = walk_graph(reinterpret_cast<CUgraph>(graph), 0, why);
  } catch (const std::exception& e) { // an allocation failure: the Python walk takes over
    why = e.what();
  }
  std::memcpy(stats, g_stats, sizeof(g_stats));
  if (!ok) {
    put_error(err, err_len, why);
    return -1;
  }
  return static_cast<int64_t>(g_out.size());
#else
  (void)graph;
  (void)stats;
  put_error(err, err_len, "built without cuda.h");
  return -1;
#endif
}

const uint8_t* gs_walk_buffer() {
#ifdef GS_HAVE_CUDA_H
  return g_out.data();
#else
  return nullptr;
#endif
}

} // extern "C"
