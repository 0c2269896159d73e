"""SGD and Muon (as in airbench94_muon.py) groups plus optional Lookahead in one optimizer, so the scheduler,
checkpoints and Accelerate see one object; SGD groups call torch.optim.sgd.sgd, exactly as torch.optim.SGD.
"""

import torch
from torch.optim.sgd import sgd

# Keller Jordan's quintic Newton-Schulz: singular values end near 1 (0.7-1.2), which suffices.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 3  # airbench94_muon's count


def orthogonalise(matrix: torch.Tensor, steps: int = NS_STEPS, dtype=torch.bfloat16) -> torch.Tensor:
    """About U V^T of matrix = U S V^T by Newton-Schulz, on the wide side so the Gram matrix is small."""
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
    def __init__(
        self, groups, lr: float, momentum: float, nesterov: bool, lookahead_steps: int = 0, lookahead_alpha: float = 0.5
    ):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=0.0, muon=False, renormalize=False)
        super().__init__(groups, defaults)
        self.lookahead_steps, self.lookahead_alpha = lookahead_steps, lookahead_alpha
        if lookahead_steps:
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
            for p, buffer in zip(params, buffers):  # sgd() creates new buffers on the first step
                self.state[p]["momentum_buffer"] = buffer
        if self.lookahead_steps:
            self._lookahead()

    def _muon_step(self, group, params):
        momentum = group["momentum"]
        for p in params:
            buffer = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            buffer.mul_(momentum).add_(p.grad)
            update = p.grad.add(buffer, alpha=momentum) if group["nesterov"] else buffer
            if group["renormalize"]:  # under BN: fixes the step's relative size
                p.mul_(len(p) ** 0.5 / p.norm())
            p.add_(orthogonalise(update.reshape(len(p), -1)).view(p.shape), alpha=-group["lr"])

    def _lookahead(self):
        params = self._all_params()
        first = self.state[params[0]]  # one counter, with the first weight
        first["lookahead_count"] = first.get("lookahead_count", 0) + 1
        if first["lookahead_count"] % self.lookahead_steps:
            return
        slow = [self.state[p]["slow"] for p in params]
        torch._foreach_lerp_(slow, params, self.lookahead_alpha)
        torch._foreach_copy_(params, slow)
