"""The 29 mutations of issue 50 (item 4), each a one-line change a default-run test must catch.

Each mutation is (id, source file, exact old snippet, new snippet, the tests that must catch it). The script
applies one at a time to the source in place (the old snippet must occur exactly once: when the code changes the
script fails loudly instead of testing nothing), runs the named tests with pytest (``-x -q``), restores the
original bytes (in a ``finally``, on Ctrl-C or SIGTERM too) and prints one line per mutation: ``caught`` and by
which test, or ``SURVIVED``. Exit status 1 when any survives (2 when a snippet no longer matches).

    OMP_WAIT_POLICY=PASSIVE python scripts/mutations.py [--only ID ...] [--list] [--tests NODE ...]

``--tests`` runs other tests than the named ones (e.g. the suite the mutation was first tried against, to
see that it survived there), ``--deselect`` leaves some out (pytest's option). Other people may edit the tree
while this runs: the original is written back only while the file still holds the mutant; otherwise the
mutation alone is reverted in their version, and a file that holds neither is left as it is and named on
stderr.

Each mutation was first seen to survive the existing tests of its module (test_gguf_arith.py, test_gguf.py,
test_auto_target.py, test_auto_divergence.py, test_auto.py with test_auto_bits.py, test_auto_whole.py,
test_output_safety.py with test_probe_outputs.py), then given the test named here.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = "src/moecompress/"
G = "tests/test_mutation_guards.py::"
SOLVER = "tests/test_solver_property.py::"
DIV = "tests/test_auto_divergence.py::"


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str  # relative to the repository root
    old: str
    new: str
    tests: tuple[str, ...]
    what: str


M = Mutation
MUTATIONS: list[Mutation] = [
    # ---- export/gguf_arith.py
    M(
        "arith-fp16-as-bf16",
        SRC + "export/gguf_arith.py",
        '{"bfloat16": "BF16", "float16": "F16"}.get(plan.model.dtype, "F32")',
        '{"bfloat16": "BF16", "float16": "BF16"}.get(plan.model.dtype, "F32")',
        (G + "test_arith_an_fp16_checkpoint_rounds_inputs_to_fp16",),
        "an fp16 checkpoint treated as bf16",
    ),
    M(
        "arith-router-refusal",
        SRC + "export/gguf_arith.py",
        'if any(tq.kind == "router" for tq in plan.tensor_quant.values()):',
        "if False:  # mutant: no router refusal",
        (G + "test_arith_refuses_a_quantized_router",),
        "the quantized-router refusal removed",
    ),
    M(
        "arith-latent-refusal",
        SRC + "export/gguf_arith.py",
        'if any(hasattr(m, "kv_a_proj_with_mqa") for m in model.modules()):',
        "if False:  # mutant: no latent-attention refusal",
        (G + "test_arith_refuses_latent_attention",),
        "the latent-attention refusal removed",
    ),
    # ---- export/gguf.py (the writer)
    M(
        "gguf-width-refusal",
        SRC + "export/gguf.py",
        "        if tq.shape[1] % BLOCK:\n",
        "        if False:  # mutant: no width refusal\n",
        (G + "test_gguf_refuses_widths_that_are_not_whole_blocks",),
        "the width-not-multiple-of-32 refusal removed",
    ),
    M(
        "gguf-top-k",
        SRC + "export/gguf.py",
        "if len(ids) < li.top_k:",
        "if len(ids) <= li.top_k:",
        (G + "test_gguf_holds_a_plan_keeping_exactly_top_k_experts",),
        "`len(ids) <= top_k`: every plan keeping exactly top-k experts refused",
    ),
    M(
        "gguf-bf16-f16-swapped",
        SRC + "export/gguf.py",
        '{"bfloat16": gguf.LlamaFileType.MOSTLY_BF16, "float16": gguf.LlamaFileType.MOSTLY_F16}',
        '{"bfloat16": gguf.LlamaFileType.MOSTLY_F16, "float16": gguf.LlamaFileType.MOSTLY_BF16}',
        (G + "test_gguf_file_type_is_the_checkpoints_float_type",),
        "BF16/F16 file types swapped",
    ),
    # ---- export/imatrix.py
    M(
        "imatrix-not-squared",
        SRC + "export/imatrix.py",
        'x2 = stats.get(lp.layer, "in_channel_norm").double()[idx].square().numpy()',
        'x2 = stats.get(lp.layer, "in_channel_norm").double()[idx].numpy()',
        (G + "test_imatrix_known_answer",),
        "gate/up in_sum2 not squared",
    ),
    M(
        "imatrix-counts-off-by-one",
        SRC + "export/imatrix.py",
        "np.array([float(tokens)])",
        "np.array([float(tokens + 1)])",
        (G + "test_imatrix_known_answer",),
        "non-expert counts off by one",
    ),
    M(
        "imatrix-chunk-count",
        SRC + "export/imatrix.py",
        'w.add_uint32("imatrix.chunk_count", chunk_count)',
        'w.add_uint32("imatrix.chunk_count", chunk_size)',
        (G + "test_imatrix_known_answer",),
        "chunk_count written as the chunk size",
    ),
    # ---- methods/auto/target.py
    M(
        "target-no-top-k",
        SRC + "methods/auto/target.py",
        "return list(range(hi, lo - 1, -1))",
        "return list(range(hi, lo, -1))",
        (G + "test_target_tries_k_equal_top_k_and_keeps_the_most_important",),
        "k == top_k never tried",
    ),
    M(
        "target-drops-important",
        SRC + "methods/auto/target.py",
        "dropped = set(order[: e - k])",
        "dropped = set(order[k:])",
        (G + "test_target_tries_k_equal_top_k_and_keeps_the_most_important",),
        "the most important experts dropped",
    ),
    M(
        "target-single-value-unchecked",
        SRC + "methods/auto/target.py",
        "if isinstance(given, list) else given in allowed",
        "if isinstance(given, list) else True",
        (G + "test_target_refuses_a_single_value_it_cannot_run",),
        "single-value fields (quant_group) never checked",
    ),
    # ---- methods/auto/divergence.py
    M(
        "div-ties-larger-prefix",
        SRC + "methods/auto/divergence.py",
        "if (cost := total(idx)) < best * (1 - 1e-9):",
        "if (cost := total(idx)) <= best * (1 + 1e-9):",
        (G + "test_divergence_ties_keep_the_smaller_prefix",),
        "ties pick the larger prefix",
    ),
    M(
        "div-scale-batch",
        SRC + "methods/auto/divergence.py",
        "total += torch.tensor(_chunk_kl(adapter, found, chunk)) * len(chunk)",
        "total += torch.tensor(_chunk_kl(adapter, found, chunk))  # mutant: unweighted",
        (G + "test_divergence_is_the_mean_over_sequences_of_unequal_batches",),
        "scale off by the batch size",
    ),
    M(
        "div-after-last-free",
        SRC + "methods/auto/divergence.py",
        "return est(idx) + kl[len(kl) - 1 if s is None else s]",
        "return est(idx) + (0.0 if s is None else kl[s])",
        (G + "test_divergence_a_change_after_the_last_stage_costs_the_last_stages_kl",),
        "a change after the last measured stage costs 0",
    ),
    M(
        "div-fp16-as-bf16",
        SRC + "methods/auto/divergence.py",
        'SERVED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}',
        'SERVED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.bfloat16}',
        (G + "test_divergence_an_fp16_checkpoint_is_probed_in_fp16",),
        "fp16 measured as bf16",
    ),
    M(
        "div-probe-rows",
        SRC + "methods/auto/divergence.py",
        "fn = _moved(slice((s + 1) * b, (s + 2) * b), seed=s)",
        "fn = _moved(slice(s * b, (s + 1) * b), seed=s)",
        (DIV + "test_each_stage_moves_its_own_rows_only",),
        "probe rows off by one batch",
    ),
    # ---- methods/auto/solver.py
    M(
        "solver-exact-fill-refused",
        SRC + "methods/auto/solver.py",
        "if total + extra <= budget:",
        "if total + extra < budget:",
        (G + "test_solver_takes_an_upgrade_that_exactly_fills_the_budget",),
        "an upgrade that exactly fills the budget refused",
    ),
    M(
        "solver-worst-step",
        SRC + "methods/auto/solver.py",
        "if best is None or (slope, l) < best:",
        "if best is None or (slope, l) > best:",
        (SOLVER + "test_allocation_is_near_optimal_on_random_problems_the_exchanges_cannot_repair",),
        "the budget walk takes the worst step instead of the best",
    ),
    M(
        "solver-pareto-equal-loss",
        SRC + "methods/auto/solver.py",
        "if not out or p.loss < out[-1].loss:",
        "if not out or p.loss <= out[-1].loss:",
        (G + "test_pareto_drops_points_of_equal_loss_and_more_bytes",),
        "the frontier keeps equal-loss points",
    ),
    # ---- methods/auto/frontier.py
    M(
        "frontier-tilt-min-rank",
        SRC + "methods/auto/frontier.py",
        "total += len(tilts) * (2 * self.h * max(tilts) + self.h) * self.el",
        "total += len(tilts) * (2 * self.h * min(tilts) + self.h) * self.el",
        (G + "test_stored_tilts_and_partials_are_padded_to_the_largest_rank",),
        "tilt bytes padded to the smallest rank",
    ),
    M(
        "frontier-no-uniform",
        SRC + "methods/auto/frontier.py",
        "points = uniform_points(prob)",
        "points = []  # mutant: no uniform states",
        (G + "test_layer_front_holds_or_beats_every_uniform_quantization",),
        "uniform-GPTQ states left off the frontier",
    ),
    M(
        "frontier-router-top-k-1",
        SRC + "methods/auto/frontier.py",
        "if sum(routable) < self.top_k:",
        "if sum(routable) < self.top_k - 1:",
        (G + "test_router_needs_top_k_routable_experts",),
        "router feasibility allowing top_k - 1 experts",
    ),
    # ---- methods/auto/tensors.py
    M(
        "tensors-uniform-edges",
        SRC + "methods/auto/tensors.py",
        "want = max(bits, 8) if it.cls in EDGE_CLASSES else bits",
        "want = bits  # mutant",
        (G + "test_uniform_baseline_keeps_embeddings_and_lm_head_at_8_bits",),
        "the uniform whole-model baseline quantizes embeddings/lm_head at b bits, not 8",
    ),
    M(
        "tensors-fallback-one",
        SRC + "methods/auto/tensors.py",
        "fallback = sorted(found.values())[len(found) // 2] if found else 1.0",
        "fallback = 1.0  # mutant",
        (G + "test_class_sensitivity_falls_back_to_the_median",),
        "the sensitivity fallback 1.0 instead of the median",
    ),
    # ---- atomic/lock.py, atomic/durable.py
    M(
        "lock-no-recheck",
        SRC + "atomic/lock.py",
        "same = os.path.samestat(os.fstat(fd), os.stat(self.path))",
        "same = True  # mutant: no re-check",
        (G + "test_lock_taken_on_a_file_unlinked_meanwhile_is_taken_again",),
        "the re-check after taking the lock removed",
    ),
    M(
        "durable-no-dir-fsync",
        SRC + "atomic/durable.py",
        "_fsync_path(out.parent, directory=True)",
        "pass  # mutant: no directory fsync",
        (G + "test_atomic_dir_fsyncs_the_parent_after_the_rename",),
        "no directory fsync after the rename",
    ),
    # ---- export/ct.py's vLLM check (`vllm_reason`, now in plan/targets.py)
    M(
        "ct-lm-head",
        SRC + "plan/targets.py",  # vllm_reason, export/ct.py's before the target registry (re-exported there)
        'if kind == "lm_head":',
        "if False:  # mutant: quantized lm_head accepted",
        (G + "test_vllm_refuses_a_quantized_lm_head_and_asymmetric_specs",),
        "vLLM's check accepts a quantized lm_head",
    ),
    M(
        "ct-asymmetric",
        SRC + "plan/targets.py",
        "if spec.bits not in VLLM_BITS or not spec.symmetric or spec.group_size not in VLLM_GROUPS:",
        "if spec.bits not in VLLM_BITS or spec.group_size not in VLLM_GROUPS:",
        (G + "test_vllm_refuses_a_quantized_lm_head_and_asymmetric_specs",),
        "vLLM's check accepts asymmetric specs",
    ),
]


class Stale(Exception):
    """An old snippet no longer occurs exactly once in its file."""


def mutated(m: Mutation, text: str) -> str:
    n = text.count(m.old)
    if n != 1:
        raise Stale(f"{m.id}: the old snippet occurs {n} times in {m.file} (must be once): {m.old!r}")
    if m.new in text:  # the mutant must be recognisable (`_restore`)
        raise Stale(f"{m.id}: the new snippet already occurs in {m.file}: {m.new!r}")
    return text.replace(m.old, m.new, 1)


def _restore(path: Path, original: bytes, mutant: bytes, m: Mutation) -> None:
    """Put the original bytes back, without undoing anyone else's edit made meanwhile."""
    now = path.read_bytes()
    if now == mutant:
        path.write_bytes(original)
    elif now == original:
        pass
    elif now.count(m.new.encode()) == 1 and now.count(m.old.encode()) == 0:
        path.write_bytes(now.replace(m.new.encode(), m.old.encode(), 1))  # their edit, our mutation reverted
        print(f"warning: {m.file} changed while mutated; only the mutation was reverted", file=sys.stderr)
    else:
        print(
            f"warning: {m.file} changed while mutated and no longer holds the mutant; left as is",
            file=sys.stderr,
        )


def _failed(out: str) -> str | None:
    """The first failing (or erroring) test pytest reports, or None."""
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return found.group(1) if found else None


def run(m: Mutation, tests: tuple[str, ...] | None, deselect=()) -> tuple[bool, str, float]:
    """(caught, by what, seconds) of mutation `m`."""
    path = ROOT / m.file
    original = path.read_bytes()
    mutant = mutated(m, original.decode()).encode()
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", *(tests or m.tests)]
    cmd += [f"--deselect={node}" for node in deselect]
    start = time.monotonic()
    try:
        path.write_bytes(mutant)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        _restore(path, original, mutant, m)
    seconds = time.monotonic() - start
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        return False, "", seconds
    if proc.returncode == 5:  # no tests collected: a named test is missing, which catches nothing
        return False, "no test ran (a named test is missing)", seconds
    return True, _failed(out) or f"pytest exit {proc.returncode}: {out.strip().splitlines()[-1:]}", seconds


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", action="append", metavar="ID", help="run this mutation only (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutations and their tests, run nothing")
    ap.add_argument("--tests", nargs="+", metavar="NODE", help="run these tests instead of the named ones")
    ap.add_argument("--deselect", action="append", default=[], metavar="NODE", help="pytest's --deselect")
    args = ap.parse_args(argv)
    ids = {m.id for m in MUTATIONS}
    assert len(ids) == len(MUTATIONS), "mutation ids are unique"
    unknown = set(args.only or ()) - ids
    if unknown:
        ap.error(f"unknown mutation id(s) {sorted(unknown)}; --list shows them")
    chosen = [m for m in MUTATIONS if not args.only or m.id in args.only]
    try:  # every snippet checked before anything runs
        for m in chosen:
            mutated(m, (ROOT / m.file).read_text())
    except Stale as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.id:28} {m.file.removeprefix(SRC)}: {m.what}")
            for t in m.tests:
                print(f"{'':28}   {t}")
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also where the shell started us ignoring it
    signal.signal(signal.SIGTERM, _sigterm)
    signal.signal(signal.SIGHUP, _sigterm)
    survived = 0
    for m in chosen:
        try:
            caught, by, seconds = run(m, tuple(args.tests) if args.tests else None, args.deselect)
        except KeyboardInterrupt:
            print(f"interrupted during {m.id}; {m.file} restored", file=sys.stderr)
            return 130
        survived += not caught
        verdict = f"caught by {by}" if caught else f"SURVIVED {by}".rstrip()
        print(f"{m.id:28} {verdict} ({seconds:.0f} s)", flush=True)
    print(f"{len(chosen) - survived} of {len(chosen)} mutations caught", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
