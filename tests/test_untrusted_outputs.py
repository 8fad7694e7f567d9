"""Issue 51, outputs and leftovers: only what moecompress wrote is deleted (proved by its marker, never by a name),
`.NAME.partial` is handled alike everywhere, spilled plan tensors of a killed run are found again, a replacement
the file system refuses is one sentence, `eval --out` and `--report` are one output, refusals that depend only on
the options come before calibration, and `--dry-run` says what becomes of `--out` (docs/architecture.md,
"Outputs").

Each case asserts the exit code, the one-sentence message (no traceback), that the user's files are
byte-identical and that none of our temporaries remain. One calibration (fixture-calib:4, 32 tokens) and one
checkpoint made from it serve every case.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from moecompress.atomic import MARKER, SPILL_PREFIX, TMP_MARKER, mark_temporary
from moecompress.testing import fixture_dir, run_cli, tree_snapshot

F = fixture_dir("qwen3-moe-tiny")
DATA = ["--data", "fixture-calib:4", "--seq-len", "32"]
PRUNE = ["--method", "prune", "--criterion", "frequency", "--ratio", "0.5"]
EVAL = ["--ppl", "fixture-heldout", "--max-tokens", "32", "--window", "16"]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """root/{s (a stats store of F), ck (a checkpoint compressed from it)}."""
    from moecompress import compress
    from moecompress.calibrate import calibrate

    root = tmp_path_factory.mktemp("untrusted-outputs")
    with warnings.catch_warnings():  # 4 short sequences leave some experts unreached; expected here
        warnings.simplefilter("ignore")
        calibrate(
            str(F), "fixture-calib:4", seq_len=32, out=root / "s", stats=["out_norm_sq_mean"], progress=False
        )
        compress(
            str(F),
            "prune",
            {"criterion": "frequency", "ratio": 0.5},
            calib=str(root / "s"),
            out=root / "ck",
            progress=False,
        )
    return root


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes (what must stay byte-identical)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _one_sentence(code: int, err: str, fragment: str, expected: int = 2) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("Loading weights")]
    assert code == expected, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    assert fragment in lines[0], lines[0]
    return lines[0]


def _ours(p: Path) -> bool:
    try:
        return "token" in json.loads((p / TMP_MARKER).read_text())
    except (OSError, ValueError, TypeError):
        return False


def _leftovers(parent: Path, name: str) -> list[str]:
    """What of ours a run on output `name` may have left in `parent`: marked temporaries, hidden file
    temporaries, the lock."""
    return sorted(p.name for p in parent.glob(f".{name}*") if _ours(p) or p.name.endswith((".tmp", ".lock")))


# ----------------------------------------------------------------------------- 1. stale temporaries: by marker only
@pytest.mark.filterwarnings("ignore")
def test_a_directory_named_like_a_stale_temporary_is_left_alone(ws, tmp_path, capsys, monkeypatch):
    """`.m.old-99999999-dec` (no live pid, but no marker either) is the user's backup: kept; a marked temporary
    of a dead run of the same output is removed, with one note."""
    monkeypatch.chdir(tmp_path)
    for name in (".m.old-99999999-dec", ".m.tmp-99999999-dec"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "w").write_text("bak\n")
    (tmp_path / ".m.tmp-99999999-bad").mkdir()  # a marker that is not ours (not JSON): no proof either
    (tmp_path / ".m.tmp-99999999-bad" / TMP_MARKER).write_text("{cut short")
    users = _files(tmp_path)
    pid = _dead_pid()
    stale = tmp_path / f".m.tmp-{pid}-abc123"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"\0" * 4096)
    mark_temporary(stale, "output-tmp", "m", pid=pid)
    code, _, err = run_cli(["compress", str(F), *PRUNE, "--calib", str(ws / "s"), "--out", "m"], capsys)
    assert code == 0, err
    assert "Traceback" not in err
    after = _files(tmp_path)
    assert {k: after.get(k) for k in users} == users  # byte-identical
    assert all(k.startswith("m/") for k in set(after) - set(users))
    assert not stale.exists()
    assert [line for line in err.splitlines() if line.startswith("note: removed")] == [
        next(line for line in err.splitlines() if line.startswith("note: removed"))
    ]
    assert (tmp_path / "m" / MARKER).is_file() and not (tmp_path / "m" / TMP_MARKER).exists()
    assert _leftovers(tmp_path, "m") == []


# ----------------------------------------------------------------------------- 2. .partial: refused, never deleted
def test_calibrate_refuses_a_partial_directory_it_did_not_write(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".s.partial").mkdir()
    (tmp_path / ".s.partial" / "mine").write_text("x\n")
    before = tree_snapshot(tmp_path)
    code, _, err = run_cli(["calibrate", str(F), *DATA, "--stats", "counts", "--out", "s"], capsys)
    _one_sentence(code, err, "was not written by moecompress")
    assert tree_snapshot(tmp_path) == before  # no s, no lock, .s.partial/mine as it was
    assert (tmp_path / ".s.partial" / "mine").read_text() == "x\n"


# ----------------------------------------------------------------------------- 3. spilled plan tensors
def test_spilled_plan_tensors_are_marked_and_a_killed_runs_are_removed(tmp_path, monkeypatch, capsys):
    """The spill directory carries our marker from its creation; the one a killed run left (marked, its process
    gone) is removed by the next run, a look-alike without our marker is left alone."""
    import torch

    from moecompress.checkpoint.view import SpilledTensors

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pid = _dead_pid()
    killed = tmp_path / f"{SPILL_PREFIX}{pid}-abc"
    killed.mkdir()
    (killed / "part00001.safetensors").write_bytes(b"\0" * 8192)
    mark_temporary(killed, "plan-tensors", pid=pid)
    alike = tmp_path / f"{SPILL_PREFIX}notes"
    alike.mkdir()
    (alike / "keep.txt").write_text("the user's\n")
    spill = SpilledTensors()
    spill.update({"a": torch.arange(4.0)})
    assert not killed.exists() and (alike / "keep.txt").read_text() == "the user's\n"
    assert spill.dir.parent == tmp_path and spill.dir.name.startswith(f"{SPILL_PREFIX}{os.getpid()}-")
    assert json.loads((spill.dir / TMP_MARKER).read_text())["pid"] == os.getpid()
    assert torch.equal(spill["a"], torch.arange(4.0))
    mine = spill.dir
    del spill
    assert not mine.exists()
    assert "note: removed" in capsys.readouterr().err


# ----------------------------------------------------------------------------- 4. --overwrite that cannot rename
@pytest.mark.filterwarnings("ignore")
def test_overwrite_of_an_output_this_user_cannot_move_is_refused_before_compute(
    ws, tmp_path, capsys, monkeypatch
):
    """Root passes every permission check, so the missing write permission is simulated (os.access)."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ws / "ck", tmp_path / "m")
    target, real = str(tmp_path / "m"), os.access

    def access(path, mode, *args, **kwargs):
        if str(path) == target and mode & os.W_OK:
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    before = tree_snapshot(tmp_path)
    argv = ["compress", str(F), *PRUNE, "--calib", "fixture-calib:4", "--seq-len", "32"]
    code, _, err = run_cli([*argv, "--out", "m", "--overwrite"], capsys)
    _one_sentence(code, err, "needs write permission on it")
    assert tree_snapshot(tmp_path) == before  # refused before the calibration: no m-calib


@pytest.mark.filterwarnings("ignore")
def test_overwrite_whose_rename_fails_keeps_the_original_and_leaves_nothing(
    ws, tmp_path, capsys, monkeypatch
):
    """The file system refuses to move the previous output aside (EPERM, as an immutable directory or a mount
    point does even for root): one sentence, the previous output byte-identical, no `.m.old-*` or `.m.tmp-*`."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ws / "ck", tmp_path / "m")
    before = _files(tmp_path)
    target, real = tmp_path / "m", os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(os.path.abspath(src)) == target:
            raise PermissionError(errno.EPERM, "Operation not permitted", str(src))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    code, _, err = run_cli(
        ["compress", str(F), *PRUNE, "--calib", str(ws / "s"), "--out", "m", "--overwrite"], capsys
    )
    _one_sentence(code, err, "Operation not permitted")
    assert _files(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


# ----------------------------------------------------------------------------- 5. eval --out and --report: one output
def test_eval_out_and_report_on_one_path_are_refused_before_any_model_loads(
    ws, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    for out, report in (("X", "X"), ("X/r.json", "X"), ("r.json", "r.json/rep")):
        code, _, err = run_cli(["eval", str(ws / "ck"), *EVAL, "--out", out, "--report", report], capsys)
        _one_sentence(code, err, "overlap")
        assert list(tmp_path.iterdir()) == []


def test_eval_report_failing_on_a_full_disk_leaves_no_results_and_the_rerun_works(
    ws, tmp_path, capsys, monkeypatch
):
    import moecompress.eval.report as report

    monkeypatch.chdir(tmp_path)
    real = report.write_report

    def full(results, out_dir, **kwargs):
        (Path(out_dir) / "report.md").write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device", str(Path(out_dir) / "quality_vs_bytes.png"))

    monkeypatch.setattr(report, "write_report", full)
    argv = ["eval", str(ws / "ck"), *EVAL, "--out", "r.json", "--report", "rep"]
    code, _, err = run_cli(argv, capsys)
    _one_sentence(code, err, "The disk is full")
    assert list(tmp_path.iterdir()) == []  # neither the results nor the report, nor a temporary of either
    monkeypatch.setattr(report, "write_report", real)
    code, _, err = run_cli(argv, capsys)  # not refused: nothing of the failed run is in the way
    assert code == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["schema"].startswith("moecompress.")
    assert (tmp_path / "rep" / "report.md").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "rep"]


# ----------------------------------------------------------------------------- 6. option-only refusals first
@pytest.mark.parametrize(
    "model,extra,fragment",
    [
        ("qwen3-moe-tiny", ["--operator", "tilt", "--target", "llama.cpp"], "has replacement operators"),
        ("olmoe-tiny", ["--gate", "keep", "--format", "gguf"], "uses gate 'keep'"),
        ("qwen3-moe-tiny", ["--method", "puzzlemoe", "--format", "gguf"], "packed element-wise merges"),
        ("qwen3-moe-tiny", ["--method", "puzzlemoe", "--target", "llama.cpp"], "packed element-wise merges"),
    ],
    ids=["tilt-llama.cpp", "keep-gate-gguf", "puzzlemoe-gguf", "puzzlemoe-llama.cpp"],
)
def test_target_and_format_refusals_of_the_options_come_before_calibration(
    tmp_path, capsys, monkeypatch, model, extra, fragment
):
    monkeypatch.chdir(tmp_path)
    method = extra if "--method" in extra else [*PRUNE, *extra]
    argv = ["compress", str(fixture_dir(model)), *method, "--calib", "fixture-calib:4", "--seq-len", "32"]
    code, _, err = run_cli([*argv, "--out", "m"], capsys)
    _one_sentence(code, err, fragment)
    assert list(tmp_path.iterdir()) == []  # no m-calib: nothing was calibrated


def test_a_plan_the_target_runs_is_not_refused_early():
    from moecompress.methods import parse_config
    from moecompress.workflows.preview import check_format_early

    prune = parse_config("prune", {"criterion": "frequency", "ratio": 0.5})
    check_format_early(str(F), "prune", prune, "llama.cpp")  # qwen3 renormalises: gate 'keep' is exact there
    check_format_early(
        str(fixture_dir("olmoe-tiny")),
        "prune",
        prune.model_copy(update={"gate": "renorm"}),
        "moecompress",
        "gguf",
    )
    check_format_early(str(F), "puzzlemoe", parse_config("puzzlemoe", {}), "moecompress", "packed")


# ----------------------------------------------------------------------------- 7. --dry-run says what becomes of --out
def test_dry_run_says_that_out_exists(ws, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ws / "ck", tmp_path / "m")
    (tmp_path / "mine").mkdir()
    before = _files(tmp_path)
    argv = ["compress", str(F), *PRUNE, "--calib", str(ws / "s"), "--dry-run"]
    code, out, err = run_cli([*argv, "--out", "m"], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert "output: m would be refused: m already exists" in " ".join(out.split())
    code, out, err = run_cli([*argv, "--out", "m", "--overwrite"], capsys)
    assert code == 0 and "output: m exists; --overwrite replaces it" in " ".join(out.split()), err
    code, out, err = run_cli([*argv, "--out", "mine", "--overwrite", "--json"], capsys)
    assert code == 0, err
    assert "was not written by moecompress" in json.loads(out)["output"]
    code, out, err = run_cli([*argv, "--out", "new", "--json"], capsys)
    assert code == 0 and json.loads(out)["output"] == "new (new)", err
    assert _files(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["m", "mine"]
