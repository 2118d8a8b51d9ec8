"""The two seed programs (../shared/seeds/), copied as functions to serve as oracles.

Only the plumbing changed (sizes and inputs are arguments, timing prints are
gone); the arithmetic is the seeds' own.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F


# --- seed 000_2b39c807a66646b2: sampled-neighbours loss on an n x n score matrix
def seed1_program(x: torch.Tensor, neighbors: int, rng: random.Random) -> torch.Tensor:
    """The question's program, as written: Python loops, random.randrange per element."""
    n = x.shape[0]
    row_sum = torch.sum(torch.exp(x), dim=1) - torch.exp(torch.diagonal(x, 0))
    y = torch.zeros((n, neighbors), dtype=x.dtype)
    for i in range(n):
        for j in range(neighbors):
            y[i][j] = x[i][rng.randrange(0, n)]
    loss = torch.sum(-torch.log(torch.exp(y) / row_sum.view(-1, 1)))
    return loss


def seed1_indices(n: int, neighbors: int, rng: random.Random) -> torch.Tensor:
    """The indices seed1_program draws from an rng in the same state."""
    return torch.tensor([[rng.randrange(0, n) for _ in range(neighbors)] for _ in range(n)])


def seed1_gather_fix(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The accepted answer's fix 1: gather instead of the loops."""
    row_sum = torch.sum(torch.exp(x), dim=1) - torch.exp(torch.diagonal(x, 0))
    y = x.gather(1, indices)
    return torch.sum(-torch.log(torch.exp(y) / row_sum.view(-1, 1)))


def seed1_log_form(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The answer's fix 2: log(a/b) = log a - log b."""
    row_sum = torch.sum(torch.exp(x), dim=1) - torch.exp(torch.diagonal(x, 0))
    y = x.gather(1, indices)
    return torch.sum(-(y - torch.log(row_sum).view(-1, 1)))


# --- seed 002_3179282b0ae86dff: supervised SimCSE
def naive_supervised_simcse_loss(embeddings, labels, temperature=0.05):
    batch_size = embeddings.size(0)
    loss = 0.0
    embeddings = F.normalize(embeddings, p=2, dim=1)

    for i in range(batch_size):
        pos_mask = (labels == labels[i]) & (torch.arange(batch_size) != i)
        sims = torch.matmul(embeddings[i].unsqueeze(0), embeddings.T).squeeze() / temperature
        pos_sim_sum = sims[pos_mask].sum()
        log_denominator = torch.logsumexp(sims, dim=0)
        loss += -pos_sim_sum + log_denominator

    return loss / batch_size


def vectorized_supervised_simcse_loss(embeddings, labels, temperature=0.05):
    batch_size = embeddings.size(0)
    embeddings = F.normalize(embeddings, p=2, dim=1)
    sim_matrix = torch.matmul(embeddings, embeddings.T) / temperature
    pos_mask = (labels.unsqueeze(0) == labels.unsqueeze(1)) & ~torch.eye(
        batch_size, device=embeddings.device, dtype=torch.bool
    )
    pos_sim_sum = (sim_matrix * pos_mask).sum(dim=1)
    log_denominator = torch.logsumexp(sim_matrix, dim=1)
    loss = (-pos_sim_sum + log_denominator).mean()
    return loss
