"""train_dictionary: ground truth recovered (TopK, ReLU, JumpReLU), kill-and-resume bitwise, the dataset store's
shards, bad activations."""

from __future__ import annotations

import pytest
import torch

from attribution import SAE, Transcoder, open_results, record, train_dictionary
from attribution.dictionaries import train as train_module


def toy(seed=0, rows=8192, d=16, n_true=32, k=3):
    """Activations that are sparse sums (k of n_true, coefficients 0.5..1.5) of known unit directions."""
    g = torch.Generator().manual_seed(seed)
    truth = torch.nn.functional.normalize(torch.randn(n_true, d, generator=g), dim=-1)
    chosen = torch.rand(rows, n_true, generator=g).argsort(-1)[:, :k]
    coefficients = torch.rand(rows, k, generator=g) + 0.5
    return truth, (coefficients[..., None] * truth[chosen]).sum(1)


def best_cosines(truth, sae):
    return (truth @ torch.nn.functional.normalize(sae.W_dec.detach(), dim=-1).T).max(1).values


@pytest.mark.slow
def test_a_topk_sae_recovers_the_ground_truth_directions(tmp_path):
    truth, x = toy()
    torch.manual_seed(1)
    sae = SAE(16, 64, k=3)
    assert best_cosines(truth, sae).mean() < 0.7  # not there at initialisation
    train_dictionary(None, x, None, sae, out=tmp_path, tokens=4 * len(x), batch_size=128, lr=1e-2, progress=False)
    cos = best_cosines(truth, sae)
    assert cos.mean() >= 0.95 and cos.min() >= 0.9, (cos.mean(), cos.min())
    torch.testing.assert_close(sae.W_dec.norm(dim=-1), torch.ones(64))  # unit decoder rows


@pytest.mark.slow
@pytest.mark.parametrize(
    ("activation", "penalty", "l0"),
    [("relu", {"l1_coefficient": 1.0}, (3.5, 6.0)), ("jumprelu", {"l0_coefficient": 0.1}, (2.5, 3.5))],
)
def test_relu_and_jumprelu_saes_recover_the_ground_truth_directions(tmp_path, activation, penalty, l0):
    truth, x = toy()
    torch.manual_seed(1)
    sae = SAE(16, 64, activation=activation)
    assert best_cosines(truth, sae).mean() < 0.7
    train_dictionary(None, x, None, sae, out=tmp_path, tokens=16 * len(x), batch_size=128, lr=1e-2, progress=False,
                     **penalty)  # fmt: skip
    cos = best_cosines(truth, sae)
    assert cos.mean() >= 0.9, (cos.mean(), cos.min())
    active = float((sae.encode(x) != 0).sum(-1).float().mean())  # 3 true directions per row
    assert l0[0] <= active <= l0[1], active


def interrupted(monkeypatch, at):
    """Make the training loop raise KeyboardInterrupt at step ``at`` (as a kill would stop it)."""
    real, calls = train_module._step, {"n": 0}

    def step(*args, **kwargs):
        if calls["n"] == at:
            raise KeyboardInterrupt
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, "_step", step)


@pytest.mark.parametrize(
    ("make", "penalty"),
    [
        (lambda: SAE(8, 24, k=2), {}),
        (lambda: Transcoder(8, 4, 24, activation="batchtopk", k=2, skip=True), {}),
        (lambda: SAE(8, 24, activation="relu"), {"l1_coefficient": 0.5, "sparsity_warmup": 10}),
        (lambda: Transcoder(8, 4, 24, activation="jumprelu", skip=True), {"l0_coefficient": 0.2, "bandwidth": 0.5}),
    ],
    ids=["topk", "batchtopk-transcoder", "relu-warmup", "jumprelu-transcoder"],
)
def test_kill_and_resume_ends_bitwise_equal_to_an_uninterrupted_run(tmp_path, monkeypatch, make, penalty):
    x = torch.randn(600, 12 if isinstance(make(), Transcoder) else 8, generator=torch.Generator().manual_seed(0))
    options = {"tokens": 1000, "batch_size": 64, "lr": 3e-3, "seed": 5, "checkpoint_every": 3, "progress": False}
    options |= penalty
    torch.manual_seed(0)
    whole = train_dictionary(None, x, None, make(), out=tmp_path / "whole", **options)
    with monkeypatch.context() as m:
        interrupted(m, at=7)  # checkpoints after steps 3 and 6; step 7 is lost
        torch.manual_seed(0)
        with pytest.raises(KeyboardInterrupt):
            train_dictionary(None, x, None, make(), out=tmp_path / "killed", **options)
    assert torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=True)["step"] == 6
    torch.manual_seed(0)
    resumed = train_dictionary(None, x, None, make(), out=tmp_path / "killed", **options)
    for key, value in whole.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), key
    torch.manual_seed(123)  # a finished run returns the stored result whatever the fresh module holds
    again = train_dictionary(None, x, None, make(), out=tmp_path / "killed", **options)
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in whole.state_dict().items())


def test_a_last_batch_of_one_row_with_dead_features_leaves_the_dictionary_finite(tmp_path):
    """AuxK normalises by the batch's variance, which one row has none of: the term is left out, not divided by 0."""
    x = torch.randn(600, 8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    sae = train_dictionary(None, x, None, SAE(8, 48, k=1), out=tmp_path, tokens=1001, batch_size=100, lr=1e-2,
                           progress=False)  # fmt: skip
    assert all(torch.isfinite(p).all() for p in sae.parameters())


def test_resuming_with_other_settings_is_refused_naming_them(tmp_path):
    x = torch.randn(100, 8)
    train_dictionary(None, x, None, SAE(8, 16, k=2), out=tmp_path, batch_size=50, lr=1e-3, progress=False)
    with pytest.raises(ValueError, match=r"other settings \(lr: 0\.001 there, 0\.002 now\)"):
        train_dictionary(None, x, None, SAE(8, 16, k=2), out=tmp_path, batch_size=50, lr=2e-3, progress=False)


class Tiny(torch.nn.Module):
    """Tokens -> embedding -> Linear ("mlp"): every position's activation is known by hand."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mlp = torch.nn.Embedding(10, 6), torch.nn.Linear(6, 6)

    def forward(self, tokens):
        return self.mlp(self.embed(tokens))


def test_recorded_shards_hold_every_position_and_training_on_them_equals_training_on_the_tensor(tmp_path):
    model, data = Tiny(), [torch.randint(1, 10, (4, 5), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    options = {"batch_size": 16, "lr": 1e-2, "progress": False}
    torch.manual_seed(0)
    recorded = train_dictionary(model, data, "mlp", SAE(6, 12, k=2), out=tmp_path / "a", **options)
    shards = open_results(tmp_path / "a" / "activations", verify=True)
    with torch.no_grad(), record(model, "mlp") as acts:
        model(torch.cat(data))
    assert torch.equal(shards.maps[:], acts["mlp"])  # (12 sequences, 5 positions, 6)
    torch.manual_seed(0)
    given = train_dictionary(None, acts["mlp"].reshape(-1, 6), None, SAE(6, 12, k=2), out=tmp_path / "b", **options)
    assert all(torch.equal(v, given.state_dict()[k]) for k, v in recorded.state_dict().items())
    tc = Transcoder(6, 6, 12, k=2)
    train_dictionary(model, data, "mlp", tc, out=tmp_path / "c", **options)
    rows = open_results(tmp_path / "c" / "activations").maps[:]
    assert torch.equal(rows, torch.cat([model.embed(torch.cat(data)).detach(), acts["mlp"]], dim=-1))


def test_nan_activations_are_named_and_left_out(tmp_path):
    model = Tiny()
    with torch.no_grad():
        model.embed.weight[0] = float("nan")
    data = torch.randint(1, 10, (6, 4), generator=torch.Generator().manual_seed(0))
    data[2, 1] = data[4, 3] = 0
    with pytest.warns(UserWarning, match=r"2 recorded activation\(s\) hold NaN or inf .*item 2 .*item 4"):
        sae = train_dictionary(model, [data], "mlp", SAE(6, 12, k=2), out=tmp_path, batch_size=8, progress=False)
    assert all(torch.isfinite(p).all() for p in sae.parameters())
    x = torch.randn(20, 6)
    x[[3, 7]] = float("inf")
    with pytest.warns(UserWarning, match=r"row 3; row 7"):
        train_dictionary(None, x, None, SAE(6, 12, k=2), out=tmp_path / "t", batch_size=8, progress=False)


def test_bad_dictionaries_and_widths_are_refused(tmp_path):
    with pytest.raises(ValueError, match="activation='relu' trains with an L1 penalty"):
        train_dictionary(None, torch.randn(8, 4), None, SAE(4, 8, activation="relu"), out=tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"width 5, but the SAE reads d_in = 4"):
        train_dictionary(None, torch.randn(8, 5), None, SAE(4, 8, k=2), out=tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"width 5, but the Transcoder reads d_in \+ d_out = 4 \+ 3"):
        train_dictionary(None, torch.randn(8, 5), None, Transcoder(4, 3, 8, k=2), out=tmp_path, progress=False)


class MaskedTiny(Tiny):
    """``Tiny`` that takes HuggingFace's keywords: masked positions get a zero embedding (so the mask shows)."""

    def forward(self, input_ids, attention_mask):
        return self.mlp(self.embed(input_ids) * attention_mask[..., None])


def test_dict_batches_as_huggingface_passes_them_are_recorded_with_every_entry(tmp_path):
    g = torch.Generator().manual_seed(3)
    batches = []
    for rows in (4, 2, 3):  # batches of several sizes, masks with zeros at the end (right padding)
        mask = torch.ones(rows, 5, dtype=torch.long)
        mask[0, 3:] = 0
        batches.append({"input_ids": torch.randint(1, 10, (rows, 5), generator=g), "attention_mask": mask})
    model, options = MaskedTiny(), {"batch_size": 16, "lr": 1e-2, "progress": False}
    torch.manual_seed(0)
    trained = train_dictionary(model, batches, "mlp", SAE(6, 12, k=2), out=tmp_path / "a", **options)
    merged = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    with torch.no_grad(), record(model, "mlp") as acts:
        model(**merged)
    shards = open_results(tmp_path / "a" / "activations", verify=True)
    assert torch.equal(shards.maps[:], acts["mlp"])  # (9 sequences, 5 positions, 6), the masks applied
    assert torch.equal(acts["mlp"][0, 3], model.mlp.bias.detach())  # a masked position: the bias alone
    torch.manual_seed(0)
    given = train_dictionary(None, acts["mlp"].reshape(-1, 6), None, SAE(6, 12, k=2), out=tmp_path / "b", **options)
    assert all(torch.equal(v, given.state_dict()[k]) for k, v in trained.state_dict().items())


def test_dict_batches_without_token_ids_or_with_other_keys_are_refused(tmp_path):
    ids, sae = torch.randint(1, 10, (2, 5)), SAE(6, 12, k=2)
    flat = [{"input_ids": ids}, {"input_ids": ids[0]}]
    with pytest.raises(TypeError, match=r"batch 1 is a dict whose 'input_ids' is \(5,\); each dict batch needs"):
        train_dictionary(MaskedTiny(), flat, "mlp", sae, out=tmp_path)
    unlike = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}, {"input_ids": ids}]
    with pytest.raises(
        ValueError, match=r"batch 1 has keys \['input_ids'\], batch 0 \['attention_mask', 'input_ids'\]"
    ):
        train_dictionary(MaskedTiny(), unlike, "mlp", sae, out=tmp_path)
    short = [{"input_ids": ids, "attention_mask": torch.ones(3, 5)}]
    with pytest.raises(ValueError, match=r"batch 0: \{'attention_mask': \(3, 5\)\} do not have the 2 rows"):
        train_dictionary(MaskedTiny(), short, "mlp", sae, out=tmp_path)
