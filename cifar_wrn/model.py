"""The course's fixed WideResNet for CIFAR-10 (17,117,754 parameters at width 160); a plain nn.Module.

Six residual blocks (16->160->160, pool, ->320->320, pool, ->640->640), global average pool, Linear(640->10).
"""

import torch
from torch import nn

COURSE_WIDTH = 160
COURSE_PARAMETERS = 17_117_754
DROPOUT = 0.01


def conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class ResidualBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.body = nn.Sequential(conv_bn_relu(c_in, c_out), nn.Dropout(DROPOUT), conv_bn_relu(c_out, c_out))
        self.shortcut = nn.Conv2d(c_in, c_out, kernel_size=1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.shortcut(x)


class WideResNet(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = COURSE_WIDTH):
        super().__init__()
        w1, w2, w3 = width, 2 * width, 4 * width
        self.stem = conv_bn_relu(3, 16)
        self.features = nn.Sequential(
            ResidualBlock(16, w1),
            ResidualBlock(w1, w1),
            nn.MaxPool2d(2),
            ResidualBlock(w1, w2),
            ResidualBlock(w2, w2),
            nn.MaxPool2d(2),
            ResidualBlock(w2, w3),
            ResidualBlock(w3, w3),
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w3, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(self.stem(x)))


@torch.no_grad()
def init_residual_bn(model: nn.Module, weight: float) -> nn.Module:
    """Set each residual body's last BatchNorm gamma to `weight` (an init, not an architecture change).
    Not 0: the body ends BN -> ReLU, and a zero gamma would pass no gradient and never train."""
    for block in model.modules():
        if isinstance(block, ResidualBlock):
            block.body[-1][1].weight.fill_(weight)
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
