"""Per-rank resident teacher parameter bytes, replicated vs sharded with FSDP2 (docs/dense.md).

    OMP_NUM_THREADS=1 PYTHONPATH=src python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        scripts/teacher_shard_bytes.py [TEACHER]      # default fixture:olmoe-tiny, in its own dtype (bf16)

Each rank loads the teacher as `distill` does (checkpoint dtype), counts the bytes its parameters occupy,
shards it with `distill.shard.shard_fsdp2` (the FSDP2 layout of `distill`) on the gloo backend, and counts
the bytes of the storages its local shards live in (FSDP2's padding included) — before and after one
forward, which gathers one unit at a time and frees it again (`reshard_after_forward=True`). The root's own
parameters and the largest other unit are what a forward holds whole on top of the shards.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moecompress.distill.shard import fsdp2_units, shard_fsdp2
from moecompress.models import load_model


def resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages holding this rank's parameters (local shards for DTensors)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p.data
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def main(source: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    teacher = load_model(source, dtype="auto")
    dtype = next(teacher.parameters()).dtype
    units = fsdp2_units(teacher)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    largest_unit = max(_bytes(unit.parameters()) for unit in units)
    root_own = _bytes(p for p in teacher.parameters() if id(p) not in in_units)
    replicated = resident_bytes(teacher)
    shard_fsdp2(teacher)
    sharded = resident_bytes(teacher)
    with torch.no_grad():
        teacher(input_ids=torch.arange(3, 35)[None], use_cache=False)
    after_forward = resident_bytes(teacher)
    rows = [None] * world
    dist.all_gather_object(rows, (rank, replicated, sharded, after_forward))
    if rank == 0:
        print(f"teacher {source} ({dtype}), {world} ranks, gloo; gathered whole during a forward: the root's own "
              f"{root_own:,} B throughout, plus the largest other unit, {largest_unit:,} B")
        print("rank  replicated B   sharded B   after a forward B   sharded / replicated")
        for r, rep, sh, af in rows:
            print(f"{r:>4}  {rep:>12,}  {sh:>10,}  {af:>18,}   {sh / rep:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fixture:olmoe-tiny")
