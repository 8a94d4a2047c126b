import pytest
import torch
import torch.nn as nn

from slimgrad.profile import fit_batch, profile, resident_bytes
from slimgrad.targets import resolve

pytest.importorskip("transformers")


def _small_mlp():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    return model, lambda b: (torch.randn(b, 16),)


@pytest.mark.parametrize("name", ["gpt2", "bert", "vit", "resnet"])
def test_profile_fake_equals_measured(name):
    t = resolve(name, size="tiny", seq=16)
    real = profile(t, batch=2, convert=False)
    fake = profile(t, batch=2, convert=False, fake=True)
    assert real.eager.peak_bytes == fake.eager.peak_bytes > 0
    assert real.eager.saved_bytes == fake.eager.saved_bytes > 0
    assert real.eager.floor_bytes == fake.eager.floor_bytes
    assert real.resident_bytes == fake.resident_bytes


def test_profile_table_and_rows_add_up():
    t = resolve("gpt2", size="tiny", seq=16)
    rep = profile(t, batch=2)
    assert sum(a for _, a, _ in rep.rows()) == rep.eager.saved_bytes
    assert sum(b for _, _, b in rep.rows()) == rep.converted.saved_bytes
    text = rep.table()
    assert "saved for backward" in text and "floor" in text


def test_profile_factory_target_and_plot(tmp_path):
    t = resolve(f"{__name__}:_small_mlp")
    rep = profile(t, batch=5)
    # eager: GELU input (5x32 fp32), GELU output kept by the second Linear, the output (squared by
    # the default loss)
    assert rep.eager.saved_bytes == 2 * 5 * 32 * 4 + 5 * 4
    assert rep.resident_bytes == sum(p.nbytes for p in t.build().parameters()) + 5 * 16 * 4
    png = rep.plot(str(tmp_path / "t.png"))
    assert open(png, "rb").read(4) == b"\x89PNG"


def test_fit_batch_is_the_largest_that_fits():
    t = resolve(f"{__name__}:_small_mlp")
    budget = 200_000
    b, rep = fit_batch(t, budget, convert=False, max_batch=4096)
    used = rep.resident_bytes + rep.eager.peak_bytes
    assert used <= budget
    over = profile(t, batch=b + 1, convert=False, fake=True)
    assert over.resident_bytes + over.eager.peak_bytes > budget


def test_resolve_errors():
    with pytest.raises(ValueError, match="slimgrad.targets.resolve: unknown target"):
        resolve("nope")
    with pytest.raises(ValueError, match="cannot load factory"):
        resolve("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="size must be 'full' or 'tiny'"):
        resolve("gpt2", size="huge")


def test_resident_bytes_counts_shared_storage_once():
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    assert resident_bytes(lin, (x, x)) == (16 + 4 + 12) * 4
