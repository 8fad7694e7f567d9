"""`moecompress.quiet`: library progress bars and logs are silenced inside the block and restored after."""

import logging

from moecompress.quiet import quiet_libraries


def _bars(capsys) -> str:
    from tqdm import tqdm  # lm-eval's kind of bar: plain tqdm, no switch of its own
    from transformers.utils import logging as tlog  # transformers' bar ("Loading weights")

    for _ in tqdm(range(3), desc="Running loglikelihood requests"):
        pass
    for _ in tlog.tqdm(range(3), desc="Loading weights"):
        pass
    logging.getLogger("lm_eval.evaluator").warning("lm-eval warning line")
    return capsys.readouterr().err


def test_library_bars_are_silenced_and_restored(capsys):
    handler = logging.StreamHandler()
    logging.getLogger("lm_eval.evaluator").addHandler(handler)
    try:
        loud = _bars(capsys)
        assert (
            "Running loglikelihood requests" in loud
            and "Loading weights" in loud
            and "lm-eval warning" in loud
        )
        with quiet_libraries():
            quiet = _bars(capsys)
        assert quiet == ""
        again = _bars(capsys)  # everything restored on exit
        assert "Running loglikelihood requests" in again and "Loading weights" in again
    finally:
        logging.getLogger("lm_eval.evaluator").removeHandler(handler)


def test_disabled_context_changes_nothing(capsys):
    with quiet_libraries(enabled=False):
        out = _bars(capsys)
    assert "Loading weights" in out


def test_lm_eval_git_probe_is_silent_outside_a_repository(tmp_path, capfd, monkeypatch):
    import lm_eval.evaluator as ev

    monkeypatch.chdir(tmp_path)  # not a git repository: git prints "fatal: ..." on fd 2
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    ev.get_git_commit_hash()
    assert "fatal" in capfd.readouterr().err
    with quiet_libraries():
        assert ev.get_git_commit_hash() is None
    assert capfd.readouterr().err == ""
