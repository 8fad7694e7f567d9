"""Untrusted GGUF files on the load path (issue 51): a crafted header is refused by our bounded reader
(`export.gguf_guard`) before `gguf`'s reader could allocate what it declares, no directory's code runs or is offered
to run without --trust-remote-code, a GGUF (or compact / hf export) missing a tensor is refused rather than loaded
with zeros, and `inspect` of a pruned GGUF reports what the file holds."""

import io
import json
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from moecompress.api import export, load
from moecompress.errors import MoECompressError
from moecompress.export.gguf import GGUF_FILE
from moecompress.export.gguf_guard import read_header
from moecompress.models import load_model
from moecompress.plan import CompressionPlan, ModelInfo
from moecompress.testing import fixture_dir, run_cli

QWEN = "qwen3-moe-tiny"
GIB = 2**30
PROMPT = "Do you wish to run the custom code"


def _sentence(msg: str) -> str:
    """One sentence: one line, ending in a full stop, no full stop followed by a new capitalised sentence."""
    assert "\n" not in msg.strip() and "Traceback" not in msg and msg.strip().endswith("."), msg
    assert not re.search(r"\.\s+[A-Z]", msg), msg
    return msg.strip()


def _refused(code: int, err: str) -> str:
    """The CLI's refusal: exit 2, no traceback, no prompt, its last line one sentence."""
    assert code == 2, err
    assert "Traceback" not in err and PROMPT not in err, err
    last = [line for line in err.splitlines() if line.strip()][-1]
    assert last.startswith("error: "), err
    return _sentence(last[len("error: ") :])


# ----------------------------------------------------------------------------- crafted headers
def _s(x) -> bytes:
    x = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(x)) + x


def _head(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def _tensor(name: str, dims, ggml_type: int = 0, offset: int = 0) -> bytes:
    return (
        _s(name)
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", ggml_type, offset)
    )


def _with_data(header: bytes, data: int) -> bytes:
    """`header` padded to the default 32-byte alignment, then `data` bytes of tensor data."""
    return header + b"\0" * (-len(header) % 32) + b"\0" * data


ARCH = _s("general.architecture") + struct.pack("<I", 8) + _s("qwen3moe")
# the reproduction: an array of 2^61 uint32 in a 101-byte file
BOMB = _head(0, 2) + ARCH + _s("x.arr") + struct.pack("<IIQ", 9, 4, 2**61)
CRAFTED = {
    "array-bomb": (BOMB, "declares an array of 2305843009213693952 entries, more than the 0 bytes left"),
    "tensor-count": (_head(2**40, 1) + ARCH, "declares 1099511627776 tensors, more than the"),
    "key-count": (_head(0, 2**40) + ARCH, "declares 1099511627776 metadata keys, more than the"),
    "string-past-eof": (
        _head(0, 1) + struct.pack("<Q", 2**40) + b"general",
        "a string of 1099511627776 bytes",
    ),
    "data-past-eof": (
        _with_data(_head(1, 1) + ARCH + _tensor("token_embd.weight", [1024, 1024]), 64),
        "declares 4194304 bytes at byte",
    ),
    "unknown-value-type": (
        _head(0, 2) + ARCH + _s("x.y") + struct.pack("<I", 13) + b"\0" * 8,
        "its key 'x.y' has the unknown value type 13",
    ),
    "unknown-ggml-type": (
        _with_data(_head(1, 1) + ARCH + _tensor("t.weight", [32], ggml_type=99), 128),
        "its tensor 't.weight' has the unknown ggml type 99",
    ),
    "bad-magic": (b"GGML" + _head(0, 1)[4:] + ARCH, "does not start with the GGUF magic bytes"),
    "version": (_head(0, 1, version=4) + ARCH, "declares version 4, and only versions 2 and 3 are read"),
    "nested-arrays": (
        _head(0, 2)
        + ARCH
        + _s("x.n")
        + struct.pack("<I", 9)
        + struct.pack("<IQ", 9, 1) * 2
        + struct.pack("<IQ", 4, 0),
        "nests arrays more than 2 deep",
    ),
    "five-dims": (
        _with_data(_head(1, 1) + ARCH + _tensor("t.weight", [1, 1, 1, 1, 1]), 32),
        "has 5 dimensions, not 1 to 4",
    ),
    "overlap": (
        _with_data(_head(2, 1) + ARCH + _tensor("a.weight", [8]) + _tensor("b.weight", [8]), 32),
        "its tensors 'a.weight' and 'b.weight' overlap",
    ),
    "misaligned": (
        _with_data(_head(1, 1) + ARCH + _tensor("a.weight", [8], offset=4), 64),
        "starts at offset 4, not a multiple of the alignment 32",
    ),
    "alignment": (
        _head(0, 2) + ARCH + _s("general.alignment") + struct.pack("<II", 4, 48),
        "general.alignment 48 is not a power of two",
    ),
    "not-utf8": (_head(0, 1) + _s(b"\xff\xfe") + struct.pack("<I", 4) + b"\0" * 4, "is not UTF-8 text"),
    "truncated": (b"GGUF" + struct.pack("<I", 3), "it ends at byte 8, inside its header"),
}
assert len(BOMB) == 101


def _crafted_dir(root, name: str):
    d = root / name
    d.mkdir()
    (d / GGUF_FILE).write_bytes(CRAFTED[name][0])
    return d


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_headers_are_one_sentence_from_our_reader(tmp_path, name):
    """Every crafted header is refused by the bounded reader, naming the file and the problem."""
    path = _crafted_dir(tmp_path, name) / GGUF_FILE
    with pytest.raises(MoECompressError) as exc:
        read_header(path)
    msg = _sentence(str(exc.value))
    assert msg.startswith(f"{path} is not a valid GGUF file: ") and CRAFTED[name][1] in msg, msg
    assert msg.endswith("; re-export it or use the original file.")


def test_crafted_headers_through_load_and_eval(tmp_path, capsys):
    """`moecompress.load` and `moecompress eval` refuse them with the reader's sentence, exit 2, no traceback."""
    for name in ("tensor-count", "string-past-eof", "data-past-eof", "overlap", "bad-magic"):
        d = _crafted_dir(tmp_path, name)
        with pytest.raises(MoECompressError) as exc:
            load(d)
        assert CRAFTED[name][1] in _sentence(str(exc.value))
    for name in ("key-count", "unknown-ggml-type"):
        code, _, err = run_cli(
            ["eval", str(_crafted_dir(tmp_path, name)), "--ppl", "fixture-heldout"], capsys
        )
        assert CRAFTED[name][1] in _refused(code, err)


_BOMB_CHILD = textwrap.dedent(
    """
    import sys
    import moecompress
    from moecompress.errors import MoECompressError

    d = sys.argv[1]
    try:
        moecompress.load(d)
    except MoECompressError as exc:
        print("load:", exc, file=sys.stderr)
    else:
        sys.exit(5)
    from moecompress.cli import main

    main(["eval", d, "--ppl", "fixture-heldout"])
    """
)


def _run_bounded(args, timeout: float = 180.0):
    """Run `args` with a 3 GiB data limit (a regression dies rather than filling the machine); returns
    (exit code, stderr, peak resident bytes of that child alone)."""

    def limit():
        resource.setrlimit(resource.RLIMIT_DATA, (3 * GIB, 3 * GIB))

    with open(os.devnull, "rb") as stdin:
        proc = subprocess.Popen(
            args, stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=limit
        )
    err_chunks = []
    deadline = time.monotonic() + timeout
    os.set_blocking(proc.stderr.fileno(), False)
    while True:
        chunk = proc.stderr.read()
        if chunk:
            err_chunks.append(chunk)
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            os.kill(proc.pid, signal.SIGKILL)
            os.wait4(proc.pid, 0)
            pytest.fail(f"{args} ran past {timeout} s")
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    os.set_blocking(proc.stderr.fileno(), True)
    err_chunks.append(proc.stderr.read() or b"")
    proc.stderr.close()
    return proc.returncode, b"".join(err_chunks).decode(errors="replace"), usage.ru_maxrss * 1024


def test_the_101_byte_array_bomb_stays_bounded(tmp_path):
    """The issue's 101-byte model.gguf: `moecompress.load` and `moecompress eval` in a child process refuse it in
    one sentence, exit 2, no traceback, with the child's peak memory under 2 GB (it grew without bound)."""
    d = _crafted_dir(tmp_path, "array-bomb")
    code, err, peak = _run_bounded([sys.executable, "-c", _BOMB_CHILD, str(d)])
    assert peak < 2 * GIB, peak
    msg = _refused(code, err)
    assert msg.startswith(f"{d / GGUF_FILE} is not a valid GGUF file: ") and CRAFTED["array-bomb"][1] in msg
    load_line = next(line for line in err.splitlines() if line.startswith("load: "))
    assert _sentence(load_line[len("load: ") :]) == msg


# ----------------------------------------------------------------------------- real exports
@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """qwen3-moe-tiny as GGUF (identity and a 50 % prune), as compact and as hf (identity)."""
    root = tmp_path_factory.mktemp("untrusted-gguf")
    model = load_model(str(fixture_dir(QWEN)))
    info = ModelInfo.from_model(model, checkpoint=fixture_dir(QWEN))
    half = CompressionPlan.prune(
        info, {li.layer: list(range(0, li.num_experts, 2)) for li in info.layers}, gate="renorm"
    )
    identity = CompressionPlan.identity(model)
    for name, plan, fmt in (
        ("identity", identity, "gguf"),
        ("half", half, "gguf"),
        ("compact", identity, "compact"),
        ("hf", identity, "hf"),
    ):
        export(str(fixture_dir(QWEN)), plan, root / name, format=fmt, quiet=True)
    return root


def test_our_reader_agrees_with_ggufs_on_a_real_export(exports):
    """The bounded reader accepts what the exporter writes and finds the same tensors, offsets and sizes."""
    import gguf

    path = exports / "identity" / GGUF_FILE
    header, reader = read_header(path), gguf.GGUFReader(path)
    assert header.data_offset == reader.data_offset and header.size == path.stat().st_size
    assert {n: (t.offset, t.nbytes) for n, t in header.tensors.items()} == {
        t.name: (t.data_offset, int(t.n_bytes)) for t in reader.tensors
    }
    assert header.metadata["qwen3moe.expert_count"] == 16
    assert header.metadata["tokenizer.ggml.tokens"].count == 4096


def _rewrite(src, dst, drop):
    """`src`'s export directory copied to `dst` with model.gguf rewritten by gguf's own writer, minus the tensors
    for which `drop(name)` is true."""
    import gguf

    shutil.copytree(src, dst)
    reader = gguf.GGUFReader(src / GGUF_FILE)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst / GGUF_FILE, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    kept = [t for t in reader.tensors if not drop(t.name)]
    assert len(kept) < len(reader.tensors)
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data)
    writer.close()
    return dst


def test_a_gguf_missing_half_of_a_fused_tensor_is_refused(exports, tmp_path, capsys):
    """transformers fuses ffn_gate_exps and ffn_up_exps into one parameter and filled a missing half with zeros
    (exit 0, perplexity 599): the GGUF's own metadata (4 blocks, 16 experts) says what it must hold."""
    gate = _rewrite(exports / "identity", tmp_path / "gate", lambda n: n == "blk.1.ffn_gate_exps.weight")
    up = _rewrite(exports / "identity", tmp_path / "up", lambda n: n.endswith("ffn_up_exps.weight"))
    for d, first in ((gate, "blk.1.ffn_gate_exps.weight"), (up, "blk.0.ffn_up_exps.weight")):
        with pytest.raises(MoECompressError) as exc:
            load(d)
        msg = _sentence(str(exc.value))
        assert msg.startswith(f"{d / GGUF_FILE} is incomplete: it lacks the tensor '{first}'"), msg
        assert "4 blocks and 16 experts" in msg and "zeros" in msg
    code, _, err = run_cli(["eval", str(up), "--ppl", "fixture-heldout", "--max-tokens", "64"], capsys)
    assert "lacks the tensor 'blk.0.ffn_up_exps.weight'" in _refused(code, err)
    # a tensor every other block has, missing from one block, is named too
    norm = _rewrite(exports / "identity", tmp_path / "norm", lambda n: n == "blk.3.ffn_norm.weight")
    with pytest.raises(MoECompressError, match=r"lacks the tensor 'blk\.3\.ffn_norm\.weight'"):
        load(norm)


def test_compact_and_hf_exports_missing_a_tensor_are_refused(exports, tmp_path):
    """A compact export's fused gate_up_proj and an hf export's q_norm: each missing one is a sentence."""
    from safetensors.torch import load_file, save_file

    for fmt, key, fragment in (
        ("compact", "moecompress.scopes.layer1.gate_up_proj", "lacks tensor"),
        ("hf", "model.layers.0.self_attn.q_norm.weight", "would be initialised at random"),
    ):
        d = tmp_path / fmt
        shutil.copytree(exports / fmt, d)
        tensors = load_file(d / "model.safetensors")
        assert key in tensors
        del tensors[key]
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(MoECompressError) as exc:
            load(d)
        msg = _sentence(str(exc.value))
        assert fragment in msg and (key in msg or fmt == "compact"), msg


class _Answer(io.StringIO):
    """stdin that answers "y" to every question, and records that one was asked."""

    asked = False

    def readline(self, *args):
        type(self).asked = True
        return super().readline(*args)


def _custom_code(d, marker, model_type: str):
    """Give export `d` a config.json naming `model_type` with code of its own (auto_map) that would create
    `marker`, and a tokenizer_config.json whose tokenizer class is that code's too."""
    code = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
    code += "from transformers import PretrainedConfig\n\nclass EvilConfig(PretrainedConfig):\n"
    code += f"    model_type = {model_type!r}\n"
    (d / "evil.py").write_text(code)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(
        model_type=model_type, auto_map={"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.Evil"}
    )
    (d / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((d / "tokenizer_config.json").read_text())
    tok.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil.EvilTokenizer", None]})
    (d / "tokenizer_config.json").write_text(json.dumps(tok))


def test_a_gguf_directorys_code_never_runs_nor_is_offered(exports, tmp_path, capsys, monkeypatch):
    """config.json with auto_map: an unknown model_type is refused in one sentence naming the custom model_type
    (not a corrupt config.json), a known one loads and evaluates with transformers' own classes; stdin answering
    "y" is never read and the directory's module never runs (it would create the marker file)."""
    marker = tmp_path / "code-ran"
    monkeypatch.setattr(sys, "stdin", _Answer("y\n" * 8))
    custom = tmp_path / "custom"
    shutil.copytree(exports / "half", custom)
    _custom_code(custom, marker, "evil_moe")
    code, _, err = run_cli(["eval", str(custom), "--ppl", "fixture-heldout", "--max-tokens", "64"], capsys)
    msg = _refused(code, err)
    assert "custom model_type 'evil_moe'" in msg and "auto_map" in msg and "not a config" not in msg
    known = tmp_path / "known"
    shutil.copytree(exports / "half", known)
    _custom_code(known, marker, "qwen3_moe")
    assert type(load(known)).__name__ == "Qwen3MoeForCausalLM"  # transformers' class, not the directory's
    # its tokenizer_config.json names the directory's tokenizer class: transformers' own reads tokenizer.json
    code, _, err = run_cli(["eval", str(known), "--ppl", "fixture-heldout", "--max-tokens", "64"], capsys)
    assert code == 0 and PROMPT not in err and "Traceback" not in err, err
    assert not marker.exists() and not _Answer.asked


def test_inspect_of_a_pruned_gguf_reports_what_the_file_holds(exports, capsys):
    """8 of 16 experts kept: inspect says 8 and counts the file's bytes (total = its size), not the original's."""
    sizes = {}
    for name, experts in (("identity", 16), ("half", 8)):
        code, out, err = run_cli(["inspect", str(exports / name), "--json"], capsys)
        assert code == 0, err
        info = json.loads(out)
        size = (exports / name / GGUF_FILE).stat().st_size
        assert info["experts_per_layer"] == [experts] and all(
            li["experts"] == experts for li in info["layers"]
        )
        assert info["bytes"]["total"] == size == info["gguf"]["bytes"]
        # bf16 [E, I, H], gate, up and down, 4 layers
        assert info["bytes"]["routed_experts"] == 4 * 3 * experts * 128 * 192 * 2
        sizes[name] = info["bytes"]
    assert sizes["half"]["routed_experts"] * 2 == sizes["identity"]["routed_experts"]
    code, out, err = run_cli(["inspect", str(exports / "half")], capsys)
    assert code == 0 and "Traceback" not in err and "gguf (BF16, F32)" in out


def test_gguf_directories_get_messages_about_what_they_lack(exports, tmp_path, capsys):
    """No tokenizer: said so (not "holds no tokens"); calibrate / compress of a GGUF: no word of pickled .bin."""
    bare = tmp_path / "no-tokenizer"
    shutil.copytree(exports / "half", bare)
    for f in bare.glob("tokenizer*"):
        f.unlink()
    code, _, err = run_cli(["eval", str(bare), "--ppl", "fixture-heldout", "--max-tokens", "64"], capsys)
    msg = _refused(code, err)
    assert "no tokenizer files" in msg and "holds no tokens" not in msg
    args = ["calibrate", str(exports / "half"), "--data", "fixture-calib:4", "--seq-len", "64"]
    code, _, err = run_cli([*args, "--stats", "counts", "--out", str(tmp_path / "stats")], capsys)
    msg = _refused(code, err)
    assert "holds a GGUF" in msg and ".bin" not in msg and "pickled" not in msg
    assert not (tmp_path / "stats").exists()


def test_a_config_json_that_does_not_belong_to_the_gguf_is_refused(exports, tmp_path):
    """config.json edited to another depth or a hidden size of 1e9: refused against the GGUF's own metadata before
    transformers builds (and allocates) the model it describes."""
    for name, edit, fragment in (
        ("layers", {"num_hidden_layers": 2}, "says num_hidden_layers 2 but"),
        ("hidden", {"hidden_size": 10**9}, "says hidden_size 1000000000 but"),
    ):
        d = tmp_path / name
        shutil.copytree(exports / "half", d)
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises(MoECompressError) as exc:
            load(d)
        msg = _sentence(str(exc.value))
        assert fragment in msg and "does not belong to this GGUF" in msg, msg
