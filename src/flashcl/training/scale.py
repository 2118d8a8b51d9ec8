"""A learnable temperature that behaves: :class:`LogitScale`."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["LogitScale"]


class LogitScale(nn.Module):
    """A learnable logit scale (the inverse temperature) held as its log, as CLIP
    learns it: the parameter is ``log(scale)``, so that the scale stays positive and
    its steps are relative; the call returns ``exp(log_scale)`` clamped at ``max``
    (open_clip clamps at 100: past it a training run's scale can grow until the
    softmax saturates).

    Past ``max`` the returned scale is constant and its gradient 0 (at ``max`` itself
    the gradient passes, so that a scale at its bound can come down); :meth:`clamp_`
    pulls the parameter itself back (open_clip's ``logit_scale.clamp_(0, log(100))``
    after the optimizer step), so that it does not drift where no gradient reaches.

    Args:
        init: the initial scale (CLIP: ``1 / 0.07``; SigLIP: 10). Default: ``1 / 0.07``.
        max: the largest scale returned; None for no bound. Default: 100.

    Shape:
        - output: a 0-dim tensor

    Examples::

        >>> scale = flashcl.LogitScale()                  # CLIP's initialisation
        >>> img, txt = torch.randn(8, 16), torch.randn(8, 16)
        >>> loss = flashcl.clip_loss(img, txt, scale())
        >>> loss.backward()
        >>> scale.log_scale.grad is not None
        True
        >>> # SigLIP: a scale of 10 and a learnable bias of -10
        >>> siglip_scale, bias = flashcl.LogitScale(10.0), torch.nn.Parameter(torch.tensor(-10.0))
        >>> loss = flashcl.siglip_loss(img, txt, siglip_scale(), bias, normalize=True)
    """

    def __init__(self, init: float = 1 / 0.07, max: Optional[float] = 100.0) -> None:
        super().__init__()
        for value, name in ((init, "init"), (max, "max")):
            if value is None and name == "max":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ValueError(f"{name} must be a positive finite float, got {value!r}")
        if max is not None and init > max:
            raise ValueError(f"init ({init}) must not exceed max ({max})")
        self.max = None if max is None else float(max)
        self.log_scale = nn.Parameter(torch.tensor(math.log(init)))

    def forward(self) -> Tensor:
        if self.max is None:
            return self.log_scale.exp()
        # clamped in the log domain, where the bound is inclusive: at the bound (after
        # clamp_, or with init = max) the gradient passes and the scale can come down;
        # exp(log(max)) rounds just above max, so the value is brought to max without
        # touching the gradient
        scale = self.log_scale.clamp(max=math.log(self.max)).exp()
        return scale - (scale - self.max).clamp(min=0.0).detach()

    @torch.no_grad()
    def clamp_(self) -> LogitScale:
        """Clamps the parameter in place to ``[0, log(max)]`` (a scale in [1, max]), as
        open_clip does after each optimizer step; returns self."""
        self.log_scale.clamp_(0.0, math.inf if self.max is None else math.log(self.max))
        return self

    def extra_repr(self) -> str:
        return f"scale={float(self.log_scale.detach().exp()):.4g}, max={self.max}"
