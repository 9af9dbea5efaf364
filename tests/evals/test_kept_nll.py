"""NLL from the scored positions' logits only (``ccft.evals.sharing.scored_positions`` / ``kept_row_nlls``,
what ``ccft.evals.scoring.handle_nll`` reads from ``SharedPrefillEngine.tail_logits(keep=...)``) ==
the cross-entropy over the whole ``(b, t, V)`` logits: the same per-row sums and token counts; ``row_nlls``
is the same rule."""

import torch

from ccft.core.tokens import IGNORE_INDEX
from ccft.evals.sharing import kept_row_nlls, row_nlls, scored_positions


def test_kept_row_nlls_equal_row_nlls():
    g = torch.Generator().manual_seed(3)
    b, t, v = 5, 9, 50
    logits = torch.randn(b, t, v, generator=g) * 3
    labels = torch.randint(0, v, (b, t), generator=g)
    starts = [1, 2, 1, 3, 4]  # the prompt's handoff tokens are not scored; rows end in padding
    ends = [9, 6, 8, 4, 4]
    for i in range(b):
        labels[i, : starts[i]] = IGNORE_INDEX
        labels[i, ends[i] :] = IGNORE_INDEX
    keep = scored_positions(labels)
    assert keep[:, -1].sum() == 0 and keep.sum() == sum(e - s for s, e in zip(starts, ends))
    assert torch.equal(keep[:, :-1], labels[:, 1:] != IGNORE_INDEX)
    full = torch.nn.functional.cross_entropy(  # the reference: the log-softmax at every position
        logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(b, t - 1)
    want = [(float(full[i].sum()), int((labels[i, 1:] != IGNORE_INDEX).sum())) for i in range(b)]
    assert row_nlls(logits, labels) == kept_row_nlls(logits[keep], labels)
    got = kept_row_nlls(logits[keep], labels)
    assert [n for _, n in got] == [n for _, n in want] == [e - s for s, e in zip(starts, ends)]
    for (a, _), (w, _) in zip(got, want):
        assert abs(a - w) <= 1e-6 * max(1.0, abs(w))
    assert got[4] == (0.0, 0) and got[3][1] == 1  # row 4: nothing scored; row 3: one token
