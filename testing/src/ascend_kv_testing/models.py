# SPDX-License-Identifier: Apache-2.0
"""Tiny random-weight models (a Llama, an MLA DeepSeek-V3, a hybrid state-space Qwen3-Next) and
a small tokenizer, made locally (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: Shape of the default tiny model: 2 layers, 2 KV heads of 64 (fast on 2 CPU cores).
TINY_LLAMA = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=4096, initializer_range=0.08)


def tiny_llama_block_bytes(block_size: int, dtype_bytes: int = 4) -> int:
    """KV bytes of one block of :data:`TINY_LLAMA` (float32 by default): layers x (K and V)
    x KV heads x tokens x head dim x bytes a value."""
    return int(TINY_LLAMA["num_hidden_layers"] * 2 * TINY_LLAMA["num_key_value_heads"]
               * block_size * TINY_LLAMA["head_dim"] * dtype_bytes)


def make_tiny_llama(path: Path, *, seed: int = 0, dtype: str = "float32", **overrides: object) -> Path:
    """Save a random ``LlamaForCausalLM`` to ``path`` (idempotent) and return ``path``.

    ``initializer_range=0.08`` keeps greedy outputs varied (with 0.02 they
    collapse into one repeated token, which makes token checks weak).
    """
    path = Path(path)
    marker = path / "config.json"
    spec = {**TINY_LLAMA, **overrides, "seed": seed, "dtype": dtype}
    stamp = path / ".spec.json"
    if marker.exists() and stamp.exists() and json.loads(stamp.read_text()) == spec:
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY_LLAMA, **overrides})
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(path)
    stamp.write_text(json.dumps(spec))
    return path


#: Shape of the tiny MLA model (DeepSeek-V3 attention): one latent of 512 + 64 = 576 values a
#: token (the only latent size vLLM's CPU MLA kernels take), every MLP dense: vLLM expects an
#: ``e_score_correction_bias`` that transformers does not save for MoE gates.
TINY_DEEPSEEK = dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                     q_lora_rank=None, max_position_embeddings=4096,
                     initializer_range=0.08)


def mla_backend() -> str:
    """The MLA attention backend vLLM CPU picks on this machine: ``AMX_MLA`` where the CPU
    has AMX tiles (bf16 only, any block size multiple of 32, prefix caching on), else the
    reference ``CPU_MLA`` (block size forced to 16, prefix caching and chunked prefill off)."""
    import torch

    return "AMX_MLA" if torch.cpu._is_amx_tile_supported() else "CPU_MLA"


def mla_engine() -> dict[str, Any]:
    """``vllm.LLM`` overrides for the tiny MLA model on this machine's backend
    (:func:`mla_backend`): bfloat16 (``AMX_MLA`` refuses float32), block size 128 on
    ``AMX_MLA``, 16 on ``CPU_MLA`` (the only size its decode kernel takes)."""
    return dict(dtype="bfloat16", block_size=128 if mla_backend() == "AMX_MLA" else 16)


def make_tiny_deepseek(path: Path, *, seed: int = 0, **overrides: object) -> Path:
    """Save a random ``DeepseekV3ForCausalLM`` (MLA attention, dense MLPs) to ``path``
    (idempotent) and return ``path``. Serve it with :func:`mla_engine`.

    ``first_k_dense_replace`` follows ``num_hidden_layers`` unless given.
    """
    path = Path(path)
    cfg_kw = {**TINY_DEEPSEEK, **overrides}
    cfg_kw.setdefault("first_k_dense_replace", cfg_kw["num_hidden_layers"])
    spec = {**cfg_kw, "seed": seed, "arch": "DeepseekV3ForCausalLM"}
    stamp = path / ".spec.json"
    if (path / "config.json").exists() and stamp.exists() and json.loads(
            stamp.read_text()) == spec:
        return path
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg_kw))
    model.save_pretrained(path)
    stamp.write_text(json.dumps(spec))
    return path


_CORPUS = """KV cache transfer moves attention keys and values between instances.
Prefill computes the prompt; decode generates one token at a time.
A pool keeps prefix blocks so that a repeated prompt skips its prefill.
The quick brown fox jumps over the lazy dog, again and again, in many sentences.
Ascend NPUs, CUDA GPUs and CPUs all run the same connector code behind a device layer.
"""


def make_tokenizer(path: Path, *, vocab_size: int = 1024) -> Path:
    """Train a small byte-level BPE tokenizer on a built-in corpus and save it in ``path``.

    The result loads with ``transformers.AutoTokenizer`` (and so with ``vllm serve``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if (path / "tokenizer.json").exists():
        return path
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 50, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return path


def make_served_llama(path: Path) -> tuple[Path, int]:
    """A tiny Llama beside a tokenizer trained here (``vllm serve`` wants one), its ids within
    the tokenizer's vocabulary; the directory and the vocabulary's size."""
    from transformers import AutoTokenizer

    make_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    make_tiny_llama(path, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                    eos_token_id=tok.eos_token_id)
    return Path(path), len(tok)


#: Qwen3-Next shape: layers 0 and 2 Gated DeltaNet ("linear_attention", one state per
#: request), 1 and 3 full attention. Constraints met on vLLM 0.32 CPU: the GDN kernel takes
#: bfloat16 only ("CPU GDN attention requires BF16") and linear head dims 64 or 128 (32 gives
#: "Unexpected head dim size, 32"); vLLM's Qwen3Next needs at least one MoE layer
#: ("No Qwen3Next layer found"), so layer 0 has 4 experts, the rest dense MLPs. 4 KV heads of
#: 64 make the attention page (32 tokens x 4 heads x (K+V) 128 x 2 bytes = 32 KiB) cover the
#: GDN state (conv 3x256 + ssm 2x64x64, bf16 = 17,920 bytes), so block_size 32 stays 32.
TINY_QWEN3_NEXT = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, head_dim=64,
    linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, mlp_only_layers=[1, 2, 3],
    max_position_embeddings=4096, initializer_range=0.08, tie_word_embeddings=False)


def make_tiny_qwen3_next(path: Path, *, seed: int = 0, **overrides: object) -> Path:
    """Save a random bfloat16 ``Qwen3NextForCausalLM`` to ``path`` (idempotent) and return
    ``path``. Serve it with :func:`qwen3_next_engine`."""
    path = Path(path)
    kw = {**TINY_QWEN3_NEXT, **overrides}
    spec = {**kw, "seed": seed, "arch": "Qwen3NextForCausalLM"}
    stamp = path / ".spec.json"
    if (path / "config.json").exists() and stamp.exists() and json.loads(
            stamp.read_text()) == spec:
        return path
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**kw)).to(torch.bfloat16)
    model.save_pretrained(path)
    stamp.write_text(json.dumps(spec))
    return path


def qwen3_next_engine() -> dict[str, Any]:
    """``vllm.LLM`` overrides for :func:`make_tiny_qwen3_next` (on top of engine_kwargs):
    bfloat16 (the CPU GDN kernel refuses float32), block size 32, the hybrid manager on, and
    the SSM state dtype pinned (with "auto" an AVX-512-BF16 host resets it to float32, which
    changes the page size, the block size (to 64+) and the tokens)."""
    return dict(dtype="bfloat16", block_size=32, mamba_ssm_cache_dtype="bfloat16",
                disable_hybrid_kv_cache_manager=False)


def hybrid_kv_cache_config(groups: int = 2, *, block_size: int = 16, num_blocks: int = 8) -> Any:
    """vLLM's ``KVCacheConfig`` of a model with full-attention and sliding-window layers
    under the hybrid KV cache manager (``groups`` 1: the full-attention group alone)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64,
                             dtype=torch.float32)
    window = SlidingWindowSpec(block_size=block_size, num_kv_heads=2, head_size=64,
                               dtype=torch.float32, sliding_window=128)
    specs = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in (0, 2)], full),
             KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in (1, 3)], window)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=specs[:groups])
