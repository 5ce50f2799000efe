"""On a GPU: PyTorch's strided elementwise kernels, captured, carry the OffsetCalculator that
graphsan.core.offset_calc recognises. Shapes are chosen so that TensorIterator keeps 2 and 3
dimensions; for every strided `elementwise_kernel` node the program records the calculators found
in its parameters (where, how many dimensions, which divisors, how many bytes are left out) and
which of the operands' data pointers the scan still reports. Prints `RESULT {json}`.
"""

import numpy as np
import torch

from graphsan.command_line import write_result
from graphsan.core import offset_calc
from graphsan.core.memory_map import MemoryMap
from graphsan.core.scan import references
from graphsan.cuda import driver

torch.manual_seed(0)
# 48 x 51 views whose rows do not follow on (2 * 51 != 101, 103): two dimensions stay
a2 = torch.randn(48, 101, device="cuda")[:, ::2]
b2 = torch.randn(48, 103, device="cuda")[:, 1:103:2]
# 6 x 10 x 7 with strides (165, 15, 2): no two dimensions follow on, so three stay
a3 = torch.randn(6, 11, 15, device="cuda")[:, :10, :14:2]
b3 = torch.randn(6, 10, 7, device="cuda")
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):  # the kernels load outside the capture
    (a2 * b2).sum().item()
    (a3 * b3).sum().item()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, stream=stream):
    c2 = a2 * b2
    c3 = a3 * b3
    nodes, stats = driver.walk(driver.capturing_graph(stream.cuda_stream))
torch.cuda.synchronize()
memmap = MemoryMap.from_snapshot(torch.cuda.memory._snapshot(), torch.cuda.current_device())
operands = {
    2: {a2.data_ptr(), b2.data_ptr(), c2.data_ptr()},
    3: {a3.data_ptr(), b3.data_ptr(), c3.data_ptr()},
}
out = {"kernels": stats.kernels, "strided": []}
for node in nodes:
    name = getattr(node, "name", "")
    if "elementwise_kernel" not in name or "vectorized" in name or "unrolled_elem" in name:
        continue  # the contiguous kernels have no calculator
    ends = [*node.offsets[1:], len(node.buffer)]
    found = []
    for start, end in offset_calc.calculator_words(node.buffer, ends):
        words = np.frombuffer(node.buffer[start : start + 4 * offset_calc.STRIDES_AT], "<u4")
        dims = int(words[0])
        found.append(
            {
                "at": start,
                "param_offsets": node.offsets,
                "dims": dims,
                "divisors": sorted(int(words[1 + 3 * i]) for i in range(dims)),
                "bytes": end - start,
            }
        )
    refs = {r.address for r in references([node], memmap)}
    out["strided"].append(
        {
            "name": node.name[:160],
            "size": len(node.buffer),
            "calculators": found,
            "operands_found": {str(k): len(v & refs) for k, v in operands.items()},
            "references": len(refs),
        }
    )
write_result(out)
