"""The optimizer of recipes that use Muon or Lookahead (docs/optimizations.md, 14). Knows nothing about processes.

One torch.optim.Optimizer, so that the one LR scheduler, the checkpoints and Accelerate's prepare() see a
single object, as with plain SGD. Each parameter group says how it steps:

- `muon: False` groups: SGD with (Nesterov) momentum and L2 weight decay, through torch.optim.sgd.sgd,
  the function torch.optim.SGD itself calls, so their steps are exactly SGD's.
- `muon: True` groups (the 4-D convolution kernels): Muon as in Keller Jordan's airbench94_muon.py
  (github.com/KellerJordan/cifar10-airbench; the Muon post: kellerjordan.github.io/posts/muon): plain
  momentum b <- mu b + g, Nesterov's g + mu b, that update seen as an (out, in*k*k) matrix and
  orthogonalised by Newton-Schulz (orthogonalise below), then a step of `lr` along it. No weight decay and
  no shape-based rate adjustment. Kernels in a `renormalize: True` group (those a BatchNorm follows, so the
  network does not see their scale) are first rescaled to Frobenius norm sqrt(out), as airbench does: that
  fixes the size of a step relative to the kernel.

Lookahead (Zhang et al., 2019), on top of either, when `lookahead_steps` > 0: every that many steps the
slow weights move a fraction `lookahead_alpha` of the way to the live ones, and the live weights restart
from them. The slow weights and the step count are optimizer state, so state_dict() (every checkpoint)
holds them and a resumed run continues exactly.

Every rank steps on the same averaged gradient and the same weights with the same arithmetic, so DDP's
replicas stay identical (tests/test_levers.py checks it with 2 processes).
"""

import torch
from torch.optim.sgd import sgd

# The quintic Newton-Schulz coefficients of Keller Jordan's Muon (also torch.optim.Muon's in torch 2.14):
# chosen to raise small singular values fast, so a few iterations suffice; the result's singular values
# end near 1 (roughly 0.7-1.2), not exactly 1, which the Muon post found not to matter.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 3  # airbench94_muon's count (torch.optim.Muon defaults to 5)


def orthogonalise(matrix: torch.Tensor, steps: int = NS_STEPS, dtype=torch.bfloat16) -> torch.Tensor:
    """An approximation of U V^T for matrix = U S V^T (2-D), in `dtype`, by `steps` Newton-Schulz iterations
    X <- a X + (b A + c A^2) X with A = X X^T. Works on the wide orientation (fewer rows than columns),
    so that A is the small Gram matrix; dividing by the Frobenius norm first puts every singular value
    at or below 1, where the iteration converges. bf16, as in the references: tensor-core speed, and the
    result differs from exact arithmetic by 2-4 % (relative Frobenius norm; tests/test_levers.py)."""
    a, b, c = NS_COEFFICIENTS
    tall = matrix.size(0) > matrix.size(1)
    x = matrix.T if tall else matrix
    x = x.to(dtype)
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class MuonSGD(torch.optim.Optimizer):
    """SGD for the groups with muon False, Muon for those with muon True, Lookahead over all (module docstring)."""

    def __init__(
        self, groups, lr: float, momentum: float, nesterov: bool, lookahead_steps: int = 0, lookahead_alpha: float = 0.5
    ):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=0.0, muon=False, renormalize=False)
        super().__init__(groups, defaults)
        self.lookahead_steps, self.lookahead_alpha = lookahead_steps, lookahead_alpha
        if lookahead_steps:  # slow weights start at the initial weights
            for p in self._all_params():
                self.state[p]["slow"] = p.detach().clone()

    def _all_params(self):
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "MuonSGD takes no closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon_step(group, params)
                continue
            buffers = [self.state[p].get("momentum_buffer") for p in params]
            sgd(
                params,
                [p.grad for p in params],
                buffers,
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=group["lr"],
                dampening=0.0,
                nesterov=group["nesterov"],
                maximize=False,
            )
            for p, buffer in zip(params, buffers):  # sgd() creates the buffers on the first step
                self.state[p]["momentum_buffer"] = buffer
        if self.lookahead_steps:
            self._lookahead()

    def _muon_step(self, group, params):
        momentum = group["momentum"]
        for p in params:
            buffer = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            buffer.mul_(momentum).add_(p.grad)
            update = p.grad.add(buffer, alpha=momentum) if group["nesterov"] else buffer
            if group["renormalize"]:
                p.mul_(len(p) ** 0.5 / p.norm())
            p.add_(orthogonalise(update.reshape(len(p), -1)).view(p.shape), alpha=-group["lr"])

    def _lookahead(self):
        params = self._all_params()
        first = self.state[params[0]]
        first["lookahead_count"] = first.get("lookahead_count", 0) + 1  # one counter, kept with the first weight
        if first["lookahead_count"] % self.lookahead_steps:
            return
        slow = [self.state[p]["slow"] for p in params]
        torch._foreach_lerp_(slow, params, self.lookahead_alpha)
        torch._foreach_copy_(params, slow)
