"""The mixture-of-experts feed-forward: dispatch against a per-token reference, grouped GEMM against the loop,
routing, the auxiliary losses against their formulas and in the model's loss, and balancing in toy runs (the
load-balancing loss and the auxiliary-loss-free bias each even out a skewed router)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from maester.models.args import MoEArgs, TransformerArgs
from maester.models.moe import (
    MoEFeedForward,
    aux_loss,
    load_balancing_loss,
    moe_metrics,
    router_z_loss,
    update_expert_bias,
)
from maester.models.registry import ARCHITECTURES
from maester.models.transformer import Transformer
from maester.train.metrics import matmul_parameters


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only contend with whatever else runs
    yield
    torch.set_num_threads(threads)


def make_layer(dim=16, seed=0, std=0.3, activation="silu", **moe) -> MoEFeedForward:
    torch.manual_seed(seed)
    args = MoEArgs(**{"n_experts": 8, "top_k": 2, "expert_hidden_dim": 16, **moe})
    layer = MoEFeedForward(dim, args, activation)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=std)
    layer.reset_state()
    return layer


def reference(layer: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the gate-weighted sum of its top-k experts' MLPs, plus the shared experts."""
    e = layer.experts
    act = F.silu if e.activation == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    _, _, weights, indices = layer.router(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, i in zip(weights[t], indices[t]):
            h = act(e.gate_proj[i] @ x[t]) * (e.up_proj[i] @ x[t])
            out[t] += w * (e.down_proj[i] @ h)
    if layer.shared_experts is not None:
        out += layer.shared_experts(x)
    return out


@pytest.mark.parametrize("moe", [dict(), dict(gate="sigmoid", norm_topk_prob=True, n_shared_experts=2),
                                 dict(top_k=8, norm_topk_prob=True), dict(top_k=1)])
def test_loop_dispatch_equals_the_per_token_reference(moe):
    layer = make_layer(**moe)
    x = torch.randn(2, 12, 16)
    out = layer(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out.reshape(-1, 16), reference(layer, x.reshape(-1, 16)), atol=1e-5, rtol=1e-5)


def test_gradients_reach_every_chosen_expert_and_the_router():
    layer = make_layer()
    x = torch.randn(64, 16)
    layer(x).square().sum().backward()
    _, _, _, indices = layer.router(x)
    chosen = torch.bincount(indices.flatten(), minlength=8) > 0
    assert torch.equal(layer.experts.gate_proj.grad.flatten(1).abs().sum(1) > 0, chosen)
    assert layer.router.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("autocast", [False, True])
def test_grouped_gemm_equals_the_loop_where_it_runs(autocast):
    """Forward only: on CPU torch runs the grouped forward but not its backward. Under bf16 autocast the grouped
    path casts the fp32 weights itself (autocast does not cover it)."""
    layer = make_layer(dim=16)
    x = torch.randn(40, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        layer.experts.dispatch = "loop"
        loop = layer(x)
        layer.experts.dispatch = "grouped"
        try:
            grouped = layer(x)
        except (RuntimeError, NotImplementedError) as e:  # no grouped GEMM for this device and dtype
            pytest.skip(f"torch._grouped_mm does not run here: {e}")
    tol = 3e-2 if autocast else 1e-5
    torch.testing.assert_close(grouped.float(), loop.float(), atol=tol, rtol=tol)


def test_routing_picks_the_top_scores_and_the_bias_changes_only_the_choice():
    layer = make_layer(norm_topk_prob=True, bias_balancing=0.01)
    x = torch.randn(32, 16)
    logits, scores, weights, indices = layer.router(x)
    torch.testing.assert_close(scores, logits.softmax(-1))
    assert torch.equal(indices, scores.topk(2).indices)
    torch.testing.assert_close(weights.sum(-1), torch.ones(32))
    layer.router.expert_bias[3] = 10.0  # every token now picks expert 3, gated by its unbiased score
    _, scores, weights, indices = layer.router(x)
    assert (indices[:, 0] == 3).all()
    picked = scores.gather(-1, indices)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))
    sigmoid = make_layer(gate="sigmoid")
    logits, scores, weights, indices = sigmoid.router(x)
    torch.testing.assert_close(weights, logits.sigmoid().gather(-1, indices))


def test_aux_losses_match_their_formulas():
    logits = torch.randn(10, 4)
    z = torch.logsumexp(logits, -1) ** 2
    torch.testing.assert_close(router_z_loss(logits), z.mean())
    uniform = torch.full((12, 4), 0.25)
    assert load_balancing_loss(uniform, torch.tensor([6, 6, 6, 6])).item() == pytest.approx(2.0)  # top_k 2
    collapsed = torch.tensor([[1.0, 0.0, 0.0, 0.0]]).repeat(12, 1)
    assert load_balancing_loss(collapsed, torch.tensor([12, 0, 0, 0])).item() == pytest.approx(4.0)  # top_k 1


def test_args_are_validated():
    with pytest.raises(ValidationError, match="top_k"):
        MoEArgs(n_experts=4, top_k=5, expert_hidden_dim=8)
    with pytest.raises(ValidationError, match="norm_topk_prob"):
        MoEArgs(n_experts=4, top_k=1, expert_hidden_dim=8, norm_topk_prob=True)
    flavor = ARCHITECTURES["olmoe"].flavors["tiny"].model_dump()
    with pytest.raises(ValidationError, match="gated"):
        TransformerArgs(**{**flavor, "mlp": "gelu"})


def tiny_model(arch="olmoe", **moe) -> Transformer:
    args = ARCHITECTURES[arch].flavors["tiny"]
    args = args.model_copy(update={"vocab_size": 96, "moe": args.moe.model_copy(update=moe)})
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


def test_the_model_adds_the_weighted_aux_losses_per_label_token_in_training_only():
    model = tiny_model(aux_loss_coef=0.5, z_loss_coef=0.25)
    ids = torch.randint(0, 96, (2, 12))
    labels = ids.clone()
    labels[0, :5] = -100  # 19 label tokens
    model.eval()
    ce = model(ids, labels=labels)
    model.train()
    total = model(ids, labels=labels)
    metrics = moe_metrics(model)  # the unweighted losses of that one training forward
    terms = [0.5 * metrics[f"moe/layers.{i}/balance_loss"] + 0.25 * metrics[f"moe/layers.{i}/z_loss"]
             for i in range(2)]
    assert total.item() == pytest.approx(ce.item() + 19 * sum(terms) / 2, rel=1e-5)  # mean over 2 layers
    assert aux_loss(model) is None  # collected by that forward


def test_activation_checkpointing_gives_the_same_gradients_with_the_aux_losses():
    grads = []
    for checkpointed in (False, True):
        layer = make_layer(aux_loss_coef=0.1, z_loss_coef=0.01)
        x = torch.randn(30, 16, generator=torch.Generator().manual_seed(3))
        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False) if checkpointed else layer(x)
        (out.square().mean() + aux_loss(layer)).backward()
        grads.append([p.grad for p in layer.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_checkpointed_recomputation_counts_the_load_once():
    layer = make_layer()
    x = torch.randn(30, 16, requires_grad=True)
    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert layer.load.sum().item() == 30 * 2
    assert layer.window_losses[2].item() == 1


def skewed_toy(steps=50, train=True, **moe):
    """An MoE layer whose router sends every token to experts 0 and 1 (the inputs share a mean direction that
    their router rows point along), trained to regress a fixed linear map for `steps` steps (or only run, with
    `train` false), the selection bias updated after each. Returns `load_spread` before and after."""
    layer = make_layer(std=0.1, **moe)
    mean = torch.randn(16)
    with torch.no_grad():
        layer.router.gate.weight[0] += mean / mean.norm()
        layer.router.gate.weight[1] += 0.5 * mean / mean.norm()
    target = torch.nn.Linear(16, 16)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    probe = mean + torch.randn(512, 16, generator=torch.Generator().manual_seed(1))
    before = load_spread(layer, probe)
    for _ in range(steps):
        x = mean + torch.randn(256, 16)
        loss = (layer(x) - target(x).detach()).square().mean() + aux_loss(layer)
        if train:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        update_expert_bias(layer)
    return before, load_spread(layer, probe)


@torch.no_grad()
def load_spread(layer: MoEFeedForward, x: torch.Tensor) -> tuple[float, float]:
    """The most and least loaded experts' shares of the routed assignments, over the balanced share."""
    _, _, _, indices = layer.router(x)
    share = torch.bincount(indices.flatten(), minlength=8) / indices.numel() * 8
    return share.max().item(), share.min().item()


def test_load_balancing_loss_evens_out_a_skewed_router():
    before, after = skewed_toy(aux_loss_coef=0.1)
    assert before == (4.0, 0.0)  # experts 0 and 1 take every assignment
    assert after[0] < 2.0 and after[1] > 0
    _, unbalanced = skewed_toy(aux_loss_coef=0.0)
    assert unbalanced == (4.0, 0.0)  # without the loss the task alone leaves it skewed


@pytest.mark.parametrize("train", [False, True])
def test_bias_balancing_evens_out_a_skewed_router_without_aux_loss(train):
    before, after = skewed_toy(train=train, gate="sigmoid", bias_balancing=0.01)
    assert before == (4.0, 0.0)
    assert after[0] < 1.5 and after[1] > 0.5


def test_bias_moves_toward_balance_and_the_counters_restart():
    layer = make_layer(bias_balancing=0.1)
    layer.load.copy_(torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6]))
    update_expert_bias(layer)
    bias = layer.router.expert_bias
    assert bias[0] < 0 and bias[7] < 0 and (bias[1:7] > 0).all()
    assert bias.sum().abs().item() < 1e-6 and layer.load.sum().item() == 0


def test_metrics_report_load_and_losses_then_restart():
    layer = make_layer()
    layer.train()
    model = torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"3": torch.nn.ModuleDict({"feed_forward": layer})})})
    layer(torch.randn(50, 16))
    layer(torch.randn(50, 16))
    assert set(moe_metrics(model)) == {f"moe/layers.3/{k}" for k in
                                      ("load_min", "load_max", "load_entropy", "balance_loss", "z_loss")}
    metrics = moe_metrics(model)  # restarted: nothing counted since
    assert metrics["moe/layers.3/load_entropy"] == 0.0 and metrics["moe/layers.3/balance_loss"] == 0.0
    layer(torch.randn(50, 16))
    metrics = {k.rsplit("/", 1)[1]: v for k, v in moe_metrics(model).items()}
    assert 0 < metrics["load_min"] <= 1 <= metrics["load_max"] <= 4
    assert 0 < metrics["load_entropy"] <= 1 and metrics["balance_loss"] >= 2 - 1e-6  # top_k 2


def test_mfu_counts_the_active_parameters_only():
    model = tiny_model(top_k=2)
    dense_total = sum(p.numel() for p in model.parameters()) - model.tok_embeddings.weight.numel()
    experts = sum(p.numel() for block in model.layers.values() for p in block.feed_forward.experts.parameters())
    assert matmul_parameters(model) == dense_total - experts + experts * 2 // 8
    assert math.isclose(matmul_parameters(model) / dense_total, 1 - 0.75 * experts / dense_total)


@pytest.mark.slow
def test_compiled_layer_equals_eager_with_its_aux_loss_and_load():
    """torch.compile (as per-block compile applies it): the same output, aux loss and gradients, the load counted
    once (the loop's host read and the recomputation check break the graph, they do not fail it)."""
    results = []
    for compiled in (False, True):
        layer = make_layer(n_experts=4, aux_loss_coef=0.1, z_loss_coef=0.01, bias_balancing=0.01)
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(5))
        out = (torch.compile(layer) if compiled else layer)(x)
        extra = aux_loss(layer)
        (out.sum() + extra).backward()
        results.append((out, extra, [p.grad for p in layer.parameters()], layer.load.clone()))
    (out, extra, grads, load), (c_out, c_extra, c_grads, c_load) = results
    torch.testing.assert_close(c_out, out)
    torch.testing.assert_close(c_extra, extra)
    for a, b in zip(grads, c_grads):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert torch.equal(load, c_load) and load.sum().item() == 16 * 2


def test_auto_dispatch_takes_the_loop_on_cpu():
    """What can be shown without a GPU: the grouped GEMM is chosen only for CUDA tensors computing in bf16."""
    from maester.models.moe import grouped_mm_supported

    layer = make_layer(dim=16)
    x = torch.randn(8, 16)
    assert not grouped_mm_supported(x, layer.experts.down_proj)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not grouped_mm_supported(x, layer.experts.down_proj)


@pytest.mark.parametrize("capability, arch, env, fast", [
    ((9, 0), None, {}, True),                      # H100, H200, GH200
    ((10, 0), None, {}, True),                     # B200, GB200
    ((10, 3), None, {}, True),                     # B300
    ((8, 0), None, {}, False),                     # A100: torch's fallback, a host read per call
    ((8, 9), None, {}, False),                     # L40S
    ((12, 0), None, {}, False),                    # RTX 50 series
    ((9, 0), "gfx90a:sramecc+:xnack-", {}, False),  # MI250X (ROCm reports capability 9.0 for it)
    ((9, 0), "gfx90a", {"ROCM_ALLOW_GROUP_GEMM_CK": "1"}, False),
    ((9, 4), "gfx942:sramecc+:xnack-", {}, False),  # MI300X: torch's CK grouped GEMM is opt-in
    ((9, 4), "gfx942:sramecc+:xnack-", {"ROCM_ALLOW_GROUP_GEMM_CK": "1"}, True),
    ((9, 5), "gfx950", {"ROCM_ALLOW_GROUP_GEMM_CK": "true"}, True),  # MI355X
    ((9, 4), "gfx942", {"ROCM_ALLOW_GROUP_GEMM_CK": "0"}, False),
])
def test_grouped_gemm_only_where_torch_has_its_kernel(capability, arch, env, fast):
    """N4: the path choice per device, as torch's `_grouped_mm_cuda` decides it (torch 2.10 to 2.15)."""
    from maester.models.moe import grouped_mm_fast_path

    assert grouped_mm_fast_path(capability, arch, env) is fast


def test_the_loop_takes_host_counts_without_reading_the_device():
    """Where expert parallel hands the experts their counts on the host, the loop splits by those, not by the device
    tensor (here deliberately wrong: reading it would give another result)."""
    layer = make_layer(dim=16)
    x = torch.randn(10, 16)
    counts = [3, 0, 2, 1, 0, 4, 0, 0]
    expected = layer.experts(x, torch.tensor(counts))
    got = layer.experts(x, torch.tensor([10, 0, 0, 0, 0, 0, 0, 0]), counts)
    torch.testing.assert_close(got, expected)


def _cuda_syncs(fn) -> int:
    """How many times `fn()` waits for the GPU (torch's sync debug mode, which warns on each)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_gemm_on_cuda_trains_like_the_loop():
    """On CUDA under bf16 autocast, `auto` runs the grouped GEMM where torch has its kernel for this GPU and the
    loop elsewhere; forward and gradients match the loop's, and the layer waits for the GPU at most once per
    forward (none with the grouped kernel), never in backward (N4: torch's fallback would, in every GEMM)."""
    from maester.models.moe import grouped_mm_fast_path, grouped_mm_supported

    torch.manual_seed(0)
    layer = make_layer(dim=64).cuda()
    x = torch.randn(256, 64, device="cuda")
    props = torch.cuda.get_device_properties(0)
    fast = grouped_mm_fast_path(torch.cuda.get_device_capability(0),
                                getattr(props, "gcnArchName", "") if torch.version.hip else None)
    results = {}
    for dispatch in ("loop", "auto"):
        layer.experts.dispatch = dispatch
        layer.zero_grad(set_to_none=True)
        outputs = []
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if dispatch == "auto":
                assert grouped_mm_supported(x, layer.experts.down_proj) is fast
            forward_syncs = _cuda_syncs(lambda: outputs.append(layer(x)))
        out = outputs[0]
        backward_syncs = _cuda_syncs(lambda: out.float().square().mean().backward())
        if dispatch == "auto":
            assert (forward_syncs, backward_syncs) == ((0, 0) if fast else (1, 0)), (forward_syncs, backward_syncs)
        results[dispatch] = (out.float(), layer.experts.gate_proj.grad.clone(), layer.router.gate.weight.grad.clone())
    for got, want in zip(results["auto"], results["loop"]):
        torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)



def test_routing_reads_nothing_back_from_the_device():
    """The layer's routing, forward and backward, runs no op that waits for the GPU (on the CPU the ops show
    it: a CUDA run is not needed to see which ones it calls). The expert loop's split sizes are not ops."""
    from tests.helpers import DeviceReads

    layer = make_layer()
    x = torch.randn(20, 16, requires_grad=True)
    with DeviceReads() as reads:
        out = layer(x)
        (out.sum() + layer.aux_loss).backward()
    assert reads.calls == []
    assert layer.load.sum() == 20 * 2  # every token's top-2 counted
