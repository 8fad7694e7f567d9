"""lm-eval tasks as data: which tasks exist (local and hub), and their documents rendered as prompts.

Evaluation (`eval/lmeval.py`) scores a model on tasks; calibration (`task:NAME` data terms) runs a
model on the same tasks' prompts, unlabeled. Both resolve task names here, through lm-eval's own
`TaskManager`, so a name means the same documents in both places.

A task's prompt is lm-eval's own zero-shot rendering of a document, `Task.fewshot_context(doc, 0)`:
the description and the question as the model sees it at evaluation time, without the answer, without
few-shot examples (those carry answers). A task with several inputs per document (Winogrande: one
context per option) contributes every rendered context, so no option is favoured.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from ..errors import MoECompressError

#: Directory of the local tasks shipped next to the fixtures (fixture_cloze, fixture_nextword, and the older fixture_mc, fixture_gen).
FIXTURE_TASKS = Path(__file__).resolve().parent.parent / "fixtures" / "tasks"


def _as_list(x) -> list:
    if x is None:
        return []
    if isinstance(x, (str, os.PathLike)):
        return [x]
    return list(x)


def parse_tasks(tasks: str | Sequence[str]) -> list[str]:
    """'a,b c' or ['a', 'b'] -> ['a', 'b', 'c'] (order kept, duplicates dropped)."""
    items = (
        re.split(r"[,\s]+", tasks)
        if isinstance(tasks, str)
        else [t for s in tasks for t in re.split(r"[,\s]+", s)]
    )
    out: list[str] = []
    for t in items:
        if t and t not in out:
            out.append(t)
    return out


def local_task_paths(include_path=None) -> list[Path]:
    """The shipped fixture task directory plus the user's include paths (which must exist)."""
    paths = [FIXTURE_TASKS]
    for p in _as_list(include_path):
        p = Path(p).expanduser()
        if not p.is_dir():
            raise MoECompressError(
                f"The task directory {p} does not exist; pass a directory holding lm-eval "
                "task YAML files (and their JSONL data) as include_path."
            )
        paths.append(p.resolve())
    return paths


def _task_manager(paths: Sequence[Path], include_defaults: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(p) for p in paths], include_defaults=include_defaults)


@lru_cache(maxsize=1)
def _standard_names_fast() -> frozenset[str]:
    """Names of lm-eval's built-in tasks/groups/tags by a regex scan of its YAML files (~0.5 s).

    Indexing them with lm-eval's TaskManager parses ~14k YAML files (10+ s on 2 cores); the scan
    misses only template-generated subtasks, and it is used only to word error messages offline.
    """
    import lm_eval.tasks

    root = Path(lm_eval.tasks.__file__).parent
    names: set[str] = set()
    line = re.compile(r"^(?:task|group|tag):[ \t]*([^\n]*)$", re.M)
    for f in root.rglob("*.yaml"):
        try:
            text = f.read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue
        for m in line.finditer(text):
            v = m.group(1).strip()
            if not v or v.startswith("!"):
                continue
            for name in v.strip("[]").split(","):
                name = name.strip().strip("'\"")
                if re.fullmatch(r"[\w.\-]+", name):
                    names.add(name)
    return frozenset(names)


def _close(name: str, candidates: Iterable[str], n: int = 5) -> list[str]:
    return difflib.get_close_matches(name, sorted(set(candidates)), n=n, cutoff=0.6)


def resolve_tasks(tasks, include_path=None, online: bool | None = None):
    """Check task names; return (task names, TaskManager, local_only) or raise a one-sentence MoECompressError.

    Local tasks (the shipped fixture tasks and `include_path`) always work. Built-in lm-eval tasks
    download their data from the HuggingFace hub, so offline they are refused; an unknown name is
    refused with its closest matches.
    """
    names = parse_tasks(tasks)
    if not names:
        raise MoECompressError(
            "No lm-eval task given; pass task names such as fixture_cloze,fixture_nextword "
            "(local) or arc_easy,hellaswag (hub)."
        )
    paths = local_task_paths(include_path)
    local = _task_manager(paths, include_defaults=False)
    missing = [t for t in names if t not in local.all_tasks]
    if not missing:
        return names, local, True
    from ..models.loading import hub_reachable

    if online is None:
        online = hub_reachable()
    if not online:
        fast = _standard_names_fast()
        local_list = ", ".join(local.all_tasks)
        for t in missing:
            if t in fast:
                raise MoECompressError(
                    f"The lm-eval task '{t}' downloads its data from the HuggingFace hub, which is not reachable; "
                    f"run where the hub is reachable, or use a local task ({local_list}, or your own YAML + JSONL "
                    "passed with --include-path)."
                )
        t = missing[0]
        near = _close(t, list(local.all_tasks) + list(fast))
        hint = f"did you mean {', '.join(near)}? " if near else ""
        raise MoECompressError(
            f"Unknown lm-eval task '{t}': {hint}Offline only local tasks run ({local_list}, or your own YAML + "
            "JSONL passed with --include-path)."
        )
    full = _task_manager(paths, include_defaults=True)
    for t in missing:
        if t not in full.all_tasks:
            near = _close(t, full.all_tasks)
            hint = f"did you mean {', '.join(near)}?" if near else "see `lm_eval ls tasks` for the list."
            raise MoECompressError(f"Unknown lm-eval task '{t}': {hint}")
    return names, full, False


@contextlib.contextmanager
def quiet_lm_eval(level: int = logging.ERROR):
    """lm-eval warns on every run about in-memory models and custom datasets; keep errors only."""
    names = ["lm_eval"] + [n for n in logging.root.manager.loggerDict if n.startswith("lm_eval.")]
    old = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(level)
    try:
        yield
    finally:
        for n, lvl in old.items():
            logging.getLogger(n).setLevel(lvl)


SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class TaskPrompts:
    """The prompts a `task:` calibration term contributes, and what they came from (for the report)."""

    task: str
    split: str
    documents: int  # documents drawn
    available: int  # documents in the split
    eval_split: str | None  # the split lm-eval scores the task on
    prompts: list[str]

    @property
    def overlaps_evaluation(self) -> bool:
        """True when the prompts come from the split the task is evaluated on (calibrating on the test items)."""
        return self.split == self.eval_split


def _split_docs(task, split: str) -> list[dict] | None:
    has = {
        "train": task.has_training_docs,
        "validation": task.has_validation_docs,
        "test": task.has_test_docs,
    }[split]
    if not has():
        return None
    get = {"train": task.training_docs, "validation": task.validation_docs, "test": task.test_docs}[split]
    return list(get())


def _eval_split(task) -> str | None:
    if task.has_test_docs():
        return "test"
    return "validation" if task.has_validation_docs() else None


def load_task(name: str, include_path=None):
    """The lm-eval `Task` object of one task name (a group or tag is refused: name one of its tasks)."""
    names, manager, _ = resolve_tasks(name, include_path)
    if len(names) != 1:
        raise MoECompressError(
            f"A task data term names one lm-eval task, not '{name}'; write task:NAME:COUNT."
        )
    with quiet_lm_eval():  # lm-eval warns about custom datasets on every load
        loaded = manager.load(names[0])
    task = loaded["tasks"].get(names[0])
    if task is None:
        raise MoECompressError(
            f"'{name}' is an lm-eval group or tag, not a task; name one of its tasks "
            f"({', '.join(sorted(loaded['tasks'])[:5])}) in task:NAME."
        )
    return task


def render_prompt(task, doc: dict) -> list[str]:
    """lm-eval's zero-shot context of `doc` (a list for tasks with several inputs per document)."""
    ctx = task.fewshot_context(doc, num_fewshot=0)
    return list(ctx) if isinstance(ctx, (list, tuple)) else [ctx]


def task_prompts(
    name: str, count: int, seed: int, split: str | None = None, include_path=None
) -> TaskPrompts:
    """`count` documents of task `name`, drawn without replacement with `seed`, rendered as unlabeled prompts.

    split: which documents (``train``, ``validation``, ``test``); by default the first of those the task
    has that is not the one it is evaluated on, and the evaluation split only when it has no other (the
    fixture tasks; `TaskPrompts.overlaps_evaluation` says so for the report).
    """
    task = load_task(name, include_path)
    ev = _eval_split(task)
    if split is not None:
        if split not in SPLITS:
            raise MoECompressError(
                f"The task term 'task:{name}@{split}' names an unknown split; use one of {', '.join(SPLITS)}."
            )
        order = [split]
    else:
        order = [s for s in SPLITS if s != ev] + ([ev] if ev else [])
    for which in order:
        docs = _split_docs(task, which)
        if docs:
            break
    else:
        raise MoECompressError(
            f"The lm-eval task '{name}' has no documents in split {' or '.join(order)}; "
            "name a split it has, e.g. task:NAME@test:128."
        )
    if count > len(docs):
        raise MoECompressError(
            f"The lm-eval task '{name}' has {len(docs)} documents in its {which} split, fewer "
            f"than the {count} requested; ask for at most {len(docs)}."
        )
    pick = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed))[:count].tolist()
    prompts = [p for i in pick for p in render_prompt(task, docs[i])]
    return TaskPrompts(name, which, count, len(docs), ev, prompts)
