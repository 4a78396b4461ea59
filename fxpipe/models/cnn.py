"""VGG16 and AlexNet, written out plainly (torchvision is not available here).

Both are the PipeDream paper's image-classification workloads: a deep conv stack followed by a
large fully connected tail, which is what makes them interesting to pipeline (the FC layers hold
most parameters, the convs most compute). ``width_div`` shrinks channel counts for the "mini"
size; the layer structure stays identical.
"""
from __future__ import annotations

import torch
from torch import nn

# VGG16 configuration "D": channel widths, "M" = 2x2 max-pool.
VGG16_CFG: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                              512, 512, 512, "M", 512, 512, 512, "M"]


class VGG16(nn.Module):
    """VGG16 (Simonyan & Zisserman 2014): 13 convs + 3 FC layers; 138M params at full size."""

    def __init__(self, num_classes: int = 1000, width_div: int = 1, image_size: int = 224,
                 hidden: int = 4096, dropout: float = 0.5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_ch = 3
        for v in VGG16_CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                out_ch = max(int(v) // width_div, 1)
                layers += [nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
                in_ch = out_ch
        self.features = nn.Sequential(*layers)
        side = image_size // 32  # five 2x2 pools
        self.classifier = nn.Sequential(
            nn.Linear(in_ch * side * side, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)              # (B, C, H/32, W/32)
        x = torch.flatten(x, 1)           # (B, C * H/32 * W/32)
        return self.classifier(x)         # (B, num_classes)


class AlexNet(nn.Module):
    """AlexNet (Krizhevsky et al. 2012), single-tower variant; 61M params at full size."""

    def __init__(self, num_classes: int = 1000, width_div: int = 1, pool_out: int = 6,
                 hidden: int = 4096, dropout: float = 0.5) -> None:
        super().__init__()
        c1, c2, c3, c4, c5 = (max(c // width_div, 1) for c in (64, 192, 384, 256, 256))
        self.features = nn.Sequential(
            nn.Conv2d(3, c1, kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c1, c2, kernel_size=5, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c2, c3, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c3, c4, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c4, c5, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((pool_out, pool_out))
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(c5 * pool_out * pool_out, hidden), nn.ReLU(inplace=True),
            nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)              # (B, C5, h, w)
        x = self.avgpool(x)               # (B, C5, pool_out, pool_out)
        x = torch.flatten(x, 1)           # (B, C5 * pool_out^2)
        return self.classifier(x)         # (B, num_classes)
