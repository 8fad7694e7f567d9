"""Runs inside llama.cpp (llama-cpp-python's ctypes bindings), in a virtualenv of its own: numpy and llama_cpp only,
nothing from moecompress. Started by benchmarks/bench_gguf_llamacpp.py, one fresh process per measurement.

    python child.py logits MODEL.gguf IDS.npy OUT.npy [--threads 2] [--batch 0]
        IDS.npy: int32 [windows, tokens]. Each window is evaluated from an empty context (token ids fed directly,
        no tokenizer), every position's logits kept: OUT.npy float32 [windows, tokens, vocab]. --batch: tokens per
        llama_decode call (0: the whole window in one; 1: one at a time, as generation runs, through llama.cpp's
        matrix-vector kernels instead of its matrix-matrix ones).
    python child.py speed MODEL.gguf PROMPT.npy OUT.json [--decode 128] [--threads 2]
        One warm-up, then the prompt (int32 [tokens]) in one batch, then greedy decoding: llama.cpp's own timers
        (llama_perf_context) and the wall clock around the same calls, and the process's peak RSS.
    python child.py info - - -                      the bindings' version and llama.cpp's CPU features
    python child.py quantize IN.gguf - OUT.gguf     llama.cpp's own quantizer, to Q4_0
--extra-bufts on|off: llama.cpp's extra CPU buffer types (repacking, AMX), its default on.

Each prints one JSON line describing the model as llama.cpp loaded it.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time


def _extra_bufts(on: bool) -> None:
    """llama.cpp's extra CPU buffer types (weight repacking, and the AMX kernels where the CPU has AMX) on or off:
    the `use_extra_bufts` model parameter, which llama-cpp-python's `Llama` does not expose, set on its defaults."""
    import llama_cpp.llama_cpp as lc

    defaults = lc.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = on
        return p

    lc.llama_model_default_params = params


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def _describe(m) -> dict:
    import llama_cpp

    buf = __import__("ctypes").create_string_buffer(256)
    llama_cpp.llama_model_desc(m.model, buf, 256)
    return dict(
        desc=buf.value.decode(),
        n_params=int(llama_cpp.llama_model_n_params(m.model)),
        model_size=int(llama_cpp.llama_model_size(m.model)),
        n_vocab=int(m.n_vocab()),
        llama_cpp_python=llama_cpp.__version__,
        system_info=llama_cpp.llama_print_system_info().decode().strip(),
    )


def logits(args) -> None:
    import numpy as np
    from llama_cpp import Llama

    ids = np.load(args.ids)
    w, t = ids.shape
    batch = args.batch or t
    m = Llama(
        model_path=args.model,
        n_ctx=t,
        n_batch=batch,
        n_ubatch=batch,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=True,
        verbose=False,
    )
    out = np.empty((w, t, m.n_vocab()), dtype=np.float32)
    for i in range(w):
        m.reset()
        m.eval([int(x) for x in ids[i]])
        out[i] = m.scores[:t]
    np.save(args.out, out)
    print(json.dumps(_describe(m)))


def speed(args) -> None:
    import llama_cpp
    import numpy as np

    rss_start = _status_kb("VmRSS") * 1024
    prompt = [int(x) for x in np.load(args.ids)]
    t0 = time.perf_counter()
    m = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=len(prompt) + args.decode + 8,
        n_batch=len(prompt),
        n_ubatch=len(prompt),
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=False,
        verbose=False,
    )
    load_s = time.perf_counter() - t0
    rss_loaded = _status_kb("VmRSS") * 1024
    m.eval(prompt[:8])  # warm-up: first-call allocations and page faults kept out of the timings
    llama_cpp.llama_synchronize(m.ctx)  # llama.cpp adds a decode's time to its counters here
    m.reset()
    p0 = llama_cpp.llama_perf_context(m.ctx)  # llama.cpp's counters, read around each phase
    t0 = time.perf_counter()
    m.eval(prompt)
    llama_cpp.llama_synchronize(m.ctx)
    prompt_wall = time.perf_counter() - t0
    p1 = llama_cpp.llama_perf_context(m.ctx)
    tokens = []
    t0 = time.perf_counter()
    n_vocab = m.n_vocab()
    for _ in range(args.decode):  # greedy: the last position's logits, as llama.cpp holds them
        tok = int(
            np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(m.ctx, -1), shape=(n_vocab,)))
        )
        tokens.append(tok)
        m.eval([tok])
    llama_cpp.llama_synchronize(m.ctx)
    decode_wall = time.perf_counter() - t0
    p2 = llama_cpp.llama_perf_context(m.ctx)
    n_p, t_p = p1.n_p_eval - p0.n_p_eval, (p1.t_p_eval_ms - p0.t_p_eval_ms) / 1000
    n_d, t_d = p2.n_eval - p1.n_eval, (p2.t_eval_ms - p1.t_eval_ms) / 1000
    res = dict(
        model=_describe(m),
        threads=args.threads,
        prompt_tokens=len(prompt),
        decode_tokens=args.decode,
        load_s=load_s,
        prompt_tok_s=n_p / t_p,
        decode_tok_s=n_d / t_d,
        prompt_tok_s_wall=len(prompt) / prompt_wall,
        decode_tok_s_wall=args.decode / decode_wall,
        n_p_eval=n_p,
        n_eval=n_d,
        rss_start=rss_start,
        rss_loaded=rss_loaded,
        # the process's peak RSS: VmHWM, which execve resets (ru_maxrss does not: it keeps the parent's peak)
        peak_rss=_status_kb("VmHWM") * 1024,
        ru_maxrss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        greedy=tokens,
    )
    with open(args.out, "w") as fh:
        json.dump(res, fh)
    print(json.dumps(res["model"]))


def info(args) -> None:
    import llama_cpp

    print(
        json.dumps(
            dict(
                llama_cpp_python=llama_cpp.__version__,
                system_info=llama_cpp.llama_print_system_info().decode().strip(),
            )
        )
    )


def quantize(args) -> None:
    """llama.cpp's own quantizer (llama_model_quantize), MODEL -> OUT as Q4_0 (IDS unused)."""
    import ctypes

    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    p.nthread = args.threads
    rc = llama_cpp.llama_model_quantize(args.model.encode(), args.out.encode(), ctypes.byref(p))
    if rc != 0:
        sys.exit(f"llama_model_quantize failed ({rc})")
    print(json.dumps(dict(quantized=args.out)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["logits", "speed", "info", "quantize"])
    ap.add_argument("model")
    ap.add_argument("ids")
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--extra-bufts", choices=["on", "off"], default="on")
    args = ap.parse_args()
    _extra_bufts(args.extra_bufts == "on")
    dict(logits=logits, speed=speed, info=info, quantize=quantize)[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
