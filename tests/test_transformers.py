"""Hugging Face transformers integration: attn_implementation="cupy_attn" against "sdpa" on tiny random models (no
downloads). Skipped when transformers is not installed. CPU tests run the float64 reference through the integration."""
import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cupy_attn.integrations import transformers as cupy_attn_hf  # noqa: E402

cupy_attn_hf.register()

VOCAB = 100


def _llama_config(**kw):
    # GQA: 4 query heads over 2 KV heads, head dim 16
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)


def _bert_config():
    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=128, max_position_embeddings=128)


def _pair(model_cls, config, device="cpu", dtype=torch.float32, seed=0):
    """(ours, sdpa) models with the same random weights, in eval mode. Each gets its own config copy:
    _from_config writes attn_implementation into the config it is given."""
    torch.manual_seed(seed)
    ref = model_cls._from_config(copy.deepcopy(config), attn_implementation="sdpa")
    ours = model_cls._from_config(copy.deepcopy(config), attn_implementation="cupy_attn")
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == "cupy_attn" and ref.config._attn_implementation == "sdpa"
    # .to() rather than from_config's dtype argument, whose name changed across transformers versions
    return ours.to(device, dtype).eval(), ref.to(device, dtype).eval()


def _inputs(device="cpu", B=3, L=11, seed=1):
    """Token ids and a padding mask: row 1 left-padded by 3 (generation's layout), row 2 right-padded by 2."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, -2:] = 0
    return ids.to(device), mask.to(device)


@pytest.fixture
def counted(monkeypatch):
    """Counts calls of our attention function, so a test fails if transformers silently used another one."""
    calls = []
    inner = cupy_attn_hf.attention_forward

    def attention(*args, **kwargs):
        calls.append(args[1].shape)
        return inner(*args, **kwargs)
    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, "cupy_attn", attention)
    return calls


def test_register_makes_the_name_available():
    assert "cupy_attn" in transformers.AttentionInterface._global_mapping
    masking = pytest.importorskip("transformers.masking_utils")
    if hasattr(masking, "AttentionMaskInterface"):
        assert masking.ALL_MASK_ATTENTION_FUNCTIONS["cupy_attn"] is masking.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]


def test_llama_gqa_logits_and_generate_match_sdpa_cpu(counted):
    ours, ref = _pair(transformers.LlamaForCausalLM, _llama_config())
    ids, mask = _inputs()
    with torch.no_grad():
        for m in (None, mask):
            got, want = ours(ids, attention_mask=m).logits, ref(ids, attention_mask=m).logits
            valid = slice(None) if m is None else m.bool()  # padded positions' outputs are unused
            torch.testing.assert_close(got[valid], want[valid], rtol=1e-4, atol=1e-5)
        assert counted, "attention did not go through cupy_attn"
        n_prefill = len(counted)
        got = ours.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want), (got[:, ids.shape[1]:], want[:, ids.shape[1]:])
    assert any(shape[2] == 1 for shape in counted[n_prefill:]), "decode steps (L = 1) were not seen"


def test_bert_padding_mask_matches_sdpa_cpu(counted):
    ours, ref = _pair(transformers.BertModel, _bert_config())
    ids, mask = _inputs()
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).last_hidden_state
        want = ref(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-4, atol=1e-5)
    assert counted


def test_attention_dropout_runs_through_cupy_attn(counted):
    """A model in train() with attention_dropout > 0 runs our dropout (torch's default generator: manual_seed
    reproduces it); eval() passes dropout=0.0 and matches sdpa."""
    ours, ref = _pair(transformers.LlamaForCausalLM, _llama_config(attention_dropout=0.3))
    ids, _ = _inputs()
    ours.train()
    with torch.no_grad():
        torch.manual_seed(4)
        a = ours(ids).logits
        torch.manual_seed(4)
        b = ours(ids).logits
        c = ours(ids).logits
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert counted
    ours.eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-5)


def test_training_with_autograd_falls_back_to_torch_and_keeps_gradients():
    ours, ref = _pair(transformers.LlamaForCausalLM, _llama_config())
    ids, _ = _inputs()
    ours.train()
    ref.train()
    ours(ids, labels=ids).loss.backward()
    ref(ids, labels=ids).loss.backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_llama_compile_fullgraph_cpu():
    torch._dynamo.reset()
    ours, ref = _pair(transformers.LlamaForCausalLM, _llama_config())
    ids, _ = _inputs()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-5)


# --- GPU: fp16 kernels ----------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_llama_fp16_logits_and_fp32_generate_match_sdpa(counted):
    ids, mask = _inputs("cuda", L=67)
    ours, ref = _pair(transformers.LlamaForCausalLM, _llama_config(), "cuda", torch.float16)
    with torch.no_grad():
        for m in (None, mask):
            got, want = ours(ids, attention_mask=m).logits, ref(ids, attention_mask=m).logits
            valid = slice(None) if m is None else m.bool()
            torch.testing.assert_close(got[valid].float(), want[valid].float(), rtol=2e-2, atol=2e-2)
    assert counted
    # Greedy tokens compared in fp32 (exact fp32 in both): fp16 rounding could flip a near tie of a random model.
    ours, ref = _pair(transformers.LlamaForCausalLM, _llama_config(), "cuda", torch.float32)
    with torch.no_grad():
        got = ours.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want), (got[:, ids.shape[1]:], want[:, ids.shape[1]:])


@pytest.mark.gpu
def test_gpu_bert_fp16_padding_mask_matches_sdpa(counted):
    ids, mask = _inputs("cuda", L=67)
    ours, ref = _pair(transformers.BertModel, _bert_config(), "cuda", torch.float16)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).last_hidden_state
        want = ref(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got[mask.bool()].float(), want[mask.bool()].float(), rtol=2e-2, atol=2e-2)
    assert counted


@pytest.mark.gpu
def test_gpu_llama_fp16_compile_fullgraph():
    torch._dynamo.reset()
    ids, _ = _inputs("cuda", L=67)
    ours, ref = _pair(transformers.LlamaForCausalLM, _llama_config(), "cuda", torch.float16)
    compiled = torch.compile(ours, fullgraph=True)
    with torch.no_grad():
        got, want = compiled(ids).logits, ref(ids).logits
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def _train(model, ids, mask, steps=3, lr=1e-2):
    """A few SGD steps of next-token loss; (losses, gradient norms) per step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        norms.append(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))
        losses.append(loss.detach().double())
        opt.step()
    return torch.stack(losses).cpu(), torch.stack(norms).cpu()


def _train_pair(device, dtype):
    ours, ref = _pair(transformers.LlamaForCausalLM, _llama_config(attention_dropout=0.0), device, dtype)
    ours.train(), ref.train()
    ids, mask = _inputs(device)
    return _train(ours, ids, mask), _train(ref, ids, mask)


def test_llama_trains_like_sdpa(counted):
    """Training records our backward (on CPU tensors: the reference math in float64 torch ops): the losses and gradient
    norms of 3 SGD steps match the sdpa implementation's."""
    (loss, norm), (ref_loss, ref_norm) = _train_pair("cpu", torch.float32)
    assert counted, "the cupy_attn attention function was not called"
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-3, atol=1e-5)


@pytest.mark.gpu
def test_gpu_llama_trains_like_sdpa(counted):
    """The same on the GPU in fp32: our kernels forward and backward (the split path: fp32), against torch's sdpa."""
    (loss, norm), (ref_loss, ref_norm) = _train_pair("cuda", torch.float32)
    assert counted
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-3, atol=1e-5)


@pytest.mark.gpu
def test_gpu_llama_fp16_trains_close_to_sdpa(counted):
    """fp16 on the GPU (the fused forward and backward): losses and gradient norms within fp16's rounding of sdpa's."""
    (loss, norm), (ref_loss, ref_norm) = _train_pair("cuda", torch.float16)
    assert counted and torch.isfinite(loss).all() and torch.isfinite(norm).all()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(norm, ref_norm, rtol=5e-2, atol=1e-2)
