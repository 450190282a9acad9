"""Path patching: the worked example by hand, Wang et al.'s algorithm with plain hooks, invariants, model state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from attribution import activation_patching, path_patching
from tests.attribution.models import tiny_gpt, tiny_llama
from tests.support import hook_state


class Toy(nn.Module):
    """``s = x + a + b`` with ``a = 2x`` and ``b = 3(x + a)``; ``a``, ``b`` and the receiver ``r`` are identities."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.r = nn.Identity(), nn.Identity(), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h1 = self.a(2 * x)
        h2 = self.b(3 * (x + h1))
        return self.r(x + h1 + h2)


def test_the_worked_example_by_hand():
    # base x = 1: a = 2, b = 3 (1 + 2) = 9, s = 12.      source x = 2: a = 4, b = 3 (2 + 4) = 18, s = 24.
    # sender a, b frozen: s = 1 + 4 + 9 = 14.             sender b (a frozen, upstream anyway): s = 1 + 2 + 18 = 21.
    # activation patching of a lets b see it: b = 3 (1 + 4) = 15, s = 1 + 4 + 15 = 20.
    model, base, source = Toy(), torch.ones(1, 1), torch.full((1, 1), 2.0)
    metric = lambda out: out.sum()  # noqa: E731
    kwargs = {"positions": False, "progress": False}
    assert path_patching(model, base, source, ["a", "b"], "r", metric, **kwargs).tolist() == [14.0, 21.0]
    normalized = path_patching(model, base, source, ["a", "b"], "r", metric, normalize=True, **kwargs)
    torch.testing.assert_close(normalized, torch.tensor([2 / 12, 9 / 12]))  # 0 = base (12), 1 = source (24)
    unfrozen = path_patching(model, base, source, ["a", "b"], "r", metric, freeze=(), **kwargs)
    assert unfrozen.tolist() == [20.0, 21.0]
    assert torch.equal(unfrozen, activation_patching(model, source, base, ["a", "b"], metric, **kwargs))
    # a alone as the sender: the default freezes only a itself, so b sees the change; freezing b gives the path again
    assert path_patching(model, base, source, "a", "r", metric, **kwargs).tolist() == [20.0]
    assert path_patching(model, base, source, "a", "r", metric, freeze="b", **kwargs).tolist() == [14.0]
    by_output = path_patching(model, base, source, "a", "r", metric, freeze="b", receiver_site="output", **kwargs)
    assert by_output.tolist() == [14.0]


@pytest.fixture(scope="module")
def gpt64():
    model, ref = tiny_gpt()
    model = model.double()
    answers = ref["answer_tokens"]
    rows = torch.arange(len(answers))

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return (logits[rows, -1, answers[:, 0]] - logits[rows, -1, answers[:, 1]]).mean()

    return model, ref["clean_tokens"], ref["corrupted_tokens"], metric


def by_hand(model, base, source, metric, layer, head):
    """Wang et al.'s path patching with raw hooks: head ``layer.head`` (its slice of the input of ``attn.o``) from
    ``source``, every other head frozen at ``base``, into the final residual stream at the last position."""
    o_proj = [block.attn.o for block in model.layers]

    def recorded(x):
        acts = []
        handles = [m.register_forward_pre_hook(lambda m, args: acts.append(args[0].clone())) for m in o_proj]
        with torch.no_grad():
            model(x)
        for h in handles:
            h.remove()
        return acts

    base_acts, source_acts = recorded(base), recorded(source)
    received = {}

    def sender_run(i):
        def hook(m, args):
            new = base_acts[i].clone()  # frozen at base
            if i == layer:
                view, src = new.view(*new.shape[:2], 4, -1), source_acts[i].view(*new.shape[:2], 4, -1)
                view[:, :, head] = src[:, :, head]
            return (new,)

        return hook

    handles = [m.register_forward_pre_hook(sender_run(i)) for i, m in enumerate(o_proj)]
    handles.append(model.ln_out.register_forward_pre_hook(lambda m, args: received.__setitem__("x", args[0].clone())))
    with torch.no_grad():
        model(base)
    for h in handles:
        h.remove()

    def receiver_run(m, args):
        new = args[0].clone()
        new[:, -1] = received["x"][:, -1]
        return (new,)

    handle = model.ln_out.register_forward_pre_hook(receiver_run)
    with torch.no_grad():
        value = metric(model(base))
    handle.remove()
    return value


def test_equals_the_algorithm_with_plain_hooks(gpt64):
    model, clean, corrupted, metric = gpt64
    ours = path_patching(model, clean, corrupted, "layers.*.attn.o", "ln_out", metric, site="input", heads=4,
                         positions=False, receiver_positions=[-1], progress=False)  # fmt: skip
    expected = torch.tensor([[by_hand(model, clean, corrupted, metric, layer, head) for head in range(4)]
                             for layer in range(2)])  # fmt: skip
    torch.testing.assert_close(ours, expected.float(), rtol=0, atol=1e-6)
    with torch.no_grad():
        m_clean = metric(model(clean)).item()
    assert (ours - m_clean).abs().max() > 0.01  # the heads do matter


def test_invariants(gpt64):
    model, clean, corrupted, metric = gpt64
    with torch.no_grad():
        m_clean = metric(model(clean)).float()
    kwargs = {"site": "input", "heads": 4, "progress": False}
    # nothing frozen and the whole final residual received: activation patching, to the last bit
    some = {"positions": [1, -1]}  # the changed token and the last position
    full = path_patching(model, clean, corrupted, "layers.*.attn.o", "ln_out", metric, freeze=(), **some, **kwargs)
    exact = activation_patching(model, corrupted, clean, "layers.*.attn.o", metric, **some, **kwargs)
    assert torch.equal(full, exact) and full.shape == (2, 2, 4)
    # the source is the base: nothing changes, exactly
    same = path_patching(model, clean, clean, "layers.*.attn.o", "ln_out", metric, **some, **kwargs)
    assert torch.equal(same, torch.full_like(same, m_clean.item()))
    # a receiver upstream of the sender receives nothing from it
    upstream = path_patching(model, clean, corrupted, "layers.1.mlp", "layers.0", metric, progress=False)
    assert torch.equal(upstream, torch.full_like(upstream, m_clean.item()))
    # per example: the mean over the batch is the averaged metric's value
    rows = torch.arange(4)
    answers = tiny_gpt()[1]["answer_tokens"]
    per = path_patching(model, clean, corrupted, "layers.*.attn.o", "ln_out", lambda lg: lg[rows, -1, answers[:, 0]]
                        - lg[rows, -1, answers[:, 1]], per_example=True, positions=False, **kwargs)  # fmt: skip
    averaged = path_patching(model, clean, corrupted, "layers.*.attn.o", "ln_out", metric, positions=False, **kwargs)
    assert per.shape == (2, 4, 4)
    torch.testing.assert_close(per.mean(-1), averaged, rtol=0, atol=1e-6)


def test_a_subset_of_cells(gpt64):
    model, clean, corrupted, metric = gpt64
    kwargs = {"site": "input", "heads": 4, "positions": False, "receiver_positions": [-1], "progress": False}
    full = path_patching(model, clean, corrupted, "layers.*.attn.o", "ln_out", metric, **kwargs)
    some = path_patching(model, clean, corrupted, "layers.*.attn.o", "ln_out", metric, only=[(1, 2), (0, -1)],
                         **kwargs)  # fmt: skip
    ran = torch.zeros(2, 4, dtype=torch.bool)
    ran[1, 2] = ran[0, 3] = True
    assert torch.equal(some[ran], full[ran]) and some[~ran].isnan().all()
    with pytest.raises(IndexError, match=r"`only` entry \(2, 0\) is not an index into the result's shape \(2, 4\)"):
        path_patching(model, clean, corrupted, "layers.*.attn.o", "ln_out", metric, only=[(2, 0)], **kwargs)


def test_model_left_as_found_and_errors(gpt64):
    model, clean, corrupted, metric = gpt64
    model.layers[1].train()
    before = hook_state(model)
    flags = {name: m.training for name, m in model.named_modules()}
    try:
        calls = []

        def failing(logits):
            calls.append(1)
            if len(calls) == 4:
                raise KeyboardInterrupt
            return metric(logits)

        with pytest.raises(KeyboardInterrupt):
            path_patching(model, clean, corrupted, "layers.*.mlp", "ln_out", failing, progress=False)
        assert hook_state(model) == before and {n: m.training for n, m in model.named_modules()} == flags
        with pytest.raises(TypeError, match=r"output of 'layers\.1\.attn' is a tuple, not a tensor \(it is a tuple"):
            path_patching(model, clean, corrupted, "layers.0.mlp", "layers.1.attn", metric, receiver_site="output")
        with pytest.raises(KeyError, match=r"did you mean 'ln_out'"):
            path_patching(model, clean, corrupted, "layers.1.mlp", "ln_ot", metric)
        with pytest.raises(ValueError, match="`site` must be 'output' or 'input'"):
            path_patching(model, clean, corrupted, "layers.1.mlp", "ln_out", metric, receiver_site="middle")
        assert hook_state(model) == before
    finally:
        model.eval()


def test_a_huggingface_model_with_a_batch_encoding():
    """Nothing frozen and the whole final residual stream received: activation patching (noising), to the last bit;
    the heads of the last layer reach the last position's residual stream only directly."""
    transformers = pytest.importorskip("transformers")
    model = tiny_llama().double()
    ids = torch.randint(0, 50, (2, 6))
    changed = ids.clone()
    changed[:, 2] = (changed[:, 2] + 1) % 50
    clean, corrupted = (transformers.BatchEncoding({"input_ids": x, "use_cache": False}) for x in (ids, changed))
    metric = lambda out: (out.logits[:, -1, 3] - out.logits[:, -1, 4]).mean()  # noqa: E731
    heads = "model.layers.*.self_attn.o_proj"
    kwargs = {"site": "input", "heads": 4, "positions": False, "progress": False}
    unfrozen = path_patching(model, clean, corrupted, heads, "model.norm", metric, freeze=(), **kwargs)
    assert torch.equal(unfrozen, activation_patching(model, corrupted, clean, heads, metric, **kwargs))
    direct = path_patching(model, clean, corrupted, heads, "model.norm", metric, receiver_positions=[-1], **kwargs)
    assert torch.equal(direct[1], unfrozen[1]) and not torch.allclose(direct[0], unfrozen[0])
