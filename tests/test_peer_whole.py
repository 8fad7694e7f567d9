"""`benchmarks/_peer.load_peer_whole`: llm-compressor's whole-model GPTQ arms as committed in
benchmarks/results/peer_gptq_whole.json (read only; nothing is run, no network)."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _peer import PEER_WHOLE, load_peer_whole  # noqa: E402


def test_every_committed_arm_pairs_window_by_window_with_the_recorded_windows():
    data = json.loads(PEER_WHOLE.read_text())
    assert data["schema"] == "peer_gptq_whole/1"
    for fx in data["fixtures"]:
        arms = load_peer_whole(fx["fixture"])
        assert {a["name"] for a in arms} == {a["name"] for a in fx["arms"]}
        for a in arms:
            assert set(a) >= {"name", "bits", "whole_bytes", "original_bytes", "kl_windows"}
            assert len(a["kl_windows"]) == len(a["window_ids"]) == len(fx["eval"]["window_ids"])
            assert 0 < a["whole_bytes"] < a["original_bytes"] == fx["original_bytes"]
            tokens = fx["eval"][
                "window_tokens"
            ]  # the recorded mean is the token-weighted mean of the windows
            assert (
                abs(sum(k * n for k, n in zip(a["kl_windows"], tokens)) / sum(tokens) - a["kl"])
                <= 1e-9 * a["kl"]
            )
            assert a["eval"]["window"] == 512 and a["eval"]["data"] == "fixture-heldout"


def test_an_absent_fixture_or_file_gives_no_arms(tmp_path):
    assert load_peer_whole("no-such-fixture") == []
    assert load_peer_whole("olmoe-tiny", tmp_path / "missing.json") == []
