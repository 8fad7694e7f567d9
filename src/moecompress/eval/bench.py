"""Memory and latency: bytes on disk, resident parameter bytes, peak memory, prefill/decode tokens per second.

* bytes on disk: every regular file under the checkpoint directory (`atomic.dir_bytes`);
* resident parameter bytes: numel x element size of every parameter and buffer the loaded model
  holds (each storage counted once, so tied embeddings count once; meta tensors count 0);
* peak memory while running a function: on CUDA `torch.cuda.max_memory_allocated` after a reset;
  on CPU the process RSS (psutil), sampled every 2 ms by a thread, minus the RSS before the call
  (sampling can miss a spike shorter than the period; it never over-reports);
* prefill tokens/s = batch x prompt_len / t(forward of the prompt with a KV cache);
  decode tokens/s  = batch x (new_tokens - 1) / (t(generate new_tokens) - t(generate 1 token)),
  greedy, exactly `new_tokens` generated (min = max), after `warmup` untimed runs; the median
  over `repeats` timed runs is reported.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..atomic import dir_bytes


def disk_bytes(path) -> int:
    """Bytes of every regular file under a checkpoint directory (or the size of one file)."""
    p = Path(path)
    return p.stat().st_size if p.is_file() else dir_bytes(p)


def resident_bytes(model) -> int:
    """Bytes held by the model's parameters and buffers (each storage once; meta tensors excluded)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == "meta":
            continue
        key = (t.device, t.untyped_storage().data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def _device(model) -> torch.device:
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def peak_memory(
    fn: Callable[[], Any], device: torch.device | str = "cpu", period: float = 0.002
) -> tuple[Any, dict]:
    """Run fn(); return (its result, {"peak_bytes", "baseline_bytes", "peak_delta_bytes", "kind"})."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        out = fn()
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        return out, dict(
            kind="cuda_allocated", peak_bytes=peak, baseline_bytes=base, peak_delta_bytes=peak - base
        )
    import psutil

    proc = psutil.Process()
    base = proc.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            stop.wait(period)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        out = fn()
    finally:
        stop.set()
        th.join()
    peak[0] = max(peak[0], proc.memory_info().rss)
    return out, dict(kind="cpu_rss", peak_bytes=peak[0], baseline_bytes=base, peak_delta_bytes=peak[0] - base)


@torch.no_grad()
def measure_latency(
    model,
    prompt_len: int = 128,
    new_tokens: int = 32,
    batch_size: int = 1,
    warmup: int = 1,
    repeats: int = 3,
    seed: int = 0,
) -> dict[str, Any]:
    """Median prefill and decode tokens/s of greedy generation with fixed lengths (see module doc)."""
    dev = _device(model)
    ids = _random_prompt(model, dev, batch_size, prompt_len, seed)
    mask = torch.ones_like(ids)
    pad = getattr(model.config, "pad_token_id", None)
    pad = 0 if pad is None else pad

    def prefill():
        model(input_ids=ids, attention_mask=mask, use_cache=True)

    def generate(n: int):
        _generate(model, ids, mask, pad, n)

    for _ in range(warmup):
        prefill()
        generate(new_tokens)
    t_pre = [_timed(dev, prefill) for _ in range(repeats)]
    t_one = [_timed(dev, lambda: generate(1)) for _ in range(repeats)]
    t_all = [_timed(dev, lambda: generate(new_tokens)) for _ in range(repeats)]
    pre, one, full = statistics.median(t_pre), statistics.median(t_one), statistics.median(t_all)
    decode_t = max(full - one, 1e-9)
    return dict(
        device=str(dev),
        batch_size=batch_size,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        warmup=warmup,
        repeats=repeats,
        prefill_s=pre,
        decode_s=decode_t,
        prefill_tok_s=batch_size * prompt_len / pre,
        decode_tok_s=batch_size * (new_tokens - 1) / decode_t if new_tokens > 1 else None,
    )


def _random_prompt(model, dev, batch_size: int, prompt_len: int, seed: int) -> torch.Tensor:
    """Random token ids [batch_size, prompt_len] (from id 3 up, drawn with `seed`) on `dev`."""
    vocab = int(
        model.config.get_text_config().vocab_size
        if hasattr(model.config, "get_text_config")
        else model.config.vocab_size
    )
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch_size, prompt_len), generator=gen).to(dev)


def _timed(dev, fn) -> float:
    """Seconds `fn()` takes on `dev`, synchronised before and after."""
    _sync(dev)
    t = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t


def _generate(model, ids, mask, pad, n: int) -> None:
    """Greedy generation of exactly `n` new tokens after `ids` (no end-of-sequence stop)."""
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=pad,
        eos_token_id=None,
    )


def benchmark(
    model,
    path=None,
    prompt_len: int = 128,
    new_tokens: int = 32,
    batch_size: int = 1,
    warmup: int = 1,
    repeats: int = 3,
) -> dict[str, Any]:
    """Bytes on disk (when `path`), resident parameter bytes, peak memory and latency in one dict.

    Fills an arm's ``bytes`` ({"disk", "resident"}), ``memory`` and ``latency`` fields.
    """
    dev = _device(model)
    lat, mem = peak_memory(
        lambda: measure_latency(model, prompt_len, new_tokens, batch_size, warmup, repeats), dev
    )
    out = {"bytes": {"resident": resident_bytes(model)}, "memory": mem, "latency": lat}
    if path is not None:
        out["bytes"]["disk"] = disk_bytes(path)
    return out
