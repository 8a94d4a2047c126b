"""verify's padded batches keep row 0 as given, also for a batch of one row (adv25 F5).

Before the fix a batch of one row had row 0 itself padded: at 2 tokens the right-padded copy
masked the only predicted label of a causal LM, every side's loss was NaN (0/0) and verify failed a
correct model (an unconverted copy too). Now a one-row batch gets a second row, a copy of row 0,
to pad; and a padded batch whose loss is not finite in the original itself is left out with a
reason, as one the original cannot run is.
"""

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slimgrad

_SEEN: list[torch.Tensor] = []  # the input_ids every forward saw (module level: verify's copies)


@dataclass
class _Out:
    loss: torch.Tensor | None
    logits: torch.Tensor


class _Causal(nn.Module):
    """Next-token loss with HF's shift and -100 labels; attention as a masked running mean."""

    def __init__(self, ignore_mask: bool = False, last_row_loss: bool = False):
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 20)
        self.ignore_mask = ignore_mask
        self.last_row_loss = last_row_loss

    def forward(self, input_ids, attention_mask=None, labels=None):
        _SEEN.append(input_ids.clone())
        h = self.emb(input_ids)
        m = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        if self.ignore_mask:
            m = torch.ones_like(m)
        m = m.unsqueeze(-1).to(h.dtype)
        ctx = (h * m).cumsum(1) / m.cumsum(1).clamp_min(1)
        logits = self.head(h + ctx)
        loss = None
        if labels is not None:
            lg, lb = logits[:, :-1], labels[:, 1:]
            if self.last_row_loss:
                lg, lb = lg[-1:], lb[-1:]
            loss = F.cross_entropy(lg.flatten(0, 1), lb.flatten(), ignore_index=-100)
        return _Out(loss, logits)


@pytest.mark.parametrize("length", [2, 3, 5, 8])
def test_one_row_batch_keeps_row_0_and_pads_a_copy(length):
    torch.manual_seed(0)
    m = _Causal()
    ids = torch.randint(1, 20, (1, length))
    _SEEN.clear()
    rep = slimgrad.verify(m, copy.deepcopy(m), {"input_ids": ids, "labels": ids})
    assert rep.ok, str(rep)
    names = [r.name for r in rep.runs]
    assert "left-padded (train)" in names and "right-padded (train)" in names, names
    assert "(a second row, a copy of row 0, added to pad)" in str(rep)
    padded = [s for s in _SEEN if s.shape[0] == 2]
    assert padded, "no padded batch ran"
    for s in padded:  # row 0 exactly as given; row 1 its copy with pad ids
        assert torch.equal(s[0], ids[0])
        assert (s[1] != ids[0]).any()
    for s in _SEEN:
        assert s.shape[0] in (1, 2)


def test_one_row_batch_still_catches_a_conversion_that_ignores_the_mask():
    torch.manual_seed(0)
    m = _Causal()
    bad = _Causal(ignore_mask=True)
    bad.load_state_dict(m.state_dict())
    ids = torch.randint(1, 20, (1, 8))
    x = {"input_ids": ids, "labels": ids}
    assert slimgrad.verify(m, bad, x, padded=False).ok
    rep = slimgrad.verify(m, bad, x)
    assert not rep.ok
    assert [r.name for r in rep.runs if not r.ok] and all(
        "padded" in r.name for r in rep.runs if not r.ok
    ), str(rep)


def test_padded_batch_with_a_non_finite_original_loss_is_left_out():
    # the loss reads the last row only: right-padded, its one label is masked, eager's loss NaN
    torch.manual_seed(0)
    m = _Causal(last_row_loss=True)
    ids = torch.randint(1, 20, (2, 2))
    rep = slimgrad.verify(m, copy.deepcopy(m), {"input_ids": ids, "labels": ids})
    assert rep.ok, str(rep)
    text = str(rep)
    assert "right-padded (train) left out (the original's loss is nan)" in text, text
    assert "left-padded (train)" in [r.name for r in rep.runs]
