"""Output directories appear complete or not at all, and `--overwrite` never deletes what moecompress did not write.

The policy (docs/architecture.md, "Outputs"):

- every output directory is written into a hidden sibling ``.NAME.tmp-PID-XXXX`` and renamed into
  place when complete; any exception, Ctrl-C or SIGTERM removes the sibling;
- every output directory carries the marker file ``.moecompress`` (written before the rename), which
  records its kind (``stats``, ``checkpoint:FORMAT``, ``report``, ``analysis``, ``distill-run``);
- an output may never be, contain or sit inside a path the run reads (the model, a reference, a stats
  store, a checkpoint to evaluate), with or without ``--overwrite`` (`check_apart`); ``--overwrite``
  replaces only a directory with the marker of the same kind, never the current directory or one of
  its ancestors (`check_output`);
- one run at a time writes an output: `claim` holds an exclusive lock on the hidden sibling
  ``.NAME.lock`` for the whole run, so a second writer refuses in one sentence instead of mixing its
  files with the first's (a calibration's ``.NAME.partial`` is covered by the same lock);
- the inputs are fingerprinted when the run starts and again just before the rename
  (`fingerprint_inputs`, `Inputs.check`): an input replaced while the run read it fails the run instead
  of giving an output made of two different inputs;
- every file is fsynced before its rename (`fsync_tree`, `write_file`), so a crash right after a run
  cannot leave a complete-looking output with empty files;
- temporary siblings left by a killed run (SIGKILL: no cleanup can run) are removed by the next
  run that writes the same output, once their process is gone, and reported with their size; a temporary
  is recognised by the marker ``.moecompress-tmp`` written into it when it was made (`temporary_dir`), never
  by its name alone, and a ``.NAME.partial`` is deleted only when its run.json is ours (`clear_partial`);
- outputs get the permissions of an ordinary `mkdir` (the umask), not `mkdtemp`'s 0700.

Modules: `checks` (which output paths a run may write), `lock` (one writer per output), `durable`
(fingerprinted inputs, fsynced files, `atomic_dir`), `sizes` (bytes on disk, printed).
"""

from .checks import (
    MARKER,
    check_apart,
    check_output,
    check_path,
    dry_run_output,
    marker_kind,
    write_marker,
)
from .durable import (
    SPILL_PREFIX,
    TMP_MARKER,
    Inputs,
    atomic_dir,
    clean_marked,
    clean_stale,
    clean_stale_spills,
    clear_partial,
    commit_file,
    fingerprint_inputs,
    fix_permissions,
    fsync_tree,
    mark_temporary,
    stage_file,
    temporary_dir,
    write_file,
)
from .lock import claim, lock_path
from .sizes import dir_bytes, human_bytes

__all__ = [
    "MARKER",
    "SPILL_PREFIX",
    "TMP_MARKER",
    "Inputs",
    "atomic_dir",
    "check_apart",
    "check_output",
    "check_path",
    "claim",
    "clean_marked",
    "clean_stale",
    "clean_stale_spills",
    "clear_partial",
    "commit_file",
    "dir_bytes",
    "dry_run_output",
    "fingerprint_inputs",
    "fix_permissions",
    "fsync_tree",
    "human_bytes",
    "lock_path",
    "marker_kind",
    "mark_temporary",
    "stage_file",
    "temporary_dir",
    "write_file",
    "write_marker",
]
