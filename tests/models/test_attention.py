"""Attention backends: a packed row gives each conversation the losses and gradients it has alone, and every
backend (sdpa, flex, varlen) computes the same thing; the ones a device cannot run fail clearly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from maester.config import ModelConfig
from maester.models.build import build_model, build_on_meta, resolve_args
from maester.models.layers import document_offsets, resolve_attention

CPU = torch.device("cpu")
BYTE_VOCAB = 269
IGNORE = -100
def needs_cuda(test):
    """Runs on a GPU only (the GPU check runs `-m cuda`)."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


def tiny_model(attention: str = "auto", device: torch.device = CPU, seed: int = 0, **overrides) -> torch.nn.Module:
    cfg = ModelConfig(flavor="tiny", attention=attention, overrides=overrides)
    return build_model(cfg, BYTE_VOCAB, device, seed).eval()


def conversations(lengths, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def shifted_labels(tokens: torch.Tensor) -> torch.Tensor:
    """Next-token labels of one conversation; its last token has none."""
    return torch.cat((tokens[1:], torch.tensor([IGNORE])))


def pack(convs: list[torch.Tensor], seq: int):
    """Conversations in order into rows of `seq` tokens (a new row when the next does not fit), padded with
    document id -1 and no labels. Returns the row tensors and each conversation's (row, start)."""
    rows, places, used = [[]], [], 0
    for c in convs:
        if used + len(c) > seq:
            rows.append([])
            used = 0
        places.append((len(rows) - 1, used))
        rows[-1].append(c)
        used += len(c)
    n = len(rows)
    input_ids = torch.zeros(n, seq, dtype=torch.long)
    labels = torch.full((n, seq), IGNORE)
    position_ids = torch.zeros(n, seq, dtype=torch.long)
    document_ids = torch.full((n, seq), -1)
    for c, (r, start), doc in zip(convs, places, range(len(convs))):
        span = slice(start, start + len(c))
        input_ids[r, span], labels[r, span] = c, shifted_labels(c)
        position_ids[r, span], document_ids[r, span] = torch.arange(len(c)), doc
    for r in range(n):  # padding positions count on from 0 too, like the collator's
        pad = document_ids[r] == -1
        position_ids[r, pad] = torch.arange(int(pad.sum()))
    return input_ids, labels, position_ids, document_ids, places


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    losses = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE, reduction="none")
    return losses.view(labels.shape)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


LENGTHS = (9, 14, 5, 11, 3, 7, 12)


# ---------------------------------------------------------------- packed rows vs each conversation alone (CPU)


# A window of 6 tokens on the first of the tiny model's two layers (every 2nd layer is global).
WINDOWED = dict(sliding_window=6, sliding_window_pattern=2)


@pytest.mark.parametrize("window", [False, True], ids=["global", "window"])
@pytest.mark.parametrize("attention", ["sdpa", "auto"])
def test_packed_rows_give_each_conversation_its_own_losses_and_gradients(attention, window):
    model = tiny_model(attention, seed=3, **(WINDOWED if window else {}))
    convs = conversations(LENGTHS, model.args.vocab_size, seed=1)
    input_ids, labels, position_ids, document_ids, places = pack(convs, seq=24)
    assert len(input_ids) == 3 and (document_ids == -1).any(), "the test packs several rows, with padding"

    logits = model(input_ids, position_ids=position_ids, document_ids=document_ids)
    packed = token_losses(logits, labels)
    assert torch.isfinite(logits).all()  # padding attends to padding only: no empty softmax, no NaN
    packed.sum().backward()
    packed_grads = grads(model)
    model.zero_grad()

    alone_total = 0
    for c, (r, start) in zip(convs, places):
        alone = token_losses(model(c[None]), shifted_labels(c)[None])[0]
        torch.testing.assert_close(packed[r, start:start + len(c)], alone, rtol=0, atol=2e-5)
        alone_total = alone_total + alone.sum()
    alone_total.backward()
    for name, g in grads(model).items():
        torch.testing.assert_close(packed_grads[name], g, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")

    # Without document ids a row's later conversations see the earlier ones: the losses change.
    with torch.no_grad():
        leaky = token_losses(model(input_ids, position_ids=position_ids), labels)
    later = [(r, start, len(c)) for c, (r, start) in zip(convs, places) if start > 0]
    assert later
    assert max((leaky[r, s:s + n] - packed[r, s:s + n]).abs().max() for r, s, n in later) > 1e-3


# ---------------------------------------------------------------- flex vs sdpa on CPU (forward)


def _flex_forward_on_cpu_or_skip(model, *args, **kwargs):
    try:
        return model(*args, **kwargs)
    except NotImplementedError as e:  # torch builds whose FlexAttention has no CPU forward
        pytest.skip(f"FlexAttention forward does not run on CPU in torch {torch.__version__}: {e}")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on CPU, by design
@pytest.mark.parametrize("window", [False, True], ids=["global", "window"])
@pytest.mark.parametrize("documents", [True, False], ids=["documents", "causal"])
def test_flex_forward_on_cpu_matches_sdpa(documents, window):
    overrides = WINDOWED if window else {}
    sdpa, flex = tiny_model("sdpa", seed=5, **overrides), tiny_model("flex", seed=5, **overrides)
    convs = conversations(LENGTHS, sdpa.args.vocab_size, seed=2)
    input_ids, labels, position_ids, document_ids, _ = pack(convs, seq=24)
    kwargs = {"position_ids": position_ids, "document_ids": document_ids} if documents else {}
    with torch.no_grad():
        expected = sdpa(input_ids, **kwargs)
        got = _flex_forward_on_cpu_or_skip(flex, input_ids, **kwargs)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(token_losses(got, labels), token_losses(expected, labels), rtol=0, atol=1e-5)


# ---------------------------------------------------------------- sdpa, flex and varlen on CUDA


def _losses_and_grads(model, batch, precision: str, documents: bool):
    input_ids, labels, position_ids, document_ids = batch
    model.zero_grad()
    kwargs = {"position_ids": position_ids, "document_ids": document_ids} if documents else {}
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
        losses = token_losses(model(input_ids, **kwargs), labels)
    losses.sum().backward()
    return losses.detach(), grads(model)


@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("backend", ["flex", "varlen"])
@pytest.mark.parametrize("documents", [True, False], ids=["documents", "causal"])
@pytest.mark.parametrize("seq", [256, 200])  # 200: rows that end inside one of FlexAttention's 128-token blocks
@pytest.mark.parametrize("window", [None, 48])  # 48: a sliding window on the first layer, inside the blocks
def test_cuda_backends_match_sdpa_forward_and_backward(backend, precision, documents, seq, window):
    cuda = torch.device("cuda")
    overrides = dict(sliding_window=window, sliding_window_pattern=2) if window else {}
    sdpa = tiny_model("sdpa", device=cuda, seed=7, **overrides)
    other = tiny_model(backend, device=cuda, seed=7, **overrides)
    other.load_state_dict(sdpa.state_dict())
    # Conversations that cross block boundaries, and rows that end in padding.
    convs = conversations((100, 90, 37, 150, 60, 90, 20, seq), sdpa.args.vocab_size, seed=3)
    input_ids, labels, position_ids, document_ids, _ = pack(convs, seq=seq)
    assert len(input_ids) >= 4 and (document_ids == -1).any()
    batch = tuple(t.to(cuda) for t in (input_ids, labels, position_ids, document_ids))
    if backend == "varlen" and precision == "fp32":
        with pytest.raises(ValueError, match="bfloat16 or float16"):
            _losses_and_grads(other, batch, precision, documents)
        return
    expected, expected_grads = _losses_and_grads(sdpa, batch, precision, documents)
    got, got_grads = _losses_and_grads(other, batch, precision, documents)
    assert torch.isfinite(got).all()
    # bf16 rounding moves these losses by ~2e-3 and gradients by ~7e-3 (relative); leaking across documents
    # moves them by ~0.2 and ~0.7.
    atol, rel = (1e-2, 3e-2) if precision == "bf16" else (2e-4, 2e-3)
    torch.testing.assert_close(got, expected, rtol=0, atol=atol)
    for name, g in expected_grads.items():
        err = (got_grads[name] - g).norm() / g.norm().clamp(min=1e-12)
        assert err < rel, f"{backend} {precision}: gradient of {name} differs from sdpa's by {err:.2e} (relative)"
    if documents:  # the comparison can fail: sdpa without document ids gives other losses
        leaky, _ = _losses_and_grads(sdpa, batch, precision, documents=False)
        assert (leaky - expected).abs().max() > 10 * atol


@needs_cuda
def test_auto_uses_flex_for_documents_on_cuda():
    cuda = torch.device("cuda")
    assert resolve_attention("auto", cuda, has_documents=True) == "flex"
    auto, flex = tiny_model("auto", device=cuda, seed=2), tiny_model("flex", device=cuda, seed=2)
    flex.load_state_dict(auto.state_dict())
    convs = conversations((30, 50, 20), auto.args.vocab_size, seed=4)
    input_ids, _, position_ids, document_ids, _ = pack(convs, seq=128)
    args = [t.to(cuda) for t in (input_ids, position_ids, document_ids)]
    with torch.no_grad():
        torch.testing.assert_close(auto(args[0], position_ids=args[1], document_ids=args[2]),
                                   flex(args[0], position_ids=args[1], document_ids=args[2]), rtol=0, atol=0)


# ---------------------------------------------------------------- choosing a backend


def test_auto_rule():
    cuda = torch.device("cuda")  # a device object only: nothing runs on it
    assert resolve_attention("auto", CPU, has_documents=True) == "sdpa"
    assert resolve_attention("auto", CPU, has_documents=False) == "sdpa"
    assert resolve_attention("auto", cuda, has_documents=True) == "flex"
    assert resolve_attention("auto", cuda, has_documents=False) == "sdpa"
    for explicit in ("sdpa", "flex", "varlen"):
        assert resolve_attention(explicit, CPU, has_documents=True) == explicit
    with pytest.raises(ValueError, match="'flash' is not one of auto, sdpa, flex, varlen"):
        resolve_attention("flash", CPU, has_documents=False)


def test_attention_setting_reaches_the_model_beside_overrides():
    cfg = ModelConfig(flavor="tiny", attention="varlen", overrides={"n_layers": 1})
    args = resolve_args(cfg, BYTE_VOCAB)
    assert (args.attention, args.n_layers) == ("varlen", 1)
    assert build_on_meta(cfg, args).args.attention == "varlen"
    assert ModelConfig(flavor="tiny").architecture().attention == "auto"


def test_bad_attention_settings_are_config_errors():
    with pytest.raises(ValueError, match="attention"):
        ModelConfig(flavor="tiny", attention="flash")
    with pytest.raises(ValueError, match="model.overrides.attention: the attention kernel is set by model.attention"):
        ModelConfig(flavor="tiny", overrides={"attention": "sdpa"})


def test_flex_cannot_train_on_cpu():
    model = tiny_model("flex").train()
    ids = torch.randint(0, model.args.vocab_size, (2, 16))
    with pytest.raises(ValueError, match="model.attention = 'flex': FlexAttention has no backward on CPU"):
        model(ids, document_ids=torch.zeros(2, 16, dtype=torch.long))


@pytest.mark.parametrize("grad", [True, False])
def test_varlen_needs_cuda(grad):
    model = tiny_model("varlen")
    ids = torch.randint(0, model.args.vocab_size, (2, 16))
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="'varlen' needs a CUDA device"):
        model(ids, document_ids=torch.zeros(2, 16, dtype=torch.long))


def test_varlen_offsets_follow_document_runs_and_rows():
    document_ids = torch.tensor([[0, 0, 1, 1, 1, -1],
                                 [0, 0, 0, 0, 1, 1],
                                 [3, 3, 3, 3, 3, 3]])
    assert document_offsets(document_ids, 3, 6, CPU).tolist() == [0, 2, 5, 6, 10, 12, 18]
    assert document_offsets(document_ids, 3, 6, CPU).dtype == torch.int32
    assert document_offsets(None, 3, 6, CPU).tolist() == [0, 6, 12, 18]


def test_sliding_window_mask_keeps_exactly_the_last_window_tokens_of_the_document():
    from maester.models.layers import document_causal_mask

    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, -1, -1]])
    mask = document_causal_mask(docs, 10, CPU, window=3)[0, 0]
    for q in range(10):
        expected = [k for k in range(10) if k <= q and q - k < 3 and docs[0, k] == docs[0, q]]
        assert mask[q].nonzero().flatten().tolist() == expected


def test_a_window_changes_the_result_only_past_the_window():
    base, windowed = tiny_model("sdpa", seed=4), tiny_model("sdpa", seed=4, **WINDOWED)
    ids = torch.randint(0, base.args.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = base(ids), windowed(ids)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-6)  # within the window: the same function
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-3
