"""The calibration loader both peer scripts hand to llm-compressor's `oneshot` (imports nothing from
moecompress: it runs inside the peer virtualenv)."""

from __future__ import annotations


def causal_loader(ids, mask, batch_size: int):
    """Batches whose `attention_mask` is the 4-D additive causal (+ key padding) mask, [B, 1, S, S] float32.

    llm-compressor 0.14.0.1's sequential pipeline traces the model's mask construction with the config
    re-created as a constant, which loses the `eager` attention it forces for calibration; with a 2-D
    all-ones mask `create_causal_mask` then returns None (the sdpa is_causal skip) and the eager attention
    it runs applies no mask at all — bidirectional attention. A 4-D mask is passed through unchanged by
    `create_causal_mask` (its early exit), so the layers see exactly the causal mask inference uses.
    """
    import torch
    from torch.utils.data import DataLoader

    s = ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    neg = torch.finfo(torch.float32).min

    def collate(rows):
        i = torch.stack([r[0] for r in rows])
        m = torch.stack([r[1] for r in rows]).bool()
        allowed = causal[None, None] & m[:, None, None, :]
        return {"input_ids": i, "attention_mask": torch.zeros(allowed.shape).masked_fill(~allowed, neg)}

    return DataLoader(list(zip(ids, mask)), batch_size=batch_size, shuffle=False, collate_fn=collate)


def calibration_data(tokens_file: str, mask: str, batch_size: int):
    """(data for `oneshot`, sequences, sequence length, real tokens) from the shared token-id file: a 2-D-mask
    `Dataset` (llm-compressor as shipped) or the 4-D causal loader above."""
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file

    tokens = load_file(tokens_file)
    ids, attn = tokens["input_ids"].to(torch.int64), tokens["attention_mask"].to(torch.int64)
    n, seq_len = ids.shape
    if mask == "2d":
        data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": attn.tolist()})
    else:
        data = causal_loader(ids, attn, batch_size)
    return data, n, seq_len, int(attn.sum())
