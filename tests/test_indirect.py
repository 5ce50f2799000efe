"""Indirect references: the device addresses held in small buffers a kernel argument points at
(pointer tables), read at capture end and judged like direct ones; on CPU, the CUDA side faked."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from graphsan.core.records import FreeEvent, Reference
from graphsan.core.scan import table_candidates, table_references
from graphsan.cuda import hooks
from graphsan.report import StaleMemoryError, format_finding
from graphsan.report.text import one_line
from tests import fake_cuda

SEG = fake_cuda.SEG
TABLE, SMALL, BIG = SEG, SEG + 512, SEG + 1024
LAYOUT = [(512, "active_allocated"), (512, "active_allocated"), (8192, "active_allocated")]
LAYOUT += [(8192, "inactive")]
FREE_GAP = SEG + 1024 + 8192 + 64


def words(*values):
    return struct.pack(f"<{len(values)}Q", *values)


def via(address=TABLE):
    return Reference(0, "void grouped(void**)", 1, 0, address)


# ----------------------------------------------------------------------------- the pure scan
def test_a_table_names_live_blocks_and_nothing_else():
    memmap = fake_cuda.one_segment(LAYOUT)
    data = words(BIG, 7, SMALL + 8, FREE_GAP, TABLE, 0) + b"\x01\x02\x03"  # 4 of 5 in range
    refs = table_references(TABLE, data, via(), memmap)
    assert [(r.address, r.slot) for r in refs] == [(BIG, 0), (SMALL + 8, 16)]
    assert all(r.through == TABLE and (r.node, r.param, r.offset) == (0, 1, 0) for r in refs)


def test_index_tensors_and_other_integer_data_make_no_references():
    memmap = fake_cuda.one_segment(LAYOUT)
    indices = words(*range(64))  # an int64 index tensor
    offsets = words(*(i * 4096 for i in range(64)))  # cumulative offsets
    doubles = struct.pack("<64d", *(float(i) / 3 for i in range(64)))
    for data in (indices, offsets, doubles):
        assert table_references(TABLE, data, via(), memmap) == []


def test_int32_token_ids_that_pair_into_an_address_do_not_make_a_table():
    memmap = fake_cuda.one_segment(LAYOUT)
    high, low = BIG >> 32, BIG & 0xFFFF_FFFF
    ids = [5, 17, 900, 31, low, high, 42, 7, 1000, 3]  # one pair reads as BIG, little-endian
    data = struct.pack(f"<{len(ids)}I", *ids)
    assert words(BIG) in data
    assert table_references(TABLE, data, via(), memmap) == []


def test_table_candidates_are_small_allocated_blocks_outside_the_graphs_pool_within_budget():
    memmap = fake_cuda.one_segment(LAYOUT)
    refs = [via(BIG), via(SMALL), via(TABLE), via(FREE_GAP), via(TABLE + 8)]
    refs.append(Reference(1, "memcpy", "src", 0, TABLE))
    got = table_candidates(refs, memmap, own_pool=None, max_block=4096, budget=1 << 16)
    assert [(a, n) for a, n, _ in got] == [(SMALL, 512), (TABLE, 512)]  # BIG is too large
    assert table_candidates(refs, memmap, None, 4096, budget=512)[0][0] == SMALL
    assert len(table_candidates(refs, memmap, None, 4096, budget=512)) == 1
    assert table_candidates(refs, memmap, own_pool=(0, 0)) == []  # the graph's own pool


# ----------------------------------------------------------------------------- the flow
@pytest.fixture
def env(monkeypatch, attach):
    state = fake_cuda.install(monkeypatch, "void grouped(void**)", stream=1)
    state["map"] = fake_cuda.one_segment(LAYOUT)
    state["memory"][TABLE] = words(BIG, SMALL + 64, 0, 0)
    state["cls"] = fake_cuda.graph_class(monkeypatch, (1, 3), attach)
    state["nodes"] = [fake_cuda.kernel(0, 17, TABLE)]  # param 1 is the table's address
    return state


@pytest.fixture
def san(env, fake_sanitizer):
    return fake_sanitizer(env, "raise")


def capture(env):
    g = env["cls"]()
    g.capture_begin()
    g.capture_end()
    return g


def free(san, ptr):
    return san.tracker.on_free(ptr, lambda: FreeEvent([("moe.py", 9, "route")], "train", 3))


def test_a_freed_buffer_named_in_a_table_stops_the_replay_and_names_the_table(env, san):
    g = capture(env)
    state = hooks.graph_state(g)
    assert BIG in state.blocks and TABLE in state.blocks
    assert free(san, BIG)
    env["map"] = fake_cuda.one_segment(LAYOUT[:2] + [(8192, "inactive")] + LAYOUT[3:])
    with pytest.raises(StaleMemoryError) as err:
        g.replay()
    assert g.launched == 0
    (f,) = err.value.findings
    assert f.kind == "freed" and f.address == BIG and f.through == TABLE
    assert (f.node, f.param, f.offset, f.through_slot) == (0, 1, 0, 0)
    assert "indirect" in format_finding(f) and f"via table {TABLE:#x}+0" in one_line(f)


def test_a_table_rewritten_before_the_free_raises_nothing(env, san):
    g = capture(env)
    env["memory"][TABLE] = words(SMALL, SMALL + 64, 0, 0)  # eager code pointed it elsewhere
    assert free(san, BIG)
    env["map"] = fake_cuda.one_segment(LAYOUT[:2] + [(8192, "inactive")] + LAYOUT[3:])
    g.replay()
    g.replay()
    assert g.launched == 2 and san.findings == []
    assert BIG not in hooks.graph_state(g).blocks  # let go: not judged again


def test_reading_tables_can_be_turned_off(env, san):
    san.table_budget = 0
    g = capture(env)
    assert BIG not in hooks.graph_state(g).blocks


def test_a_table_is_read_up_to_its_tensor_not_into_the_stale_rest_of_its_block(env, san):
    """A 16-byte table in a 512-byte block whose rest holds old float data: the whole block
    does not look like a table; up to the requested size it does."""
    stale = np.full(62, 0x3F80_0000_3F80_0000, dtype="<u8").tobytes()
    env["memory"][TABLE] = words(BIG, SMALL + 64) + stale
    g = capture(env)
    assert BIG not in hooks.graph_state(g).blocks
    env["map"].requested[TABLE] = 16
    g = capture(env)
    assert BIG in hooks.graph_state(g).blocks


def test_the_report_counts_the_tables_read_and_the_references_they_gave(env, san):
    capture(env)
    (entry,) = [g for g in san.report().graphs if g["id"] == max(san.graph_stats)]
    assert (entry["tables_read"], entry["indirect"]) == (1, 2)  # BIG and SMALL + 64
    san.table_budget = 0
    capture(env)
    (entry,) = [g for g in san.report().graphs if g["id"] == max(san.graph_stats)]
    assert (entry["tables_read"], entry["indirect"]) == (0, 0)
