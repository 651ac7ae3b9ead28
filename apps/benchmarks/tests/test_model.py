import pytest
import torch

from benchmarks.model import MODEL_SIZES, TransformerLM, count_parameters, model_config, random_batch


def test_attention_choices_agree():
    cfg = model_config("tiny", context_length=32)
    torch.manual_seed(0)
    naive = TransformerLM(cfg, attention="naive")
    sdpa = TransformerLM(cfg, attention="sdpa")
    sdpa.load_state_dict(naive.state_dict())
    tokens = random_batch(cfg, 2, 32, "cpu")
    torch.testing.assert_close(naive(tokens), sdpa(tokens), rtol=1e-4, atol=1e-4)


def test_causal_future_tokens_do_not_change_the_past():
    cfg = model_config("tiny", context_length=16)
    model = TransformerLM(cfg)
    tokens = random_batch(cfg, 1, 16, "cpu")
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % cfg.vocab_size
    torch.testing.assert_close(model(tokens)[0, :10], model(changed)[0, :10])
    assert not torch.allclose(model(tokens)[0, 10:], model(changed)[0, 10:])


def test_parameter_count_of_small_matches_its_shape():
    cfg = MODEL_SIZES["small"]
    d, f, n, v = cfg.d_model, cfg.d_ff, cfg.num_layers, cfg.vocab_size
    expected = 2 * v * d + n * (4 * d * d + 3 * d * f + 2 * d) + d
    with torch.device("meta"):
        model = TransformerLM(model_config("small"))
    assert count_parameters(model) == expected


def test_bad_size_and_attention_are_named():
    with pytest.raises(ValueError, match="size="):
        model_config("huge")
    with pytest.raises(ValueError, match="attention="):
        TransformerLM(model_config("tiny"), attention="fast")


def test_the_llama_layout_gets_the_same_logits_from_every_attention():
    """Grouped-query attention in HuggingFace's layout (separate projections, (B, T, H, d) views transposed):
    every attention function, with is_causal or a materialized causal mask, gives naive attention's logits."""
    import torch

    from benchmarks.model import ATTENTION, ModelConfig, forward_flops

    cfg = ModelConfig(d_model=64, d_ff=128, num_layers=2, num_heads=4, num_kv_heads=2, context_length=32)
    tokens = random_batch(cfg, 2, 32, "cpu")
    logits = {}
    for attention in ATTENTION:
        torch.manual_seed(0)
        logits[attention] = TransformerLM(cfg, attention=attention)(tokens)
    for attention, got in logits.items():
        torch.testing.assert_close(got, logits["naive"], msg=attention)
    dense = model_config("tiny", 32)
    assert forward_flops(cfg, 2, 32) < forward_flops(dense, 2, 32)  # (K/V projections of half the width)
    assert MODEL_SIZES["llama-8L"].kv_heads == 4
