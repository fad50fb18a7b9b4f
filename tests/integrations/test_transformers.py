"""attn_implementation="fagen" in Hugging Face transformers' own modeling code, on the emulator.

Small configs with random weights (no download): Llama (GQA), Mistral (sliding window), Gemma 2
(softcap, alternating sliding and global layers), Qwen2, gpt-oss (sinks). For each:
- logits, fagen against eager in bf16 and fp16, within FlashAttention-2's rule against a float64
  eager run of the same weights (fagen's error at most 2x eager's, plus a floor);
- one training step's parameter gradients, likewise (3x);
- greedy `generate` on a left-padded batch of two prompts of different lengths: eager's tokens;
- a packed batch of three documents (padding-free: position_ids restart at 0) equal to running
  each document alone.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
import fagen.integrations.transformers  # noqa: E402,F401  (registers "fagen")

VOCAB, LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, WINDOW = 96, 2, 64, 4, 2, 16, 8
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=256,
              initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=None)


def configs() -> dict:
    return {
        "llama": transformers.LlamaConfig(**COMMON),
        "mistral": transformers.MistralConfig(**COMMON, sliding_window=WINDOW),
        "gemma2": transformers.Gemma2Config(**COMMON, sliding_window=WINDOW, attn_logit_softcapping=5.0,
                                            final_logit_softcapping=None, query_pre_attn_scalar=24,
                                            layer_types=["sliding_attention", "full_attention"]),
        "qwen2": transformers.Qwen2Config(**COMMON, use_sliding_window=False),
        "gpt_oss": transformers.GptOssConfig(**COMMON, sliding_window=WINDOW, num_local_experts=4,
                                             num_experts_per_tok=2,
                                             layer_types=["sliding_attention", "full_attention"]),
    }


MODELS = list(configs())
ABS_FLOOR = 1e-5


def build(name: str, implementation: str, dtype, seed: int = 0):
    torch.manual_seed(seed)
    config = configs()[name]
    extra = {"experts_implementation": "eager"} if name == "gpt_oss" else {}   # float64 runs: no grouped_mm
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", **extra)
    if name == "gpt_oss":   # sinks start at zero; make them matter
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    model = model.to(dtype)
    model.set_attn_implementation(implementation)
    return model


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch, length), generator=gen)


def max_error(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", MODELS)
def test_logits_within_flash_attention_2s_rule(name, dtype):
    ids = tokens(2, 20)   # longer than the window: the sliding layers cut keys
    exact = build(name, "eager", torch.float64)(ids).logits
    fagen_logits = build(name, "fagen", dtype)(ids).logits
    eager_logits = build(name, "eager", dtype)(ids).logits
    assert torch.isfinite(fagen_logits).all()
    fagen_err, eager_err = max_error(fagen_logits, exact), max_error(eager_logits, exact)
    assert fagen_err <= 2 * eager_err + ABS_FLOOR, f"fagen {fagen_err:.3g} vs eager {eager_err:.3g}"


def _gradients(model, ids):
    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", MODELS)
def test_training_step_gradients_within_the_rule(name, dtype):
    ids = tokens(2, 20, seed=2)
    exact = _gradients(build(name, "eager", torch.float64), ids)
    mine = _gradients(build(name, "fagen", dtype), ids)
    eager = _gradients(build(name, "eager", dtype), ids)
    assert set(mine) == set(exact)
    if name == "gpt_oss":
        assert any("sinks" in n for n in mine), "the sinks get a gradient"
    worst = max(max_error(mine[n], exact[n]) / max(max_error(eager[n], exact[n]), ABS_FLOOR) for n in exact)
    assert worst <= 3.0, f"worst parameter gradient error {worst:.2f}x eager's"


@pytest.mark.parametrize("name", MODELS)
def test_generate_on_a_left_padded_batch_gives_eagers_tokens(name):
    prompts = tokens(2, 11, seed=3)
    mask = torch.ones_like(prompts)
    prompts[1, :4], mask[1, :4] = 0, 0   # the second prompt is 7 tokens, left-padded
    runs = {}
    for implementation in ("eager", "fagen"):
        model = build(name, implementation, torch.float16).eval()
        runs[implementation] = model.generate(prompts, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                              pad_token_id=0)
    assert torch.equal(runs["fagen"], runs["eager"]), f"{runs['fagen']} vs {runs['eager']}"


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", MODELS)
def test_a_padded_batch_equals_each_prompt_alone(name, side):
    """The (B, N) padding mask reaches fagen as key padding (through flash_attn_varlen_func): each
    prompt's logits at its real positions equal the prompt run alone."""
    model = build(name, "fagen", torch.bfloat16).eval()
    long, short = tokens(1, 14, seed=4), tokens(1, 9, seed=5)
    pad = torch.zeros(1, 5, dtype=torch.long)
    padded = torch.cat([short, pad], 1) if side == "right" else torch.cat([pad, short], 1)
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1] = torch.cat([torch.ones(9), torch.zeros(5)]) if side == "right" else \
        torch.cat([torch.zeros(5), torch.ones(9)])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)   # each prompt's tokens at 0, 1, ... as when alone
    with torch.no_grad():
        batch = model(torch.cat([long, padded]), attention_mask=mask, position_ids=positions).logits
        alone = [model(long).logits[0], model(short).logits[0]]
    real = slice(0, 9) if side == "right" else slice(5, 14)
    for got, want in ((batch[0], alone[0]), (batch[1, real], alone[1])):
        assert max_error(got, want) <= 1e-2 * want.abs().max().item(), f"{side} padding leaks into the prompt"


@pytest.mark.parametrize("name", MODELS)
def test_packed_documents_equal_each_document_alone(name):
    lengths = [5, 9, 12]
    model = build(name, "fagen", torch.bfloat16).eval()
    docs = [tokens(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    packed_ids = torch.cat(docs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(packed_ids, position_ids=position_ids).logits[0]
        alone = torch.cat([model(doc).logits[0] for doc in docs])
    assert max_error(packed, alone) <= 2e-2 * alone.abs().max().item(), "packed documents see each other"


def test_every_attention_layer_runs_on_fagen(monkeypatch):
    """from_config(..., attn_implementation="fagen") dispatches each layer's attention to fagen:
    plain batches to flash_attn_func, padded ones to flash_attn_varlen_func."""
    from fagen.integrations import transformers as integration

    calls = []

    def spy(name, real):
        def counted(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return counted

    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        monkeypatch.setattr(integration, name, spy(name, getattr(integration, name)))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(configs()["mistral"], attn_implementation="fagen")
    model = model.to(torch.bfloat16)
    assert model.config._attn_implementation == "fagen"
    ids = tokens(2, 20)
    model(ids)
    model(ids, attention_mask=torch.ones_like(ids).index_fill_(1, torch.tensor([0]), 0))
    assert calls == ["flash_attn_func"] * LAYERS + ["flash_attn_varlen_func"] * LAYERS


def test_a_mask_fagen_cannot_honour_is_an_error():
    model = build("llama", "fagen", torch.bfloat16)
    ids = tokens(1, 6)
    dense = torch.zeros(1, 1, 6, 6)   # an arbitrary float mask
    with pytest.raises(ValueError, match="attn_implementation='sdpa' or 'eager'"):
        model(ids, attention_mask=dense)
    with pytest.raises(ValueError, match="position_bias"):
        fagen.integrations.transformers.attention_forward(
            model.model.layers[0].self_attn, *(torch.zeros(1, 4, 6, HEAD_DIM, dtype=torch.bfloat16) for _ in range(3)),
            None, position_bias=torch.zeros(1, 4, 6, 6))


@pytest.mark.parametrize("via", ["cu_seq_lens", "position_ids"])
def test_packed_kwargs_reach_flash_attn_varlen_func(via):
    """The attention function alone, as the models call it (query (1, H, N, d)): the documents
    of a packed row attend only within themselves, given by cu_seq_lens_* / max_length_* or by
    position_ids restarting at 0."""
    from fagen.integrations.transformers import attention_forward

    lengths = [5, 9, 12]
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, sum(lengths), HEAD_DIM, generator=gen).to(torch.bfloat16)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    cu = torch.tensor([0, 5, 14, 26], dtype=torch.int32)
    kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12) if via == "cu_seq_lens" \
        else dict(position_ids=torch.cat([torch.arange(n) for n in lengths])[None])
    module = torch.nn.Module()
    out, weights = attention_forward(module, q, k, v, None, is_causal=True, **kwargs)
    assert weights is None and out.shape == (1, sum(lengths), HEADS, HEAD_DIM)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = fagen.flash_attn_func(*(t[:, :, a:b].transpose(1, 2) for t in (q, k, v)), causal=True)
        assert max_error(out[:, a:b], alone) == 0.0, "a document sees another"


@pytest.mark.parametrize("name", ["llama", "gpt_oss"])
def test_fp32_model_under_autocast_within_the_rule_against_eager(name):
    """fp32 master weights under torch.autocast(bf16), the usual mixed precision: rotary
    embeddings hand fp32 q and k to attention, which runs in bf16 as in transformers'
    flash_attention_2. Logits and parameter gradients against eager under the same autocast."""
    ids = tokens(2, 20, seed=6)
    exact_model = build(name, "eager", torch.float64)
    exact_logits, exact_grads = exact_model(ids).logits, _gradients(exact_model, ids)
    runs = {}
    for implementation in ("fagen", "eager"):
        model = build(name, implementation, torch.float32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids).logits
            runs[implementation] = (logits, _gradients(model, ids))
    assert runs["fagen"][0].dtype == runs["eager"][0].dtype
    fagen_err, eager_err = (max_error(runs[i][0], exact_logits) for i in ("fagen", "eager"))
    assert fagen_err <= 2 * eager_err + ABS_FLOOR, f"fagen {fagen_err:.3g} vs eager {eager_err:.3g}"
    mine, eager = runs["fagen"][1], runs["eager"][1]
    assert set(mine) == set(exact_grads) and all(g.dtype == torch.float32 for g in mine.values())
    worst = max(max_error(mine[n], exact_grads[n]) / max(max_error(eager[n], exact_grads[n]), ABS_FLOOR)
                for n in exact_grads)
    assert worst <= 3.0, f"worst parameter gradient error {worst:.2f}x eager's"


def test_fp32_activations_take_the_models_half_dtype_or_are_a_clear_error():
    """Without autocast an fp32 query runs in the dtype of the model's Linear weights (fp32 layer
    norms in a bf16 model, as PEFT leaves them); an all-fp32 model is told what to do."""
    from fagen.integrations.transformers import attention_forward

    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, h, 12, HEAD_DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    module = torch.nn.Module()
    module.proj = torch.nn.Linear(HEAD_DIM, HEAD_DIM, dtype=torch.bfloat16)
    out, _ = attention_forward(module, q, k, v, None, is_causal=True)
    half = (t.to(torch.bfloat16).transpose(1, 2) for t in (q, k, v))
    assert out.dtype == torch.bfloat16 and torch.equal(out, fagen.flash_attn_func(*half, causal=True))
    model = build("llama", "fagen", torch.float32)
    with pytest.raises(TypeError, match=r"float16 or bfloat16.*torch\.autocast"):
        model(tokens(1, 6))
