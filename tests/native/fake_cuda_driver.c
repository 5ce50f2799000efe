/* A stand-in for the ten driver functions graphwalk.cpp calls, over one fixed graph, so that
 * the compiled walk can be tested without a GPU (tests/test_graphwalk.py knows the graph). */
#include <cuda.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { MAX_NODES = 16 };

typedef struct Node {
  CUgraphNodeType type;
  int fail; /* its get-params call fails */
  CUDA_KERNEL_NODE_PARAMS kernel;
  CUDA_MEMCPY3D copy;
  CUDA_MEMSET_NODE_PARAMS set;
  CUDA_MEM_ALLOC_NODE_PARAMS alloc;
  CUgraph child;
} Node;

typedef struct Graph {
  size_t n;
  Node* nodes[MAX_NODES];
} Graph;

#define F1 ((CUfunction)(uintptr_t)0x1000) /* (int32, float, pointer): 16 bytes */
#define F2 ((CUfunction)(uintptr_t)0x2000) /* (pointer, int32, pointer): 24 bytes */
#define K1 ((CUkernel)(uintptr_t)0x3000)   /* launched with a packed buffer */

static Graph root, child;
static Node nodes[MAX_NODES];
static size_t used;
static int fail_get_nodes;

static int32_t f1_n = 4096, c_n = 7;
static float f1_x = 1.5f, c_x = -2.0f;
static uint64_t f1_p = 0x7f0000001000ull, c_p = 0x7f0000004000ull;
static void* f1_args[3] = {&f1_n, &f1_x, &f1_p};
static void* c_args[3] = {&c_n, &c_x, &c_p};
static uint64_t f2_a = 0x7f0000005000ull, f2_c = 0x7f0000006000ull;
static void* f2_args[3] = {&f2_a, NULL, &f2_c}; /* a null parameter: zeros */
static unsigned char packed[40];
static size_t packed_size = sizeof(packed);
static void* extra[5];

static Node* add(Graph* g, CUgraphNodeType type) {
  Node* node = &nodes[used++];
  memset(node, 0, sizeof(*node));
  node->type = type;
  g->nodes[g->n++] = node;
  return node;
}

static void build(void) {
  Node* n;
  root.n = child.n = used = 0;
  n = add(&root, CU_GRAPH_NODE_TYPE_KERNEL); /* 0: F1 with its three parameters */
  n->kernel.func = F1;
  n->kernel.kernelParams = f1_args;
  n->kernel.gridDimX = 40; /* the launch shape travels with the record */
  n->kernel.gridDimY = 2;
  n->kernel.gridDimZ = 1;
  n->kernel.blockDimX = 128;
  n = add(&root, CU_GRAPH_NODE_TYPE_KERNEL); /* 1: K1 with a packed buffer */
  n->kernel.gridDimX = 7;
  for (size_t i = 0; i < sizeof(packed); ++i) packed[i] = (unsigned char)(3 * i + 1);
  extra[0] = CU_LAUNCH_PARAM_BUFFER_POINTER;
  extra[1] = packed;
  extra[2] = CU_LAUNCH_PARAM_BUFFER_SIZE;
  extra[3] = &packed_size;
  extra[4] = CU_LAUNCH_PARAM_END;
  n->kernel.kern = K1;
  n->kernel.extra = extra;
  n = add(&root, CU_GRAPH_NODE_TYPE_EMPTY); /* no record */
  n = add(&root, CU_GRAPH_NODE_TYPE_MEMCPY); /* 2: device -> pinned host */
  n->copy.srcMemoryType = CU_MEMORYTYPE_DEVICE;
  n->copy.srcDevice = 0x7f0000002000ull;
  n->copy.srcXInBytes = 16;
  n->copy.dstMemoryType = CU_MEMORYTYPE_HOST;
  n->copy.dstHost = (void*)(uintptr_t)0x555500000000ull;
  n = add(&root, CU_GRAPH_NODE_TYPE_KERNEL); /* unreadable: arguments but no function */
  n->kernel.kernelParams = f1_args;
  n = add(&root, CU_GRAPH_NODE_TYPE_KERNEL); /* unreadable: the driver call fails */
  n->fail = 1;
  n = add(&root, CU_GRAPH_NODE_TYPE_GRAPH); /* a child graph with one kernel */
  n->child = (CUgraph)&child;
  n = add(&child, CU_GRAPH_NODE_TYPE_KERNEL); /* 3: F1 again, other values */
  n->kernel.func = F1;
  n->kernel.kernelParams = c_args;
  n = add(&root, CU_GRAPH_NODE_TYPE_MEMCPY); /* 4: from an array (left out) to device */
  n->copy.srcMemoryType = CU_MEMORYTYPE_ARRAY;
  n->copy.dstMemoryType = CU_MEMORYTYPE_UNIFIED;
  n->copy.dstDevice = 0x7f0000007000ull;
  n->copy.dstXInBytes = 8;
  n = add(&root, CU_GRAPH_NODE_TYPE_MEMSET); /* 5 */
  n->set.dst = 0x7f0000003000ull;
  n = add(&root, CU_GRAPH_NODE_TYPE_KERNEL); /* 6: F2 with a null parameter */
  n->kernel.func = F2;
  n->kernel.kernelParams = f2_args;
  n = add(&root, CU_GRAPH_NODE_TYPE_KERNEL); /* 7: F1 without arguments */
  n->kernel.func = F1;
  n = add(&root, CU_GRAPH_NODE_TYPE_MEM_ALLOC); /* 8: memory the graph allocates */
  n->alloc.dptr = 0x7f0000008000ull;
  n->alloc.bytesize = 4096;
}

static CUresult get_nodes(CUgraph graph, CUgraphNode* out, size_t* count) {
  Graph* g = (Graph*)graph;
  if (fail_get_nodes) return CUDA_ERROR_INVALID_VALUE;
  if (out == NULL) {
    *count = g->n;
    return CUDA_SUCCESS;
  }
  for (size_t i = 0; i < *count && i < g->n; ++i) out[i] = (CUgraphNode)g->nodes[i];
  *count = g->n;
  return CUDA_SUCCESS;
}

static CUresult get_type(CUgraphNode node, CUgraphNodeType* type) {
  *type = ((Node*)node)->type;
  return CUDA_SUCCESS;
}

static CUresult kernel_params(CUgraphNode node, CUDA_KERNEL_NODE_PARAMS* p) {
  if (((Node*)node)->fail) return CUDA_ERROR_INVALID_VALUE;
  *p = ((Node*)node)->kernel;
  return CUDA_SUCCESS;
}

static CUresult copy_params(CUgraphNode node, CUDA_MEMCPY3D* p) {
  *p = ((Node*)node)->copy;
  return CUDA_SUCCESS;
}

static CUresult set_params(CUgraphNode node, CUDA_MEMSET_NODE_PARAMS* p) {
  *p = ((Node*)node)->set;
  return CUDA_SUCCESS;
}

static CUresult alloc_params(CUgraphNode node, CUDA_MEM_ALLOC_NODE_PARAMS* p) {
  *p = ((Node*)node)->alloc;
  return CUDA_SUCCESS;
}

static CUresult child_graph(CUgraphNode node, CUgraph* g) {
  *g = ((Node*)node)->child;
  return CUDA_SUCCESS;
}

static CUresult func_param(CUfunction f, size_t i, size_t* off, size_t* size) {
  static const size_t f1[3][2] = {{0, 4}, {4, 4}, {8, 8}};
  static const size_t f2[3][2] = {{0, 8}, {8, 4}, {16, 8}};
  const size_t(*layout)[2] = f == F1 ? f1 : f == F2 ? f2 : NULL;
  if (layout == NULL || i >= 3) return CUDA_ERROR_INVALID_VALUE;
  *off = layout[i][0];
  *size = layout[i][1];
  return CUDA_SUCCESS;
}

int32_t fake_table(void** out) {
  build();
  out[0] = (void*)get_nodes;
  out[1] = (void*)get_type;
  out[2] = (void*)kernel_params;
  out[3] = (void*)copy_params;
  out[4] = (void*)set_params;
  out[5] = (void*)child_graph;
  out[6] = NULL; /* no conditional bodies */
  out[7] = (void*)func_param;
  out[8] = NULL; /* no CUkernel layouts: K1 has none */
  out[9] = (void*)alloc_params;
  return 10;
}

uint64_t fake_root(void) { return (uint64_t)(uintptr_t)&root; }

void fake_fail_get_nodes(int on) { fail_get_nodes = on; }

#ifdef __cplusplus
}
#endif
