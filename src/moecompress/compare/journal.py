"""The journal of a `compare` run in progress: the finished arms kept beside the report, so that an
interrupted run resumes with only the arms left."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


class ArmJournal:
    """The finished arms of a `compare` run in progress, in ``.OUT.partial/`` beside the report: the shared
    calibration store, each finished arm's results (``arms/NAME.json``) and checkpoint. `start(resume=True)`
    after an interruption returns the finished arms, so only the others are computed; the run's identity
    (recipe, model fingerprint, whether checkpoints are kept) must match, as `calibrate --resume` requires."""

    def __init__(self, out: Path, identity: dict):
        self.dir = out.parent / f".{out.name}.partial"
        self.identity = identity

    def start(self, resume: bool) -> dict[str, dict[str, Any]]:
        from ..atomic import clear_partial, write_file
        from ..errors import MoECompressError
        from ..safejson import load_json

        run = self.dir / "run.json"
        old = None if self.dir.is_symlink() else self._read(run)
        if resume and old is not None:
            ident = old.get("identity")
            model = ident.get("model") if isinstance(ident, dict) else None
            if model != self.identity.get("model"):
                raise MoECompressError(
                    f"The interrupted run in {self.dir} was made from other weights of the model (a tensor "
                    "or its config changed since, or an earlier moecompress recorded it), so its finished "
                    "arms would not match the rest; drop --resume to start over."
                )
            if ident != self.identity:
                raise MoECompressError(
                    f"The interrupted run in {self.dir} was made with another recipe, model or "
                    "--keep-checkpoints setting; drop --resume to start over or pass the same ones."
                )
            fix = "the interrupted run is corrupted, so drop --resume to start over"
            return {p.stem: load_json(p, fix) for p in sorted((self.dir / "arms").glob("*.json"))}
        clear_partial(self.dir, ours=old is not None)  # never deletes what moecompress did not write
        (self.dir / "arms").mkdir(parents=True)
        write_file(run, json.dumps({"identity": self.identity}))
        return {}

    @staticmethod
    def _read(run: Path) -> dict | None:
        from ..safejson import try_load_json

        got = try_load_json(run)
        return got if isinstance(got, dict) and "identity" in got else None

    def save(self, entry: dict[str, Any]) -> None:
        from ..atomic import write_file

        write_file(self.dir / "arms" / f"{entry['name']}.json", json.dumps(entry))

    def fresh(self, sub: str, name: str) -> Path:
        """`sub/name` under the journal, emptied: what an interrupted attempt at the arm left is not reused."""
        path = self.dir / sub / name
        shutil.rmtree(path, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def remove(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
