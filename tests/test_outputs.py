"""The output and exit-code policy: atomic outputs, marker-gated --overwrite, stale temporaries, and
SIGINT / SIGTERM / SIGKILL during calibrate, compress and compare (docs/architecture.md, "Outputs")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moecompress.atomic import MARKER, TMP_MARKER, atomic_dir, clean_stale, mark_temporary
from moecompress.errors import MoECompressError
from moecompress.testing import fixture_dir

F = fixture_dir("olmoe-tiny")
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_atomic_dir_writes_marker_normal_permissions_and_replaces_only_marked(tmp_path):
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("one")
    mask = os.umask(0)
    os.umask(mask)
    assert (out / MARKER).is_file() and (out / "a.txt").read_text() == "one"
    assert out.stat().st_mode & 0o777 == 0o777 & ~mask  # not mkdtemp's 0700
    assert (out / "a.txt").stat().st_mode & 0o777 == 0o666 & ~mask
    with pytest.raises(MoECompressError, match="already exists"):
        with atomic_dir(out) as tmp:
            pass
    with atomic_dir(out, overwrite=True) as tmp:
        (tmp / "b.txt").write_text("two")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "b.txt"]
    # a failure inside keeps the previous output and leaves no temporary behind
    with pytest.raises(RuntimeError):
        with atomic_dir(out, overwrite=True) as tmp:
            (tmp / "c.txt").write_text("three")
            raise RuntimeError("boom")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "b.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    (out / MARKER).unlink()
    with pytest.raises(MoECompressError, match="not written by moecompress"):
        with atomic_dir(out, overwrite=True) as tmp:
            pass
    assert (out / "b.txt").is_file()


def test_the_marker_is_in_the_output_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """A kill between rename and marker would leave an output that --overwrite refuses as the user's: the
    marker is written into the temporary directory, so the rename moves a complete, marked output."""
    import moecompress.atomic.durable as atomic

    seen = []
    real = os.replace

    def replace(src, dst):
        if Path(dst) == tmp_path / "out":
            seen.append((Path(src) / MARKER).is_file())
        return real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "a.txt").write_text("one")
    with atomic_dir(tmp_path / "out", overwrite=True) as tmp:
        (tmp / "a.txt").write_text("two")
    assert seen == [True, True]


def test_an_output_replaced_by_the_users_directory_during_the_run_is_not_deleted(tmp_path):
    """--overwrite was checked at the start against a marked output; if the user put their own directory there
    while the run computed, the re-check before the rename refuses instead of deleting it."""
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        (tmp / "a.txt").write_text("ours")
    with pytest.raises(MoECompressError, match="not written by moecompress"):
        with atomic_dir(out, overwrite=True) as tmp:
            (tmp / "a.txt").write_text("new")
            os.rename(out, tmp_path / "moved")
            out.mkdir()
            (out / "thesis.tex").write_text("the user's")
    assert (out / "thesis.tex").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".out.lock")) == [
        "moved",
        "out",
    ]


def test_stale_temporaries_of_dead_runs_are_removed_and_reported(tmp_path, capsys):
    """Only a temporary carrying our marker for this output, whose process is gone, is removed; a directory that
    merely has such a name (the user's) is left alone (issue 51)."""
    pid = _dead_pid()
    dead = tmp_path / f".out.tmp-{pid}-abc123"
    (dead / "sub").mkdir(parents=True)
    (dead / "sub" / "w.bin").write_bytes(b"x" * 3000)
    mark_temporary(dead, "output-tmp", "out", pid=pid)
    size = 3000 + (dead / TMP_MARKER).stat().st_size
    live = tmp_path / f".out.tmp-{os.getpid()}-def456"
    live.mkdir()
    mark_temporary(live, "output-tmp", "out")
    other = tmp_path / f".other.tmp-{pid}-ghi789"
    other.mkdir()
    mark_temporary(other, "output-tmp", "other", pid=pid)
    users = tmp_path / f".out.old-{pid}-dec"  # named like one, but no marker: the user's
    users.mkdir()
    (users / "w").write_text("bak\n")
    removed = clean_stale(tmp_path / "out")
    assert removed == [(dead, size)]
    assert not dead.exists() and live.exists() and other.exists()
    assert (users / "w").read_text() == "bak\n"
    assert "KiB" in capsys.readouterr().err


# ----------------------------------------------------------------------------- signals, as a user sends them
RECIPE = f"""model: {F}
calibration: {{data: fixture-calib:64, seq_len: 128}}
eval: {{ppl: fixture-heldout, max_tokens: 64, window: 32, tasks: [], latency: false, quant_baselines: []}}
method: prune
params: {{criterion: frequency, ratio: 0.5}}
"""

VERBS = {
    # argv, the path whose appearance shows the run is computing, the output that must be absent or complete
    "calibrate": (
        ["calibrate", str(F), "--data", "fixture-calib:64", "--seq-len", "256", "--out", "s"],
        ".s.partial",
        "s",
    ),
    "compress": (
        [
            "compress",
            str(F),
            "--criterion",
            "frequency",
            "--ratio",
            "0.5",
            "--calib",
            "fixture-calib:64",
            "--seq-len",
            "256",
            "--out",
            "c",
        ],
        "c-calib/.stats.partial",
        "c",
    ),
    "compare": (["compare", "r.yaml", "--out", "rep"], ".rep.tmp-*", "rep"),
}


# each subprocess pays the torch/transformers import: the default run covers every verb and every signal
# once (the diagonal); the other six pairs are marked slow
FAST = {("calibrate", signal.SIGINT), ("compress", signal.SIGTERM), ("compare", signal.SIGKILL)}
PAIRS = [
    pytest.param(v, s, id=f"{v}-{s.name}", marks=() if (v, s) in FAST else pytest.mark.slow)
    for v in VERBS
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)
]


@pytest.mark.parametrize("verb,sig", PAIRS)
def test_signal_leaves_no_partial_output(tmp_path, verb, sig):
    argv, busy, out = VERBS[verb]
    (tmp_path / "r.yaml").write_text(RECIPE)
    env = dict(
        os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_WAIT_POLICY="PASSIVE"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "moecompress.cli", *argv],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(busy)) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, f"{verb} ended before it could be interrupted: {proc.stderr.read()}"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    target = tmp_path / out
    assert not target.exists() or (target / MARKER).is_file()  # absent or complete
    assert "Traceback" not in err, err
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
        leftovers = list(tmp_path.glob(f".{out}.tmp-*"))
        clean_stale(target)  # what the next run does first
        assert not any(p.exists() for p in leftovers)
        return
    assert proc.returncode == 128 + sig, err
    assert [line for line in err.splitlines() if "interrupted:" in line] == [
        next(line for line in err.splitlines() if "interrupted:" in line)
    ]
    assert ("SIGTERM" if sig == signal.SIGTERM else "Ctrl-C") in err
    assert not list(tmp_path.glob(f".{out}.tmp-*"))  # cleaned up on the way out


def test_a_signal_that_native_code_turns_into_another_error_still_ends_as_interrupted(tmp_path, capsys):
    # safetensors' reader, interrupted inside its call back into torch, raises a ValueError in the signal's place
    import typer

    from moecompress.cli.entry import run

    app = typer.Typer()
    out = tmp_path / "o"

    @app.command()
    def work():
        with atomic_dir(out):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except BaseException:
                raise ValueError(
                    "could not determine the shape of object type 'torch.storage.UntypedStorage'"
                ) from None

    with pytest.raises(SystemExit) as exc:
        run(app, [])
    err = capsys.readouterr().err
    assert exc.value.code == 128 + signal.SIGTERM
    assert "interrupted:" in err and "SIGTERM" in err and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".o.tmp-*"))
