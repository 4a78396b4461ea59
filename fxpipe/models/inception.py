"""Inception-v3 (Szegedy et al. 2016): a branchy network of parallel conv towers.

Each Inception block runs 3-4 branches side by side and concatenates them on the channel axis,
so the graph is wide rather than a chain: a pipeline cut inside a block must carry every live
branch. ``width_div`` divides every channel count (mini size); the auxiliary classifier of the
paper is omitted (it only adds a training-time side loss).
"""
from __future__ import annotations

import torch
from torch import nn


class BasicConv2d(nn.Module):
    """conv (no bias) -> BatchNorm -> ReLU, the unit every Inception branch is made of."""

    def __init__(self, in_ch: int, out_ch: int, **kwargs: object) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, bias=False, **kwargs)  # type: ignore[arg-type]
        self.bn = nn.BatchNorm2d(out_ch, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


class InceptionA(nn.Module):
    """35x35 block: 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1."""

    def __init__(self, in_ch: int, pool_features: int, d: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(in_ch, 64 // d, kernel_size=1)
        self.branch5x5_1 = BasicConv2d(in_ch, 48 // d, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(48 // d, 64 // d, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(in_ch, 64 // d, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64 // d, 96 // d, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96 // d, 96 // d, kernel_size=3, padding=1)
        self.pool = nn.AvgPool2d(kernel_size=3, stride=1, padding=1)
        self.branch_pool = BasicConv2d(in_ch, pool_features, kernel_size=1)
        self.out_ch = 64 // d + 64 // d + 96 // d + pool_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)                                               # (B, 64, H, W)
        b5 = self.branch5x5_2(self.branch5x5_1(x))                           # (B, 64, H, W)
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))  # (B, 96, H, W)
        bp = self.branch_pool(self.pool(x))                                  # (B, pf, H, W)
        return torch.cat([b1, b5, b3, bp], 1)


class InceptionB(nn.Module):
    """35->17 reduction: 3x3/2 | 1x1-3x3-3x3/2 | maxpool/2."""

    def __init__(self, in_ch: int, d: int) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(in_ch, 384 // d, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(in_ch, 64 // d, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64 // d, 96 // d, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96 // d, 96 // d, kernel_size=3, stride=2)
        self.pool = nn.MaxPool2d(kernel_size=3, stride=2)
        self.out_ch = 384 // d + 96 // d + in_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3(x)                                               # (B, 384, H/2, W/2)
        bd = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))  # (B, 96, H/2, W/2)
        bp = self.pool(x)                                                    # (B, C, H/2, W/2)
        return torch.cat([b3, bd, bp], 1)


class InceptionC(nn.Module):
    """17x17 block with factorised 7x7 convs (1x7 then 7x1)."""

    def __init__(self, in_ch: int, c7: int, d: int) -> None:
        super().__init__()
        o = 192 // d
        self.branch1x1 = BasicConv2d(in_ch, o, kernel_size=1)
        self.branch7x7_1 = BasicConv2d(in_ch, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, o, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(in_ch, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, o, kernel_size=(1, 7), padding=(0, 3))
        self.pool = nn.AvgPool2d(kernel_size=3, stride=1, padding=1)
        self.branch_pool = BasicConv2d(in_ch, o, kernel_size=1)
        self.out_ch = 4 * o

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)                                               # (B, 192, H, W)
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))         # (B, 192, H, W)
        bd = self.branch7x7dbl_1(x)                                          # (B, c7, H, W)
        bd = self.branch7x7dbl_3(self.branch7x7dbl_2(bd))
        bd = self.branch7x7dbl_5(self.branch7x7dbl_4(bd))                    # (B, 192, H, W)
        bp = self.branch_pool(self.pool(x))                                  # (B, 192, H, W)
        return torch.cat([b1, b7, bd, bp], 1)


class InceptionD(nn.Module):
    """17->8 reduction: 1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | maxpool/2."""

    def __init__(self, in_ch: int, d: int) -> None:
        super().__init__()
        self.branch3x3_1 = BasicConv2d(in_ch, 192 // d, kernel_size=1)
        self.branch3x3_2 = BasicConv2d(192 // d, 320 // d, kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(in_ch, 192 // d, kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(192 // d, 192 // d, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192 // d, 192 // d, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192 // d, 192 // d, kernel_size=3, stride=2)
        self.pool = nn.MaxPool2d(kernel_size=3, stride=2)
        self.out_ch = 320 // d + 192 // d + in_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_2(self.branch3x3_1(x))                           # (B, 320, H/2, W/2)
        b7 = self.branch7x7x3_2(self.branch7x7x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(b7))                      # (B, 192, H/2, W/2)
        bp = self.pool(x)                                                    # (B, C, H/2, W/2)
        return torch.cat([b3, b7, bp], 1)


class InceptionE(nn.Module):
    """8x8 block with expanded filter banks: 3x3 branches split into parallel 1x3 and 3x1."""

    def __init__(self, in_ch: int, d: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(in_ch, 320 // d, kernel_size=1)
        self.branch3x3_1 = BasicConv2d(in_ch, 384 // d, kernel_size=1)
        self.branch3x3_2a = BasicConv2d(384 // d, 384 // d, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384 // d, 384 // d, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(in_ch, 448 // d, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(448 // d, 384 // d, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384 // d, 384 // d, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384 // d, 384 // d, kernel_size=(3, 1), padding=(1, 0))
        self.pool = nn.AvgPool2d(kernel_size=3, stride=1, padding=1)
        self.branch_pool = BasicConv2d(in_ch, 192 // d, kernel_size=1)
        self.out_ch = 320 // d + 4 * (384 // d) + 192 // d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1x1(x)                                               # (B, 320, H, W)
        b3 = self.branch3x3_1(x)                                             # (B, 384, H, W)
        b3 = torch.cat([self.branch3x3_2a(b3), self.branch3x3_2b(b3)], 1)    # (B, 768, H, W)
        bd = self.branch3x3dbl_2(self.branch3x3dbl_1(x))                     # (B, 384, H, W)
        bd = torch.cat([self.branch3x3dbl_3a(bd), self.branch3x3dbl_3b(bd)], 1)  # (B, 768, H, W)
        bp = self.branch_pool(self.pool(x))                                  # (B, 192, H, W)
        return torch.cat([b1, b3, bd, bp], 1)


class InceptionV3(nn.Module):
    """Inception-v3 on 299x299 (any side >= 75 works); about 23.8M params at full size."""

    def __init__(self, num_classes: int = 1000, width_div: int = 1, dropout: float = 0.5) -> None:
        super().__init__()
        d = width_div
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32 // d, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32 // d, 32 // d, kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(32 // d, 64 // d, kernel_size=3, padding=1)
        self.maxpool1 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.Conv2d_3b_1x1 = BasicConv2d(64 // d, 80 // d, kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(80 // d, 192 // d, kernel_size=3)
        self.maxpool2 = nn.MaxPool2d(kernel_size=3, stride=2)
        blocks: list[nn.Module] = []
        ch = 192 // d
        for make in (lambda c: InceptionA(c, 32 // d, d), lambda c: InceptionA(c, 64 // d, d),
                     lambda c: InceptionA(c, 64 // d, d), lambda c: InceptionB(c, d),
                     lambda c: InceptionC(c, 128 // d, d), lambda c: InceptionC(c, 160 // d, d),
                     lambda c: InceptionC(c, 160 // d, d), lambda c: InceptionC(c, 192 // d, d),
                     lambda c: InceptionD(c, d), lambda c: InceptionE(c, d),
                     lambda c: InceptionE(c, d)):
            block = make(ch)
            blocks.append(block)
            ch = block.out_ch
        (self.Mixed_5b, self.Mixed_5c, self.Mixed_5d, self.Mixed_6a, self.Mixed_6b, self.Mixed_6c,
         self.Mixed_6d, self.Mixed_6e, self.Mixed_7a, self.Mixed_7b, self.Mixed_7c) = blocks
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.Conv2d_1a_3x3(x)     # (B, 32, 149, 149) at 299x299
        x = self.Conv2d_2a_3x3(x)     # (B, 32, 147, 147)
        x = self.Conv2d_2b_3x3(x)     # (B, 64, 147, 147)
        x = self.maxpool1(x)          # (B, 64, 73, 73)
        x = self.Conv2d_3b_1x1(x)     # (B, 80, 73, 73)
        x = self.Conv2d_4a_3x3(x)     # (B, 192, 71, 71)
        x = self.maxpool2(x)          # (B, 192, 35, 35)
        x = self.Mixed_5b(x)          # (B, 256, 35, 35)
        x = self.Mixed_5c(x)          # (B, 288, 35, 35)
        x = self.Mixed_5d(x)          # (B, 288, 35, 35)
        x = self.Mixed_6a(x)          # (B, 768, 17, 17)
        x = self.Mixed_6b(x)          # (B, 768, 17, 17)
        x = self.Mixed_6c(x)
        x = self.Mixed_6d(x)
        x = self.Mixed_6e(x)          # (B, 768, 17, 17)
        x = self.Mixed_7a(x)          # (B, 1280, 8, 8)
        x = self.Mixed_7b(x)          # (B, 2048, 8, 8)
        x = self.Mixed_7c(x)          # (B, 2048, 8, 8)
        x = self.avgpool(x)           # (B, 2048, 1, 1)
        x = self.dropout(torch.flatten(x, 1))  # (B, 2048)
        return self.fc(x)             # (B, num_classes)
