"""ResNet-50 (He et al. 2016): bottleneck blocks with residual additions.

The residual adds are why this model matters for pipelining: a skip connection keeps an
activation live across several layers, so a cut inside a block must carry two tensors.
"""
from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 -> 1x1 expand (x4), plus the (possibly projected) identity."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_ch),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)  # (B, 4w, H/s, W/s)
        out = self.relu(self.bn1(self.conv1(x)))      # (B, w, H, W)
        out = self.relu(self.bn2(self.conv2(out)))    # (B, w, H/s, W/s)
        out = self.bn3(self.conv3(out))               # (B, 4w, H/s, W/s)
        return self.relu(out + identity)


class ResNet50(nn.Module):
    """ResNet-50: stem, four stages of [3, 4, 6, 3] bottlenecks, global pool, FC; 25.6M params."""

    def __init__(self, num_classes: int = 1000, width_div: int = 1, small_input: bool = False) -> None:
        super().__init__()
        base = max(64 // width_div, 1)
        if small_input:  # CIFAR-style stem keeps resolution for 32x32 inputs
            self.stem = nn.Sequential(
                nn.Conv2d(3, base, kernel_size=3, stride=1, padding=1, bias=False),
                nn.BatchNorm2d(base), nn.ReLU(inplace=True))
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(3, base, kernel_size=7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(base), nn.ReLU(inplace=True),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1))
        in_ch = base
        stages = []
        for i, blocks in enumerate((3, 4, 6, 3)):
            width = base * 2 ** i
            layers = []
            for j in range(blocks):
                layers.append(Bottleneck(in_ch, width, stride=2 if (j == 0 and i > 0) else 1))
                in_ch = width * Bottleneck.expansion
            stages.append(nn.Sequential(*layers))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)          # (B, 64, H/4, W/4)
        x = self.layer1(x)        # (B, 256, H/4, W/4)
        x = self.layer2(x)        # (B, 512, H/8, W/8)
        x = self.layer3(x)        # (B, 1024, H/16, W/16)
        x = self.layer4(x)        # (B, 2048, H/32, W/32)
        x = self.avgpool(x)       # (B, 2048, 1, 1)
        x = torch.flatten(x, 1)   # (B, 2048)
        return self.fc(x)         # (B, num_classes)
