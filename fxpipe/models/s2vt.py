"""S2VT-style video captioning (Venugopalan et al. 2015): sequence to sequence with LSTMs.

An encoder LSTM reads one feature vector per video frame (VGG fc7 features in the paper); its
final (h, c) state seeds a decoder LSTM that reads the caption's previous words and emits logits
over the vocabulary. PipeDream used it as its recurrent workload: few layers, large weight
matrices, tuple-valued LSTM outputs (which fxpipe must never cut while live).
"""
from __future__ import annotations

import torch
from torch import nn


class S2VT(nn.Module):
    """Encoder LSTM over frames, decoder LSTM over words, linear head to the vocabulary."""

    def __init__(self, feature_dim: int = 4096, hidden: int = 1000, embed: int = 500,
                 vocab_size: int = 12594, dropout: float = 0.5) -> None:
        super().__init__()
        self.frame_proj = nn.Linear(feature_dim, hidden)   # compress fc7 features first
        self.frame_drop = nn.Dropout(dropout)
        self.encoder = nn.LSTM(hidden, hidden, batch_first=True)
        self.embed = nn.Embedding(vocab_size, embed)
        self.decoder = nn.LSTM(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, frames: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        x = self.frame_drop(self.frame_proj(frames))  # (B, T_frames, hidden)
        _, (h, c) = self.encoder(x)                   # h, c: (1, B, hidden)
        w = self.embed(words)                         # (B, T_words, embed)
        y, _ = self.decoder(w, (h, c))                # (B, T_words, hidden)
        return self.head(y)                           # (B, T_words, vocab_size)
