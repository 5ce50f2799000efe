"""One selftest run in its own process: `python -m graphsan.selftest.child NAME [--dump PATH]`.

The program runs under `graphsan.enable(policy="raise")`; the process prints one line
`RESULT {json}` (`graphsan.command_line.write_result`): how the program ended, the findings, the
memory the twin broke. A stale replay graphsan misses can kill the CUDA context, which is why
each run has a process of its own.

`--dump PATH` also writes, per captured graph, every node's name, parameter offsets, grid and
argument bytes, the references graphsan took from them, and the storages of the live CUDA
tensors at capture end (gzipped JSON lines): what a layout question about a kernel needs.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import sys
import traceback

from graphsan.command_line import write_result


def _finding(f) -> dict:
    """A finding as the result line carries it: the report's JSON of it (the parent's verdict
    line rebuilds the finding from it), with the graph's label and the finding's text."""
    from graphsan.report.json_report import finding_to_dict
    from graphsan.report.text import format_finding

    return finding_to_dict(f) | {"label": f.graph.label, "text": format_finding(f)}


class Dump:
    """Writes every captured graph's nodes and references (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.out = gzip.open(path, "wt")  # noqa: SIM115 (open for the whole run)

    def install(self) -> None:
        from graphsan.runtime import capture

        original = capture.references

        def references(nodes, view, *args, **kwargs):
            nodes = list(nodes)
            refs = original(nodes, view, *args, **kwargs)
            try:
                self.write(nodes, refs)
            except Exception as err:  # a dump must never change the run
                sys.stderr.write(f"selftest dump: {err}\n")
            return refs

        capture.references = references

    def write(self, nodes, refs) -> None:
        from graphsan.cuda.owners import gc_tensors

        storages = {}
        for obj in gc_tensors():
            if obj.is_cuda:
                try:
                    st = obj.untyped_storage()
                    storages[st.data_ptr()] = st.nbytes()
                except Exception:
                    continue
        record = {
            "nodes": [
                {
                    "index": n.index,
                    "name": n.name,
                    "offsets": list(n.offsets),
                    "grid": list(n.grid),
                    "buffer": base64.b64encode(n.buffer).decode(),
                }
                if hasattr(n, "buffer")
                else {"index": n.index, "copy": n.kind, "addresses": n.addresses}
                for n in nodes
            ],
            "refs": [[r.node, r.param, r.offset, r.address] for r in refs],
            "storages": sorted(storages.items()),
        }
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()

    def close(self) -> None:
        self.out.close()


def run(name: str, dump: str | None) -> dict:
    import torch

    import graphsan
    from graphsan.selftest import find
    from graphsan.selftest.case import Case, Skip

    prog, broken = find(name)
    san = graphsan.enable(policy="raise")
    dumper = None
    if dump:
        dumper = Dump(dump)
        dumper.install()
    case = Case(broken)
    result: dict = {"name": name, "broken": broken}
    try:
        prog.run(case)
        torch.cuda.synchronize()
        result["outcome"] = "completed"
    except graphsan.StaleMemoryError:
        result["outcome"] = "stopped"
    except Skip as why:
        result["outcome"] = "skipped"
        result["why"] = str(why)
    except Exception as err:
        result["outcome"] = "error"
        result["why"] = "".join(traceback.format_exception_only(type(err), err)).strip()
        result["traceback"] = traceback.format_exc()[-4000:]
    finally:
        if dumper is not None:
            dumper.close()
    result.update(
        findings=[_finding(f) for f in san.findings],
        victims=case.victims,
        kinds=sorted(case.kinds),
        failed_checks=case.failed,
        replays=case.replays,
        disabled=san.disabled_reason,
        graphs=len(san.graph_stats),
        allocator_log=san.memory.event_source,
        attachment=san.attachment(),
    )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphsan.selftest.child")
    p.add_argument("name")
    p.add_argument("--dump", metavar="PATH")
    args = p.parse_args(argv)
    result = run(args.name, args.dump)
    write_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
