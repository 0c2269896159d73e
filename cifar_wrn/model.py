"""The course's WideResNet, as its script writes it: the same seed gives the same weights, its state_dict loads.

AvgPool2d(7) is the course's head: on the 8x8 map it averages the top-left 7x7 window.
"""

import torch
from torch import nn

COURSE_WIDTH = 160
# In every checkpoint: one of another network is refused.
ARCHITECTURE = "course WideResNet: cbrblock, conv_block, AvgPool2d(7)"


class cbrblock(nn.Module):
    def __init__(self, input_channels: int, output_channels: int):
        super().__init__()
        self.cbr = nn.Sequential(
            nn.Conv2d(input_channels, output_channels, kernel_size=3, stride=(1, 1), padding="same", bias=False),
            nn.BatchNorm2d(output_channels),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cbr(x)


class conv_block(nn.Module):
    def __init__(self, input_channels: int, output_channels: int, scale_input: int):
        super().__init__()
        self.scale_input = scale_input
        if self.scale_input:
            self.scale = nn.Conv2d(input_channels, output_channels, kernel_size=1, stride=(1, 1), padding="same")
        self.layer1 = cbrblock(input_channels, output_channels)
        self.dropout = nn.Dropout(p=0.01)
        self.layer2 = cbrblock(output_channels, output_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        out = self.layer1(x)
        out = self.dropout(out)
        out = self.layer2(out)
        if self.scale_input:
            residual = self.scale(residual)
        return out + residual


class WideResNet(nn.Module):
    def __init__(self, num_classes: int = 10, width: int = COURSE_WIDTH):
        super().__init__()
        n_channels = [3, 16, width, 2 * width, 4 * width]

        self.input_block = cbrblock(n_channels[0], n_channels[1])

        self.block1 = conv_block(n_channels[1], n_channels[2], 1)
        self.block2 = conv_block(n_channels[2], n_channels[2], 0)
        self.pool1 = nn.MaxPool2d(2)
        self.block3 = conv_block(n_channels[2], n_channels[3], 1)
        self.block4 = conv_block(n_channels[3], n_channels[3], 0)
        self.pool2 = nn.MaxPool2d(2)
        self.block5 = conv_block(n_channels[3], n_channels[4], 1)
        self.block6 = conv_block(n_channels[4], n_channels[4], 0)

        self.pool = nn.AvgPool2d(7)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(n_channels[4], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.input_block(x)
        out = self.block1(out)
        out = self.block2(out)
        out = self.pool1(out)
        out = self.block3(out)
        out = self.block4(out)
        out = self.pool2(out)
        out = self.block5(out)
        out = self.block6(out)
        out = self.pool(out)
        out = self.flat(out)
        return self.fc(out)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
