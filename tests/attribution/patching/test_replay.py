"""Exact sweeps replay the module calls that finish before a cell's site: same bits, less work, nothing changed."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from torch import nn

from attribution import activation_patching
from tests.attribution.models import tiny_gpt, tiny_llama


class Counted(nn.Module):
    """A block that counts how often its forward really runs (no hook: hooks would switch replay off for it)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return x + torch.tanh(self.linear(x))


class Stack(nn.Module):
    def __init__(self, width: int = 6, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(3, width)
        self.blocks = nn.ModuleList(Counted(width) for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def metric(out: torch.Tensor) -> torch.Tensor:
    return out[:, -1, 0].mean()


def inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 5, 3, generator=g), torch.randn(2, 5, 3, generator=g)


def runs(model: Stack) -> list[int]:
    counts = [b.runs for b in model.blocks]
    for b in model.blocks:
        b.runs = 0
    return counts


def both(model: nn.Module, layers, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The sweep with replay and without."""
    clean, corrupted = kwargs.pop("data", inputs())
    fn = kwargs.pop("metric", metric)
    fast = activation_patching(model, clean, corrupted, layers, fn, progress=False, **kwargs)
    slow = activation_patching(model, clean, corrupted, layers, fn, progress=False, reuse=False, **kwargs)
    return fast, slow


@pytest.mark.filterwarnings("error")  # a check-run fallback would hide a wrong plan
@pytest.mark.parametrize("site", ["input", "output"])
def test_blocks_before_the_site_do_not_run_and_the_bits_do_not_change(site):
    torch.manual_seed(0)
    model = Stack().eval()
    clean, corrupted = inputs()
    layers = [f"blocks.{i}" for i in range(4)]
    fast = activation_patching(model, clean, corrupted, layers, metric, site=site, progress=False)
    counted = runs(model)
    slow = activation_patching(model, clean, corrupted, layers, metric, site=site, progress=False, reuse=False)
    assert torch.equal(fast, slow) and fast.shape == (4, 5)
    # without replay: the clean run, then 5 positions x 4 layers, each a whole forward
    assert runs(model) == [1 + 20] * 4
    # with replay: the clean run and the traced corrupted run (1 each); the check run replays everything before the
    # last site; cells at layer l run block i only if i >= l (input site) or i > l (output site: its own call too)
    check = [0, 0, 0, 1] if site == "input" else [0, 0, 0, 0]
    first = 0 if site == "input" else 1
    cells = [5 * sum(1 for layer in range(4) if i >= layer + first) for i in range(4)]
    assert counted == [2 + c + k for c, k in zip(cells, check, strict=True)]
    assert all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.filterwarnings("error")  # a check-run fallback would hide a wrong plan
def test_reference_transformer_all_options_bitwise():
    model, ref = tiny_gpt()
    clean, corrupted, answers = ref["clean_tokens"], ref["corrupted_tokens"], ref["answer_tokens"]
    rows = torch.arange(clean.shape[0])

    def logit_diff(logits: torch.Tensor) -> torch.Tensor:
        return logits[rows, -1, answers[:, 0]] - logits[rows, -1, answers[:, 1]]

    cases = [
        dict(layers="layers.*", site="input"),
        dict(layers="layers.*.attn", element=0, normalize=True),
        dict(layers="layers.*.attn.o", site="input", heads=4, direction="noise"),
        dict(layers=["layers.1.mlp", "layers.0.mlp"], positions=[0, -1], per_example=True),
    ]
    for case in cases:
        per_example = case.get("per_example", False)
        layers = case.pop("layers")
        fast, slow = both(
            model,
            layers,
            data=(clean, corrupted),
            metric=logit_diff if per_example else lambda out: logit_diff(out).mean(),
            **case,
        )
        assert torch.equal(fast.nan_to_num(), slow.nan_to_num()), case


@pytest.mark.filterwarnings("error")  # a check-run fallback would hide a wrong plan
def test_views_of_the_input_are_not_replayed_when_written_in_place():
    class View(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[:, :]  # shares memory with x

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.view, self.b = nn.Linear(3, 3), View(), nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            v = self.view(h)
            v.mul_(2)  # through the view, h changes too
            return self.b(h) + v

    torch.manual_seed(0)
    fast, slow = both(Model().eval(), ["b"], site="input")
    assert torch.equal(fast, slow)


@pytest.mark.filterwarnings("error")  # a check-run fallback would hide a wrong plan
def test_a_module_shared_between_blocks_keeps_its_call_numbers():
    class Model(Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.blocks[1](self.blocks[0](self.embed(x)))  # block 0 calls `shared` (its call 0)
            h = self.shared(h)  # call 1, before the site
            h = self.blocks[3](self.blocks[2](h))  # the site: the input of block 2
            return self.head(self.shared(h))  # call 2, after the site: must run

    torch.manual_seed(0)
    model = Model().eval()
    model.shared = model.blocks[0].linear
    # replaying block 0 whole would skip call 0, so call 2 would be numbered 1 and get call 1's recorded output
    fast, slow = both(model, ["blocks.2"], site="input")
    assert torch.equal(fast, slow)
    assert runs(model)[0] > 2  # block 0 ran in the cells (its `shared` call replayed inside it)


def test_the_users_hooks_fire_as_often_as_without_replay():
    torch.manual_seed(0)
    model = Stack().eval()
    seen: list[int] = []
    handle = model.blocks[1].linear.register_forward_hook(lambda m, a, o: seen.append(1))
    try:
        activation_patching(model, *inputs(), "blocks.*", metric, site="input", progress=False)
        with_replay = len(seen)
        seen.clear()
        activation_patching(model, *inputs(), "blocks.*", metric, site="input", progress=False, reuse=False)
        # without: the clean run and 20 cells; with: also the traced run and the check run (block 1 holds a hooked
        # module, so it runs in every cell, hook included)
        assert (with_replay, len(seen)) == (23, 21)
    finally:
        handle.remove()


def test_models_that_draw_random_numbers_run_every_call():
    class Noisy(Counted):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + 0 * torch.randn_like(x)  # draws, whatever it adds

    torch.manual_seed(0)
    model = Stack().eval()
    model.blocks[0] = Noisy(6)
    torch.manual_seed(1)
    fast = activation_patching(model, *inputs(), "blocks.*", metric, site="input", progress=False)
    counted = runs(model)
    torch.manual_seed(1)
    slow = activation_patching(model, *inputs(), "blocks.*", metric, site="input", progress=False, reuse=False)
    assert torch.equal(fast, slow)
    assert counted == [2 + 20] * 4  # the traced run, then whole forwards


@pytest.mark.parametrize(
    ("tolerant", "problem"),
    [(False, "made the model fail .*stack expects a non-empty"), (True, "did not reproduce the model's output")],
)
def test_a_side_effect_that_later_code_reads_is_caught_by_the_check_run(tolerant, problem):
    class Noting(Counted):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.notes.append(x.abs().mean())  # read at the end of the model's forward
            return super().forward(x)

    class Model(Stack):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.blocks[0].notes = []
            out = super().forward(x)
            notes = self.blocks[0].notes
            return out * (torch.stack(notes).sum() if notes or not tolerant else 1.0)

    torch.manual_seed(0)
    model = Model().eval()
    model.blocks[0] = Noting(6)
    with pytest.warns(RuntimeWarning, match=problem):
        fast = activation_patching(model, *inputs(), "blocks.*", metric, site="input", progress=False)
    assert torch.equal(
        fast, activation_patching(model, *inputs(), "blocks.*", metric, site="input", progress=False, reuse=False)
    )
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_global_hooks_switch_replay_off():
    torch.manual_seed(0)
    model = Stack().eval()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        activation_patching(model, *inputs(), "blocks.*", metric, site="input", progress=False)
    finally:
        handle.remove()
    assert runs(model) == [1 + 1 + 20] * 4  # clean run, traced run, cells


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_forward_methods_come_back_after_an_error_or_an_interrupt(error):
    torch.manual_seed(0)
    model = Stack().eval()
    own = model.blocks[2].forward  # an instance attribute set by a wrapper library
    model.blocks[2].forward = own
    calls = []

    def failing(out: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 4:
            raise error("stop")
        return metric(out)

    with pytest.raises(error, match="stop"):
        activation_patching(model, *inputs(), "blocks.*", failing, site="input", progress=False)
    assert model.blocks[2].__dict__["forward"] is own
    assert all("forward" not in m.__dict__ for i, m in enumerate(model.modules()) if m is not model.blocks[2])
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.filterwarnings("error")  # a check-run fallback would hide a wrong plan
def test_another_thread_running_the_model_during_the_sweep_sees_the_plain_model():
    torch.manual_seed(0)
    model = Stack().eval()
    clean, corrupted = inputs()
    with torch.no_grad():
        expected = model(corrupted)
    seen: list[torch.Tensor] = []

    def watching(out: torch.Tensor) -> torch.Tensor:
        if not seen:  # mid-sweep, replay installed: a worker thread runs the same model
            worker = threading.Thread(target=lambda: seen.append(model(corrupted).detach()))
            worker.start()
            worker.join()
        return metric(out)

    with torch.no_grad():
        activation_patching(model, clean, corrupted, "blocks.*", watching, site="input", progress=False)
    assert torch.equal(seen[0], expected)


def test_huggingface_llama_bitwise_with_keyword_sites():
    model = tiny_llama(num_hidden_layers=3, max_position_embeddings=32)
    clean = torch.randint(1, 50, (2, 6))
    corrupted = clean.clone()
    corrupted[:, 1] = clean[:, 1] % 49 + 1

    def logit(out):
        return out.logits[:, -1, 3].mean()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no check-run warning: replay is used
        for kwargs in (
            dict(site="input", element="hidden_states"),
            dict(layers="model.layers.*.self_attn.o_proj", site="input", heads=4),
        ):
            layers = kwargs.pop("layers", "model.layers.*")
            fast, slow = both(model, layers, data=(clean, corrupted), metric=logit, **kwargs)
            assert torch.equal(fast, slow)
