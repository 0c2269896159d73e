"""The course's WideResNet for CIFAR-10 (fixed: never change it in a real run).

This module knows nothing about processes, ranks or devices: it is a plain nn.Module.

    input block   Conv3x3(3->16, no bias) -> BN -> ReLU
    block 1       16 -> 160     (1x1 conv shortcut, because the width changes)
    block 2       160 -> 160    (identity shortcut)
    MaxPool2d(2)                32x32 -> 16x16
    block 3       160 -> 320
    block 4       320 -> 320
    MaxPool2d(2)                16x16 -> 8x8
    block 5       320 -> 640
    block 6       640 -> 640
    head          global average pool over the 8x8 map -> Flatten -> Linear(640 -> 10)

Each residual block is [Conv3x3 -> BN -> ReLU] -> Dropout(0.01) -> [Conv3x3 -> BN -> ReLU],
added to its shortcut. With the default width (160) the network has 17,117,754 trainable
parameters; `width` exists only so that tests can build tiny copies quickly.
"""

import torch
from torch import nn

COURSE_WIDTH = 160  # widths are width, 2*width, 4*width = 160, 320, 640
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
        # A 1x1 convolution (with bias) matches the channel count where the width changes.
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
    """Set the weight (gamma) of each residual body's last BatchNorm to `weight`: an initialisation, not a
    change of architecture. Below 1 each body starts by adding less to its shortcut, so the unnormalised
    residual stream starts smaller. Not 0: the body ends BN -> ReLU, and ReLU(0) passes no gradient, so a
    zero gamma (bias 0) would never train (docs/optimizations.md, 6b)."""
    for block in model.modules():
        if isinstance(block, ResidualBlock):
            block.body[-1][1].weight.fill_(weight)
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
