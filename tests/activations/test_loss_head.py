"""The fused loss head (lazyzero/activations/loss_head.py) against transformers' own causal-LM loss."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lazyzero.activations import ActivationPacker, ActivationPolicy, loss_head
from lazyzero.activations.config import ActivationsConfig

VOCAB, HIDDEN = 1000, 64


def tiny_llama(dtype=torch.float32, tied=True, **extra) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, tie_word_embeddings=tied, **extra)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype).train()


def batch(seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 40), generator=generator)
    labels = ids.clone()
    labels[0, :15] = loss_head.IGNORE_INDEX  # a prompt that is not predicted
    labels[2, -5:] = loss_head.IGNORE_INDEX
    return ids, labels


def loss_and_gradients(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kwargs)
    (out.loss * 2.5).backward()  # a loss scale: backward must scale the gradients made in forward
    return out, {name: param.grad.clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("chunk_elements, grad_chunk_elements", [
    (loss_head.CHUNK_ELEMENTS, loss_head.GRAD_CHUNK_ELEMENTS), (7 * VOCAB, loss_head.GRAD_CHUNK_ELEMENTS),
    (3 * VOCAB, 50 * VOCAB)], ids=["one-chunk", "softmax-chunks-of-7", "matmul-chunks-of-50"])
def test_fused_loss_and_gradients_equal_transformers(monkeypatch, tied, chunk_elements, grad_chunk_elements):
    """Over 120 tokens: one chunk; softmax chunks of 7 tokens inside one matmul chunk; matmul chunks
    of 50 tokens (three, the weight gradient summed in fp32), each of softmax chunks of 3."""
    monkeypatch.setattr(loss_head, "CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(loss_head, "GRAD_CHUNK_ELEMENTS", grad_chunk_elements)
    model, (ids, labels) = tiny_llama(tied=tied), batch()
    plain, plain_grads = loss_and_gradients(model, ids, labels)
    assert loss_head.install_fused_loss(model)
    fused, fused_grads = loss_and_gradients(model, ids, labels)
    assert fused.logits is None
    torch.testing.assert_close(fused.loss, plain.loss, rtol=1e-6, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)
    # num_items_in_batch (the HF Trainer's count over accumulated micro-batches) divides the sum.
    loss_head.remove_fused_loss(model)
    plain, plain_grads = loss_and_gradients(model, ids, labels, num_items_in_batch=200)
    loss_head.install_fused_loss(model)
    fused, fused_grads = loss_and_gradients(model, ids, labels, num_items_in_batch=200)
    torch.testing.assert_close(fused.loss, plain.loss, rtol=1e-6, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_fused_loss_in_bf16_is_as_close_to_fp32_as_transformers():
    ids, labels = batch()
    _, exact = loss_and_gradients(tiny_llama(torch.float32), ids, labels)
    model = tiny_llama(torch.bfloat16)
    _, plain = loss_and_gradients(model, ids, labels)
    loss_head.install_fused_loss(model)
    _, fused = loss_and_gradients(model, ids, labels)

    def error(grads):
        return max(float((grads[n].float() - g).norm() / g.norm()) for n, g in exact.items())

    assert error(fused) <= 1.5 * error(plain)


def test_evaluation_generation_and_calls_without_labels_keep_the_logits():
    model, (ids, labels) = tiny_llama(), batch()
    loss_head.install_fused_loss(model)
    assert model(input_ids=ids).logits.shape == (3, 40, VOCAB)
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
    assert out.logits is not None and out.loss is not None
    model.eval()  # a model loaded with from_pretrained is in eval mode: training it still fuses
    assert model(input_ids=ids, labels=labels).logits is None
    assert model.lm_head(torch.zeros(2, HIDDEN)).shape == (2, VOCAB)


def test_models_it_cannot_reproduce_keep_their_forward():
    assert not loss_head.install_fused_loss(tiny_llama(mlp_bias=False, final_logit_softcapping=30.0))
    biased = tiny_llama(tied=False)
    biased.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=True)
    assert not loss_head.supports_fused_loss(biased)
    assert not loss_head.supports_fused_loss(torch.nn.Linear(4, 4))


def test_the_packer_installs_it_by_default_and_removes_it():
    model, (ids, labels) = tiny_llama(), batch()
    packer = ActivationPacker(model, ActivationPolicy(ActivationsConfig(enabled=True)))
    with packer:
        out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    assert out.logits is None
    # Outside the decoder layers: the embedding's token ids (int64); the head holds its hidden-state and
    # weight gradients, not the fp32 logits transformers would keep, and at the default 8 bits.
    by_kind = packer.accounting.by_kind()
    assert by_kind[None].after == 8 * ids.numel()
    held = 4 * (ids.numel() * HIDDEN + VOCAB * HIDDEN)
    assert by_kind["head"].before == held < 4 * ids.numel() * VOCAB
    assert by_kind["head"].after == 4 * ids.numel() * HIDDEN + packed_fp32_bytes(VOCAB * HIDDEN)
    packer.remove()
    assert "forward" not in model.__dict__ and model(input_ids=ids, labels=labels).logits is not None
    off = ActivationPacker(model, ActivationPolicy(ActivationsConfig(enabled=True, fused_loss=False)))
    assert not off.fused_loss and "forward" not in model.__dict__
    off.remove()


@pytest.mark.parametrize("default_bits", [8, 16])
def test_the_heads_held_gradients_follow_the_default_width(default_bits):
    """What the fused head holds for backward is stored at `default_bits` (kept exact at 16), and at 8
    bits the model's gradients stay within the packing's own error."""
    model, (ids, labels) = tiny_llama(), batch()
    config = ActivationsConfig(enabled=True, default_bits=default_bits, norm_bits=16, attention_bits=16,
                               overrides={"model.*": 16})
    packer = ActivationPacker(model, ActivationPolicy(config))
    with packer:
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    packed = {name: param.grad.clone() for name, param in model.named_parameters()}
    head = packer.accounting.by_kind()["head"]
    packer.remove()
    model.zero_grad()
    model(input_ids=ids, labels=labels).loss.backward()
    for name, param in model.named_parameters():
        if default_bits == 16:
            assert torch.allclose(packed[name], param.grad, rtol=1e-5, atol=1e-7), name
        else:
            cosine = torch.nn.functional.cosine_similarity(packed[name].flatten(), param.grad.flatten(), dim=0)
            assert cosine > 0.999, (name, float(cosine))
    # The weight gradient at the default width; the hidden states' gradient always exact.
    weight_bytes = packed_fp32_bytes(VOCAB * HIDDEN) if default_bits == 8 else 4 * VOCAB * HIDDEN
    assert head.after == 4 * ids.numel() * HIDDEN + weight_bytes


def packed_fp32_bytes(numel: int, block: int = 64) -> int:
    """8-bit codes, and per block an fp32 scale, the fp32 outlier and its one-byte index."""
    return numel + -(-numel // block) * (4 + 4 + 1)
