"""Tiny random MoE models of every declared family, built from configs (for tests and benchmarks)."""

from __future__ import annotations

from pathlib import Path

import torch

_COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
               pad_token_id=0)

TINY_CONFIGS: dict[str, dict] = {
    "qwen3_moe": dict(_COMMON, head_dim=8, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True),
    "qwen2_moe": dict(_COMMON, intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "olmoe": dict(_COMMON, intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
    "mixtral": dict(_COMMON, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v2": dict(_COMMON, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
                        q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, head_dim=8,
                        num_key_value_heads=4, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                        routed_scaling_factor=1.5, num_hidden_layers=3),
    "deepseek_v3": dict(_COMMON, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16,
                        q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, head_dim=8,
                        num_key_value_heads=4, n_group=4, topk_group=2, norm_topk_prob=True,
                        routed_scaling_factor=2.5, num_hidden_layers=3),
    "gpt_oss": dict(_COMMON, head_dim=8, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "granitemoe": dict(_COMMON, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2),
}

FAMILY_NAMES = tuple(TINY_CONFIGS)


def tiny_config(model_type: str, **overrides):
    from transformers import AutoConfig

    kwargs = dict(TINY_CONFIGS[model_type], **overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def _randomise_buffers(model: torch.nn.Module, gen: torch.Generator) -> None:
    # zero-initialised router weights / biases would make every routing a tie
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 1 and ("router" in name or ".gate." in name or name.endswith("gate.weight")
                                 or "experts" in name or "sinks" in name):
                scale = 0.1 if "experts" in name else 0.5
                p.copy_(torch.randn(p.shape, generator=gen) * (scale if p.dim() > 1 else 0.1))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=gen) * 0.05)


def tiny_model(model_type: str, seed: int = 0, dtype=torch.float32, **overrides):
    """A random tiny causal LM of `model_type` in eval mode with non-degenerate routers and experts."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=dtype)
    _randomise_buffers(model, torch.Generator().manual_seed(seed))
    return model.eval()


def save_tiny(model_type: str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a tiny model (safetensors) with a byte-level stub tokenizer-free config to `path`."""
    model = tiny_model(model_type, seed=seed, **overrides)
    model.save_pretrained(path)
    return Path(path)


def fixture_dir(name: str) -> Path:
    """Path of a shipped trained fixture ('qwen3-moe-tiny' or 'olmoe-tiny')."""
    return Path(__file__).parent / "fixtures" / name


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """Run `moecompress ARGS` in-process; (exit code, stdout, stderr) captured by pytest's capsys."""
    from .cli import main

    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def block_inputs(adapter, ids) -> dict:
    """{MoE layer: its block's input [N, H]} from one full forward of `adapter.model` on token ids."""
    inputs = {}
    hooks = [adapter.layer(i).block.register_forward_hook(
        lambda m, a, o, i=i: inputs.__setitem__(i, a[0].reshape(-1, a[0].shape[-1]).detach()))
        for i in adapter.moe_layers]
    try:
        with torch.no_grad():
            adapter.model(ids)
    finally:
        for h in hooks:
            h.remove()
    return inputs


def calibrated_tiny(root: str | Path, model_type: str, seed: int, stats: list[str]):
    """A saved tiny model calibrated on 8 x 24 seeded random tokens: (path, store, adapter, block inputs)."""
    from .calibrate import calibrate
    from .data import CalibrationData
    from .models import MoEAdapter, load_model

    root = Path(root)
    path = save_tiny(model_type, root / "model", seed=seed)
    ids = torch.randint(3, 96, (8, 24), generator=torch.Generator().manual_seed(0))
    store = calibrate(str(path), CalibrationData.from_tokens(ids), seq_len=24, out=root / "stats", stats=stats,
                      batch_size=4, dtype="float32", progress=False)
    adapter = MoEAdapter(load_model(str(path), dtype="float32"))
    return path, store, adapter, block_inputs(adapter, ids)


def save_as(src: str | Path, dst: str | Path, dtype: str) -> Path:
    """A copy of checkpoint `src` stored in `dtype` ("float32", "bfloat16"), written by `save_pretrained`
    (tokenizer files copied), e.g. a float32 copy of a bf16 fixture for tests that concern bytes."""
    import shutil

    from transformers import AutoModelForCausalLM

    src, dst = Path(src), Path(dst)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=getattr(torch, dtype))
    model.save_pretrained(str(dst))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return dst
