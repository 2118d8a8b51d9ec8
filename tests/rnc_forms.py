"""Rank-N-Contrast as its published code computes it (Zha et al., NeurIPS 2023,
``RnCLoss.forward`` in the authors' ``loss.py``: not a package), re-expressed as a function:
the same steps (two views concatenated, L1 label distances, the negative L2 feature
distance over the temperature, the row maximum subtracted, the diagonal removed, a loop
over the positives' columns with a mask of the denominator at each step)."""

from __future__ import annotations

import torch


def rnc_published(features: torch.Tensor, labels: torch.Tensor, t: float = 2.0) -> torch.Tensor:
    """Rank-N-Contrast's published RnCLoss(temperature=t).forward (L1 label distance, L2
    feature similarity) on features (B, 2, D) and labels (B, K): a loop over the
    positives' columns, a B x B mask at each step."""
    features = torch.cat([features[:, 0], features[:, 1]], dim=0)
    labels = labels.repeat(2, 1)
    label_diffs = torch.abs(labels[:, None, :] - labels[None, :, :]).sum(dim=-1)
    logits = -(features[:, None, :] - features[None, :, :]).norm(2, dim=-1).div(t)
    logits_max, _ = torch.max(logits, dim=1, keepdim=True)
    logits = logits - logits_max.detach()
    exp_logits = logits.exp()
    n = logits.shape[0]
    keep = (1 - torch.eye(n)).bool()
    logits = logits.masked_select(keep).view(n, n - 1)
    exp_logits = exp_logits.masked_select(keep).view(n, n - 1)
    label_diffs = label_diffs.masked_select(keep).view(n, n - 1)
    loss = torch.zeros((), dtype=features.dtype)
    for k in range(n - 1):
        pos_logits = logits[:, k]
        neg_mask = (label_diffs >= label_diffs[:, k].view(-1, 1)).float()
        pos_log_probs = pos_logits - torch.log((neg_mask * exp_logits).sum(dim=-1))
        loss = loss + -(pos_log_probs / (n * (n - 1))).sum()
    return loss
